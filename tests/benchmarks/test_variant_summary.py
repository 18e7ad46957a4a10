"""benchmarks/variant_summary.py: the recorded summary of the CuTeDSL default is what its two source runs say."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
VARIANT = "cula-cutedsl[CULA_CUTE_INTRA=fused-prepare-prefetch-8warps]"
SOURCES = ("kda_prefill_fixed_variants_h200.md", "kda_prefill_rest_variants_h200.md")


def _summary(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *argv: str) -> str:
    monkeypatch.setattr(sys, "argv", ["variant_summary.py", *argv])
    runpy.run_path(str(ROOT / "benchmarks" / "variant_summary.py"), run_name="__main__")
    return capsys.readouterr().out


def test_recorded_summary_matches_its_sources(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Every table row and the closing line of kda_prefill_cutedsl_default_h200.md come out of the script run on
    the two recorded bench files (30 configs, each with FLA, sm90, the base cutedsl and the variant)."""
    out = _summary(monkeypatch, capsys, VARIANT, *(str(RESULTS / name) for name in SOURCES))
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 31  # header + 30 configs
    recorded = (RESULTS / "kda_prefill_cutedsl_default_h200.md").read_text(encoding="utf-8")
    for line in out.splitlines():
        if line.strip():
            assert line in recorded, line
    assert "30 configs: FLA/variant mean 2.42x" in out


def test_unknown_variant_column_is_an_error(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    with pytest.raises(SystemExit, match="no column 'cula-cutedsl\\[CULA_CUTE_INTRA=nope\\] ms'"):
        _summary(monkeypatch, capsys, "cula-cutedsl[CULA_CUTE_INTRA=nope]", str(RESULTS / SOURCES[0]))
