"""The sm90 backend of ``kda_prefill``: checks validated arguments, allocates through torch, launches the kernels.

Two kernels (``csrc/kda/``): ``intra`` runs over all chunks in parallel (L2 norm, safe gate, cumulative gate,
Aqk/Akk, the fp32 inverse, w/u/kg/qg) into a bf16 workspace; ``recurrence`` walks each sequence's chunks with the
fp32 state in registers and writes o and the final state. Both launch on the current torch stream.

What it serves (``verify``): an SM90 GPU, bf16 q/k/v, K = V = 128, the safe gate (``safe_gate=True``,
``lower_bound`` in [-5, 0)), fp32/bf16 g and beta, fp32/bf16 initial state, any GVA ratio, fixed or varlen.
"""

from __future__ import annotations

from typing import Any

import torch

from cula_runtime.index import prepare_chunk_indices, prepare_chunk_offsets
from cula_runtime.kda_args import safe_gate_kernel_rejection
from cula_runtime.kda_tuning import recurrence_block_v, sm_count

from . import load_extension

__all__ = ["verify_kda_prefill", "kda_prefill", "run_kernels"]

CHUNK = 64
HEAD_DIM = 128
_INT32_MAX = 2**31 - 1
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_fixed_index_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def verify_kda_prefill(args: Any) -> tuple[bool, str]:
    """Whether the sm90 kernels serve these validated ``kda_prefill`` arguments, and if not, why."""
    if args.device.type != "cuda":
        return False, f"needs CUDA tensors, got {args.device.type}"
    major, minor = torch.cuda.get_device_capability(args.device)
    if (major, minor) != (9, 0):
        return False, f"built for sm_90a only; this GPU is sm_{major}{minor}"
    reason = safe_gate_kernel_rejection(args, HEAD_DIM)
    if reason is not None:
        return False, reason
    if args.B * args.T * args.HV * HEAD_DIM > _INT32_MAX:
        return False, f"B*T*HV*128 = {args.B * args.T * args.HV * HEAD_DIM} exceeds 32-bit indexing"
    return True, "sm_90a kernels serve this call"


def _aligned(x: torch.Tensor | None) -> torch.Tensor | None:
    """16-byte aligned dense tensor (the kernels use 16-byte vector loads)."""
    if x is None:
        return None
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.data_ptr()


def _indices(args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(cu_seqlens, chunk_indices, chunk_offsets, number of chunks), int32 on the device."""
    if args.cu_seqlens is not None:
        cu = args.cu_seqlens
        indices = prepare_chunk_indices(cu, CHUNK)
        offsets = prepare_chunk_offsets(cu, CHUNK)
        return cu, indices, offsets, indices.shape[0]
    key = (args.B, args.T, args.device)
    cached = _fixed_index_cache.get(key)
    if cached is None:
        cu = torch.arange(args.B + 1, dtype=torch.int32, device=args.device) * args.T
        cached = (cu, prepare_chunk_indices(cu, CHUNK), prepare_chunk_offsets(cu, CHUNK))
        if len(_fixed_index_cache) > 64:
            _fixed_index_cache.clear()
        _fixed_index_cache[key] = cached
    cu, indices, offsets = cached
    return cu, indices, offsets, args.B * -(-args.T // CHUNK)


def kda_prefill(args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run KDA prefill on the sm_90a kernels. ``args``: validated ``KdaPrefillArgs`` that ``verify`` accepted.

    Returns ``o`` bf16 ``[B, T, HV, V]`` and the fp32 final state (``[N, HV, K, V]`` or ``[N, HV, V, K]``) or None.
    """
    o, final_state, _ = run_kernels(args)
    return o, final_state


def run_kernels(args: Any, block_v: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """``kda_prefill`` that also returns the workspace between the two kernels (for tests and tuning).

    Workspace (token-major, ``Ttot = B*T``): ``qg``, ``kg``, ``w``, ``u`` bf16 ``[Ttot, HV, 128]``, ``Aqk`` bf16
    ``[Ttot, HV, 64]``, ``g_last`` fp32 ``[NT, HV, 128]`` (log2 units). ``block_v``: V columns per recurrence CTA
    (32, 64 or 128; 0: :func:`cula_runtime.kda_tuning.recurrence_block_v` picks it from N·HV and the SM count).
    """
    ext = load_extension()
    B, T, H, HV, N = args.B, args.T, args.H, args.HV, args.N
    device = args.device
    total = B * T
    o = torch.empty(B, T, HV, HEAD_DIM, dtype=torch.bfloat16, device=device)
    final_state = torch.empty(args.state_shape, dtype=torch.float32, device=device) if args.output_final_state \
        else None
    if total == 0:
        if final_state is not None:
            final_state.copy_(args.initial_state if args.initial_state is not None else torch.zeros_like(final_state))
        return o, final_state, {}
    cu, chunk_indices, chunk_offsets, num_chunks = _indices(args)
    q, k, v, g, beta = (_aligned(x) for x in (args.q, args.k, args.v, args.g, args.beta))
    A_log = None if args.A_log is None else _aligned(args.A_log.float())
    dt_bias = None if args.dt_bias is None else _aligned(args.dt_bias.float())
    h0 = _aligned(args.initial_state)

    def workspace(width: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(total, HV, width, dtype=dtype, device=device)

    qg, kg, w, u = workspace(HEAD_DIM), workspace(HEAD_DIM), workspace(HEAD_DIM), workspace(HEAD_DIM)
    Aqk = workspace(CHUNK)
    g_last = torch.empty(num_chunks, HV, HEAD_DIM, dtype=torch.float32, device=device)
    if block_v == 0:
        block_v = recurrence_block_v(N * HV, sm_count(device))
    stream = torch.cuda.current_stream(device).cuda_stream
    lower_bound = args.lower_bound if args.lower_bound is not None else -5.0
    with torch.cuda.device(device):
        ext.kda_intra(
            _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(A_log), _ptr(dt_bias),
            _DTYPE_CODES[g.dtype], _DTYPE_CODES[beta.dtype], _ptr(cu), _ptr(chunk_indices), _ptr(chunk_offsets),
            total, num_chunks, H, HV, args.scale, lower_bound, args.use_qk_l2norm_in_kernel, args.use_gate_in_kernel,
            args.use_beta_sigmoid_in_kernel, args.allow_neg_eigval,
            _ptr(qg), _ptr(kg), _ptr(w), _ptr(u), _ptr(Aqk), _ptr(g_last), stream,
        )
        ext.kda_recurrence(
            _ptr(qg), _ptr(kg), _ptr(w), _ptr(u), _ptr(Aqk), _ptr(g_last), _ptr(cu), _ptr(chunk_offsets),
            _ptr(h0), _DTYPE_CODES[h0.dtype] if h0 is not None else 0, _ptr(final_state), _ptr(o),
            N, HV, args.scale, args.state_v_first, block_v, stream,
        )
    return o, final_state, {"qg": qg, "kg": kg, "w": w, "u": u, "Aqk": Aqk, "g_last": g_last}
