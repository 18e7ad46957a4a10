"""Where cula-sm90's time goes: per-kernel GPU time (torch.profiler) for the intra and recurrence kernels.

    python benchmarks/profile_kda_sm90.py [--reps 20]

For a few of the benchmark configs and each recurrence block size BV (32, 64, 128), prints the mean GPU time of
each kernel per call, the bytes each must move at least (workspace model of csrc/kda/kda_params.h) and the
bandwidth that implies. A microbenchmark for tuning; the end-to-end numbers are bench_kda_prefill.py's.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_kda_prefill import configs, make_inputs  # noqa: E402

K = V = 128
PICK = ("fixed B1 T16384", "fixed B2 T16384", "fixed B1 T512", "varlen T16384 10xskewed", "B1 H16 T32768")


def kernel_bytes(cfg, HV: int) -> tuple[float, float]:
    """Minimum HBM bytes of (intra, recurrence) for one call."""
    tokens = cfg.B * cfg.T
    workspace = tokens * HV * (4 * 2 * K + 2 * 64) + tokens / 64 * HV * 4 * K  # qg kg w u, Aqk, g_last
    intra_in = tokens * (2 * 2 * K * cfg.H + HV * (2 * V + 2 * K + 4))
    recurrence_out = tokens * HV * 2 * V
    return intra_in + workspace, workspace + recurrence_out


def main() -> None:
    from cula_runtime.kda_args import validate_kda_prefill
    from cula_sm90.kda import run_kernels

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    print(f"{'config':28s} {'BV':>4s} {'intra us':>9s} {'GB/s':>6s} {'recur us':>9s} {'GB/s':>6s} {'total us':>9s}")
    for cfg in configs():
        if cfg.name not in PICK:
            continue
        kda_args = validate_kda_prefill(**make_inputs(cfg))
        intra_bytes, recur_bytes = kernel_bytes(cfg, cfg.HV)
        for block_v in (32, 64, 128):
            for _ in range(3):
                run_kernels(kda_args, block_v=block_v)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    run_kernels(kda_args, block_v=block_v)
                torch.cuda.synchronize()
            per_kernel: dict[str, float] = defaultdict(float)
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[event.name] += event.device_time / args.reps  # microseconds
            intra = sum(t for n, t in per_kernel.items() if "intra" in n)
            recur = sum(t for n, t in per_kernel.items() if "recurrence" in n)
            print(f"{cfg.name:28s} {block_v:4d} {intra:9.1f} {intra_bytes / intra / 1e3 if intra else 0:6.0f} "
                  f"{recur:9.1f} {recur_bytes / recur / 1e3 if recur else 0:6.0f} {sum(per_kernel.values()):9.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
