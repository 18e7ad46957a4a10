"""Per-config table of one knob variant against FLA, from recorded ``bench_kda_prefill.py`` results.

    python benchmarks/variant_summary.py VARIANT_COLUMN RESULT.md [RESULT.md ...]

``VARIANT_COLUMN`` is a variant's column title in the results' "Knob variants" table, e.g.
``cula-cutedsl[CULA_CUTE_INTRA=fused-prepare-prefetch-8warps]`` (a knob since retired, with the forms it chose: the
recorded runs keep its name). Every number comes from the files (each config
timed side by side with FLA in one process); nothing is measured here. Prints Markdown: per config FLA ms, cula-sm90
ms, the base cula-cutedsl ms, the variant's ms, FLA/variant and variant/sm90, then the mean, geometric mean and
range of FLA/variant.
"""

from __future__ import annotations

import statistics
import sys


def _rows(lines: list[str]) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines
            if line.startswith("| ") and not line.startswith("|---")]


def read_result(path: str, variant: str) -> dict[str, tuple[float, float, float, float]]:
    """``{config: (FLA ms, cula-sm90 ms, cula-cutedsl ms, variant ms)}`` of one results file."""
    text = open(path, encoding="utf-8").read()
    main, _, knobs = text.partition("Knob variants")
    main_rows, knob_rows = _rows(main.splitlines()), _rows(knobs.splitlines())
    if not knob_rows:
        raise SystemExit(f"{path}: no 'Knob variants' table")
    header = main_rows[0]
    fla, sm90, cute = (header.index(name) for name in ("FLA ms", "cula-sm90 ms", "cula-cutedsl ms"))
    try:
        column = knob_rows[0].index(f"{variant} ms")
    except ValueError:
        raise SystemExit(f"{path}: no column '{variant} ms' in the knob table") from None
    base = {row[0]: row for row in main_rows[1:]}
    return {row[0]: (float(base[row[0]][fla]), float(base[row[0]][sm90]), float(base[row[0]][cute]),
                     float(row[column])) for row in knob_rows[1:]}


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    variant, paths = sys.argv[1], sys.argv[2:]
    table: dict[str, tuple[float, float, float, float]] = {}
    for path in paths:
        table.update(read_result(path, variant))
    print(f"| config | FLA ms | cula-sm90 ms | cula-cutedsl (base) ms | {variant} ms | FLA/variant | variant/sm90 |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for config, (fla, sm90, cute, ms) in table.items():
        ratios.append(fla / ms)
        print(f"| {config} | {fla:.3f} | {sm90:.3f} | {cute:.3f} | {ms:.3f} | {fla / ms:.2f} | {ms / sm90:.2f} |")
    print(f"\n{len(ratios)} configs: FLA/variant mean {statistics.mean(ratios):.2f}x, geometric mean "
          f"{statistics.geometric_mean(ratios):.2f}x, min {min(ratios):.2f}x, max {max(ratios):.2f}x.")


if __name__ == "__main__":
    main()
