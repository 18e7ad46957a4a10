"""``cula_runtime.state_pool.pool_slots``: the slots a call reads and writes, strict (the validator on CPU tensors)
and lenient (what a kernel does with the same values on the device)."""

from __future__ import annotations

import pytest

from cula_runtime.state_pool import PoolSlots, pool_slots


def test_one_slot_per_sequence_and_padding_rows() -> None:
    slots = pool_slots([3, -1, 0, -7], [2, 2, 0, 1], 4, per_token=False, strict=True)
    assert slots == PoolSlots(start=(3, -1, 0, -1), final=(3, -1, 0, -1), steps=None)
    assert slots.active == [0, 2]


def test_per_token_slots_from_column_zero_or_the_accepted_count() -> None:
    rows = [[0, 1, 2], [-1, 5, 6], [7, -1, 8]]
    plain = pool_slots(rows, [3, 3, 2], 9, per_token=True, strict=True)
    assert plain.start == (0, -1, 7) and plain.final == (-1, -1, -1)
    assert plain.steps == ((0, 1, 2), (-1, -1, -1), (7, -1))  # a padding row writes nothing; -1: not written
    accepted = pool_slots(rows, [3, 3, 2], 9, [3, 2, 1], per_token=True, strict=True)
    assert accepted.start == (2, 5, 7) and accepted.steps == ((0, 1, 2), (-1, 5, 6), (7, -1))


def test_a_slot_may_repeat_within_a_row_but_not_across_rows() -> None:
    assert pool_slots([[4, 4], [1, 2]], [2, 2], 5, per_token=True, strict=True).steps == ((4, 4), (1, 2))
    for strict in (True, False):  # (a duplicate has no device meaning: refused wherever values are read)
        with pytest.raises(ValueError, match="slot 2 is used by sequences 0 and 1"):
            pool_slots([[4, 2], [1, 2]], [2, 2], 5, per_token=True, strict=strict)
        with pytest.raises(ValueError, match="slot 1 is used by sequences 0 and 2"):
            pool_slots([1, -1, 1], [1, 1, 1], 5, per_token=False, strict=strict)


def test_unused_entries_are_not_checked() -> None:
    """Only the entries a sequence uses count: its start slot and its first T_n per-token entries."""
    slots = pool_slots([[0, 99], [1, 0]], [1, 1], 2, per_token=True, strict=True)
    assert slots.steps == ((0,), (1,))


@pytest.mark.parametrize("indices,lens,accepted,per_token,words", [
    ([0, 5], [1, 1], None, False, "state_indices[1]=5 is outside the pool of 5 slots"),
    ([[0, 5]], [2], None, True, "state_indices[0, 1]=5 is outside"),
    ([[0, 1]], [1], [0], True, "num_accepted_tokens[0]=0 must be in [1, 2]"),
    ([[0, 1]], [1], [3], True, "num_accepted_tokens[0]=3 must be in [1, 2]"),
    ([[0, 1]], [3], None, True, "sequence 0 has 3 tokens but state_indices has 2 columns"),
], ids=["past-pool", "step-past-pool", "accepted-zero", "accepted-past-W", "longer-than-W"])
def test_strict_refuses_what_a_kernel_treats_as_padding(indices, lens, accepted, per_token, words) -> None:
    with pytest.raises(ValueError) as info:
        pool_slots(indices, lens, 5, accepted, per_token=per_token, strict=True)
    assert words in str(info.value)


def test_lenient_treats_it_as_padding_or_a_state_not_written() -> None:
    assert pool_slots([0, 5], [1, 1], 5, per_token=False, strict=False).start == (0, -1)
    slots = pool_slots([[0, 9], [1, 2], [3, 4]], [2, 2, 3], 5, [1, 0, 1], per_token=True, strict=False)
    assert slots.start == (0, -1, 3)
    assert slots.steps == ((0, -1), (-1, -1), (3, 4, -1))  # past the pool, a padding row, past the row's W columns
