"""The ``cutedsl`` backend of ``kda_decode``: one launch of the decode kernel (:mod:`.decode`) over the pool, in
place. Importing this module imports neither CuTeDSL nor TVM-FFI; the kernel module loads on the first call.

Where it has run: the kernel ran on sm_90 (H200) against a float64 loop (``tests/cute/test_kda_decode_gpu.py``,
2026-12-02) and through ``cula.kda.kda_decode`` (``tests/gpu/test_kda_decode_gpu.py``); it is compiled for
sm_100a/sm_103a in CI, where no GPU has run it.

What it serves: bf16 q/k/v with K = V = 128, fp32 or bf16 g and β, every gate form, fp32 or bf16 pools whose heads
are dense ``[128, 128]`` blocks (16-byte aligned; the slot stride is free). Everything else goes to the reference,
with the reason. An int64 ``cu_seqlens`` is narrowed to int32 (one small copy per call; int32 is the zero-allocation
form a CUDA graph wants).
"""

from __future__ import annotations

import functools

import torch

from ...kda_decode_args import KdaDecodeArgs
from .. import decode_pool_rejection, device_rejection

__all__ = ["verify_decode", "kda_decode_cutedsl_backend", "plan_kda_decode"]

HEAD_DIM = 128


def verify_decode(args: KdaDecodeArgs) -> tuple[bool, str]:
    """Whether the CuTeDSL decode kernel serves these validated ``kda_decode`` arguments, and if not, why."""
    reason = device_rejection(args.device)
    if reason is not None:
        return False, reason
    if args.q.dtype != torch.bfloat16:
        return False, f"needs bf16 q/k/v, got {args.q.dtype}"
    if (args.K, args.V) != (HEAD_DIM, HEAD_DIM):
        return False, f"needs K = V = {HEAD_DIM}, got K={args.K} V={args.V}"
    for name in ("g", "beta"):
        dtype = getattr(args, name).dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return False, f"needs {name} in fp32 or bf16, got {dtype}"
    return decode_pool_rejection(args.state, "the CuTeDSL decode kernel serves this call", HEAD_DIM)


@functools.cache
def _kernel() -> object:
    """``kda_decode_cutedsl``, imported on the first call (importing it imports CuTeDSL)."""
    from .decode import kda_decode_cutedsl

    return kda_decode_cutedsl


@functools.cache
def _planner() -> object:
    """``plan_kda_decode_launch``, imported on the first plan."""
    from .decode import plan_kda_decode_launch

    return plan_kda_decode_launch


def _fp32(x: torch.Tensor | None) -> torch.Tensor | None:
    """A gate parameter (``A_log``, ``dt_bias``; fp32, bf16 or fp64) in the fp32 the kernel reads."""
    return x if x is None or x.dtype == torch.float32 else x.float()


def kda_decode_cutedsl_backend(args: KdaDecodeArgs) -> torch.Tensor:
    """Run validated ``kda_decode`` arguments (accepted by :func:`verify_decode`) on the CuTeDSL kernel: ``o``
    ``[B, T, HV, V]`` bf16 (``args.out`` when given), the pool updated in place."""
    cu = args.cu_seqlens
    if cu is not None and cu.dtype != torch.int32:
        cu = cu.to(torch.int32)
    return _kernel()(
        args.q, args.k, args.v, args.g, args.beta, state=args.state, state_indices=args.state_indices,
        scale=args.scale, A_log=_fp32(args.A_log), dt_bias=_fp32(args.dt_bias), lower_bound=args.lower_bound,
        use_qk_l2norm_in_kernel=args.use_qk_l2norm_in_kernel, use_gate_in_kernel=args.use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=args.use_beta_sigmoid_in_kernel, allow_neg_eigval=args.allow_neg_eigval,
        state_v_first=args.state_v_first, cu_seqlens=cu, num_accepted_tokens=args.num_accepted_tokens,
        out=args.out,
    )


def plan_kda_decode(args: KdaDecodeArgs):
    """A call plan (``cula.call_plans``) for every later ``kda_decode`` call with the signature of ``args``
    (validated arguments :func:`verify_decode` accepted, every tensor passed as it is): ``plan(q, k, v, g, beta,
    state, state_indices, A_log, dt_bias, cu_seqlens, num_accepted_tokens, out) -> o`` launches the kernel with
    nothing validated or dispatched and the compiled kernel looked up once, allocating ``o`` when ``out`` is None
    (:func:`~.decode.plan_kda_decode_launch`, which is the plan itself: one Python frame per call); for a signature
    with an int64 ``cu_seqlens`` or non-fp32 gate parameters, the plan first converts them as the validator and
    :func:`kda_decode_cutedsl_backend` would. Holds no tensor of the call it was made from (the pool, the indices
    and every input come with each call)."""
    cu = args.cu_seqlens
    narrow_cu = cu is not None and cu.dtype != torch.int32
    A_log, dt_bias = _fp32(args.A_log), _fp32(args.dt_bias)
    widen_A_log = A_log is not args.A_log
    widen_dt_bias = dt_bias is not args.dt_bias
    launch = _planner()(
        args.q, args.v, args.g, args.beta, state=args.state, state_indices=args.state_indices, scale=args.scale,
        A_log=A_log, dt_bias=dt_bias, lower_bound=args.lower_bound,
        use_qk_l2norm_in_kernel=args.use_qk_l2norm_in_kernel, use_gate_in_kernel=args.use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=args.use_beta_sigmoid_in_kernel, allow_neg_eigval=args.allow_neg_eigval,
        state_v_first=args.state_v_first, cu_seqlens=None if cu is None else cu.to(torch.int32),
        num_accepted_tokens=args.num_accepted_tokens)
    if not (narrow_cu or widen_A_log or widen_dt_bias):
        return launch

    def plan(q, k, v, g, beta, state, state_indices, A_log, dt_bias, cu_seqlens, num_accepted_tokens, out):
        if narrow_cu:
            cu_seqlens = cu_seqlens.to(torch.int32)
        if widen_A_log:
            A_log = A_log.float()
        if widen_dt_bias:
            dt_bias = dt_bias.float()
        return launch(q, k, v, g, beta, state, state_indices, A_log, dt_bias, cu_seqlens, num_accepted_tokens, out)

    return plan
