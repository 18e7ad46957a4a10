"""Host-side argument checks shared by the CuTeDSL kernel wrappers: token-major tensors and packed-varlen indices."""

from __future__ import annotations

from typing import Any


def check_cu_seqlens(cu_seqlens: Any, B: int, device: Any) -> int:
    """Check a packed batch's ``cu_seqlens`` (1-D int32 on ``device``, with ``B == 1``); return N, the sequences."""
    import torch

    if B != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs B = 1, got B = {B}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != device:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor on the inputs' device")
    return cu_seqlens.shape[0] - 1


def chunk_rows(cu_seqlens: Any, chunk_indices: Any, B: int, T: int, device: Any, chunk_size: int = 64) -> tuple:
    """``(chunk_indices or None, number of chunks)`` for a chunk-parallel launch.

    Fixed length (``cu_seqlens`` None): no index tensor, ``B * ceil(T / C)`` chunks. Packed: ``chunk_indices``
    (computed by :func:`cula_runtime.index.prepare_chunk_indices` when None) must be int32 ``[NT, 2]``.
    """
    import torch

    if cu_seqlens is None:
        return None, B * -(-T // chunk_size)
    check_cu_seqlens(cu_seqlens, B, device)
    if chunk_indices is None:
        from ..index import prepare_chunk_indices

        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    if chunk_indices.dtype != torch.int32 or chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
        raise ValueError("chunk_indices must be an int32 [NT, 2] tensor")
    return chunk_indices, chunk_indices.shape[0]


def check_token_tensors(named: dict, B: int, T: int) -> None:
    """Every tensor of ``named`` (name -> ``(tensor, heads, last, dtype)``, ``last`` None for a rank-3 tensor) is
    ``dtype [B, T, heads, last]`` on the first one's CUDA device; else ``ValueError`` naming it."""
    device = next(iter(named.values()))[0].device
    for name, (t, heads, last, dtype) in named.items():
        shape = (B, T, heads) if last is None else (B, T, heads, last)
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
        if t.device != device or device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor on {device}")
