"""The ``cutedsl`` backend of ``kda_prefill``: prepare → intra → recurrence, three CuTeDSL launches (two with the
``fused-prepare`` intra variant, whose intra kernel does prepare's work).

Importing this module imports neither CuTeDSL nor TVM-FFI; the kernel modules load on the first call.

Where it has run: all three kernels ran on sm_90 (H200) against the fp64 oracle (tests/cute, tests/gpu,
2026-11-29); they are compiled for sm_100a/sm_103a in CI but no Blackwell GPU has run them (the registry says so).
"""

from __future__ import annotations

from typing import Any

from ...index import prepare_chunk_indices, prepare_chunk_offsets, prepare_sequence_order
from ...kda_args import safe_gate_kernel_rejection
from ...kda_tuning import device_capability, recurrence_block_v, sm_count
from .. import is_available

__all__ = ["verify", "kda_prefill_cutedsl"]

CHUNK = 64
HEAD_DIM = 128
_CAPABILITIES = {(9, 0), (10, 0), (10, 3)}
CUTE_NARROWEST_BLOCK_V = 64  # the CuTeDSL recurrence's 2-warp CTAs (block_v 32) are its slowest (kda_tuning)


def verify(args: Any) -> tuple[bool, str]:
    """Whether the CuTeDSL kernels serve these validated ``kda_prefill`` arguments, and if not, why."""
    if not is_available():
        return False, 'needs CuTeDSL and TVM-FFI: pip install "cula[cute]"'
    if args.device.type != "cuda":
        return False, f"needs CUDA tensors, got {args.device.type}"
    capability = device_capability(args.device)
    if capability not in _CAPABILITIES:
        return False, f"targets sm_90a/sm_100a/sm_103a; this GPU is sm_{capability[0]}{capability[1]}"
    reason = safe_gate_kernel_rejection(args, HEAD_DIM)
    if reason is not None:
        return False, reason
    return True, "CuTeDSL kernels serve this call"


def kda_prefill_cutedsl(args: Any, *, block_v: int = 0) -> tuple[Any, Any]:
    """Run KDA prefill on the CuTeDSL kernels. ``args``: validated ``KdaPrefillArgs`` that ``verify`` accepted;
    ``block_v``: value columns per recurrence CTA (32, 64, 128; the same bits for each; 0:
    :func:`cula_runtime.kda_tuning.recurrence_block_v` picks it from N·HV and the SM count, at least 64).

    Returns ``o`` bf16 ``[B, T, HV, V]`` and the fp32 final state (layout of ``initial_state``) or None.
    """
    import torch

    from .intra import chunk_kda_fwd_intra, chunk_kda_fwd_intra_from_raw, variant_flags
    from .prepare import kda_prepare
    from .recurrence import chunk_kda_fwd_recurrence

    if args.B * args.T == 0:  # nothing to launch: empty o, and each sequence's state passes through
        o = torch.empty(args.B, args.T, args.HV, args.V, dtype=args.q.dtype, device=args.device)
        if not args.output_final_state:
            return o, None
        if args.initial_state is None:
            return o, torch.zeros(args.state_shape, dtype=torch.float32, device=args.device)
        return o, args.initial_state.float().clone()
    cu = args.cu_seqlens
    chunk_indices = None if cu is None else prepare_chunk_indices(cu, CHUNK)
    h0 = args.initial_state
    if h0 is not None and h0.dtype != torch.float32:
        h0 = h0.float()
    if block_v == 0:
        block_v = recurrence_block_v(args.N * args.HV, sm_count(args.device), narrowest=CUTE_NARROWEST_BLOCK_V)
    _, _, fuse_l2norm, fuse_gate, _ = variant_flags(None)
    raw_dtypes = (torch.bfloat16, torch.float32)
    if fuse_gate and args.g.dtype in raw_dtypes and args.beta.dtype in raw_dtypes:
        # "fused-prepare": the intra kernel does all of kda_prepare's work (same bits), one launch less; the
        # recurrence reads its per-chunk decay rows and launches varlen sequences longest first (same bits)
        w, u, qg, kg, Aqk, g_last = chunk_kda_fwd_intra_from_raw(
            args.q, args.k, args.v, args.g, args.beta, args.scale, A_log=args.A_log, dt_bias=args.dt_bias,
            lower_bound=args.lower_bound if args.use_gate_in_kernel else None,
            use_qk_l2norm_in_kernel=args.use_qk_l2norm_in_kernel, use_gate_in_kernel=args.use_gate_in_kernel,
            use_beta_sigmoid_in_kernel=args.use_beta_sigmoid_in_kernel, allow_neg_eigval=args.allow_neg_eigval,
            cu_seqlens=cu, chunk_indices=chunk_indices,
        )
        return chunk_kda_fwd_recurrence(
            qg, kg, w, u, Aqk, g_last, args.scale, initial_state=h0, output_final_state=args.output_final_state,
            cu_seqlens=cu, chunk_offsets=None if cu is None else prepare_chunk_offsets(cu, CHUNK),
            state_v_first=args.state_v_first, block_v=block_v, gate_per_chunk=True,
            seq_order=None if cu is None else prepare_sequence_order(cu),
        )
    # The "fused" intra variant L2-normalises q/k itself (same bits): prepare then only does the gate and beta.
    fuse_l2norm = args.use_qk_l2norm_in_kernel and fuse_l2norm
    q_hat, k_hat, g_cum, beta = kda_prepare(
        args.q, args.k, args.g, args.beta, A_log=args.A_log, dt_bias=args.dt_bias,
        lower_bound=args.lower_bound if args.use_gate_in_kernel else None,
        use_qk_l2norm_in_kernel=args.use_qk_l2norm_in_kernel and not fuse_l2norm,
        use_gate_in_kernel=args.use_gate_in_kernel, use_beta_sigmoid_in_kernel=args.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=args.allow_neg_eigval, cu_seqlens=cu, chunk_indices=chunk_indices,
    )
    w, u, qg, kg, Aqk, _ = chunk_kda_fwd_intra(
        q_hat, k_hat, args.v, g_cum, beta, args.scale, cu_seqlens=cu, chunk_indices=chunk_indices, output_qg=True,
        use_qk_l2norm_in_kernel=fuse_l2norm,
    )
    return chunk_kda_fwd_recurrence(
        qg, kg, w, u, Aqk, g_cum, args.scale, initial_state=h0, output_final_state=args.output_final_state,
        cu_seqlens=cu, state_v_first=args.state_v_first, block_v=block_v,
    )
