"""One ``kda_prefill`` call at a benchmark configuration, inside a profiler range, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 tools/ncu_kda.py --backend sm90|cutedsl [--config "fixed B1 T16384"]

(``tools/h200_ncu.sh`` runs it.) The call is made once outside the range first (compilation, index caches, the
allocator), then once inside ``torch.cuda.profiler.start()``/``stop()``, so ncu profiles exactly one call's kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("sm90", "cutedsl"), required=True)
    parser.add_argument("--config", default="fixed B1 T16384", help="a config name of bench_kda_prefill.configs()")
    parser.add_argument("--kimi", default="",
                        help="a row of bench_kda_unbounded.py instead (\"H32 [8192] fp32 g\"[ safe])")
    opts = parser.parse_args()
    os.environ["CULA_BACKEND"] = opts.backend

    import torch
    from bench_kda_prefill import configs, make_inputs

    from cula.kda import kda_prefill

    by_name = {cfg.name: cfg for cfg in configs()}
    if opts.kimi:
        from bench_kda_unbounded import row_inputs

        kwargs, opts.config = row_inputs(opts.kimi), opts.kimi
    elif opts.config not in by_name:
        raise SystemExit(f"--config {opts.config!r}: expected one of {sorted(by_name)}")
    else:
        kwargs = make_inputs(by_name[opts.config])
    kda_prefill(**kwargs)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    kda_prefill(**kwargs)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{opts.backend} {opts.config}: profiled one call")


if __name__ == "__main__":
    main()
