"""benchmarks/bench_kda_prefill.py's harness: what runs inside a timed call and what around it (CPU only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kda_prefill as bench  # noqa: E402

KNOB = "CULA_TEST_HARNESS_KNOB"


def _seen_backend(**_kw) -> tuple[str | None, str | None]:
    """A stand-in for kda_prefill: the knobs as the call sees them."""
    return os.environ.get("CULA_BACKEND"), os.environ.get(KNOB)


def test_cula_contender_sets_its_knobs_around_calls_not_inside_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setenv(KNOB, "outer")
    contender = bench._cula_run(_seen_backend, "sm90", {KNOB: "inner"})
    assert contender({}) == (None, "outer")  # a timed call writes nothing to os.environ
    with contender.knobs():
        assert contender({}) == ("sm90", "inner")
    assert "CULA_BACKEND" not in os.environ and os.environ[KNOB] == "outer"
    with pytest.raises(RuntimeError), contender.knobs():  # restored when the batch raises
        raise RuntimeError
    assert "CULA_BACKEND" not in os.environ and os.environ[KNOB] == "outer"


def test_interleaved_ms_runs_every_call_of_a_contender_inside_its_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "event_times_ms", lambda fn, reps: [float(fn() is None) for _ in range(reps)])
    seen: dict[str, list] = {"a": [], "b": [], "plain": []}
    runs = {name: bench._cula_run(lambda name=name, **_kw: seen[name].append(os.environ.get("CULA_BACKEND")),
                                  name, {}) for name in ("a", "b")}
    fns = {name: (lambda run=run: run({})) for name, run in runs.items()}
    fns["plain"] = lambda: seen["plain"].append(os.environ.get("CULA_BACKEND"))
    times = bench.interleaved_ms(fns, reps=6, rounds=3, warmup=2,
                                 knobs={name: run.knobs for name, run in runs.items()})
    assert times == {"a": 1.0, "b": 1.0, "plain": 1.0}
    assert seen == {"a": ["a"] * 8, "b": ["b"] * 8, "plain": [None] * 8}  # 2 warm-up + 6 timed calls each
    assert "CULA_BACKEND" not in os.environ


def test_fla_inputs_give_int64_boundaries_and_leave_the_call_inputs_alone() -> None:
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    kwargs = {"q": torch.zeros(1), "cu_seqlens": cu}
    converted = bench.fla_inputs(kwargs)
    assert converted["cu_seqlens"].dtype == torch.int64 and converted["cu_seqlens"].tolist() == [0, 3, 7]
    assert converted["q"] is kwargs["q"] and kwargs["cu_seqlens"] is cu and cu.dtype == torch.int32
    fixed = {"q": torch.zeros(1)}
    assert bench.fla_inputs(fixed) is fixed
