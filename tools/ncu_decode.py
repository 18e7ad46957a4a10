"""One KDA decode step (``cute/kda/decode.py``) at a benchmark row, inside a profiler range, for Nsight Compute;
or the in-place pass over the same states' bytes that the decode benchmarks take as their yardstick.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 tools/ncu_decode.py [--row "fp32 kfirst H32 HV32 N128"] [--lines 0|1|2|4] [--state-pass]

(``tools/h200_session.sh ncu:decode`` runs it.) Rows: ``bench_kda_decode.py``'s names (its inputs: the fp32
log-gate, L2 norm in the kernel). ``--lines``: a K-first CTA's 128-byte lines per K row (``k_first_lines``, the
product's configuration of the call with it replaced); 0 keeps the product's choice (``kda.decode.k_first_lines``).
The step is launched once outside the range first (compilation, caches), then once inside
``torch.cuda.profiler.start()``/``stop()``, so ncu profiles exactly one kernel; ``--state-pass`` profiles torch's
``mul_`` over ``N · HV · K · V`` elements of the pool's dtype instead. What it is for: where the K-first step's
5-15% over a pass goes (issues 26, 28) — DRAM throughput, stall reasons, the barrier.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", default="fp32 kfirst H32 HV32 N128", help="a row name of bench_kda_decode.py")
    parser.add_argument("--lines", type=int, default=0, choices=(0, 1, 2, 4))
    parser.add_argument("--state-pass", action="store_true", help="profile the in-place pass over the same bytes")
    opts = parser.parse_args()

    import bench_kda_decode as kda_bench
    import torch

    by_name = {case.name: case for case in kda_bench.decode_cases()}
    if opts.row not in by_name:
        raise SystemExit(f"--row {opts.row!r}: expected one of {sorted(by_name)}")
    case = by_name[opts.row]
    if opts.state_pass:
        step = kda_bench.state_pass(case)
        label = "the in-place pass"
    else:
        from ab_decode_k_first_lines import kda_decode_step

        step = kda_decode_step(case, kda_bench.make_decode_inputs(case, "cuda", 0))(opts.lines)
        label = "the decode step, " + (f"k_first_lines={opts.lines}" if opts.lines else "the product's lines")
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{opts.row}: profiled {label}")


if __name__ == "__main__":
    main()
