"""Where a kernel's warps stall, per barrier-delimited segment of its SASS, from Nsight Compute's per-instruction CSV.

    python tools/ncu_segments.py ncu_sm90_intra_source.csv [--top 5] [--barriers 50]

Reads the CSV that ``NCU_SOURCE_KERNEL=intra|recurrence bash tools/h200_ncu.sh`` writes (``ncu --page source --csv
--print-source sass``; one kernel) and prints, for each run of instructions ending at a ``BAR.SYNC``, its share of the
warp stall samples and of the executed instructions, its main stall reasons (each as a share of all samples) and its
``--top`` instructions by samples; then every instruction holding at least ``--barriers`` samples of barrier stall (a
warp waiting at a barrier is sampled at the instruction after it). Pure Python, no GPU.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_rows(path: Path) -> list[dict[str, str]]:
    """The CSV's instruction rows (those after its ``"Address"`` header line) as dicts."""
    with path.open(newline="") as f:
        lines = list(csv.reader(f))
    start = next(i for i, row in enumerate(lines) if row and row[0] == "Address")
    header = lines[start]
    return [dict(zip(header, row, strict=True)) for row in lines[start + 1:] if len(row) == len(header)]


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def segments(rows: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """The instructions split after each ``BAR.SYNC`` (the barrier ends its segment)."""
    parts: list[list[dict[str, str]]] = [[]]
    for row in rows:
        parts[-1].append(row)
        if "BAR.SYNC" in row["Source"]:
            parts.append([])
    return [part for part in parts if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--barriers", type=float, default=50.0)
    opts = parser.parse_args()
    rows = read_rows(opts.csv)
    reasons = [name for name in rows[0] if name.startswith("stall_") and "Not Issued" not in name]
    total = sum(number(row[SAMPLES]) for row in rows) or 1.0
    executed = sum(number(row[EXECUTED]) for row in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} stall samples, {executed:.0f} warp-instructions executed")
    print("| segment | instructions | samples | executed | main stall reasons (share of all samples) |")
    print("|---|---|---|---|---|")
    for i, part in enumerate(segments(rows)):
        samples = sum(number(row[SAMPLES]) for row in part)
        share = {name: sum(number(row[name]) for row in part) / total for name in reasons}
        main = ", ".join(f"{name[6:]} {100 * value:.1f}" for name, value in
                         sorted(share.items(), key=lambda item: -item[1])[:3] if value >= 0.005)
        print(f"| {i} | {len(part)} | {100 * samples / total:.1f}% | "
              f"{100 * sum(number(row[EXECUTED]) for row in part) / executed:.1f}% | {main} |")
        for row in sorted(part, key=lambda row: -number(row[SAMPLES]))[:opts.top]:
            print(f"|   | {number(row[SAMPLES]):.0f} samples | {row['Source'].strip()[:60]} | | |")
    print("\nbarrier stalls (sampled at the instruction after the barrier):")
    for index, row in enumerate(rows):
        waits = number(row.get("stall_barrier", "0"))
        if waits >= opts.barriers:
            print(f"  #{index} {row['Source'].strip()[:60]}: {waits:.0f} ({100 * waits / total:.1f}% of samples)")


if __name__ == "__main__":
    main()
