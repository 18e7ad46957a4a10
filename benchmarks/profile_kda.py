"""Where each GPU backend's time goes: per-kernel GPU time (torch.profiler) of one ``kda_prefill`` call.

    python benchmarks/profile_kda.py [--backend sm90|cutedsl|all] [--reps 20]
                                     [--block-v 64,128] [--configs "fixed B1 T16384,fixed B2 T16384"]

For a few of the benchmark configs (``PICK``, or ``--configs``) and each recurrence block size BV (64, 128),
prints the mean GPU time per call of each stage (intra and recurrence for both backends; "other": everything else
on the GPU, e.g. index helpers and allocations),
the bytes the intra and recurrence stages must move at least (the workspace model of csrc/kda/kda_params.h, the same
for both backends) and the bandwidth that implies. A microbenchmark for tuning; the end-to-end numbers are
bench_kda_prefill.py's.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_kda_prefill import make_inputs, named_configs  # noqa: E402

K = V = 128
PICK = ("fixed B1 T16384", "fixed B2 T16384", "fixed B1 T512", "varlen T16384 10xskewed", "B1 H16 T32768")
STAGES = {"sm90": ("intra", "recurrence"), "cutedsl": ("intra", "recurrence")}  # backend -> its stages


def kernel_bytes(cfg, HV: int) -> tuple[float, float]:
    """Minimum HBM bytes of (intra, recurrence) for one call."""
    tokens = cfg.B * cfg.T
    # qg kg w u, Aqk (its 10 written 16 x 16 blocks of 16 per chunk: 40 columns per token on average), g_last
    workspace = tokens * HV * (4 * 2 * K + 2 * 40) + tokens / 64 * HV * 4 * K
    intra_in = tokens * (2 * 2 * K * cfg.H + HV * (2 * V + 2 * K + 4))
    recurrence_out = tokens * HV * 2 * V
    return intra_in + workspace, workspace + recurrence_out


def runner(backend: str) -> Callable:
    """``run(validated_args, block_v)``: one forward pass on ``backend``'s kernels."""
    if backend == "sm90":
        from cula_sm90.kda import run_kernels

        return lambda args, block_v: run_kernels(args, block_v=block_v)
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl

    return lambda args, block_v: kda_prefill_cutedsl(args, block_v=block_v)


def stage_means(prof: torch.profiler.profile, stages: tuple[str, ...], reps: int) -> dict[str, float]:
    """Mean GPU microseconds per call (``reps`` calls profiled) of each stage, its kernels matched by name
    (case-insensitive), and of every other kernel under "other"."""
    times: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            stage = next((s for s in stages if s in event.name.lower()), "other")
            times[stage] += event.device_time / reps
    return times


def stage_times(run: Callable, args, block_v: int, reps: int, stages: tuple[str, ...]) -> dict[str, float]:
    """Mean GPU microseconds per call of each stage (matched by kernel name, case-insensitive) and of the rest."""
    for _ in range(3):
        run(args, block_v)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run(args, block_v)
        torch.cuda.synchronize()
    return stage_means(prof, stages, reps)


def main() -> None:
    from cula_runtime.kda_args import validate_kda_prefill

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=(*STAGES, "all"), default="all")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--block-v", default="64,128", help="comma-separated recurrence block sizes to time (64, 128)")
    parser.add_argument("--configs", default=",".join(PICK),
                        help="comma-separated config names of bench_kda_prefill.configs() (default: a few)")
    parser.add_argument("--kimi", default="",
                        help='comma-separated rows of bench_kda_unbounded.py instead ("H32 [8192] fp32 g", each '
                             'optionally followed by " safe"): the unbounded gate\'s calls and their safe twins')
    opts = parser.parse_args()
    if opts.kimi:
        return profile_kimi_rows(opts)
    picked = named_configs(opts.configs)
    block_vs = tuple(int(x) for x in opts.block_v.split(","))
    backends = tuple(STAGES) if opts.backend == "all" else (opts.backend,)
    print(f"{'backend':8s} {'config':26s} {'BV':>3s} {'intra us':>9s} {'GB/s':>5s} "
          f"{'recur us':>9s} {'GB/s':>5s} {'other us':>8s} {'total us':>9s}")
    for backend in backends:
        run = runner(backend)
        for cfg in picked:
            args = validate_kda_prefill(**make_inputs(cfg))
            intra_bytes, recur_bytes = kernel_bytes(cfg, cfg.HV)
            for block_v in block_vs:
                t = stage_times(run, args, block_v, opts.reps, STAGES[backend])
                intra, recur = t["intra"], t["recurrence"]
                print(f"{backend:8s} {cfg.name:26s} {block_v:3d} {intra:9.1f} "
                      f"{intra_bytes / intra / 1e3 if intra else 0:5.0f} {recur:9.1f} "
                      f"{recur_bytes / recur / 1e3 if recur else 0:5.0f} {t['other']:8.1f} {sum(t.values()):9.1f}",
                      flush=True)


def profile_kimi_rows(opts) -> None:
    """Stage times of bench_kda_unbounded.py's rows (``--kimi``); bytes as for a fixed config of the same tokens."""
    from bench_kda_unbounded import row_inputs

    from cula_runtime.kda_args import validate_kda_prefill

    block_vs = tuple(int(x) for x in opts.block_v.split(","))
    backends = tuple(STAGES) if opts.backend == "all" else (opts.backend,)
    print(f"{'backend':8s} {'row':36s} {'BV':>3s} {'intra us':>9s} {'recur us':>9s} {'other us':>8s} {'total us':>9s}")
    for backend in backends:
        run = runner(backend)
        for row in opts.kimi.split(","):
            args = validate_kda_prefill(**row_inputs(row))
            for block_v in block_vs:
                t = stage_times(run, args, block_v, opts.reps, STAGES[backend])
                print(f"{backend:8s} {row:36s} {block_v:3d} {t['intra']:9.1f} {t['recurrence']:9.1f} "
                      f"{t['other']:8.1f} {sum(t.values()):9.1f}", flush=True)


if __name__ == "__main__":
    main()
