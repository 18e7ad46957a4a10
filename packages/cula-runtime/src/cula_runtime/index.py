"""Index helpers for packed variable-length batches (KDA_SPEC.md §4).

All helpers take ``cu_seqlens``, an integer tensor ``[N+1]`` of cumulative sequence starts (``cu[0] == 0``,
non-decreasing), and return tensors of the same dtype and device. They are vectorised: no Python loop over
sequences or chunks.

Results are cached on the identity of ``cu_seqlens`` *and* its version counter, so an in-place update of
``cu_seqlens`` is never answered from a stale entry, and a cache hit touches no device memory (no
synchronisation). Inference-mode tensors carry no version counter and are never cached.

Device synchronisation: :func:`checked_cu_seqlens_values` (the validator's check) copies ``cu_seqlens`` to the host
once per (tensor, version) and keeps that copy; :func:`prepare_chunk_indices` then counts its rows on the host
copy, so building the indices of a checked ``cu_seqlens`` adds no further synchronisation. Without a checked copy
(an unchecked or inference-mode tensor) ``repeat_interleave`` reads the row count on the device (two
synchronisations on a cache miss).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "prepare_lens", "prepare_chunk_indices", "prepare_chunk_offsets", "prepare_sequence_order", "check_chunk_size",
    "check_cu_seqlens_values",
    "checked_cu_seqlens_values", "cached_on_version", "clear_index_cache",
]

_CACHE_CAPACITY = 128  # entries; a cu_seqlens tensor takes up to five (its check, boundaries, index tensors)
_cache: OrderedDict[tuple, tuple[weakref.ref, Any]] = OrderedDict()
_T = TypeVar("_T")


def check_chunk_size(chunk_size: object) -> int:
    """Return ``chunk_size`` if it is a positive ``int``; raise ``TypeError``/``ValueError`` naming it otherwise."""
    if chunk_size is None or isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be a positive int (e.g. 64), got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int (e.g. 64), got {chunk_size}")
    return chunk_size


def _check_cu_seqlens_tensor(cu_seqlens: object) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor (torch.int32), got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}")
    return cu_seqlens


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """Check that ``cu_seqlens`` starts at 0, never decreases and ends at the packed length ``T``.

    Returns the boundaries as Python ints (one device-to-host copy); ``ValueError`` naming the bad entry otherwise.
    """
    values = [int(c) for c in _check_cu_seqlens_tensor(cu_seqlens).tolist()]
    if values[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={values[i]} < "
                f"cu_seqlens[{i - 1}]={values[i - 1]}"
            )
    if values[-1] != T:
        raise ValueError(f"cu_seqlens[-1] must equal the packed length T={T}, got {values[-1]}")
    return values


def cached_on_version(kind: str, cu_seqlens: torch.Tensor, extra: object, build: Callable[[], _T]) -> _T:
    """Return ``build()``, cached on (``kind``, identity and version counter of ``cu_seqlens``, ``extra``).

    The one cache of everything derived from ``cu_seqlens`` (index tensors, validation results).
    """
    if cu_seqlens.is_inference():
        return build()
    key = (kind, id(cu_seqlens), cu_seqlens._version, extra)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is cu_seqlens:
        _cache.move_to_end(key)
        return hit[1]
    value = build()
    _cache[key] = (weakref.ref(cu_seqlens), value)
    while len(_cache) > _CACHE_CAPACITY:
        _cache.popitem(last=False)
    return value


def _cached(kind: str, cu_seqlens: torch.Tensor, extra: object) -> Any:
    """The entry :func:`cached_on_version` holds for this key, or None; never builds one."""
    if cu_seqlens.is_inference():
        return None
    hit = _cache.get((kind, id(cu_seqlens), cu_seqlens._version, extra))
    return hit[1] if hit is not None and hit[0]() is cu_seqlens else None


def checked_cu_seqlens_values(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """:func:`check_cu_seqlens_values`, cached on (identity and version of ``cu_seqlens``, ``T``).

    The first call per (tensor, version) copies the boundaries to the host (one synchronisation), checks the copy and
    keeps it for :func:`prepare_chunk_indices`; later calls touch no device memory. ``ValueError`` as
    :func:`check_cu_seqlens_values` (a failed check is not cached).
    """

    def build() -> list[int]:
        host = _check_cu_seqlens_tensor(cu_seqlens).to("cpu", copy=True)  # a copy even of a CPU tensor
        values = check_cu_seqlens_values(host, T)
        cached_on_version("boundaries", cu_seqlens, None, lambda: host)
        return values

    return cached_on_version("cu_seqlens_values", cu_seqlens, T, build)


def clear_index_cache() -> None:
    """Drop every cached index tensor."""
    _cache.clear()


def prepare_lens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence lengths ``cu[1:] - cu[:-1]``: shape ``[N]``, dtype and device of ``cu_seqlens``."""
    cu_seqlens = _check_cu_seqlens_tensor(cu_seqlens)
    return cu_seqlens[1:] - cu_seqlens[:-1]


def _chunks_per_sequence(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    lens = prepare_lens(cu_seqlens)
    return torch.div(lens + (chunk_size - 1), chunk_size, rounding_mode="floor")


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Global index of each sequence's first chunk: ``[0, cumsum(ceil(len_n / C))]``, shape ``[N+1]``.

    ``offsets[N]`` is the total number of chunks. Same dtype and device as ``cu_seqlens``.
    """
    chunk_size = check_chunk_size(chunk_size)
    cu_seqlens = _check_cu_seqlens_tensor(cu_seqlens)

    def build() -> torch.Tensor:
        counts = _chunks_per_sequence(cu_seqlens, chunk_size)
        zero = torch.zeros(1, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
        return torch.cat([zero, torch.cumsum(counts, 0).to(cu_seqlens.dtype)])

    return cached_on_version("offsets", cu_seqlens, chunk_size, build)


def prepare_sequence_order(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The sequences of a packed batch, longest first (equal lengths keep their order): ``[N]``, dtype and device
    of ``cu_seqlens``. A recurrence that launches its sequences in this order starts the longest chains first.
    Example: ``cu = [0, 100, 100, 228, 240]`` gives ``[2, 0, 3, 1]``. Built on the device (no synchronisation)."""
    cu_seqlens = _check_cu_seqlens_tensor(cu_seqlens)

    def build() -> torch.Tensor:
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        return torch.argsort(lens, descending=True, stable=True).to(cu_seqlens.dtype)

    return cached_on_version("sequence_order", cu_seqlens, None, build)


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """One row ``(sequence id, chunk id within the sequence)`` per chunk, in sequence order.

    Shape ``[NT_total, 2]``, dtype and device of ``cu_seqlens``. A zero-length sequence contributes no row.
    Example: ``cu = [0, 100, 100, 228]``, C = 64 gives ``[[0, 0], [0, 1], [2, 0], [2, 1]]``.
    """
    chunk_size = check_chunk_size(chunk_size)
    cu_seqlens = _check_cu_seqlens_tensor(cu_seqlens)

    def build() -> torch.Tensor:
        counts = _chunks_per_sequence(cu_seqlens, chunk_size).to(torch.int64)
        # the row count from the checked host copy, if any: then repeat_interleave need not read it on the device
        host = _cached("boundaries", cu_seqlens, None)
        rows = None if host is None else int(torch.div(host.diff() + (chunk_size - 1), chunk_size,
                                                       rounding_mode="floor").sum())
        seq = torch.arange(counts.numel(), device=cu_seqlens.device)
        seq_ids = torch.repeat_interleave(seq, counts, output_size=rows)
        starts = torch.cumsum(counts, 0) - counts
        chunk_ids = torch.arange(seq_ids.numel(), device=cu_seqlens.device) - torch.repeat_interleave(
            starts, counts, output_size=rows
        )
        return torch.stack([seq_ids, chunk_ids], dim=1).to(cu_seqlens.dtype)

    return cached_on_version("indices", cu_seqlens, chunk_size, build)
