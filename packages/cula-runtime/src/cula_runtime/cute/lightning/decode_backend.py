"""The ``cutedsl`` backend of ``lightning_decode``: one launch of the Lightning decode kernel (:mod:`.decode`) over
the state pool, in place. Importing this module imports neither CuTeDSL nor TVM-FFI; the kernel module loads on the
first call.

What it serves: bf16 or fp16 q/k/v with K = V = 128, an fp32 ``g_gamma`` ``[H]``, fp32 or bf16 pools in either layout
whose heads are dense ``[128, 128]`` blocks (16-byte aligned; the slot stride is free), and an ``out`` (when given)
that is contiguous and 16-byte aligned. Everything else is declined with the reason (the dispatch then runs the
reference): fp32 q/k/v, other head dims, an fp64 (or any other) pool, misaligned or non-dense pool heads.

A fixed-length call of T = 1 (a decode step) runs the kernel's single-token form, every other call (T > 1, packed
sequences) its general form (:class:`~.decode.LightningDecodeConfig`); both compile once per configuration and
serve every batch size.

An int64 ``cu_seqlens`` is narrowed to int32 on the device (one small copy and allocation per call; int32 is the
zero-allocation form a CUDA graph wants, and a packed batch's offsets fit in it: the kernel indexes tokens with
int32).

Where it has run: on sm_90 (H200, 2026-12-02) against a float64 loop (``tests/cute/test_lightning_decode_gpu.py``) and
through ``cula.lightning.lightning_decode`` (``tests/gpu/test_lightning_gpu.py``), both forms; compiled for sm_100a
and sm_103a in CI (``tests/cute/test_lightning_decode_compile.py``), where no GPU has run it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import decode_pool_rejection, device_rejection

if TYPE_CHECKING:
    from ...lightning_args import LightningDecodeArgs

__all__ = ["verify_lightning_decode", "lightning_decode_cutedsl_backend", "plan_lightning_decode"]

HEAD_DIM = 128
_IO_DTYPES = (torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def verify_lightning_decode(args: LightningDecodeArgs) -> tuple[bool, str]:
    """Whether the CuTeDSL Lightning decode kernel serves these validated ``lightning_decode`` arguments, and if
    not, why. Free of side effects; reads no device value."""
    reason = device_rejection(args.device)
    if reason is not None:
        return False, reason
    if args.q.dtype not in _IO_DTYPES:
        return False, f"needs bf16 or fp16 q/k/v, got {args.q.dtype}"
    if (args.K, args.V) != (HEAD_DIM, HEAD_DIM):
        return False, f"needs K = V = {HEAD_DIM}, got K={args.K} V={args.V}"
    if args.g_gamma.dtype != torch.float32 or not args.g_gamma.is_contiguous():
        return False, f"needs g_gamma fp32 contiguous [H], got {args.g_gamma.dtype} strides {args.g_gamma.stride()}"
    if args.state_indices.dtype != torch.int32 or args.state_indices.dim() != 1:
        return False, (f"needs state_indices int32 [N], got {args.state_indices.dtype} "
                       f"{list(args.state_indices.shape)}")
    if args.cu_seqlens is not None and args.cu_seqlens.dtype not in _INDEX_DTYPES:
        return False, f"needs cu_seqlens int32 or int64, got {args.cu_seqlens.dtype}"
    # (``out``: the validator checked its shape, dtype and contiguity; a misaligned one is refused by the launch with
    # a ValueError, as kda_decode's is and as a plan's launch refuses it: never sent to the reference)
    return decode_pool_rejection(args.state, "the CuTeDSL Lightning decode kernel serves this call", HEAD_DIM)


@functools.cache
def _kernel() -> Callable:
    """``lightning_decode_cutedsl``, imported on the first call (importing it imports CuTeDSL)."""
    from .decode import lightning_decode_cutedsl

    return lightning_decode_cutedsl


@functools.cache
def _planner() -> Callable:
    """``plan_lightning_decode_launch``, imported on the first plan."""
    from .decode import plan_lightning_decode_launch

    return plan_lightning_decode_launch


def _int32(cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    """``cu_seqlens`` as the int32 the kernel reads (an int64 one narrowed: a small device copy)."""
    if cu_seqlens is None or cu_seqlens.dtype == torch.int32:
        return cu_seqlens
    return cu_seqlens.to(torch.int32)


def lightning_decode_cutedsl_backend(args: LightningDecodeArgs) -> torch.Tensor:
    """Run validated ``lightning_decode`` arguments (accepted by :func:`verify_lightning_decode`) on the CuTeDSL
    kernel: ``o`` ``[B, T, H, V]`` in q's dtype (``args.out`` when given), the pool updated in place."""
    return _kernel()(args.q, args.k, args.v, args.g_gamma, state=args.state, state_indices=args.state_indices,
                     scale=args.scale, state_v_first=args.state_v_first, cu_seqlens=_int32(args.cu_seqlens),
                     out=args.out)


def plan_lightning_decode(args: LightningDecodeArgs) -> Callable | None:
    """A call plan (``cula.call_plans``) for every later ``lightning_decode`` call with the signature of ``args``
    (validated arguments, every tensor passed as it is): ``plan(q, k, v, g_gamma, state, state_indices, cu_seqlens,
    out) -> o`` launches the kernel with nothing validated or dispatched and the compiled kernel looked up once,
    allocating ``o`` when ``out`` is None (:func:`~.decode.plan_lightning_decode_launch`, which is the plan itself:
    one Python frame per call); for a signature with an int64 ``cu_seqlens``, the plan first narrows it as the
    backend does. None when :func:`verify_lightning_decode` declines ``args``. Holds no tensor of the call it was
    made from (the pool, the indices and every input come with each call)."""
    if not verify_lightning_decode(args)[0]:
        return None
    cu = args.cu_seqlens
    launch = _planner()(args.q, args.k, args.v, args.g_gamma, state=args.state, state_indices=args.state_indices,
                        scale=args.scale, state_v_first=args.state_v_first, cu_seqlens=_int32(cu))
    if cu is None or cu.dtype == torch.int32:
        return launch

    def plan(q, k, v, g_gamma, state, state_indices, cu_seqlens, out):
        return launch(q, k, v, g_gamma, state, state_indices, cu_seqlens.to(torch.int32), out)

    return plan
