"""Varlen index helpers: values, dtype/device, empty sequences, argument checks, cache invalidation."""

from __future__ import annotations

import pytest
import torch

from cula_runtime.index import (
    checked_cu_seqlens_host,
    clear_index_cache,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_lens,
    prepare_sequence_order,
    prepare_varlen_launch,
)


def _loop_indices(cu: list[int], chunk: int) -> list[list[int]]:
    rows = []
    for n in range(len(cu) - 1):
        length = cu[n + 1] - cu[n]
        rows += [[n, c] for c in range(-(-length // chunk))]
    return rows


CASES = {
    "spec-example": ([0, 100, 100, 228], 64),
    "single": ([0, 15], 64),
    "exact-multiples": ([0, 64, 128, 320], 64),
    "leading-empty": ([0, 0, 0, 65, 66], 64),
    "chunk16": ([0, 1, 17, 50, 50, 99], 16),
    "all-empty": ([0, 0, 0], 64),
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_helpers_match_a_loop(case: str, dtype: torch.dtype) -> None:
    cu_list, chunk = CASES[case]
    cu = torch.tensor(cu_list, dtype=dtype)
    lens = prepare_lens(cu)
    assert lens.dtype == dtype and lens.tolist() == [b - a for a, b in zip(cu_list, cu_list[1:], strict=False)]
    idx = prepare_chunk_indices(cu, chunk)
    assert idx.dtype == dtype and idx.device == cu.device
    assert idx.shape == (len(_loop_indices(cu_list, chunk)), 2)
    assert idx.tolist() == _loop_indices(cu_list, chunk)
    offsets = prepare_chunk_offsets(cu, chunk)
    expected = [0]
    for n in range(len(cu_list) - 1):
        expected.append(expected[-1] + -(-(cu_list[n + 1] - cu_list[n]) // chunk))
    assert offsets.dtype == dtype and offsets.tolist() == expected


def test_spec_example_values() -> None:
    cu = torch.tensor([0, 100, 100, 228], dtype=torch.int32)
    assert prepare_lens(cu).tolist() == [100, 0, 128]
    assert prepare_chunk_indices(cu, 64).tolist() == [[0, 0], [0, 1], [2, 0], [2, 1]]
    assert prepare_chunk_offsets(cu, 64).tolist() == [0, 2, 2, 4]


@pytest.mark.parametrize("bad", [None, 0, -64, 64.0, "64", True], ids=["None", "zero", "negative", "float", "str",
                                                                        "bool"])
@pytest.mark.parametrize("helper", [prepare_chunk_indices, prepare_chunk_offsets], ids=["indices", "offsets"])
def test_chunk_size_is_checked(helper, bad) -> None:
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises((TypeError, ValueError), match="chunk_size"):
        helper(cu, bad)


def test_cu_seqlens_type_is_checked() -> None:
    with pytest.raises(TypeError, match="cu_seqlens"):
        prepare_chunk_indices([0, 10], 64)
    with pytest.raises(TypeError, match="cu_seqlens"):
        prepare_chunk_indices(torch.tensor([0.0, 10.0]), 64)
    with pytest.raises(ValueError, match="cu_seqlens"):
        prepare_chunk_indices(torch.zeros(2, 2, dtype=torch.int32), 64)


def test_in_place_update_is_never_stale() -> None:
    clear_index_cache()
    cu = torch.tensor([0, 10, 200], dtype=torch.int32)
    first = prepare_chunk_indices(cu, 64)
    assert prepare_chunk_indices(cu, 64) is first  # cache hit on an unchanged tensor
    cu[2] = 70  # in place: same object, new version
    second = prepare_chunk_indices(cu, 64)
    assert second.tolist() == [[0, 0], [1, 0]]
    assert prepare_chunk_offsets(cu, 64).tolist() == [0, 1, 2]
    cu.copy_(torch.tensor([0, 130, 131], dtype=torch.int32))
    assert prepare_chunk_indices(cu, 64).tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]


def test_distinct_tensors_with_equal_ids_are_not_confused() -> None:
    clear_index_cache()
    for length in range(1, 200, 37):
        cu = torch.tensor([0, length], dtype=torch.int32)  # may reuse a freed tensor's id
        assert prepare_chunk_indices(cu, 64).tolist() == _loop_indices([0, length], 64)


def test_inference_tensors_work_uncached() -> None:
    with torch.inference_mode():
        cu = torch.tensor([0, 65], dtype=torch.int32)
        assert prepare_chunk_indices(cu, 64).tolist() == [[0, 0], [0, 1]]
        cu[1] = 10
        assert prepare_chunk_indices(cu, 64).tolist() == [[0, 0]]


def test_cache_hit_does_not_synchronise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit returns the stored tensor without reading values (no .tolist/.item, hence no device sync)."""
    clear_index_cache()
    cu = torch.tensor([0, 100, 228], dtype=torch.int32)
    first = prepare_chunk_indices(cu, 64)

    def forbidden(*args, **kwargs):
        raise AssertionError("cache hit must not run tensor ops")

    monkeypatch.setattr(torch, "repeat_interleave", forbidden)
    monkeypatch.setattr(torch, "cumsum", forbidden)
    assert prepare_chunk_indices(cu, 64) is first


@pytest.mark.parametrize(("bounds", "order"), [
    ([0, 100, 100, 228, 240], [2, 0, 3, 1]),
    ([0, 64, 128, 192], [0, 1, 2]),  # equal lengths keep batch order
    ([0, 1, 2, 300, 300, 900], [4, 2, 0, 1, 3]),
    ([0, 0], [0]),
])
def test_sequence_order_is_longest_first_and_stable(bounds: list[int], order: list[int]) -> None:
    from cula_runtime.index import prepare_sequence_order

    cu = torch.tensor(bounds, dtype=torch.int32)
    got = prepare_sequence_order(cu)
    assert got.dtype == torch.int32 and got.tolist() == order
    assert prepare_sequence_order(cu) is got  # cached
    cu[1:] = cu[-1]  # in place: every sequence but the first is now empty
    assert prepare_sequence_order(cu).tolist() == list(range(len(bounds) - 1))


# ---- building from a host copy of cu_seqlens (the validator's checked copy, passed as host=)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_helpers_build_from_the_host_copy_they_are_given(case: str) -> None:
    """With ``host=`` the helpers build from that copy, not from ``cu_seqlens``' own values: given a copy of other
    (valid) boundaries of the same length, they return that copy's indices. (On a GPU, ``cu_seqlens`` and its
    checked copy hold the same values; the copy spares the device a dozen launches and two synchronisations.)"""
    from cula_runtime.index import prepare_sequence_order

    clear_index_cache()
    cu_list, chunk = CASES[case]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    assert prepare_chunk_indices(cu, chunk, host=cu.clone()).tolist() == _loop_indices(cu_list, chunk)
    other = [0] + [cu_list[-1] + 7 * i for i in range(1, len(cu_list))]  # same length, other lengths
    clear_index_cache()
    host = torch.tensor(other, dtype=torch.int32)
    assert prepare_chunk_indices(cu, chunk, host=host).tolist() == _loop_indices(other, chunk)
    expected = [0]
    for n in range(len(other) - 1):
        expected.append(expected[-1] + -(-(other[n + 1] - other[n]) // chunk))
    assert prepare_chunk_offsets(cu, chunk, host=host).tolist() == expected
    lens = [b - a for a, b in zip(other, other[1:], strict=False)]
    order = sorted(range(len(lens)), key=lambda n: -lens[n])
    assert prepare_sequence_order(cu, host=host).tolist() == order


def test_validator_keeps_the_checked_host_copy() -> None:
    """``validate_kda_prefill`` hands the CPU copy it checked to the backends (``cu_seqlens_host``), also for an
    inference-mode tensor (never cached), and the helpers build from it; None without cu_seqlens."""
    from cula_runtime.index import prepare_sequence_order
    from cula_runtime.kda_args import validate_kda_prefill

    def inputs(T: int) -> dict:
        q = torch.randn(1, T, 2, 16)
        return dict(q=q, k=torch.randn_like(q), v=torch.randn(1, T, 2, 16), g=-torch.rand(1, T, 2, 16),
                    beta=torch.rand(1, T, 2))

    clear_index_cache()
    assert validate_kda_prefill(**inputs(40)).cu_seqlens_host is None
    for inference in (False, True):
        with torch.inference_mode(inference):
            cu = torch.tensor([0, 5, 5, 40], dtype=torch.int32)
            args = validate_kda_prefill(**inputs(40), cu_seqlens=cu)
            host = args.cu_seqlens_host
            assert host is not None and host.device.type == "cpu" and host is not cu and host.tolist() == [0, 5, 5, 40]
            assert prepare_chunk_indices(cu, 16, host=host).tolist() == [[0, 0], [2, 0], [2, 1], [2, 2]]
            assert prepare_sequence_order(cu, host=host).tolist() == [2, 0, 1]


@pytest.mark.parametrize("sequences", [3, 700, 5000], ids=["few", "over-4096-chunks", "over-4096-sequences"])
def test_host_builds_equal_tensor_builds_on_both_sides_of_the_loop_limit(sequences: int) -> None:
    """The host builds (a Python loop up to 4096 values, torch CPU ops above) give exactly the tensor build's values,
    with empty and 1-token sequences among random lengths."""
    from cula_runtime.index import prepare_sequence_order

    gen = torch.Generator().manual_seed(sequences)
    lens = torch.randint(0, 700, (sequences,), generator=gen)
    lens[::7] = 0
    lens[1::11] = 1
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]).to(torch.int32)
    clear_index_cache()
    plain = (prepare_chunk_indices(cu, 64), prepare_chunk_offsets(cu, 64), prepare_sequence_order(cu))
    clear_index_cache()
    host = cu.clone()
    built = (prepare_chunk_indices(cu, 64, host=host), prepare_chunk_offsets(cu, 64, host=host),
             prepare_sequence_order(cu, host=host))
    for a, b in zip(plain, built, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("bad", [[0, 5], torch.tensor([0, 5, 9], dtype=torch.int64), torch.tensor([0, 5]),
                                 torch.tensor([0, 5, 9], dtype=torch.int32).reshape(1, 3)],
                         ids=["list", "int64", "short", "2-D"])
def test_host_copy_is_checked(bad) -> None:
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="host must be None or a CPU copy of cu_seqlens"):
        prepare_chunk_indices(cu, 64, host=bad)


@pytest.mark.gpu
def test_host_built_indices_equal_device_built_ones_and_launch_no_kernel() -> None:
    """On the GPU: the helpers given the checked host copy return exactly what they build on the device, and launch
    no kernel to do it (one host-to-device copy per tensor); random varlen batches with empty and 1-token sequences."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        lens = torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen)
        lens[trial % len(lens)] = trial % 2  # an empty or 1-token sequence
        cu_list = [0, *torch.cumsum(lens, 0).tolist()]
        with torch.inference_mode():  # uncached: the device path really builds
            cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
            device_built = (prepare_chunk_indices(cu, 64), prepare_chunk_offsets(cu, 64), prepare_sequence_order(cu))
            host = checked_cu_seqlens_host(cu, cu_list[-1])
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                host_built = (prepare_chunk_indices(cu, 64, host=host), prepare_chunk_offsets(cu, 64, host=host),
                              prepare_sequence_order(cu, host=host))
                torch.cuda.synchronize()
        for a, b in zip(device_built, host_built, strict=True):
            assert a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "memcpy" not in e.name.lower()]
        assert kernels == [], kernels
        with torch.inference_mode():  # the three in one buffer: the same values, one copy, no kernel
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                launch = prepare_varlen_launch(cu, 64, host=host)
                torch.cuda.synchronize()
        for a, b in zip(device_built, launch, strict=True):
            assert a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
        events = [e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(events) == 1 and "memcpy" in events[0], events


# (number of sequences, longest sequence): short batches (every part a Python loop), > 4096 chunks (the indices
# built vectorised, the rest by the loop), > 4096 sequences (every part vectorised)
SIZES = {"loop-built": (1, 40, 320), "long-indices": (100, 101, 64 * 90), "many-sequences": (4200, 4201, 128)}


@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
def test_varlen_launch_buffer_holds_the_three_helpers_values(size: str) -> None:
    """prepare_varlen_launch: chunk indices, chunk offsets and the longest-first order, equal to the three helpers,
    as views of one buffer whose parts each start on a 16-byte boundary (built from the checked host copy); random
    batches with empty and 1-token sequences, and batches past the Python-loop limit (4096 values)."""
    gen = torch.Generator().manual_seed(4)
    low, high, longest = SIZES[size]
    for trial in range(6):
        count = int(torch.randint(low, high, (1,), generator=gen))
        lens = torch.randint(0, longest, (count,), generator=gen)
        lens[trial % count] = trial % 2
        cu = torch.tensor([0, *torch.cumsum(lens, 0).tolist()], dtype=torch.int32)
        host = checked_cu_seqlens_host(cu, int(cu[-1]))
        indices, offsets, order = prepare_varlen_launch(cu, 64, host=host)
        assert torch.equal(indices, prepare_chunk_indices(cu, 64)) and indices.shape[1] == 2
        assert torch.equal(offsets, prepare_chunk_offsets(cu, 64)) and torch.equal(order, prepare_sequence_order(cu))
        if size != "loop-built":
            assert indices.shape[0] > 4096  # (the vectorised host builds ran)
        storage = indices.untyped_storage().data_ptr()
        for part in (indices, offsets, order):
            assert part.dtype == torch.int32 and part.untyped_storage().data_ptr() == storage
            assert part.storage_offset() % 4 == 0
        assert prepare_varlen_launch(cu, 64, host=host)[0] is indices  # cached per tensor and version


def test_varlen_launch_without_a_host_copy_builds_each_part() -> None:
    clear_index_cache()
    with torch.inference_mode():  # no version counter: no cached host copy either
        cu = torch.tensor([0, 100, 100, 228, 240], dtype=torch.int32)
        indices, offsets, order = prepare_varlen_launch(cu, 64)
    assert indices.tolist() == [[0, 0], [0, 1], [2, 0], [2, 1], [3, 0]]
    assert offsets.tolist() == [0, 2, 2, 4, 5] and order.tolist() == [2, 0, 3, 1]

