"""The sm90 backend of ``kda_prefill``: checks validated arguments, allocates through torch, launches the kernels.

Two kernels (``csrc/kda/``): ``intra`` runs over all chunks in parallel (L2 norm, the gate, cumulative gate,
Aqk/Akk, the fp32 inverse, w/u/kg/qg) into a bf16 workspace, one CTA per (chunk, value head), in the form
``CULA_SM90_INTRA_TUNED`` picks ("auto": "tensor" or "bands" per call; "unbounded" for every call whose gate can
leave [-5, 0], :func:`cula_runtime.kda_args.gate_is_bounded`); ``recurrence`` walks each sequence's chunks
with the fp32 state in registers and writes o and the final state, its products on warpgroup MMAs at V blocks of 64
or 128 (:func:`cula_runtime.kda_tuning.recurrence_block_v` picks one per call). Both launch on the current torch
stream.

What it serves (``verify``): an SM90 GPU, bf16 q/k/v, K = V = 128, every gate form (precomputed fp32/bf16 g, the
in-kernel lower-bound and softplus forms), fp32/bf16 beta (values or logits), fp32/bf16 initial state, any GVA ratio,
fixed or varlen; and the state-pool form (``state=``, ``state_indices=``, ``has_initial_state=``) on an fp32 or bf16
pool whose slots do not overlap: the recurrence reads each sequence's start state from its slot and writes the final
state back in place (no gather or scatter copy; the index values are read on the GPU only: a slot outside the pool
is a padding row there), and the call returns ``(o, None)``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from cula_runtime.env import env_choice
from cula_runtime.graph_pools import built_outside_graph_pools
from cula_runtime.index import cached_on_version, prepare_chunk_indices, prepare_chunk_offsets
from cula_runtime.kda_args import empty_prefill_result, gate_is_bounded, gpu_kernel_rejection
from cula_runtime.kda_tuning import BLOCK_V_CHOICES, device_capability, recurrence_block_v, sm_count

from . import load_extension

__all__ = ["verify_kda_prefill", "kda_prefill", "plan_kda_prefill", "run_kernels", "workspace_layout",
           "WorkspaceRegion"]

CHUNK = 64
HEAD_DIM = 128
_INT32_MAX = 2**31 - 1
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_NO_POOL = (0, 0, 0, 0, 0)  # the recurrence's state-pool arguments of a call without a pool
# The intra kernel's form: "tensor" the L2 norms' row sums by one transposed reduction per tensor and warp, the
# off-diagonal inverse by recursive doubling, its products as bf16x3 tensor-core MMAs (each fp32 operand kept as two
# bf16 parts: about fp32 accuracy); "bands" "tensor" computing only the 16-row bands that hold valid rows (the same
# bits; on the H200 a sequence's partial last chunk cost less, the intra kernel 6.5% faster on 20 uniform sequences of
# T4096, but full chunks 1.6-2% slower); "auto" (the default) "bands" for a call whose partial last chunks leave many
# bands idle (_bands_pay), else "tensor": the same bits either way. The earlier forms "0" (the first verified kernel),
# "norm", "inverse" and "all" (slower than "tensor" on the H200: the intra kernel 1024-1090 us against 924 at B1
# T16384, benchmarks/results/kda_profile_h200.md) were retired in issue 25 and are refused like any other unknown value.
ENV_INTRA_TUNED = "CULA_SM90_INTRA_TUNED"
# Form name -> the kernel's bit set (csrc/kda/kda_intra_item.cuh). The extension lists the codes it builds once, beside
# its launcher (csrc/kda/kda_intra.cu, `intra_form_built`); the wheel check (tools/inspect_wheels.py) tests that every
# code named here but "auto" and the "ablate:" ones is built.
# "unbounded" (4107): "tensor" exact for any log-gate <= 0 (the diagonal blocks split by levels, KDA_SPEC §3.7):
# every call whose gate can leave [-5, 0] runs it whatever the knob says (the other forms would overflow); naming it
# runs it on bounded calls too (for A/B timing).
_TUNED_FORMS = {"tensor": 11, "bands": 15, "unbounded": 4107, "auto": -1,  # (-1: 11 or 15 per call, _bands_pay)
                # timing-only: "tensor" without one phase's arithmetic (garbage outputs); only an extension built with
                # CMake's CULA_SM90_ABLATION=ON launches them (others refuse with a ValueError before any launch)
                "ablate:gate": 11 | 16, "ablate:norm-exp": 11 | 32, "ablate:products": 11 | 64,
                "ablate:inverse": 11 | 128, "ablate:solve": 11 | 256,
                # ... and without its global loads (inputs zero-filled), its workspace stores, both, or w/u's stores
                "ablate:loads": 11 | 512, "ablate:stores": 11 | 1024, "ablate:io": 11 | 512 | 1024,
                "ablate:stores-wu": 11 | 2048}
# "1" launches the recurrence as a programmatic dependent of the intra kernel (CUDA's programmatic dependent launch):
# its grid launches while the intra kernel's last CTAs run and its CTAs wait on the GPU for them, instead of the grid
# launching after the intra kernel has drained. "0" launches it in plain stream order. "auto" (the default): "1" when
# the recurrence's CTAs fit on the SMs at once (one wave: every fixed-length benchmark config), else "0". Same bits
# either way. On the H200 (2026-11-30, benchmarks/results/kda_pdl_h200.md) "1" was 5-6% faster at B1 T512, 1-4%
# at the other one-wave configs, and 0-2% slower on varlen batches of 20 sequences (many waves).
ENV_PROGRAMMATIC_LAUNCH = "CULA_SM90_PDL"
_WORKSPACE_ALIGN = 256  # bytes; each workspace region starts on such a boundary (the kernels need 16)
_fixed_index_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
# The current stream as an integer, without building a torch.cuda.Stream (what torch's own generated code calls).
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The current device's index without torch.cuda.current_device()'s lazy-initialisation checks (the call's tensors
# are on a CUDA device, so CUDA is initialised): ~0.6 us instead of ~2.7 on the H200's host (cProfile).
_raw_current_device = getattr(torch._C, "_cuda_getDevice", None)
# The caching allocator's raw block interface (what torch.cuda.caching_allocator_alloc calls): a call's workspace
# as an address, without a tensor: ~1 us instead of torch.empty's ~3.4 on the H200's host, before the first launch.
_raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
_raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
_SAME_DEVICE = contextlib.nullcontext()


def verify_kda_prefill(args: Any) -> tuple[bool, str]:
    """Whether the sm90 kernels serve these validated ``kda_prefill`` arguments, and if not, why."""
    if args.device.type != "cuda":
        return False, f"needs CUDA tensors, got {args.device.type}"
    major, minor = device_capability(args.device)
    if (major, minor) != (9, 0):
        return False, f"built for sm_90a only; this GPU is sm_{major}{minor}"
    reason = gpu_kernel_rejection(args, HEAD_DIM)
    if reason is None and args.state is not None:
        reason = _pool_rejection(args.state, args.HV)
    if reason is not None:
        return False, reason
    if args.B * args.T * args.HV * HEAD_DIM > _INT32_MAX:
        return False, f"B*T*HV*128 = {args.B * args.T * args.HV * HEAD_DIM} exceeds 32-bit indexing"
    return True, "sm_90a kernels serve this call"


def _pool_rejection(pool: torch.Tensor, HV: int) -> str | None:
    """Why the recurrence cannot update this (validated) state pool in place, or None if it can: it reads and writes
    fp32 or bf16 slots (one element at a time: any element-aligned data pointer and slot stride), and slots that
    overlap would be written by two sequences at once."""
    if pool.dtype not in _DTYPE_CODES:
        return f"needs the state pool in fp32 or bf16, got {pool.dtype}"
    if pool.shape[0] > 1 and pool.stride(0) < HV * HEAD_DIM * HEAD_DIM:
        return (f"needs the state pool's slots apart (slot stride {pool.stride(0)} < {HV * HEAD_DIM * HEAD_DIM} "
                "elements per slot): overlapping slots would be written by two sequences at once")
    return None


def _pool_arguments(pool: tuple | None) -> tuple[int, int, int, int, int]:
    """The recurrence's state-pool arguments (pool address, slot indices, has_initial_state or 0, P, slot stride in
    elements) of ``pool`` = ``(state, state_indices, has_initial_state)``, or :data:`_NO_POOL`. The pool is passed as
    it is (written in place: never copied); the validator made the index tensors contiguous."""
    if pool is None:
        return _NO_POOL
    state, indices, has_initial = pool
    return state.data_ptr(), indices.data_ptr(), _ptr(has_initial), state.shape[0], state.stride(0)


def _aligned(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` (a ``KdaPrefillArgs`` tensor, contiguous by the validator's contract) 16-byte aligned, as the kernels'
    vector loads need: itself, or a dense copy when its data starts off a 16-byte boundary."""
    if x is None:
        return None
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _fp32(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` in fp32: the tensor itself when it already is (``.float()`` would cost a dispatch per call)."""
    return x if x is None or x.dtype == torch.float32 else x.float()


def _ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.data_ptr()


def _fixed_indices(B: int, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens, chunk_indices, chunk_offsets) of a fixed-length batch, int32 on ``device``; cached per shape."""
    key = (B, T, device)
    cached = _fixed_index_cache.get(key)
    if cached is None:
        def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            cu = torch.arange(B + 1, dtype=torch.int32, device=device) * T
            return cu, prepare_chunk_indices(cu, CHUNK), prepare_chunk_offsets(cu, CHUNK)

        cached = built_outside_graph_pools(device, build)  # (kept between calls: never in a CUDA graph's pool)
        if len(_fixed_index_cache) > 64:
            _fixed_index_cache.clear()
        _fixed_index_cache[key] = cached
    return cached


def _varlen_launch(ext: Any, cu: torch.Tensor, host: torch.Tensor, total: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(chunk_indices [NT, 2], chunk_offsets [N + 1], launch order [N], idle bands) of a packed batch on ``cu``'s
    device: the values of :func:`cula_runtime.index.prepare_varlen_launch`, built by the extension in C++ from
    ``host`` (the checked host copy of ``cu``, int32) into one host buffer and moved in one copy, and the 16-row bands
    without a token in the sequences' partial last chunks (for :func:`_bands_pay`). Cached per ``cu`` version. On the
    H200's host the Python build of a fresh ``cu_seqlens`` took ~38 us (varlen T4096, 10 sequences), all of it before
    the first launch. (Every varlen call has that copy: the validator's, or the one a call plan's caller checked.)"""

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        n = host.numel() - 1
        capacity = ext.varlen_launch_capacity(n, total, CHUNK)
        values = torch.empty(capacity, dtype=torch.int32)
        num_chunks, offsets_at, order_at, size = ext.varlen_launch_values(host.data_ptr(), n, CHUNK,
                                                                          values.data_ptr(), capacity)
        on_device = values.narrow(0, 0, size).to(cu.device, non_blocking=True)  # (itself for a CPU cu)
        return (on_device.narrow(0, 0, 2 * num_chunks).view(num_chunks, 2), on_device.narrow(0, offsets_at, n + 1),
                on_device.narrow(0, order_at, n), ext.varlen_idle_bands(host.data_ptr(), n, CHUNK))

    return cached_on_version("sm90_varlen_launch", cu, CHUNK, build)


class WorkspaceRegion(NamedTuple):
    """One workspace tensor inside the call's byte buffer."""

    name: str
    offset: int  # bytes from the buffer's start
    shape: tuple[int, int, int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2] * self.dtype.itemsize


@functools.lru_cache(maxsize=256)
def workspace_layout(total: int, HV: int, num_chunks: int) -> tuple[tuple[WorkspaceRegion, ...], int]:
    """Where the workspace between the two kernels lives in the one byte buffer a call allocates.

    Returns the regions of ``qg``, ``kg``, ``w``, ``u`` (bf16 ``[total, HV, 128]``), ``Aqk`` (bf16
    ``[total, HV, 64]``) and ``g_last`` (fp32 ``[num_chunks, HV, 128]``), in that order, and the buffer's size in
    bytes. Regions do not overlap and each starts on a 256-byte boundary. Pure arithmetic on sizes, cached.
    """
    regions = []
    offset = 0
    for name, rows, width, dtype in (("qg", total, HEAD_DIM, torch.bfloat16), ("kg", total, HEAD_DIM, torch.bfloat16),
                                     ("w", total, HEAD_DIM, torch.bfloat16), ("u", total, HEAD_DIM, torch.bfloat16),
                                     ("Aqk", total, CHUNK, torch.bfloat16),
                                     ("g_last", num_chunks, HEAD_DIM, torch.float32)):
        region = WorkspaceRegion(name, offset, (rows, HV, width), dtype)
        regions.append(region)
        offset += -(-region.nbytes // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN
    return tuple(regions), offset


def _intra_tuned() -> int:
    """``CULA_SM90_INTRA_TUNED`` as the kernel's bit set: "tensor", "bands", "auto" (the default; -1: "tensor" or
    "bands" per call), or a timing-only "ablate:" form."""
    return env_choice(ENV_INTRA_TUNED, "auto", _TUNED_FORMS)


def _bands_pay(num_chunks: int, idle_bands: int) -> bool:
    """Whether the "bands" intra form beats "tensor" on a call of ``num_chunks`` chunks whose partial last chunks hold
    ``idle_bands`` 16-row bands without a token. On the H200 (twelfth session, intra kernel at HV 64) a skipped band
    saved ~6 ns of GPU time and the band tests cost every chunk ~2% (~1.1 ns): "bands" wins from ~0.18 idle bands per
    chunk (20 sequences of T4096: 0.75, 6.5% faster; of T8192: 0.29, 1%; 10 of T16384: 0.04, 1.3% slower)."""
    return 5 * idle_bands >= num_chunks


def _programmatic_launch(recurrence_ctas: int, device: torch.device) -> bool:
    """``CULA_SM90_PDL``: whether the recurrence launches as a programmatic dependent of the intra kernel ("1"), in
    stream order ("0"), or ("auto", the default) the first when its ``recurrence_ctas`` CTAs fit on the SMs at once."""
    choice = env_choice(ENV_PROGRAMMATIC_LAUNCH, "auto", {"auto": None, "0": False, "1": True})
    return recurrence_ctas <= sm_count(device) if choice is None else choice


def _current_stream(index: int) -> int:
    """The current torch stream of CUDA device ``index``, as the integer ``cudaStream_t`` the extension takes."""
    if _raw_current_stream is not None:
        return _raw_current_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _uses_raw_workspace(device: torch.device) -> bool:
    """Whether a call's workspace on ``device`` is a raw caching-allocator block (CUDA, and a torch that has the raw
    interface) rather than a tensor."""
    return _raw_alloc is not None and device.type == "cuda"


def _device_guard(index: int) -> contextlib.AbstractContextManager:
    """Make ``index`` the current CUDA device for the launches; a no-op context when it already is (the usual case;
    entering ``torch.cuda.device`` costs two device exchanges per call)."""
    current = _raw_current_device() if _raw_current_device is not None else torch.cuda.current_device()
    return _SAME_DEVICE if current == index else torch.cuda.device(index)


class _Launch:
    """A call's two launches with everything its signature fixes resolved once: the knobs, the launch shapes, the
    dtype codes, and for a fixed-length batch the index tensors and the workspace layout. Calling it with the call's
    tensors checks their alignment, allocates o, the final state and the workspace, and launches both kernels on the
    current stream. ``kda_prefill`` builds one per call; a call plan (:func:`plan_kda_prefill`) keeps one for every
    call of its signature. Raises ValueError for a bad knob or ``block_v``, before any launch."""

    def __init__(self, args: Any, block_v: int = 0, tuned: int | None = None) -> None:
        self.ext = load_extension()
        device = args.device
        if tuned is None:
            tuned = _intra_tuned()
        if not gate_is_bounded(args):  # (only this form is exact there)
            tuned = _TUNED_FORMS["unbounded"]
        if block_v == 0:
            block_v = recurrence_block_v(args.N * args.HV, sm_count(device))
        elif block_v not in BLOCK_V_CHOICES:  # (the warpgroup-MMA recurrence needs whole warpgroups)
            raise ValueError(f"block_v must be 0 (the per-call choice), 64 or 128, got {block_v!r}")
        self.programmatic = _programmatic_launch(args.N * args.HV * (HEAD_DIM // block_v), device)
        self.block_v, self.tuned = block_v, tuned
        self.B, self.T, self.H, self.HV, self.N = args.B, args.T, args.H, args.HV, args.N
        self.total = args.B * args.T
        self.device, self.index = device, device.index
        self.raw_workspace = _uses_raw_workspace(device)
        self.scale = args.scale
        self.lower_bound = args.lower_bound if args.lower_bound is not None else -5.0
        self.gate_flags = (args.use_qk_l2norm_in_kernel, args.use_gate_in_kernel, args.use_beta_sigmoid_in_kernel,
                           args.allow_neg_eigval, args.use_gate_in_kernel and args.lower_bound is None)
        self.type_codes = (_DTYPE_CODES[args.g.dtype], _DTYPE_CODES[args.beta.dtype])
        # whether the gate's parameters need an fp32 copy (the signature fixes their dtypes)
        self.gate_params_fp32 = all(x is None or x.dtype == torch.float32 for x in (args.A_log, args.dt_bias))
        # (the state-pool form: the pool's dtype; the validator refuses initial_state and output_final_state with it)
        self.pooled = args.state is not None
        h0 = args.state if self.pooled else args.initial_state
        self.state_code = 0 if h0 is None else _DTYPE_CODES[h0.dtype]
        self.state_shape = args.state_shape if args.output_final_state else None
        self.state_v_first = args.state_v_first
        self.fixed = None
        if args.cu_seqlens is None and self.total:
            cu, indices, offsets = _fixed_indices(args.B, args.T, device)
            num_chunks = args.B * -(-args.T // CHUNK)
            # (the index tensors' addresses: the cache entry's tensors stay alive through self.fixed_indices)
            self.fixed_indices = (cu, indices, offsets)
            self.fixed = ((cu.data_ptr(), indices.data_ptr(), offsets.data_ptr()), num_chunks,
                          *workspace_layout(self.total, args.HV, num_chunks))
        # the intra launch's arguments that the signature fixes, after the index pointers and before the workspace's
        self.intra_shape = (self.H, self.HV, self.scale, self.lower_bound, *self.gate_flags)
        self.intra_form = tuned  # (the intra launch's form code, after the workspace's addresses)
        if tuned == _TUNED_FORMS["auto"]:  # "tensor" or "bands": per call (cached) for varlen, here for fixed lengths
            self.intra_forms = (_TUNED_FORMS["tensor"], _TUNED_FORMS["bands"])
            if self.fixed is not None:  # (the extension's count of idle bands, on the batch's host boundaries)
                host = torch.arange(args.B + 1, dtype=torch.int32) * args.T
                idle = self.ext.varlen_idle_bands(host.data_ptr(), args.B, CHUNK)
                self.intra_form = self.intra_forms[_bands_pay(num_chunks, idle)]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 h0: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None, cu_host: torch.Tensor | None, keep_workspace: bool = False,
                 pool: tuple | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, tuple[WorkspaceRegion, ...]]:
        """Launch on contiguous tensors of the signature it was built for (``cu_host``: the checked host copy of
        ``cu_seqlens``; ``pool``: ``(state, state_indices, has_initial_state)`` of a state-pool signature, else
        None). Returns o, the final state (or None; always None with a pool), the workspace buffer (None unless
        ``keep_workspace``) and its regions.

        Without ``keep_workspace`` the workspace is a raw block of torch's caching allocator on the current stream,
        returned to it once both kernels are queued: the same stream-ordered reuse as a tensor that goes out of scope
        after the launches (a later allocation on this stream runs after them; CUDA-graph capture gives it the
        graph's pool, as for any allocation on the capturing stream)."""
        # Host order: only what the intra kernel needs comes before its launch; o and the final state are allocated
        # while it runs (at small T the host time before the first launch is GPU idle).
        ext, device, HV, total = self.ext, self.device, self.HV, self.total
        if (pool is not None) != self.pooled:
            raise ValueError("this launch is for a state-pool call: pass its state and state_indices" if self.pooled
                             else "this launch is for a call without a state pool: pass no state")
        fixed, intra_form = self.fixed, self.intra_form
        if fixed is not None:
            # (cu_seqlens, chunk indices, chunk offsets) addresses
            index_ptrs, num_chunks, regions, nbytes = fixed
            order = None  # (equal lengths: slot order)
        else:
            # built from the checked host copy and moved in one copy (no launch, no synchronisation); cached
            chunk_indices, chunk_offsets, order, idle_bands = _varlen_launch(ext, cu_seqlens, cu_host, total)
            index_ptrs = (cu_seqlens.data_ptr(), chunk_indices.data_ptr(), chunk_offsets.data_ptr())
            num_chunks = chunk_indices.shape[0]
            regions, nbytes = workspace_layout(total, HV, num_chunks)
            if self.tuned == _TUNED_FORMS["auto"]:  # (the same bits either way)
                intra_form = self.intra_forms[_bands_pay(num_chunks, idle_bands)]
        inputs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), _ptr(A_log), _ptr(dt_bias))
        if (inputs[0] | inputs[1] | inputs[2] | inputs[3] | inputs[4] | inputs[5] | inputs[6]) & 15 or (
                not self.gate_params_fp32):  # (rare) data off a 16-byte boundary, or gate parameters not in fp32
            q, k, v, g, beta = _aligned(q), _aligned(k), _aligned(v), _aligned(g), _aligned(beta)
            A_log, dt_bias = _aligned(_fp32(A_log)), _aligned(_fp32(dt_bias))
            inputs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), _ptr(A_log),
                      _ptr(dt_bias))
        index = self.index
        stream = _current_stream(index)
        with _device_guard(index):
            # one allocation for the six workspace tensors (each only a pointer to the kernels), not six
            if keep_workspace or not self.raw_workspace:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
                base, raw = buffer.data_ptr(), 0
            else:  # (on the current device, which the guard made the tensors' one)
                buffer, base = None, _raw_alloc(nbytes, stream)
                raw = base
            try:
                o, final_state = self._launch(ext, inputs, index_ptrs, num_chunks, intra_form, order, h0,
                                              tuple(base + region.offset for region in regions), stream,
                                              _pool_arguments(pool))
            finally:
                if raw:
                    _raw_delete(raw)
        return o, final_state, buffer, regions

    def _launch(self, ext: Any, inputs: tuple[int, ...], index_ptrs: tuple[int, int, int], num_chunks: int,
                intra_form: int, order: torch.Tensor | None, h0: torch.Tensor | None,
                workspace: tuple[int, ...], stream: int, pool_args: tuple[int, ...] = _NO_POOL,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both launches on ``stream`` (the call's device current), with the workspace at the addresses
        ``workspace`` (qg, kg, w, u, Aqk, g_last) and the state-pool arguments ``pool_args``
        (:func:`_pool_arguments`). Returns o and the final state (or None). Nothing is enqueued between the two
        launches: the recurrence's programmatic launch depends on the kernel just before it."""
        device, HV, total = self.device, self.HV, self.total
        ext.kda_intra(
            *inputs, *self.type_codes, *index_ptrs, total, num_chunks, *self.intra_shape, *workspace, intra_form,
            stream,
        )
        qg, kg, w, u, Aqk, g_last = workspace
        o = torch.empty(self.B, self.T, HV, HEAD_DIM, dtype=torch.bfloat16, device=device)
        state_shape = self.state_shape
        final_state = None if state_shape is None else torch.empty(state_shape, dtype=torch.float32,
                                                                   device=device)
        ext.kda_recurrence(
            qg, kg, w, u, Aqk, g_last, index_ptrs[0], index_ptrs[2], _ptr(order),
            _ptr(_aligned(h0)), self.state_code, _ptr(final_state), o.data_ptr(), self.N, HV, self.scale,
            self.state_v_first, self.block_v, self.programmatic, total, stream, *pool_args,
        )
        return o, final_state

    def pass_states(self, args: Any) -> None:
        """A state-pool call without tokens (``B * T == 0``, ``N > 0``): as in the reference, each sequence's start
        state (zeros where ``has_initial_state`` is False) is written back to its slot; padding rows are untouched.
        The recurrence alone, on zero-length sequences (every boundary and chunk offset 0: no workspace, no o), in
        stream order (no intra kernel before it to depend on)."""
        zeros = torch.zeros(args.N + 1, dtype=torch.int32, device=self.device)  # (the boundaries of no tokens)
        pool_args = _pool_arguments((args.state, args.state_indices, args.has_initial_state))
        index = self.index
        with _device_guard(index):
            self.ext.kda_recurrence(
                0, 0, 0, 0, 0, 0, zeros.data_ptr(), zeros.data_ptr(), 0, 0, self.state_code, 0, 0, self.N, self.HV,
                self.scale, self.state_v_first, self.block_v, False, 0, _current_stream(index), *pool_args,
            )


def kda_prefill(args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run KDA prefill on the sm_90a kernels. ``args``: validated ``KdaPrefillArgs`` that ``verify`` accepted.

    Returns ``o`` bf16 ``[B, T, HV, V]`` and the fp32 final state (``[N, HV, K, V]`` or ``[N, HV, V, K]``) or None;
    with a state pool ``(o, None)``, the final states written to their slots in place.
    """
    launch = _Launch(args)  # (knobs checked first: a bad one raises even for a call without tokens)
    if args.B * args.T == 0:  # no intra launch: empty o, and each sequence's state passes through
        if launch.pooled and args.N:
            launch.pass_states(args)
        return empty_prefill_result(args)
    o, final_state, _, _ = launch(args.q, args.k, args.v, args.g, args.beta, args.initial_state, args.A_log,
                                  args.dt_bias, args.cu_seqlens, args.cu_seqlens_host, pool=_pool_of(args))
    return o, final_state


def _pool_of(args: Any) -> tuple | None:
    """``(state, state_indices, has_initial_state)`` of validated arguments with a state pool, else None."""
    return None if args.state is None else (args.state, args.state_indices, args.has_initial_state)


Plan = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def plan_kda_prefill(args: Any) -> Plan | None:
    """A call plan for every later call with the signature of ``args`` (validated arguments ``verify`` accepted,
    whose tensors the caller passed contiguous), or None for a call without tokens (it launches nothing).

    The plan takes the call's tensors in the order ``(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
    cu_seqlens_host)``, the last the checked host copy of ``cu_seqlens``
    (:func:`cula_runtime.kda_args.checked_boundaries`, which its caller runs), and for a state-pool signature the
    keywords ``state``, ``state_indices`` and ``has_initial_state`` (the pool written in place; ``cula.call_plans``
    plans no such call, the validator sees each), and returns what :func:`kda_prefill` returns. It resolves the knobs
    and launch shapes once (``cula.call_plans`` keys plans on the knobs' values) and holds no tensor of the call it
    was made from.
    """
    if args.B * args.T == 0:
        return None
    launch = _Launch(args)

    def plan(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_host, *, state=None,
             state_indices=None, has_initial_state=None):
        pool = None if state is None else (state, state_indices, has_initial_state)
        o, final_state, _, _ = launch(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_host, pool=pool)
        return o, final_state

    return plan


def run_kernels(args: Any, block_v: int = 0, intra_tuned: str | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """``kda_prefill`` that also returns the workspace between the two kernels (for tests and tuning).

    Workspace (token-major, ``Ttot = B*T``): ``qg``, ``kg``, ``w``, ``u`` bf16 ``[Ttot, HV, 128]``, ``Aqk`` bf16
    ``[Ttot, HV, 64]`` (only its 16 x 16 blocks on and below each chunk's diagonal are written; the rest is
    whatever the allocator left), ``g_last`` fp32 ``[NT, HV, 128]`` (log2 units); views into one buffer
    (:func:`workspace_layout`). ``block_v``: V columns per recurrence CTA, 64 or 128 (0:
    :func:`cula_runtime.kda_tuning.recurrence_block_v` picks one from N·HV and the SM count; another value is a
    ValueError). ``intra_tuned``: the intra kernel's form, a key of ``_TUNED_FORMS`` ("tensor", "bands", "auto",
    or in an ablation build a timing-only "ablate:" form); None: ``CULA_SM90_INTRA_TUNED``.
    """
    if intra_tuned is not None and intra_tuned not in _TUNED_FORMS:
        raise ValueError(f"intra_tuned must be None or one of {sorted(_TUNED_FORMS)}, got {intra_tuned!r}")
    tuned = None if intra_tuned is None else _TUNED_FORMS[intra_tuned]
    launch = _Launch(args, block_v, tuned=tuned)  # (knobs checked before the empty case: a bad one raises either way)
    if args.B * args.T == 0:
        if launch.pooled and args.N:
            launch.pass_states(args)
        return *empty_prefill_result(args), {}
    o, final_state, buffer, regions = launch(args.q, args.k, args.v, args.g, args.beta, args.initial_state,
                                             args.A_log, args.dt_bias, args.cu_seqlens, args.cu_seqlens_host,
                                             keep_workspace=True, pool=_pool_of(args))
    views = {r.name: buffer[r.offset:r.offset + r.nbytes].view(r.dtype).view(r.shape) for r in regions}
    return o, final_state, views
