"""Kimi Delta Attention: the public prefill and decode API (FLA-compatible names) and the varlen index helpers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cula_runtime.index import prepare_chunk_indices, prepare_chunk_offsets, prepare_lens
from cula_runtime.kda_args import KdaPrefillArgs, checked_boundaries, validate_kda_prefill
from cula_runtime.kda_decode_args import validate_kda_decode

from . import call_plans
from .call_plans import (
    LaunchDeclined,
    call_signature,
    decode_call_signature,
    first_call,
    lookup,
    lookup_guarded,
)
from .dispatch import select_backend, select_decode_backend

__all__ = ["kda_prefill", "kda_decode", "prepare_lens", "prepare_chunk_indices", "prepare_chunk_offsets"]


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward over whole sequences (prefill), on the best backend for the tensors' device.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (bf16, fp16 or fp32; one dtype for q, k, v).
        v: ``[B, T, HV, V]`` values; ``HV`` must be a multiple of ``H`` (GVA: value head ``hv`` reads q/k head
            ``hv // (HV // H)``).
        g: ``[B, T, HV, K]`` per-channel log-decay (``<= 0``), or the raw gate when ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` step sizes (bf16 or fp32), or logits when ``use_beta_sigmoid_in_kernel``.
        scale: query scale; ``None`` means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``), fp32 (bf16 accepted), one per
            sequence; ``None`` means zeros.
        output_final_state: also return the final state (fp32, same layout as ``initial_state``).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (``x / sqrt(sum x^2 + 1e-6)``).
        use_gate_in_kernel: compute the log gate from the raw ``g``: ``-exp(A_log) * softplus(g + dt_bias)``, or
            with ``lower_bound`` set, ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)`` (``2 * sigmoid`` with ``allow_neg_eigval``).
        safe_gate: the gate is bounded in ``[lower_bound, 0]`` with ``lower_bound >= -5`` (lets kernels use
            tensor cores on the diagonal blocks). With ``use_gate_in_kernel`` it requires ``lower_bound``
            (``ValueError`` below -5); with a precomputed ``g`` a ``lower_bound`` below -5 withdraws the promise
            (the call runs the unbounded-gate form, as without ``safe_gate``).
        A_log: ``[HV]`` fp32, for the in-kernel gate. dt_bias: ``[HV * K]`` or ``[HV, K]`` fp32, optional.
        cu_seqlens: int32 ``[N + 1]`` cumulative lengths of a packed batch (then ``B`` must be 1). A buffer reused
            across calls is read again whenever its values may have changed: a CPU one is checked by its values (a
            write through a NumPy view included), a GPU one by torch's version counter (any torch op that writes
            it); a GPU buffer rewritten outside torch (a foreign kernel through its pointer) needs
            ``cu_seqlens_cpu`` alongside, or a new tensor.
        state_v_first: states laid out ``[N, HV, V, K]``.
        cu_seqlens_cpu: the same boundaries as ``cu_seqlens`` in a CPU int32 tensor, if the caller has them (a
            serving engine builds its batches on the host). The checks and the chunk indices then read this copy,
            and a call with a new ``cu_seqlens`` makes no synchronising call; without it, each new ``cu_seqlens``
            is copied to the host once (one synchronisation). Its values are not compared with
            ``cu_seqlens``' (that would synchronise): they must be equal.
        state: a state pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` if ``state_v_first``), fp32 or bf16 (fp64
            accepted), read and written in place (never copied: each slot must be dense and own its memory, the
            slot stride is free; the pool shares no memory with another argument; it must not require grad while
            grad mode is on).
            Sequence ``n`` starts from slot ``state_indices[n]`` and its final state (rounded to the pool's dtype)
            is written back to that slot; the other slots are untouched. Exclusive with ``initial_state`` and
            ``output_final_state=True`` (``ValueError``).
        state_indices: int32 ``[N]`` on q's device, with ``state``. A negative index is a padding row: nothing is
            read or written for it and its output rows are zero. An index ``>= P`` and a slot named twice are
            refused (``ValueError``) for CPU tensors; on a GPU the values are not read by the validator and an index
            ``>= P`` is treated as padding (the rules: ``cula_runtime.state_pool``).
        has_initial_state: optional bool ``[N]`` on q's device, with ``state``: where False, sequence ``n`` starts
            from zeros instead of its slot (its final state is still written there).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` fp32 or ``None``. With a pool:
        ``(o, None)`` (the final states are in the pool).

    Any strides are accepted (non-contiguous inputs are copied once). Bad arguments raise ``TypeError`` or
    ``ValueError`` naming the argument; a call no backend can serve raises ``NotImplementedError`` saying which
    backends were tried and why. ``CULA_BACKEND=reference|cutedsl|sm90`` forces a backend. A call with the signature
    of an earlier accepted one (tensors' shapes, strides, dtypes and devices, the flags, ``scale``, ``lower_bound``,
    the ``CULA_*`` variables) runs the call plan that call's backend left, without validation and dispatch; it still
    checks ``cu_seqlens``' values (``cula.call_plans``). Pool-form calls run on both GPU backends (the slots read
    on the device); those with CPU index tensors are validated on every call (their slots are checked on the host)
    and never planned. Whether the pool shares memory with another argument is checked on the call that makes a
    plan, not on those it serves.
    """
    # positional: the same order as validate_kda_prefill's parameters (keywords cost a little on every call)
    signature = call_signature(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, cu_seqlens,
        state_v_first, cu_seqlens_cpu, state, state_indices, has_initial_state,
    )  # (None for a call never planned: e.g. a pool with CPU indices)
    plan = lookup(signature)
    if plan is not None:  # a call of this signature passed the checks and dispatch before (cula.call_plans)
        try:
            return run_prefill_plan(plan, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                                    cu_seqlens_cpu, state, state_indices, has_initial_state)
        except LaunchDeclined:  # (a pointer refused before launching: decided below, as if there were no plan)
            pass
    args = validate_kda_prefill(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, cu_seqlens,
        state_v_first, cu_seqlens_cpu, state, state_indices, has_initial_state,
    )
    as_is = signature is not None and _passed_as_is(args, q, k, v, g, beta, initial_state, A_log, dt_bias,
                                                    cu_seqlens, state_indices, has_initial_state)
    pool = None if state is None else dict(state=state, state_indices=state_indices,
                                           has_initial_state=has_initial_state)
    return first_call(signature, args, select_backend(args), as_is,
                      (q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, args.cu_seqlens_host), pool)


def run_prefill_plan(plan: Callable, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu,
                     state=None, state_indices=None, has_initial_state=None) -> tuple:
    """A ``kda_prefill`` call by the plan its signature has (:func:`cula.call_plans.lookup`): ``cu_seqlens``' values
    checked as the validator does (``ValueError`` before any launch), then the plan. For entry points that found
    the plan themselves (FLA's door, whose verifier looked it up for the same call). Raises
    :class:`~cula.call_plans.LaunchDeclined` where the plan's kernels refuse a pointer before launching (the pool
    untouched): the caller then runs the call as if there were no plan (:func:`kda_prefill`)."""
    cu_host = None if cu_seqlens is None else checked_boundaries(cu_seqlens, cu_seqlens_cpu, q.shape[1])
    if state is None:
        return plan(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_host)
    return plan(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_host, state=state,
                state_indices=state_indices, has_initial_state=has_initial_state)


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """KDA decode: the recurrence (KDA_SPEC §1.2) over ``T_n >= 0`` new tokens per sequence, from and into a state
    pool, in place.

    Args:
        q, k: ``[B, T, H, K]`` (bf16, fp16 or fp32; one dtype for q, k, v). v: ``[B, T, HV, V]``, ``HV`` a multiple
            of ``H`` (GVA: value head ``hv`` reads q/k head ``hv // (HV // H)``). g: ``[B, T, HV, K]`` log-decay
            (any value ``<= 0``: no bound is assumed), or the raw gate with ``use_gate_in_kernel``. beta:
            ``[B, T, HV]`` (fp32 or bf16) step sizes, or logits with ``use_beta_sigmoid_in_kernel``. Without
            ``cu_seqlens``: ``B`` sequences of ``T`` tokens each (``T = 1``: one decode step).
        state: the pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` with ``state_v_first``), fp32 or bf16 (fp64 accepted),
            read and written in place, never copied (each slot dense and its own memory; the slot stride is free; no
            memory shared with another argument; not requiring grad while grad mode is on). The running state is
            fp32; a bf16 pool is rounded (to nearest) when a state is written.
        state_indices: int32, on q's device. ``[N]``: sequence ``n`` starts from slot ``state_indices[n]`` and its
            state after its last token is written back there. ``[N, W]`` (speculative verification, ``W >=`` every
            ``T_n``): the state after token ``t`` is written to ``state_indices[n, t]`` (not at all where that entry
            is negative), and the start state is read from ``state_indices[n, 0]``, or from
            ``state_indices[n, num_accepted_tokens[n] - 1]``. A negative start slot is a padding row: nothing is read
            or written for it and its output rows are zero. Slots no sequence names are untouched.
        scale: query scale; ``None`` means ``K ** -0.5``.
        A_log, dt_bias, lower_bound, use_gate_in_kernel: the in-kernel gate, as in :func:`kda_prefill`: ``A_log``
            ``[HV]``, ``dt_bias`` ``[HV * K]`` or ``[HV, K]``; ``-exp(A_log) * softplus(g + dt_bias)``, or with
            ``lower_bound`` (any finite negative value), ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.
        use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval: as in :func:`kda_prefill`.
        state_v_first: the pool's layout.
        cu_seqlens: int32 or int64 ``[N + 1]`` on q's device: ``N`` packed sequences of any lengths, zero included
            (then ``B`` must be 1).
        num_accepted_tokens: int32 ``[N]`` on q's device, with ``[N, W]`` indices only; each in ``[1, W]``.
        out: the output, written in place when given: contiguous ``[B, T, HV, V]`` in q's dtype on q's device,
            sharing no memory with another argument.

    Returns:
        ``o`` ``[B, T, HV, V]`` in q's dtype (``out`` when given).

    Rules for the index values (``cula_runtime.state_pool``): no two sequences may use one slot; a used index
    ``>= P``, a count outside ``[1, W]`` or ``T_n > W`` is refused. These are checked (``ValueError``) when the index
    tensors are on the CPU; on a GPU the validator reads no value (no synchronisation) and a kernel treats what is
    out of range as padding, so nothing outside the pool is read or written. Bad arguments raise ``TypeError`` or
    ``ValueError`` naming the argument. Backends: on SM90/SM100/SM103 the CuTeDSL decode kernel (bf16 inputs,
    K = V = 128, fp32 or bf16 pools): no host synchronisation and nothing allocated but ``o`` (nothing with ``out``
    and an int32 ``cu_seqlens``), so a call can be captured in a CUDA graph; a GPU call outside it runs the torch
    reference with a ``CulaFallbackWarning`` (which reads the index values back: not capturable). A call with the
    signature of an earlier one served by the kernel (tensors' shapes, strides, dtypes, devices; flags, ``scale``,
    ``lower_bound``; the ``CULA_*`` variables) runs the plan that call left, without validation and dispatch
    (``cula.call_plans``). Whether the pool or ``out`` shares memory with another argument is checked on the call
    that makes a plan, not on those it serves.
    """
    return kda_decode_ordered(q, k, v, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound,
                              use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                              state_v_first, cu_seqlens, num_accepted_tokens, out)


def kda_decode_ordered(q, k, v, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound,
                       use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                       state_v_first, cu_seqlens, num_accepted_tokens, out) -> torch.Tensor:
    """:func:`kda_decode` with every argument positional, in its order (``out`` last), for callers that hold them
    all (the custom ops ``torch.ops.cula.kda_decode`` / ``kda_decode_out``, whose schemas have this order): binding
    them costs nothing, where 14 keywords cost about 0.7 us per call on a 2-core CPU."""
    signature = decode_call_signature(
        q, k, v, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
        num_accepted_tokens, out,
    )
    plan = lookup_guarded(signature, q, k, v, g, beta, state, state_indices, A_log, dt_bias, cu_seqlens,
                          num_accepted_tokens, out)
    if plan is not None:  # (nothing of a GPU call's values is checked on the host: the plan is the whole call)
        try:
            return plan(q, k, v, g, beta, state, state_indices, A_log, dt_bias, cu_seqlens, num_accepted_tokens, out)
        except LaunchDeclined:  # (refused before launching: decided below, as if there were no plan)
            pass
    args = validate_kda_decode(
        q, k, v, g, beta, state=state, state_indices=state_indices, scale=scale, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        num_accepted_tokens=num_accepted_tokens, out=out,
    )
    # (CPU indices: the validator checks their values on every call, so such a call is never planned)
    as_is = (signature is not None and not call_plans.indices_checked_on_host(state_indices) and args.q is q
             and args.k is k and args.v is v and args.g is g and args.beta is beta
             and args.state_indices is state_indices and args.A_log is A_log and args.cu_seqlens is cu_seqlens
             and args.num_accepted_tokens is num_accepted_tokens
             and (dt_bias is None or args.dt_bias is dt_bias or dt_bias.is_contiguous()))
    return first_call(signature, args, select_decode_backend(args), as_is,
                      (q, k, v, g, beta, state, state_indices, A_log, dt_bias, cu_seqlens, num_accepted_tokens, out),
                      guarded=True)


def _passed_as_is(args: KdaPrefillArgs, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                  state_indices, has_initial_state) -> bool:
    """Whether the validator kept every tensor as passed (contiguous: no copy), which a plan relies on (it takes
    the call's tensors; a flattened ``dt_bias`` is a view of the same memory; the pool is never copied)."""
    return (args.q is q and args.k is k and args.v is v and args.g is g and args.beta is beta
            and args.initial_state is initial_state and args.A_log is A_log and args.cu_seqlens is cu_seqlens
            and args.state_indices is state_indices and args.has_initial_state is has_initial_state
            and (dt_bias is None or dt_bias.is_contiguous()))
