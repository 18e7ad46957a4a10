"""The host-side caches that spare per-call work: checked cu_seqlens boundaries (the host copy that
``prepare_chunk_indices`` then builds from, sparing the device's launches and synchronisations) and the device
capability. Each test could fail if a cache answered for another tensor, another version of one tensor, other values
of a host tensor, or another device. A device ``cu_seqlens`` is cached on its identity and version, a CPU one on its
values: the tests of the former stand CPU tensors in for device ones (fixture ``device_keys``)."""

from __future__ import annotations

import pytest
import torch

from cula_runtime import index, kda_tuning
from cula_runtime.index import checked_cu_seqlens_values, clear_index_cache, prepare_chunk_indices


def _loop_indices(cu: list[int], chunk: int) -> list[list[int]]:
    rows = []
    for n in range(len(cu) - 1):
        rows += [[n, c] for c in range(-(-(cu[n + 1] - cu[n]) // chunk))]
    return rows


@pytest.fixture
def built_from(monkeypatch: pytest.MonkeyPatch) -> list:
    """What every index build read: the ``cu_seqlens`` tensor (a build from its own values), or the boundaries of
    a checked host copy as a Python list (a build on the host)."""
    seen: list = []
    real_tensor, real_list = index._chunks_per_sequence, index._chunk_counts

    def spy_tensor(cu, chunk_size):
        seen.append(cu)
        return real_tensor(cu, chunk_size)

    def spy_list(values, chunk_size):
        seen.append(list(values))
        return real_list(values, chunk_size)

    monkeypatch.setattr(index, "_chunks_per_sequence", spy_tensor)
    monkeypatch.setattr(index, "_chunk_counts", spy_list)
    return seen


@pytest.fixture
def device_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors keyed as device ones are (identity and version counter), for the tests of that path."""
    monkeypatch.setattr(index, "_keyed_on_values", lambda cu_seqlens: False)


def test_host_tensors_are_keyed_on_their_values(built_from: list) -> None:
    """A CPU ``cu_seqlens`` whose memory changes without its version counter (written through a NumPy view, as a
    serving engine writes its host buffers) is checked again and indexed from its new values: a stale entry is never
    used, and new values that break the rules are refused."""
    clear_index_cache()
    cu = torch.tensor([0, 65, 130], dtype=torch.int32)
    assert checked_cu_seqlens_values(cu, 130) == [0, 65, 130]
    assert prepare_chunk_indices(cu, 64).tolist() == _loop_indices([0, 65, 130], 64)
    version = cu._version
    cu.numpy()[1] = 10
    assert cu._version == version  # (the counter did not see the write)
    assert checked_cu_seqlens_values(cu, 130) == [0, 10, 130]
    assert prepare_chunk_indices(cu, 64).tolist() == _loop_indices([0, 10, 130], 64)
    cu.numpy()[1] = 131
    with pytest.raises(ValueError, match="non-decreasing"):
        checked_cu_seqlens_values(cu, 130)
    cu.numpy()[1] = 65  # the first values again: their entries serve (no new build)
    builds = len(built_from)
    assert prepare_chunk_indices(cu, 64).tolist() == _loop_indices([0, 65, 130], 64) and len(built_from) == builds
    other = torch.tensor([0, 65, 130], dtype=torch.int32)  # another tensor of the same values shares them
    assert prepare_chunk_indices(other, 64).tolist() == _loop_indices([0, 65, 130], 64) and len(built_from) == builds
    assert prepare_chunk_indices(other.to(torch.int64), 64).dtype == torch.int64  # (the dtype is in the key)


@pytest.mark.usefixtures("device_keys")
def test_indices_built_from_a_host_copy_follow_its_values(built_from: list) -> None:
    """A device ``cu_seqlens`` of an unchanged version with a host copy of new values (rewritten outside torch, the
    copy handed over as ``cu_seqlens_cpu`` / ``host=``): the index is built from the copy's new values."""
    clear_index_cache()
    cu = torch.tensor([0, 65, 130], dtype=torch.int32)
    host = cu.clone()
    assert prepare_chunk_indices(cu, 64, host=host).tolist() == _loop_indices([0, 65, 130], 64)
    host.numpy()[1] = 10
    cu.numpy()[1] = 10  # (its version unchanged)
    assert prepare_chunk_indices(cu, 64, host=host).tolist() == _loop_indices([0, 10, 130], 64)
    assert built_from[-1] == [0, 10, 130]
    launch = index.prepare_varlen_launch(cu, 64, host=host)
    assert launch[0].tolist() == _loop_indices([0, 10, 130], 64)


def test_checked_values_are_read_once_per_version(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_index_cache()
    reads: list[int] = []
    real = index.check_cu_seqlens_values

    def counting(cu, T):
        reads.append(T)
        return real(cu, T)

    monkeypatch.setattr(index, "check_cu_seqlens_values", counting)
    cu = torch.tensor([0, 30, 30, 70], dtype=torch.int32)
    assert checked_cu_seqlens_values(cu, 70) == [0, 30, 30, 70]
    assert checked_cu_seqlens_values(cu, 70) == [0, 30, 30, 70]
    assert reads == [70]
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] must equal the packed length T=71"):
        checked_cu_seqlens_values(cu, 71)  # another T is another check
    cu[2] = 20  # in place: the new version is read and checked again
    with pytest.raises(ValueError, match="non-decreasing"):
        checked_cu_seqlens_values(cu, 70)
    with pytest.raises(ValueError, match="non-decreasing"):  # a failed check is not cached
        checked_cu_seqlens_values(cu, 70)
    assert reads == [70, 71, 70, 70]
    cu[2] = 50
    assert checked_cu_seqlens_values(cu, 70) == [0, 30, 50, 70]


@pytest.mark.parametrize("cu_list", [[0, 100, 100, 228], [0, 15], [0, 0, 0, 65, 66], [0, 64, 128, 320], [0, 0]],
                         ids=["spec-example", "single", "leading-empty", "exact", "all-empty"])
def test_indices_of_checked_cu_seqlens_need_no_device_read(cu_list: list[int], built_from: list) -> None:
    """After the check, the indices are built from the checked host copy, not from cu_seqlens (on a GPU: no launch
    and no synchronising repeat_interleave)."""
    clear_index_cache()
    cu = torch.tensor(cu_list, dtype=torch.int32)
    checked_cu_seqlens_values(cu, cu_list[-1])
    rows = _loop_indices(cu_list, 64)
    assert prepare_chunk_indices(cu, 64).tolist() == rows
    assert built_from == [cu_list]  # the host copy's boundaries, not the tensor


@pytest.mark.usefixtures("device_keys")
def test_boundaries_of_an_older_version_are_never_used(built_from: list) -> None:
    clear_index_cache()
    cu = torch.tensor([0, 100, 228], dtype=torch.int32)
    checked_cu_seqlens_values(cu, 228)
    cu.copy_(torch.tensor([0, 10, 300], dtype=torch.int32))  # new contents, not checked again
    assert prepare_chunk_indices(cu, 64).tolist() == _loop_indices([0, 10, 300], 64)
    assert len(built_from) == 1 and built_from[0] is cu  # the stale host copy was not used
    checked_cu_seqlens_values(cu, 300)
    assert prepare_chunk_indices(cu, 16).tolist() == _loop_indices([0, 10, 300], 16)
    assert len(built_from) == 2 and built_from[1] == [0, 10, 300]


@pytest.mark.usefixtures("device_keys")
def test_boundaries_of_another_tensor_are_never_used(built_from: list) -> None:
    """A new tensor that reuses a freed one's id (and version 0) gets its own rows."""
    clear_index_cache()
    for length in range(1, 400, 37):
        checked = torch.tensor([0, length], dtype=torch.int32)
        checked_cu_seqlens_values(checked, length)
        del checked
        cu = torch.tensor([0, 2 * length + 1], dtype=torch.int32)  # may take the freed tensor's id
        assert prepare_chunk_indices(cu, 64).tolist() == _loop_indices([0, 2 * length + 1], 64)
        assert built_from[-1] is cu


@pytest.mark.usefixtures("device_keys")
def test_inference_tensors_keep_no_boundaries(built_from: list) -> None:
    with torch.inference_mode():
        cu = torch.tensor([0, 65, 130], dtype=torch.int32)
        assert checked_cu_seqlens_values(cu, 130) == [0, 65, 130]
        assert prepare_chunk_indices(cu, 64).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
        cu[1] = 10
        assert checked_cu_seqlens_values(cu, 130) == [0, 10, 130]
        assert prepare_chunk_indices(cu, 64).tolist() == [[0, 0], [1, 0], [1, 1]]
        assert len(built_from) == 2 and all(source is cu for source in built_from)


@pytest.fixture
def capability_queries(monkeypatch: pytest.MonkeyPatch):
    """Count driver queries; the cache is emptied before and after, so no fake capability outlives the test."""
    asked: list[int] = []

    def fake(index: int) -> tuple[int, int]:
        asked.append(index)
        return (9, 0) if index == 0 else (10, 0)

    kda_tuning._capability.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    yield asked
    kda_tuning._capability.cache_clear()


def test_device_capability_is_asked_once_per_device(capability_queries: list[int]) -> None:
    for _ in range(3):
        assert kda_tuning.device_capability(torch.device("cuda", 0)) == (9, 0)
        assert kda_tuning.device_capability(torch.device("cuda", 1)) == (10, 0)
    assert kda_tuning.device_capability(torch.device("cuda")) == (10, 0)  # no index: the current device (1)
    assert capability_queries == [0, 1]
