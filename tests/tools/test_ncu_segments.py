"""tools/ncu_segments.py: Nsight Compute's per-instruction CSV split and summed per barrier segment (CPU only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "ncu_segments.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
          "stall_long_sb", "stall_long_sb (Not Issued)"]
ROWS = [  # (source, samples, executed, barrier, long scoreboard)
    ("LDG.E R2, [R4.64]", 10, 100, 0, 0),
    ("FADD R3, R2, R2", 50, 100, 0, 40),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 5, 100, 0, 0),
    ("@!P0 BRA 0x10", 30, 100, 25, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 5, 100, 0, 0),
]


def write_csv(path: Path) -> None:
    lines = ['"==PROF== a preamble line"', ",".join(f'"{h}"' for h in HEADER)]
    for i, (source, samples, executed, barrier, long_sb) in enumerate(ROWS):
        values = [f"0x{16 * i:x}", source, samples, executed, barrier, long_sb, long_sb]
        lines.append(",".join(f'"{v}"' for v in values))
    path.write_text("\n".join(lines) + "\n")


def test_segments_end_at_barriers_and_shares_are_of_all_samples(tmp_path: Path) -> None:
    path = tmp_path / "source.csv"
    write_csv(path)
    out = subprocess.run([sys.executable, str(TOOL), str(path), "--top", "1", "--barriers", "20"],
                         capture_output=True, text=True, check=True).stdout
    assert "5 instructions, 100 stall samples, 500 warp-instructions executed" in out
    # segment 0: the load, its use and the first barrier (65 of 100 samples, 3 of 5 instructions executed)
    assert "| 0 | 3 | 65.0% | 60.0% | long_sb 40.0 |" in out
    assert "| 1 | 2 | 35.0% | 40.0% | barrier 25.0 |" in out
    assert "50 samples | FADD R3, R2, R2" in out  # segment 0's top instruction
    assert "#3 @!P0 BRA 0x10: 25 (25.0% of samples)" in out  # the wait at the first barrier
