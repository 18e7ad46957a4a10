"""Index helpers for packed variable-length batches (KDA_SPEC.md §4).

All helpers take ``cu_seqlens``, an integer tensor ``[N+1]`` of cumulative sequence starts (``cu[0] == 0``,
non-decreasing), and return tensors of the same dtype and device.

Results are cached on the identity of ``cu_seqlens`` *and* its version counter, so an in-place update of
``cu_seqlens`` by a torch op is never answered from a stale entry, and a cache hit touches no device memory (no
synchronisation); a device tensor in inference mode carries no version counter and is never cached. A CPU tensor
(``cu_seqlens`` on the host, or the host copy a caller hands over as ``cu_seqlens_cpu`` / ``host=``) is cached on its
*values* instead: its memory may change without its version counter (a serving engine writes its host buffers
through NumPy views), and reading it costs no synchronisation. So the one case a cache cannot see is a device
``cu_seqlens`` rewritten outside torch (by a foreign kernel through its pointer) and passed again as the same tensor
object: pass the host copy as well (``cu_seqlens_cpu``, whose values key the index tensors built from it) or a new
tensor.

Device synchronisation: :func:`checked_cu_seqlens_host` (the validator's check) copies ``cu_seqlens`` to the host
once per (tensor, version) and keeps that copy, which the validator also hands to the backends
(``cu_seqlens_host``, the helpers' ``host=``). The helpers build from a host copy on the host (a Python loop up to
4096 values, vectorised torch CPU ops above) and move each result to the device in one copy, so the indices of a
checked ``cu_seqlens`` cost no further synchronisation and no kernel launches. Without a host copy (an unchecked
tensor) they are built on the device, vectorised, where ``repeat_interleave`` reads the row count back (two
synchronisations on a cache miss).
"""

from __future__ import annotations

import array
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .graph_pools import built_outside_graph_pools

__all__ = [
    "prepare_lens", "prepare_chunk_indices", "prepare_chunk_offsets", "prepare_sequence_order", "prepare_varlen_launch",
    "check_chunk_size",
    "check_cu_seqlens_values",
    "checked_cu_seqlens_host", "checked_cu_seqlens_values", "cached_on_version", "clear_index_cache",
    "host_values_key", "is_integer_dtype",
]

_CACHE_CAPACITY = 128  # entries; a cu_seqlens tensor takes up to six (its checked copy twice, index tensors)
_cache: OrderedDict[tuple, tuple[weakref.ref, Any]] = OrderedDict()
_T = TypeVar("_T")


def check_chunk_size(chunk_size: object) -> int:
    """Return ``chunk_size`` if it is a positive ``int``; raise ``TypeError``/``ValueError`` naming it otherwise."""
    if chunk_size is None or isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be a positive int (e.g. 64), got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int (e.g. 64), got {chunk_size}")
    return chunk_size


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers (signed or unsigned; not ``bool``): what an index tensor may be."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_cu_seqlens_tensor(cu_seqlens: object) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if not is_integer_dtype(cu_seqlens.dtype):
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


def host_values_key(host: torch.Tensor) -> tuple:
    """A CPU integer tensor's dtype and values as a hashable key (its bytes in order; about 1 us for a few hundred
    values): what a cache of things derived from a host tensor's values must be keyed on, since its memory may
    change without its version counter (NumPy views, ``.data``, DLPack)."""
    try:
        values: object = host.numpy().tobytes()
    except (RuntimeError, TypeError):  # (a tensor NumPy cannot view: its values as ints)
        values = tuple(host.tolist())
    return (host.dtype, tuple(host.shape), values)


def _keyed_on_values(cu_seqlens: torch.Tensor) -> bool:
    """Whether the cache keys entries of ``cu_seqlens`` on its values (a CPU tensor) rather than its identity."""
    return cu_seqlens.device.type == "cpu"


def _cache_key(kind: str, cu_seqlens: torch.Tensor, extra: object) -> tuple[tuple | None, torch.Tensor | None]:
    """``(key, owner)`` of an entry: a CPU tensor's values (owner None: any tensor of those values shares it), or a
    device tensor's identity and version counter (owner: the tensor, held weakly by the entry); ``(None, None)``
    for a device tensor in inference mode (no version counter: never cached)."""
    if _keyed_on_values(cu_seqlens):
        return (kind, "values", host_values_key(cu_seqlens), extra), None
    if cu_seqlens.is_inference():
        return None, None
    return (kind, id(cu_seqlens), cu_seqlens._version, extra), cu_seqlens


def cached_on_version(kind: str, cu_seqlens: torch.Tensor, extra: object, build: Callable[[], _T], *,
                      on_device: bool = True) -> _T:
    """Return ``build()``, cached on (``kind``, identity and version counter of ``cu_seqlens``, ``extra``), or for a
    CPU ``cu_seqlens`` on (``kind``, its values, ``extra``) (the module docstring says why).

    The one cache of everything derived from ``cu_seqlens`` (index tensors, validation results). ``on_device``
    (the default): the value may hold device tensors, so a build on a miss runs outside any CUDA graph's memory
    pool (:func:`~cula_runtime.graph_pools.built_outside_graph_pools`); False for a value of host tensors only.
    """
    key, owner = _cache_key(kind, cu_seqlens, extra)
    if key is None:
        return build()
    hit = _cache.get(key)
    if hit is not None and (owner is None or hit[0]() is owner):
        _cache.move_to_end(key)
        return hit[1]
    # (the entry outlives the call: never in a CUDA graph's pool)
    value = built_outside_graph_pools(cu_seqlens.device, build) if on_device else build()
    _cache[key] = (None if owner is None else weakref.ref(owner), value)
    while len(_cache) > _CACHE_CAPACITY:
        _cache.popitem(last=False)
    return value


def _cached(kind: str, cu_seqlens: torch.Tensor, extra: object) -> Any:
    """The entry :func:`cached_on_version` holds for this key, or None; never builds one."""
    key, owner = _cache_key(kind, cu_seqlens, extra)
    hit = None if key is None else _cache.get(key)
    return hit[1] if hit is not None and (owner is None or hit[0]() is owner) else None


def checked_cu_seqlens_host(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """A host (CPU) copy of ``cu_seqlens`` that :func:`check_cu_seqlens_values` accepted, cached on (identity and
    version of ``cu_seqlens``, ``T``), or on (its values, ``T``) for a CPU ``cu_seqlens``.

    The first call per (tensor, version) copies the boundaries to the host (one synchronisation), checks the copy and
    keeps it, also for the index helpers; later calls touch no device memory. A device tensor in inference mode is
    copied and checked on every call (it has no version counter); pass the copy to the index helpers (``host=``) so
    that they build from it. ``ValueError`` as :func:`check_cu_seqlens_values` (a failed check is not cached).
    """

    def build() -> torch.Tensor:
        host = _check_cu_seqlens_tensor(cu_seqlens).to("cpu", copy=True)  # a copy even of a CPU tensor
        check_cu_seqlens_values(host, T)
        cached_on_version("boundaries", cu_seqlens, None, lambda: host, on_device=False)
        return host

    return cached_on_version("cu_seqlens_checked", cu_seqlens, T, build, on_device=False)


def checked_cu_seqlens_values(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    """:func:`check_cu_seqlens_values` on the cached checked copy of :func:`checked_cu_seqlens_host`: the boundaries
    as Python ints; one synchronisation per (tensor, version), none after."""
    return checked_cu_seqlens_host(cu_seqlens, T).tolist()


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


# Host builds of at most this many values run as a Python loop: a vectorised torch CPU op costs ~5 us of dispatch
# each, and an index build takes a dozen; above it the loop costs more than the ops.
_LOOP_BUILD_MAX = 4096


def _built_on_host(cu_seqlens: torch.Tensor, host: torch.Tensor | None, build: Callable[[torch.Tensor], torch.Tensor],
                   from_values: Callable[[list[int]], list[int] | None]) -> torch.Tensor:
    """The index tensor of ``cu_seqlens``, built on a host copy of it (``host``, else the one
    :func:`checked_cu_seqlens_host` cached) and moved to ``cu_seqlens``' device in one copy; without a host copy,
    ``build(cu_seqlens)`` on the device. ``from_values(boundaries)`` gives the flat values as a Python list (None
    when it would be long: then ``build`` runs on the host copy). Same values every way. A device build costs a dozen
    kernel launches and two synchronisations (a fresh ``cu_seqlens`` per call, as a server passes, cost 0.54 ms more
    than a cached one on the H200 that way, 2026-11-30)."""
    if host is None:
        host = _cached("boundaries", cu_seqlens, None)
    if host is None:
        return build(cu_seqlens)
    flat = from_values(host.tolist())
    built = build(host) if flat is None else _host_tensor(flat, host.dtype)
    return built.to(cu_seqlens.device, non_blocking=True)  # (itself when cu_seqlens is on the CPU)


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def _host_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a 1-D CPU tensor of ``dtype``, through an ``array`` buffer: about 3x faster than
    ``torch.tensor(list)`` (4 us vs 12 for 170 values here), which converts each Python int on its own."""
    code = _ARRAY_CODES.get(dtype)
    if not values or code is None or array.array(code).itemsize != dtype.itemsize:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)  # (the tensor keeps the array alive)


def _chunk_counts(values: list[int], chunk_size: int) -> list[int]:
    return [-(-(b - a) // chunk_size) for a, b in zip(values, values[1:], strict=False)]


def _host_key(host: torch.Tensor | None) -> tuple | None:
    """The values of a host copy an index is built from, for its cache key (a device ``cu_seqlens`` rewritten
    outside torch keeps its version; its new host copy does not keep its values), or None without one."""
    return None if host is None else host_values_key(host)


def _host_copy(host: object, cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """``host`` checked as a CPU copy of ``cu_seqlens`` (same dtype and length), or None."""
    if host is None:
        return None
    if not isinstance(host, torch.Tensor) or host.device.type != "cpu" or host.dtype != cu_seqlens.dtype \
            or host.shape != cu_seqlens.shape:
        raise ValueError("host must be None or a CPU copy of cu_seqlens (same dtype and shape), e.g. from "
                         "checked_cu_seqlens_host")
    return host


def _offsets_built(cu: torch.Tensor, chunk_size: int) -> torch.Tensor:
    counts = _chunks_per_sequence(cu, chunk_size)
    zero = torch.zeros(1, dtype=cu.dtype, device=cu.device)
    return torch.cat([zero, torch.cumsum(counts, 0).to(cu.dtype)])


def _offsets_values(values: list[int], chunk_size: int) -> list[int] | None:
    offsets = [0]
    for count in _chunk_counts(values, chunk_size):
        offsets.append(offsets[-1] + count)
    return offsets if len(values) <= _LOOP_BUILD_MAX else None


def prepare_chunk_offsets(cu_seqlens: torch.Tensor, chunk_size: int, *,
                          host: torch.Tensor | None = None) -> torch.Tensor:
    """Global index of each sequence's first chunk: ``[0, cumsum(ceil(len_n / C))]``, shape ``[N+1]``.

    ``offsets[N]`` is the total number of chunks. Same dtype and device as ``cu_seqlens``. ``host``: a CPU copy of
    ``cu_seqlens`` (:func:`checked_cu_seqlens_host`) to build from, then one copy to the device.
    """
    chunk_size = check_chunk_size(chunk_size)
    cu_seqlens = _check_cu_seqlens_tensor(cu_seqlens)
    host = _host_copy(host, cu_seqlens)
    return cached_on_version("offsets", cu_seqlens, (chunk_size, _host_key(host)), lambda: _built_on_host(
        cu_seqlens, host, lambda cu: _offsets_built(cu, chunk_size), lambda v: _offsets_values(v, chunk_size)))


def _order_built(cu: torch.Tensor) -> torch.Tensor:
    lens = cu[1:] - cu[:-1]
    return torch.argsort(lens, descending=True, stable=True).to(cu.dtype)


def _order_values(values: list[int]) -> list[int] | None:
    lens = [b - a for a, b in zip(values, values[1:], strict=False)]
    return sorted(range(len(lens)), key=lambda n: -lens[n]) if len(lens) <= _LOOP_BUILD_MAX else None  # stable


def prepare_sequence_order(cu_seqlens: torch.Tensor, *, host: torch.Tensor | None = None) -> torch.Tensor:
    """The sequences of a packed batch, longest first (equal lengths keep their order): ``[N]``, dtype and device
    of ``cu_seqlens``. A recurrence that launches its sequences in this order starts the longest chains first.
    Example: ``cu = [0, 100, 100, 228, 240]`` gives ``[2, 0, 3, 1]``. Built from a host copy (``host``, or the
    validator's cached one) when there is one, else on the device (no synchronisation either way)."""
    cu_seqlens = _check_cu_seqlens_tensor(cu_seqlens)
    host = _host_copy(host, cu_seqlens)
    return cached_on_version("sequence_order", cu_seqlens, _host_key(host),
                             lambda: _built_on_host(cu_seqlens, host, _order_built, _order_values))


def _indices_built(cu: torch.Tensor, chunk_size: int) -> torch.Tensor:
    # (on a device tensor repeat_interleave reads the row count back: one synchronisation)
    counts = _chunks_per_sequence(cu, chunk_size).to(torch.int64)
    seq_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=cu.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    chunk_ids = torch.arange(seq_ids.numel(), device=cu.device) - torch.repeat_interleave(starts, counts)
    return torch.stack([seq_ids, chunk_ids], dim=1).to(cu.dtype).view(-1)


def _indices_values(values: list[int], chunk_size: int) -> list[int] | None:
    counts = _chunk_counts(values, chunk_size)
    total = sum(counts)
    if total > _LOOP_BUILD_MAX:
        return None
    flat = [0] * (2 * total)  # rows (sequence id, chunk id), interleaved
    flat[0::2] = [n for n, count in enumerate(counts) for _ in range(count)]
    flat[1::2] = [c for count in counts for c in range(count)]
    return flat


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int, *,
                          host: torch.Tensor | None = None) -> torch.Tensor:
    """One row ``(sequence id, chunk id within the sequence)`` per chunk, in sequence order.

    Shape ``[NT_total, 2]``, dtype and device of ``cu_seqlens``. A zero-length sequence contributes no row.
    Example: ``cu = [0, 100, 100, 228]``, C = 64 gives ``[[0, 0], [0, 1], [2, 0], [2, 1]]``. ``host``: a CPU copy
    of ``cu_seqlens`` (:func:`checked_cu_seqlens_host`) to build from, then one copy to the device.
    """
    chunk_size = check_chunk_size(chunk_size)
    cu_seqlens = _check_cu_seqlens_tensor(cu_seqlens)
    host = _host_copy(host, cu_seqlens)
    return cached_on_version("indices", cu_seqlens, (chunk_size, _host_key(host)), lambda: _built_on_host(
        cu_seqlens, host, lambda cu: _indices_built(cu, chunk_size),
        lambda v: _indices_values(v, chunk_size)).view(-1, 2))


_PART_ALIGN = 4  # int32 values: each part of the launch buffer starts 16 bytes in (vector loads, assumed alignment)


def prepare_varlen_launch(cu_seqlens: torch.Tensor, chunk_size: int, *, host: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(chunk_indices [NT, 2], chunk_offsets [N + 1], sequence_order [N])`` of a packed batch, the values of
    :func:`prepare_chunk_indices`, :func:`prepare_chunk_offsets` and :func:`prepare_sequence_order`, for a GPU
    backend's launches: with a host copy (``host``, or the validator's cached one) all three are built on the host
    and moved to ``cu_seqlens``' device in one copy, as views of one buffer (each part starting on a 16-byte
    boundary); without one, the three device builds. Cached per (tensor, version, ``chunk_size``): a new
    ``cu_seqlens`` per call (a server's batches) costs one host-to-device copy, not three.
    """
    chunk_size = check_chunk_size(chunk_size)
    cu_seqlens = _check_cu_seqlens_tensor(cu_seqlens)
    host = _host_copy(host, cu_seqlens)

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = host if host is not None else _cached("boundaries", cu_seqlens, None)
        if h is None:
            return (prepare_chunk_indices(cu_seqlens, chunk_size), prepare_chunk_offsets(cu_seqlens, chunk_size),
                    prepare_sequence_order(cu_seqlens))
        values = h.tolist()
        parts = [_indices_values(values, chunk_size), _offsets_values(values, chunk_size), _order_values(values)]
        if any(part is None for part in parts):  # long: vectorised host builds, joined by torch.cat
            parts = [_host_tensor(part, h.dtype) if part is not None else built(h) for part, built in zip(
                parts, (lambda cu: _indices_built(cu, chunk_size), lambda cu: _offsets_built(cu, chunk_size),
                        _order_built), strict=True)]
        num_chunks, N = len(parts[0]) // 2, len(parts[2])
        starts = [0]
        if isinstance(parts[0], list):  # one list, then one tensor (the usual, short case)
            flat_values = parts[0]  # (extended in place: the lengths are taken above)
            for part in parts[1:]:
                flat_values += [0] * (-len(flat_values) % _PART_ALIGN)
                starts.append(len(flat_values))
                flat_values += part
            flat = _host_tensor(flat_values, h.dtype)
        else:
            pieces, size = [parts[0]], len(parts[0])
            for part in parts[1:]:
                pad = -size % _PART_ALIGN
                pieces += [torch.zeros(pad, dtype=h.dtype), part]
                starts.append(size + pad)
                size += pad + len(part)
            flat = torch.cat(pieces)
        device_buffer = flat.to(cu_seqlens.device, non_blocking=True)  # (one copy; itself for a CPU cu_seqlens)
        return (device_buffer.narrow(0, 0, 2 * num_chunks).view(num_chunks, 2),
                device_buffer.narrow(0, starts[1], N + 1), device_buffer.narrow(0, starts[2], N))

    return cached_on_version("varlen_launch", cu_seqlens, (chunk_size, _host_key(host)), build)
