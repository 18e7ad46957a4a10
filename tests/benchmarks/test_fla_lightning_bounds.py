"""benchmarks/fla_lightning_error_bounds.py's logic on the CPU: FLA's arguments against FLA 0.6.0's signatures (read
from its wheel), the errors on every case with stand-in contenders (the fp64 recurrence itself: errors near zero, the
dense form of the pool calls included), NaN for non-finite values and the bound's fallback, ``missing`` mode and the
written table."""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fla_lightning_error_bounds as script  # noqa: E402

from cula_runtime.reference.lightning import lightning_naive  # noqa: E402
from tests import lightning_cases as lc  # noqa: E402

FLA_WHEEL = ROOT / ".devcarry" / "fla_core-0.6.0-py3-none-any.whl"
FLA_SOURCES = {"lightning": ("fla/ops/lightning_attn/chunk.py", "chunk_lightning_attn"),
               "prefill": ("fla/ops/simple_gla/chunk.py", "chunk_simple_gla"),
               "decode": ("fla/ops/simple_gla/fused_recurrent.py", "fused_recurrent_simple_gla")}


def _fla_params(path: str, function: str) -> set[str]:
    if not FLA_WHEEL.exists():
        pytest.skip(f"{FLA_WHEEL} absent")
    with zipfile.ZipFile(FLA_WHEEL) as wheel:
        tree = ast.parse(wheel.read(path).decode())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}


def _naive(q, k, v, g_gamma, initial_state, output_final_state, cu_seqlens, state_v_first=False):
    assert output_final_state and (cu_seqlens is None or cu_seqlens.dtype == torch.int64)
    return lightning_naive(q, k, v, g_gamma, initial_state=initial_state, output_final_state=True,
                           cu_seqlens=cu_seqlens, state_v_first=state_v_first)


def _naive_layer(q, k, v, layer_idx, num_layers, initial_state, output_final_state, cu_seqlens):
    return _naive(q, k, v, lc.layer_gamma(layer_idx, num_layers), initial_state, output_final_state, cu_seqlens)


STAND_INS = {"lightning": _naive_layer, "prefill": _naive, "decode": _naive}


@pytest.mark.parametrize("case", lc.CASES, ids=[c.name for c in lc.CASES])
def test_flas_arguments_name_its_0_6_0_parameters(case: lc.LightningCase) -> None:
    which, call = script.fla_call(case, lc.make_inputs(case, "cpu"))
    assert which == ("lightning" if case.layer else case.op)
    assert set(call) <= _fla_params(*FLA_SOURCES[which])
    assert call["output_final_state"] is True
    if case.pool:
        assert call["initial_state"].dtype == torch.float32 and call["initial_state"].shape[0] == case.N


@pytest.mark.parametrize("case", lc.CASES, ids=[c.name for c in lc.CASES])
def test_the_fp64_recurrence_as_fla_measures_near_zero(case: lc.LightningCase) -> None:
    """(a pool call's padding rows: the stand-in computes them from a zero state, the script zeroes them as the
    contract does; a bf16 pool: both sides rounded alike)"""
    err_o, err_states = script.measure(case, STAND_INS, "cpu")
    assert 0 <= err_o < 1e-12 and 0 <= err_states < 1e-12


def test_non_finite_values_are_nan_and_the_bound_falls_back(tmp_path: Path) -> None:
    def nan_states(*args, **kwargs):
        o, ht = _naive(*args, **kwargs)
        return o, torch.full_like(ht, float("nan"))

    case = lc.BY_NAME["prefill-packed-0-1-64-130-0-257-h0-kfirst"]
    out = tmp_path / "errors.py"
    rows = script.main(str(out), case.name, {**STAND_INS, "prefill": nan_states}, "cpu")
    assert len(rows) == 1 and rows[0][1] < 1e-12 and math.isnan(rows[0][2])
    table = _load(out)
    assert math.isnan(table[case.name][1]) and "not finite" in out.read_text()
    assert lc.bound(case.name, 1, table) == lc.PROVISIONAL_BOUND
    assert lc.bound(case.name, 0, table) == lc.ROUNDING_FLOOR


def test_missing_mode_measures_only_the_unrecorded_cases_and_keeps_the_rest(tmp_path: Path) -> None:
    known = {c.name: (3e-3, 1e-3) for c in lc.CASES[1:]}
    out = tmp_path / "errors.py"
    rows = script.main(str(out), "missing", STAND_INS, "cpu", known=known)
    assert [name for name, *_ in rows] == [*known, lc.CASES[0].name]
    table = _load(out)
    assert table[lc.CASES[1].name] == (3e-3, 1e-3) and set(table) == set(lc.BY_NAME)
    assert "kept from their own runs" in out.read_text()


def test_unknown_case_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown cases"):
        script.main(str(tmp_path / "x.py"), "no-such-case", STAND_INS, "cpu")


def _load(path: Path) -> dict:
    spec = importlib.util.spec_from_file_location("written_errors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LIGHTNING_FLA_ERRORS
