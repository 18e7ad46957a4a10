"""The frozen accuracy bounds of the GPU tests (CPU): every case of tests/kda_cases.py has FLA's measured error,
and the bound is 1.25x it, capped at 1e-2, never a silent default."""

from __future__ import annotations

import pytest

from tests.gpu_backends import CEILING, FLA_FACTOR, bound
from tests.kda_cases import CASES
from tests.kda_fla_errors import FLA_ERRORS


def test_every_case_has_fla_errors_and_nothing_else_does() -> None:
    assert sorted(FLA_ERRORS) == sorted(case.name for case in CASES)
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bounds_are_fla_times_factor_below_the_ceiling(case) -> None:
    err_o, err_ht = FLA_ERRORS[case.name]
    assert 1e-4 < err_o < 5e-3  # a bf16 pipeline: an FLA error outside this range is a broken measurement
    assert bound(case.name, 0) == min(FLA_FACTOR * err_o, CEILING)
    assert bound(case.name, 1) == min(FLA_FACTOR * err_ht, CEILING)


def test_unknown_case_has_no_bound() -> None:
    with pytest.raises(KeyError, match="no FLA error"):
        bound("not-a-case", 0)
