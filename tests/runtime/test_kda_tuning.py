"""The recurrence block-size choice shared by the GPU backends (CPU: pure arithmetic)."""

from __future__ import annotations

import pytest

from cula_runtime import kda_tuning
from cula_runtime.kda_tuning import BLOCK_V_CHOICES, recurrence_block_v

H200_SMS = 132


@pytest.mark.parametrize(
    "pairs,expected",
    [(1, 64), (16, 64), (33, 64), (34, 64), (64, 64), (66, 64), (67, 128), (128, 128), (640, 128), (1280, 128)],
    ids=lambda x: str(x),
)
def test_narrowest_block_that_fits_one_wave(pairs: int, expected: int) -> None:
    """B1 H16 -> 16 pairs -> 64 (32 CTAs: no narrower block); B1 H64 -> 64 -> 64 (128 CTAs); B2 H64 -> 128 -> 128
    (one wave, not two); varlen 10 x 64 heads -> 640 -> 128 (the fewest waves)."""
    block_v = recurrence_block_v(pairs, H200_SMS)
    assert block_v == expected
    assert pairs * 128 // block_v <= H200_SMS or block_v == 128


def test_only_whole_warpgroups() -> None:
    """The 2-warp blocks (block_v = 32) are retired: the choices are 64 and 128."""
    assert BLOCK_V_CHOICES == (64, 128)


@pytest.mark.parametrize("value", ["32", "64", "128", "16"])
def test_the_retired_env_knob_is_not_read(value: str, monkeypatch) -> None:
    """CULA_BLOCK_V is gone: set to anything (32 included), the choice is the per-call one."""
    monkeypatch.setenv("CULA_BLOCK_V", value)
    assert recurrence_block_v(640, H200_SMS) == 128
    assert recurrence_block_v(16, H200_SMS) == 64
    assert not hasattr(kda_tuning, "ENV_BLOCK_V")
