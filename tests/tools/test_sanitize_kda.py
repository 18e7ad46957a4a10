"""tools/sanitize_kda.py's shape tables on the CPU: every decode shape names a case of the GPU decode tests, and the
whole-column shapes run K-first cases in a form the decode kernel implements (nothing compiles or runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import sanitize_kda  # noqa: E402

from tests.gpu.test_kda_decode_gpu import CASES  # noqa: E402


def test_decode_shapes_name_the_gpu_tests_cases() -> None:
    names = {case.name for case in CASES}
    assert set(sanitize_kda.DECODE_SHAPES.values()) <= names


def test_whole_column_shapes_take_k_first_cases_in_a_form_the_kernel_implements(
        monkeypatch: pytest.MonkeyPatch) -> None:
    decode = pytest.importorskip("cula_runtime.cute.kda.decode", exc_type=ImportError)
    from cula_runtime.cute.kda.intra import InKernelGate

    plan = decode._plan
    cases = {case.name: case for case in CASES}
    assert sanitize_kda.DECODE_COLUMN_SHAPES
    for name, (shape, width) in sanitize_kda.DECODE_COLUMN_SHAPES.items():
        case = cases[sanitize_kda.DECODE_SHAPES[shape]]
        assert not case.v_first, name
        monkeypatch.setattr(decode, "_plan", plan)  # (with_columns wraps the module's _plan; restored at the end)
        sanitize_kda.with_columns(width)
        state_dtype = "bfloat16" if "bf16" in shape else "float32"
        flags = (False, state_dtype, False, False, False, False, 1)
        config, _ = decode._plan(4, 4, InKernelGate(form="none", has_A_log=False, has_dt_bias=False), flags)
        assert (config.k_first_columns, config.k_first_lines) == (width, 0)
        assert decode.KdaDecode.can_implement(config) == (True, "")
