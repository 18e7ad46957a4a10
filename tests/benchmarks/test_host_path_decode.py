"""benchmarks/host_path_decode.py on the CPU: the stand-ins force the planned path and are put back, every piece is
timed on a planned call (none allocates with ``out``), a call the revision does not plan says so, and the GPU table's
layout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import host_path_decode as harness  # noqa: E402

pytest.importorskip("cutlass", reason="CuTeDSL is not installed (the plans build the kernels' real argument specs)")


def test_the_stand_ins_are_put_back() -> None:
    from cula import call_plans
    from cula_runtime.cute import compile_cache

    before = (compile_cache.compile_kernel, call_plans.indices_checked_on_host)
    with harness.stand_ins():
        assert compile_cache.compile_kernel is not before[0]
    assert (compile_cache.compile_kernel, call_plans.indices_checked_on_host) == before
    assert call_plans._plans == {} and call_plans._guarded_plans == {}


@pytest.mark.parametrize("case", [harness.Case("kda", 1), harness.Case("kda", 1, form="gate-no-out"),
                                  harness.Case("lightning", 1, 64, 64, form="layer")], ids=lambda c: c.name)
def test_every_piece_of_a_planned_call_is_timed(case: harness.Case) -> None:
    rows = harness.cpu_pieces(case, calls=20)
    assert "note" not in rows
    for piece in ("call", "signature", "knobs", "lookup", "plan", "compiled stand-in", "tvm-ffi"):
        assert isinstance(rows[piece], float) and rows[piece] >= 0, piece
    assert rows["allocations"] == (1 if case.form == "gate-no-out" else 0), "o alone, and only without out"
    assert (rows["o allocation"] is None) == (case.form != "gate-no-out")
    assert rows["launch arguments"].endswith("of 14" if case.op == "kda" else "of 9")
    table = harness.cpu_table({case.name: rows})
    assert table[0] == f"| piece | {case.name} |" and len(table) == 2 + len(harness.CPU_ROWS)


def test_a_cpu_g_gamma_is_not_planned_and_the_table_says_so() -> None:
    rows = harness.cpu_pieces(harness.Case("lightning", 1, 64, 64), calls=5)
    assert rows == {"note": "not planned by this revision"}
    assert harness.cpu_table({"x": rows})[-1] == "- x: not planned by this revision"


def test_the_gpu_table_has_a_column_per_revision_and_piece() -> None:
    one = {name: {"call": 21.0, "signature": 5.0, "plan": 9.0} for name in harness.GPU_CASES}
    text = harness.gpu_table({"before": [one, one], "now": [one]}, ["# title"])
    lines = text.splitlines()
    assert lines[0] == "# title" and lines[2].count(" us |") == 6 and "now plan us" in lines[2]
    assert lines[4].startswith(f"| {harness.GPU_CASES[0]} | 21.0 (short) [21.0, 21.0] | 5.0 | 9.0 | 21.0 (short)")
