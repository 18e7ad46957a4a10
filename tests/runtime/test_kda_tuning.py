"""The recurrence block-size choice shared by the GPU backends (CPU: pure arithmetic and the env override)."""

from __future__ import annotations

import pytest

from cula_runtime.kda_tuning import ENV_BLOCK_V, recurrence_block_v

H200_SMS = 132


@pytest.mark.parametrize(
    "pairs,expected",
    [(1, 32), (16, 32), (33, 32), (34, 64), (64, 64), (66, 64), (67, 128), (128, 128), (640, 128), (1280, 128)],
    ids=lambda x: str(x),
)
def test_narrowest_block_that_fits_one_wave(pairs: int, expected: int, monkeypatch) -> None:
    """B1 H16 -> 16 pairs -> 32 (64 CTAs); B1 H64 -> 64 -> 64 (128 CTAs); B2 H64 -> 128 -> 128 (one wave, not two);
    varlen 10 x 64 heads -> 640 -> 128 (the fewest waves)."""
    monkeypatch.delenv(ENV_BLOCK_V, raising=False)
    block_v = recurrence_block_v(pairs, H200_SMS)
    assert block_v == expected
    assert pairs * 128 // block_v <= H200_SMS or block_v == 128


@pytest.mark.parametrize("pairs,expected", [(1, 64), (16, 64), (34, 64), (64, 64), (66, 64), (67, 128), (640, 128)])
def test_a_backend_can_ask_for_a_narrowest_block(pairs: int, expected: int, monkeypatch) -> None:
    """The CuTeDSL backend asks for at least 64 (its 2-warp CTAs lose even when they fill more SMs)."""
    monkeypatch.delenv(ENV_BLOCK_V, raising=False)
    assert recurrence_block_v(pairs, H200_SMS, narrowest=64) == expected


@pytest.mark.parametrize("value", ["32", "64", "128"])
def test_env_overrides_the_choice(value: str, monkeypatch) -> None:
    monkeypatch.setenv(ENV_BLOCK_V, value)
    assert recurrence_block_v(640, H200_SMS) == int(value)


@pytest.mark.parametrize("value", ["16", "auto", "64.0"])
def test_bad_env_value_is_a_value_error_naming_it(value: str, monkeypatch) -> None:
    monkeypatch.setenv(ENV_BLOCK_V, value)
    with pytest.raises(ValueError, match=f"{ENV_BLOCK_V}='{value}'.*32, 64, 128"):
        recurrence_block_v(64, H200_SMS)
