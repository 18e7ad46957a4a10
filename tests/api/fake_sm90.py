"""A stand-in for the ``cula_sm90._C`` extension, to drive the sm90 shim on CPU tensors: it records each launch and
reads and writes through the raw pointers it is given. Needs the ``cula_sm90`` shim importable (pure Python, e.g.
``packages/cula-sm90/src`` on ``PYTHONPATH``); the compiled extension is never loaded."""

from __future__ import annotations

import ctypes

import pytest
import torch


def shim():
    """``cula_sm90.kda`` (pure Python: imports without the compiled extension), or skip where it is not importable."""
    return pytest.importorskip("cula_sm90.kda", reason="the cula_sm90 shim is not importable here")


def read_values(ptr: int, ctype, count: int) -> list:
    return list((ctype * count).from_address(ptr))


class FakeExtension:
    """Stands in for ``cula_sm90._C``: records each launch; the "intra kernel" fills each workspace region with its
    own byte through the raw pointers; the "recurrence" fills o and the final state (``o_bytes`` and
    ``state_bytes``, set by the test, say how many bytes), and in the state-pool form (its arguments after the
    stream) reads the slot indices and ``has_initial_state`` through their pointers and fills each named slot of the
    pool in place: ``POOL_BYTE`` where the sequence reads its slot, zeros where ``has_initial_state`` is False;
    padding rows (a slot outside ``[0, P)``) are left alone."""

    O_BYTE, STATE_BYTE, POOL_BYTE = 0x3C, 0x41, 0x5A
    SLOT_ELEMENTS = 128 * 128  # per value head: K = V = 128

    def __init__(self) -> None:
        self.intra: tuple = ()
        self.recurrence: tuple = ()
        self.reads: dict[int, tuple] = {}  # intra argument position -> (ctypes type, count): read during the launch
        self.read: dict[int, list] = {}
        self.launches = 0

    def varlen_launch_capacity(self, n: int, total: int, chunk: int) -> int:
        return 2 * (total // chunk + n) + 4 + (n + 1) + 4 + n

    def varlen_launch_values(self, cu: int, n: int, chunk: int, out: int, capacity: int) -> tuple:
        """The extension's C++ builder, done here with the runtime's: the same buffer layout."""
        from cula_runtime.index import prepare_varlen_launch

        bounds = torch.tensor(read_values(cu, ctypes.c_int32, n + 1), dtype=torch.int32)
        indices, offsets, order = prepare_varlen_launch(bounds, chunk, host=bounds.clone())
        base = indices.untyped_storage().data_ptr()
        size = (order.data_ptr() - base) // 4 + n
        assert size <= capacity
        ctypes.memmove(out, base, 4 * size)
        return indices.shape[0], (offsets.data_ptr() - base) // 4, (order.data_ptr() - base) // 4, size

    def varlen_idle_bands(self, cu: int, n: int, chunk: int) -> int:
        bounds = read_values(cu, ctypes.c_int32, n + 1)
        return sum((chunk - (b - a) % chunk) // 16 for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                   if (b - a) % chunk)

    def kda_intra(self, *a) -> int:
        self.intra = a
        self.launches += 1
        self.read = {i: read_values(a[i], ctype, count) for i, (ctype, count) in self.reads.items() if a[i]}
        regions, _ = shim().workspace_layout(a[12], a[15], a[13])
        for byte, (region, ptr) in enumerate(zip(regions, a[23:29], strict=True), start=1):
            ctypes.memset(ptr, byte, region.nbytes)
        return 0

    def kda_recurrence(self, *a) -> int:
        self.recurrence = a
        self.order = read_values(a[8], ctypes.c_int32, a[13]) if a[8] else None  # the sequences' launch order
        self.bounds = read_values(a[6], ctypes.c_int32, a[13] + 1) if a[6] else None  # cu_seqlens, as launched
        o_ptr, state_ptr = a[12], a[11]
        if o_ptr:  # (none for a state-pool call without tokens)
            ctypes.memset(o_ptr, self.O_BYTE, self.o_bytes)
        if state_ptr:
            ctypes.memset(state_ptr, self.STATE_BYTE, self.state_bytes)
        self.pool_read = None
        if len(a) > 21 and a[22]:  # the state-pool form: (pool, indices, has_initial_state, P, slot stride)
            pool, indices, has_initial, size, stride = a[21:26]
            N, HV, itemsize = a[13], a[14], 4 if a[10] == 0 else 2
            slots = read_values(indices, ctypes.c_int32, N)
            reads = [bool(x) for x in read_values(has_initial, ctypes.c_uint8, N)] if has_initial else [True] * N
            self.pool_read = (slots, reads if has_initial else None)
            for slot, read in zip(slots, reads, strict=True):
                if 0 <= slot < size:
                    ctypes.memset(pool + slot * stride * itemsize, self.POOL_BYTE if read else 0,
                                  HV * self.SLOT_ELEMENTS * itemsize)
        return 0
