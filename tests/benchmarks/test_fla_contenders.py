"""Every benchmark that times or measures FLA turns cuLA's FLA backend off first: ``import cula`` registers cuLA in
FLA's backend registry (``cula.integrations.fla``), so without ``FLA_CULA=0`` an "FLA" contender runs cuLA's kernels
(one H200 run of ``bench_kda_unbounded.py`` did)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
USES_FLA = [p for p in sorted(BENCHMARKS.glob("*.py")) if re.search(r"^\s*(from|import) fla\b", p.read_text(), re.M)]


def test_some_benchmarks_use_fla() -> None:
    assert len(USES_FLA) >= 4, [p.name for p in USES_FLA]


@pytest.mark.parametrize("path", USES_FLA, ids=[p.name for p in USES_FLA])
def test_fla_contenders_run_flas_own_kernels(path: Path) -> None:
    text = path.read_text()
    if path.name == "host_doors_kda.py":  # (it times both: FLA's door into cuLA, and FLA's own path under FLA_CULA=0)
        assert 'os.environ["FLA_CULA"] = "0"' in text
        return
    assert re.search(r'^os\.environ\["FLA_CULA"\] = "0"', text, re.M), f"{path.name} must set FLA_CULA=0 at import"
