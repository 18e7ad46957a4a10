"""Varlen index helpers: values, dtype/device, empty sequences, argument checks, cache invalidation."""

from __future__ import annotations

import pytest
import torch

from cula_runtime.index import clear_index_cache, prepare_chunk_indices, prepare_chunk_offsets, prepare_lens


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
