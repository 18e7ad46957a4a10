"""``host_overhead_kda.GpuSleep`` (the sleep the host-time benchmarks enqueue so that no call waits for the GPU)
calibrates at the GPU's highest clock of a few sleeps: one taken at an idle clock would make every later sleep too
short. Driven on the CPU with a stand-in of ``torch.cuda`` whose clock ramps up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import host_overhead_kda  # noqa: E402


class _RampingGpu:
    """``_sleep(cycles)`` takes cycles / (the clock in cycles per ms), the clock rising from idle to full."""

    def __init__(self, clocks: list[float]) -> None:
        self.clocks, self.elapsed = list(clocks), 0.0

    def sleep(self, cycles: int) -> None:
        self.elapsed = cycles / (self.clocks.pop(0) if len(self.clocks) > 1 else self.clocks[0])

    def event(self, enable_timing: bool = False):
        gpu = self

        class Event:
            def record(self) -> None: ...
            def synchronize(self) -> None: ...
            def elapsed_time(self, end) -> float:
                return gpu.elapsed

        return Event()


def test_the_sleep_is_calibrated_at_the_highest_clock_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = _RampingGpu([345e3, 1200e3, 1980e3, 1980e3])  # cycles per ms: an H100 from idle to its load clock
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", gpu.sleep)
    monkeypatch.setattr(torch.cuda, "Event", gpu.event)
    assert host_overhead_kda.GpuSleep().cycles_per_ms == pytest.approx(1980e3)
