"""``kda_prefill`` on each GPU backend (forced with CULA_BACKEND) when the device ``cu_seqlens`` holds other values
than the host copy its launch tables were built from: the prefill kernels clamp what they read (the CuTeDSL
recurrence and intra kernel, cula-sm90's recurrence and intra forms), so nothing outside their tensors is touched and
every call ends, whatever the device values; o is then wrong, which is allowed for such inputs.

The mismatch is made through the public API, the two ways a caller can reach it:

* ``stale``: a call with valid boundaries, then the same ``cu_seqlens`` rewritten through ``cu.data`` (the storage
  without the version counter: what a foreign kernel writing through the pointer, or a CUDA-graph replay copying new
  values into the captured buffer, does) and called again. The validator's host copy
  (``cula_runtime.index.checked_cu_seqlens_host``, cached on identity and version), and the chunk indices, chunk
  offsets, launch order and workspace built from it, still hold the first values.
* ``cpu_copy``: ``cu_seqlens_cpu`` valid, ``cu_seqlens`` on the device different (the contract says equal; nothing
  compares them, which would synchronise).

The device values (N = 6, T = 1200; the host's are 0, 1, 64, 65, 65, 700, 1200): decreasing, past T, negative, and
INT32_MIN/MAX, in the dense form and in the pool form with a padding row (its o rows zeroed by the recurrence).

Checked: the call and a synchronisation raise no CUDA error within ``TIMEOUT_S`` (a hang ends the process); every
cached allocator block that was free before the call (all filled with a canary byte) keeps the canary wherever the
call allocated nothing (the allocator's history of the call); the inputs, the pool's unnamed slots and the o of an
earlier call are bit-unchanged; after it the GPU still gives the first call's bits.

Without the clamps these fail: ``past_t`` makes the recurrence store o rows up to 4096 rows (8 MiB) past o's end and
the intra kernel write 12 workspace rows past its tensors (the canary or a live tensor breaks); ``negative`` stores o
rows 4096 rows before o's start; ``int32_extremes`` gives a sequence 2^31 - 1 tokens (stores about 4 TiB past o: an
illegal-address error, or a loop of 2^25 chunks); ``decreasing`` stays inside T and checks that sequences made empty
or longer than their chunks are harmless. The reads past a tensor are not seen here: ``tools/sanitize_kda.py
cu-mismatch`` runs this call under compute-sanitizer memcheck.
"""

from __future__ import annotations

import faulthandler

import pytest
import torch

from tests.gpu_backends import BACKENDS, use_backend
from tests.kda_cases import HEAD_DIM, KdaCase, make_inputs

pytestmark = pytest.mark.gpu

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
VALID = (0, 1, 64, 65, 65, 700, 1200)
# (H = 2, HV = 8, T = 1200: o and each workspace tensor above 1 MiB, so they come from the large pool's blocks)
CASE = KdaCase("cu-mismatch-T1200-H2-HV8", B=1, T=1200, H=2, HV=8, cu=VALID)
DEVICE_VALUES = {
    "decreasing": (0, 700, 64, 1200, 65, 1, 0),
    "past_t": (0, 1, 64, 65, 65, 700, 1200 + 4096),
    "negative": (-4096, 1, -64, 65, 65, 700, 1200),
    "int32_extremes": (0, INT32_MAX, 64, INT32_MIN, 65, 700, INT32_MAX),
}
STATE_INDICES = (0, -1, 1, 2, 3, 4)  # the pool form: sequence 1 a padding row (its o rows zeroed on the device)
POOL_SLOTS = 8
CANARY = 0x5A
ARENA_BYTES = 96 << 20  # a free block the call's large tensors may be carved from, canary-filled with the others
TIMEOUT_S = 120.0


class _DeviceBytes:
    """``nbytes`` bytes of device memory at ``address`` as a ``__cuda_array_interface__`` (for a uint8 view)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def _device_bytes(address: int, nbytes: int) -> torch.Tensor:
    """A uint8 view of cached allocator memory no tensor owns (read and filled here, never freed)."""
    return torch.as_tensor(_DeviceBytes(address, nbytes), device="cuda")


def _free_blocks() -> list[tuple[int, int]]:
    """(address, size) of every block the caching allocator holds free on the current device."""
    device = torch.cuda.current_device()
    free = []
    for segment in torch.cuda.memory_snapshot():
        if segment["device"] != device:
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                free.append((block.get("address", address), block["size"]))
            address += block["size"]
    return free


def _poison_free_memory() -> list[tuple[int, int]]:
    """Fill every free cached block (and a fresh ``ARENA_BYTES`` one) with ``CANARY``; returns them."""
    arena = torch.empty(ARENA_BYTES, dtype=torch.uint8, device="cuda")
    del arena  # (back to the cache, free)
    blocks = _free_blocks()
    for address, size in blocks:
        _device_bytes(address, size).fill_(CANARY)
    torch.cuda.synchronize()
    return blocks


def _allocated_during(call) -> list[tuple[int, int]]:
    """Run ``call()`` (and synchronise) under the allocator's history; the (address, size) of every allocation it
    made, rounded up to the allocator's 512-byte granule."""
    from torch.cuda import memory

    memory._record_memory_history(context=None, max_entries=1_000_000, clear_history=True)  # (no stack traces)
    try:
        call()
        torch.cuda.synchronize()
        traces = memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        memory._record_memory_history(enabled=None)
    return [(t["addr"], -(-t["size"] // 512) * 512) for t in traces if t["action"] == "alloc"]


def _untouched_canary_broken(blocks: list[tuple[int, int]], allocated: list[tuple[int, int]]) -> list[str]:
    """The byte ranges of the poisoned ``blocks`` that the call did not allocate and that lost the canary. The blocks
    are copied to the host first: a device tensor made here could be carved from them."""
    contents = [(address, _device_bytes(address, size).cpu()) for address, size in blocks]
    broken = []
    for address, content in contents:
        size = content.numel()
        untouched = torch.ones(size, dtype=torch.bool)
        for start, length in allocated:
            lo, hi = max(start, address), min(start + length, address + size)
            if lo < hi:
                untouched[lo - address:hi - address] = False
        bad = untouched & (content != CANARY)
        if bool(bad.any()):
            where = torch.nonzero(bad).flatten()
            broken.append(f"block {address:#x}+{size}: {where.numel()} bytes, first at +{int(where[0])}")
    return broken


def _kwargs(pool: bool) -> dict:
    kwargs = make_inputs(CASE, "cuda", seed=3)
    if pool:
        del kwargs["initial_state"]
        kwargs["output_final_state"] = False
        kwargs["state"] = torch.randn(POOL_SLOTS, CASE.HV, HEAD_DIM, HEAD_DIM, device="cuda")
        kwargs["state_indices"] = torch.tensor(STATE_INDICES, dtype=torch.int32, device="cuda")
    return kwargs


@pytest.mark.parametrize("pool", [False, True], ids=["dense", "pool"])
@pytest.mark.parametrize("values", list(DEVICE_VALUES))
@pytest.mark.parametrize("how", ["stale", "cpu_copy"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_device_cu_seqlens_unlike_the_host_tables_touch_nothing_else(backend: str, how: str, values: str,
                                                                      pool: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from cula.kda import kda_prefill

    use_backend(backend, monkeypatch)
    kwargs = _kwargs(pool)
    cu = kwargs["cu_seqlens"]
    bad = torch.tensor(DEVICE_VALUES[values], dtype=torch.int32, device="cuda")
    if how == "cpu_copy":
        kwargs["cu_seqlens_cpu"] = cu.cpu()
    start_pool = kwargs["state"].clone() if pool else None
    o_first, _ = kda_prefill(**kwargs)  # valid: leaves the call plan and the cached host copy of cu
    torch.cuda.synchronize()
    if pool:
        kwargs["state"].copy_(start_pool)
    kept = {name: x.clone() for name, x in kwargs.items() if isinstance(x, torch.Tensor) and name != "cu_seqlens"}
    kept["o_first"] = o_first.clone()

    if how == "stale":
        cu.data.copy_(bad)  # no version bump: the host tables stay those of VALID
        assert torch.equal(cu.cpu(), bad.cpu())
        call_kwargs = kwargs
    else:
        call_kwargs = {**kwargs, "cu_seqlens": bad}
    blocks = _poison_free_memory()
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)  # a kernel that loops on a garbage length ends the run
    try:
        allocated = _allocated_during(lambda: kda_prefill(**call_kwargs))
    finally:
        faulthandler.cancel_dump_traceback_later()

    assert _untouched_canary_broken(blocks, allocated) == []
    named = {s for s in STATE_INDICES if 0 <= s < POOL_SLOTS}
    for name, before in kept.items():
        now = o_first if name == "o_first" else kwargs[name]
        if name == "state":  # the named slots are written (with wrong states); the others must not be
            unnamed = [s for s in range(POOL_SLOTS) if s not in named]
            before, now = before[unnamed], now[unnamed]
        assert torch.equal(now, before), f"{name} changed"

    # the GPU is still sound: the valid boundaries again give the first call's bits
    if how == "stale":
        cu.copy_(torch.tensor(VALID, dtype=torch.int32, device="cuda"))  # (a torch write: the version moves)
    if pool:
        kwargs["state"].copy_(start_pool)
    o_again, _ = kda_prefill(**kwargs)
    torch.cuda.synchronize()
    assert torch.equal(o_again, o_first)
