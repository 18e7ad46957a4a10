"""The ``cutedsl`` backend of ``kda_prefill``: intra → recurrence, two CuTeDSL launches. The intra kernel takes the
raw inputs (the gate's activation and chunk cumsum, β and the q/k L2 norm are done in it) and writes each chunk's
decay row for the recurrence, which launches varlen sequences longest first.

Importing this module imports neither CuTeDSL nor TVM-FFI; the kernel modules load on the first call.

Where it has run: both kernels ran on sm_90 (H200) against the fp64 oracle (tests/cute, tests/gpu; this pair, the
``fused-prepare-prefetch-8warps`` intra variant of the time, is the default since 2026-11-30); they are compiled for
sm_100a/sm_103a in CI but no Blackwell GPU has run them (the registry says so).

Every gate form is served: bounded gates (:func:`cula_runtime.kda_args.gate_is_bounded`) run the intra kernel's
safe-gate form, every other gate (the softplus form, ``lower_bound < -5``, a precomputed g without ``safe_gate``) its
unbounded form (``KdaIntraConfig.unbounded``: the diagonal score blocks by the levels split), which ran on sm_90
(H200) against the fp64 oracle on the 13 unbounded configs of tests/gpu (2026-12-01).

The state-pool form (``state=``, ``state_indices=``, ``has_initial_state=``; issue 26): the recurrence kernel reads
each sequence's slot index (and flag) on the device, starts from that slot of the fp32 or bf16 pool and writes the
final state back in place (``KdaRecurrenceConfig.state_pool``); a slot outside the pool is a padding row, whose o rows
are zeros. No gather or scatter copy and no host read of the index values. Compiled for the three targets in CI; not
yet run on a GPU (tests/gpu/test_kda_prefill_pool_gpu.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from ...index import prepare_varlen_launch
from ...kda_args import empty_prefill_result, gate_is_bounded, gpu_kernel_rejection
from ...kda_tuning import BLOCK_V_CHOICES, recurrence_block_v, sm_count
from .. import device_rejection

__all__ = ["verify", "kda_prefill_cutedsl"]

CHUNK = 64
HEAD_DIM = 128
WORKSPACE_ALIGN = 128  # bytes: every intermediate starts at a multiple (the kernels' TensorSpecs promise 16 at most)


def verify(args: Any) -> tuple[bool, str]:
    """Whether the CuTeDSL kernels serve these validated ``kda_prefill`` arguments, and if not, why."""
    reason = device_rejection(args.device)
    if reason is not None:
        return False, reason
    reason = gpu_kernel_rejection(args, HEAD_DIM)
    if reason is None and args.state is not None:
        reason = pool_rejection(args.state)
    if reason is not None:
        return False, reason
    if not gate_is_bounded(args):  # (kda_prefill_cutedsl runs the intra kernel's unbounded form for it)
        return True, "CuTeDSL kernels serve this call (unbounded gate)"
    return True, "CuTeDSL kernels serve this call"


def pool_rejection(pool: Any) -> str | None:
    """Why the recurrence kernel cannot take this (validated) state pool in place, or None: it needs fp32 or bf16,
    and, for its paired accesses, the slot stride even and the data aligned to two elements (what its
    ``TensorSpec`` promises; a pool is never copied)."""
    import torch

    if pool.dtype not in (torch.float32, torch.bfloat16):
        return f"needs the state pool in fp32 or bf16, got {pool.dtype}"
    if pool.data_ptr() % (2 * pool.element_size()) or (pool.shape[0] > 1 and pool.stride(0) % 2):
        return (f"needs the state pool's slot stride even and its data {2 * pool.element_size()}-byte aligned (the "
                f"kernel writes it in place, never copies it), got stride {pool.stride(0)} at address "
                f"{pool.data_ptr():#x}")
    return None


@functools.cache
def _kernel_modules() -> tuple:
    """The kernel modules ``(gate, intra, recurrence)``, imported on the first call (importing this module imports
    no CuTeDSL); a function-level import costs microseconds on every call."""
    from . import gate, intra, recurrence

    return gate, intra, recurrence


@functools.lru_cache(maxsize=256)
def _workspace_plan(groups: tuple) -> tuple:
    """``(total elements of the first group's dtype, elements of each group's span, (elements, stride) of each
    group's tensors)`` for :func:`carve_workspace` (cached per call signature: no arithmetic per call)."""
    base = groups[0][2].itemsize
    spans, steps = [], []
    for count, shape, dtype in groups:
        nbytes = math.prod(shape) * dtype.itemsize
        step = -(-nbytes // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
        spans.append(count * step // base)
        steps.append((nbytes // dtype.itemsize, step // dtype.itemsize))
    return sum(spans), tuple(spans), tuple(steps)


def _workspace_groups(B: int, T: int, HV: int, K: int, rows: int) -> tuple:
    """:func:`carve_workspace`'s groups for one call: w, u, qg, kg (bf16 ``[B, T, HV, K]``), Aqk (bf16 ``[B, T, HV,
    64]``) and g_last (fp32, ``rows`` chunk rows)."""
    import torch

    bf16 = torch.bfloat16
    return ((4, (B, T, HV, K), bf16), (1, (B, T, HV, CHUNK), bf16), (1, (B, rows, HV, K), torch.float32))


def carve_workspace(device: Any, groups: tuple) -> list:
    """One call's intermediates as views of one allocation: one ``torch.empty`` (and one free) instead of one per
    tensor.

    Args:
        groups: ``(count, shape, dtype)`` each (hashable: the layout is planned once per signature): ``count``
            contiguous tensors of ``shape`` and ``dtype``.

    Returns:
        The tensors, group by group, each starting at a multiple of :data:`WORKSPACE_ALIGN` bytes from the start of
        the buffer (a CUDA allocation starts 512-byte aligned). A view costs about a microsecond of host time, so
        the buffer is split once into the groups' spans and a group of unpadded tensors is one ``[count, *shape]``
        view, unbound.
    """
    import torch

    total, spans, steps = _workspace_plan(groups)
    base = groups[0][2]
    pieces = torch.empty(total, dtype=base, device=device).split_with_sizes(spans)
    tensors = []
    for piece, (count, shape, dtype), (numel, stride) in zip(pieces, groups, steps, strict=True):
        typed = piece if dtype == base else piece.view(dtype)
        if numel != stride:  # padded to the alignment: one slice per tensor
            tensors += (typed[i * stride:i * stride + numel].view(shape) for i in range(count))
        elif count == 1:
            tensors.append(typed.view(shape))
        else:
            tensors += typed.view(count, *shape).unbind(0)
    return tensors


def kda_prefill_cutedsl(args: Any, *, block_v: int = 0) -> tuple[Any, Any]:
    """Run KDA prefill on the CuTeDSL kernels. ``args``: validated ``KdaPrefillArgs`` that ``verify`` accepted;
    ``block_v``: value columns per recurrence CTA, 64 or 128 (the same bits for each; 0:
    :func:`cula_runtime.kda_tuning.recurrence_block_v` picks one from N·HV and the SM count; another value is a
    ValueError, raised before any launch).

    Returns ``o`` bf16 ``[B, T, HV, V]`` and the fp32 final state (layout of ``initial_state``) or None, each its
    own allocation. The intermediates (w, u, qg, kg, Aqk, g_last) are views of one workspace buffer
    (:func:`carve_workspace`), alive until the call returns.

    The pool form (``args.state``: the pool ``[P, HV, K, V]`` or ``[P, HV, V, K]`` in fp32 or bf16;
    ``args.state_indices`` int32 ``[N]``; ``args.has_initial_state`` bool ``[N]`` or None; all on the device)
    returns ``(o, None)``: the recurrence kernel writes each sequence's final state to its slot in place, and a
    padding row's (slot outside ``[0, P)``) o rows are zeros. A call with no tokens still launches the recurrence:
    each named slot gets its start state back, or zeros where ``has_initial_state`` is False, as in the reference.

    Host path: ``validate_kda_prefill`` and ``verify`` have checked everything the kernel wrappers would (shapes,
    dtypes, one CUDA device, K = V = 128, g and beta bf16 or fp32, ``cu_seqlens``), so the wrappers' checks are
    skipped: each kernel is planned and launched by the same internal function its public wrapper uses
    (``intra._intra_from_raw``, ``recurrence._run``), with the same configurations and arguments
    (``tests/cute/test_kda_wrapper_marshalling.py`` compares the launches with the public wrappers' chain).
    """
    import torch

    if block_v != 0 and block_v not in BLOCK_V_CHOICES:
        raise ValueError(f"block_v must be 0 (the per-call choice), 64 or 128, got {block_v!r}")
    gate, intra, recurrence = _kernel_modules()
    pool = args.state
    if args.B * args.T == 0 and (pool is None or args.N == 0):  # nothing to launch: empty o, the states pass through
        return empty_prefill_result(args)
    B, T, HV, K = args.B, args.T, args.HV, args.K
    device = args.device
    cu, cu_host = args.cu_seqlens, args.cu_seqlens_host  # (the index tensors are built from the host copy)
    # chunk indices, chunk offsets and the longest-first order: one host build, one copy to the device (cached)
    chunk_indices, chunk_offsets, seq_order = (None, None, None) if cu is None else \
        prepare_varlen_launch(cu, CHUNK, host=cu_host)
    num_chunks = B * -(-T // CHUNK) if cu is None else chunk_indices.shape[0]
    h0 = args.initial_state
    if h0 is not None and h0.dtype != torch.float32:
        h0 = h0.float()
    if block_v == 0:
        block_v = recurrence_block_v(args.N * args.HV, sm_count(device))
    lower_bound = args.lower_bound if args.use_gate_in_kernel else None
    form, A_log, dt_bias = gate.gate_arguments(args.use_gate_in_kernel, lower_bound, args.A_log, args.dt_bias,
                                               args.allow_neg_eigval, args.use_beta_sigmoid_in_kernel, HV, K, device)
    rows = num_chunks if cu is not None else -(-T // CHUNK)  # g_last: one row per chunk
    w, u, qg, kg, Aqk, g_last = carve_workspace(device, _workspace_groups(B, T, HV, K, rows))
    if num_chunks:  # (a pool-form call without tokens runs the recurrence alone: its states pass through the pool)
        intra._intra_from_raw(
            args.q, args.k, args.v, args.g, args.beta, args.scale, form, A_log, dt_bias, lower_bound,
            args.use_qk_l2norm_in_kernel, args.use_beta_sigmoid_in_kernel, args.allow_neg_eigval, cu, chunk_indices,
            num_chunks, out=(w, u, qg, kg, Aqk, g_last), unbounded=not gate_is_bounded(args),
        )
    if pool is None:
        return recurrence._run(qg, kg, w, u, Aqk, g_last, args.scale, h0, args.output_final_state, cu,
                               chunk_offsets, args.state_v_first, block_v, seq_order, args.N)
    o, _ = recurrence._run(qg, kg, w, u, Aqk, g_last, args.scale, None, False, cu, chunk_offsets, args.state_v_first,
                           block_v, seq_order, args.N, pool=pool, state_indices=args.state_indices,
                           has_initial_state=args.has_initial_state)
    return o, None


def plan_kda_prefill(args: Any) -> Callable[..., tuple[Any, Any]] | None:
    """A call plan (``cula.call_plans``) for every later call with the signature of ``args`` (validated arguments
    ``verify`` accepted, passed contiguous): it takes the call's tensors in the order ``(q, k, v, g, beta,
    initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_host)``, the last the checked host copy of ``cu_seqlens``
    (:func:`cula_runtime.kda_args.checked_boundaries`, which its caller runs), and for a pool-form signature the
    keywords ``state``, ``state_indices`` and ``has_initial_state`` (GPU index tensors: ``cula.call_plans`` plans
    no call whose slots the validator reads on the host), skipping validation and dispatch. Holds no tensor of the
    call it was made from.

    What :func:`kda_prefill_cutedsl` derives per call from the signature alone (the gate form, the V block, both
    kernels' configurations, the workspace's layout, the compiled kernels) is derived here once: a call runs the
    varlen index build (cached per ``cu_seqlens``), the allocations (workspace, ``o``, the final state) and the
    two kernels through launches bound once (no per-tensor check: the signature fixes every layout but the data
    pointers' alignment, which TVM-FFI checks). A call TVM-FFI refuses (``LaunchDeclined``: a misaligned pointer;
    the intra kernel may have run into this call's own workspace) runs :func:`kda_prefill_cutedsl` instead, which
    copies such a tensor. The same kernels, configurations and arguments: the same bits (``tests/api/
    test_call_plans.py`` compares the launches; ``tests/gpu`` the planned calls' bits). A signature with no sequence
    or no token runs :func:`kda_prefill_cutedsl` on every call."""
    template = args.with_tensors(*(None,) * 10)

    def unplanned(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_host, *, state=None,
                  state_indices=None, has_initial_state=None):
        return kda_prefill_cutedsl(template.with_tensors(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                                                         cu_host, state=state, state_indices=state_indices,
                                                         has_initial_state=has_initial_state))

    if args.N == 0 or args.B * args.T == 0:
        return unplanned
    return _planned(args, unplanned)


def _planned(args: Any, unplanned: Callable) -> Callable:
    """:func:`plan_kda_prefill`'s plan for a signature with sequences and tokens."""
    import torch

    gate, intra, recurrence = _kernel_modules()
    B, T, HV, K, N = args.B, args.T, args.HV, args.K, args.N
    device = args.device
    varlen = args.cu_seqlens is not None
    pool_form = args.state is not None
    h0_float = args.initial_state is not None and args.initial_state.dtype != torch.float32
    lower_bound = args.lower_bound if args.use_gate_in_kernel else None
    form, A_log, dt_bias = gate.gate_arguments(args.use_gate_in_kernel, lower_bound, args.A_log, args.dt_bias,
                                               args.allow_neg_eigval, args.use_beta_sigmoid_in_kernel, HV, K, device)
    run_intra = intra.plan_intra_from_raw(args.q, args.k, args.v, args.g, args.beta, args.scale, form, A_log, dt_bias,
                                          lower_bound, args.use_qk_l2norm_in_kernel, args.use_beta_sigmoid_in_kernel,
                                          args.allow_neg_eigval, varlen, unbounded=not gate_is_bounded(args))
    fixed_groups = _workspace_groups(B, T, HV, K, -(-T // CHUNK))
    run_recurrence = recurrence.plan_run(
        (B, T, HV, K), N, recurrence_block_v(N * HV, sm_count(device)), args.scale, device, cu_seqlens=args.cu_seqlens,
        initial_state=None if pool_form else args.initial_state, output_final_state=args.output_final_state and
        not pool_form, state_v_first=args.state_v_first, pool=args.state,
        has_initial_state=args.has_initial_state if pool_form else None)

    def plan(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_host, *, state=None,
             state_indices=None, has_initial_state=None):
        if varlen:
            chunk_indices, chunk_offsets, seq_order = prepare_varlen_launch(cu_seqlens, CHUNK, host=cu_host)
            groups = _workspace_groups(B, T, HV, K, chunk_indices.shape[0])
        else:
            chunk_indices = chunk_offsets = seq_order = None
            groups = fixed_groups
        out = carve_workspace(device, groups)
        a_log, dt = (None, None) if form == "none" else gate.gate_tensors(A_log, dt_bias, HV, K, device)
        h0 = None if pool_form else initial_state.float() if h0_float else initial_state
        # (a pointer TVM-FFI refuses raises LaunchDeclined before that kernel launches: the caller then validates
        # and dispatches the call as if there were no plan, e.g. a misaligned pool, which this backend declines)
        run_intra(q, k, v, g, beta, out, cu_seqlens, chunk_indices, a_log, dt)
        w, u, qg, kg, Aqk, g_last = out
        o, ht = run_recurrence(qg, kg, w, u, Aqk, g_last, h0, cu_seqlens, chunk_offsets, seq_order, state,
                               state_indices, has_initial_state)
        return o, None if pool_form else ht

    return plan
