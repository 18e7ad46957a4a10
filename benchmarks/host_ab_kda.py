"""A/B of two versions of the host call path (e.g. the sm90 shim before and after a change), run in turns.

    python benchmarks/host_ab_kda.py TAG [--configs "fixed B1 T512,varlen T4096 10xuniform"] [--reps 400]

Run it once per version and in alternation (A B A B), each time with that version first on ``PYTHONPATH`` (the
compiled extension can be the same: only Python changed), so that machine drift lands on both. Per config of
``bench_kda_prefill.py`` (same inputs and flags), after 30 warm-up calls of ``cula.kda.kda_prefill``:

- eager ms: the median of ``--reps`` CUDA-event timings of one call, the GPU idle before each (the benchmark's
  measure: the host time to the first launch counts);
- host us: the median host wall time of one call over 300 calls while the GPU sleeps (``host_overhead_kda.host_us``:
  the Python path with no launch waiting for the GPU), and whether the sleep outlasted them.

Prints one line per config: ``AB <TAG> <config> eager_ms <x> host_us <y> gpu_busy <bool>``. Never imports FLA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_CONFIGS = "fixed B1 T512,fixed B1 T1024,fixed B2 T1024,varlen T4096 10xuniform,varlen T8192 10xuniform"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tag", help="name printed on each line (e.g. old / new)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated config names")
    parser.add_argument("--reps", type=int, default=400, help="CUDA-event timings per config")
    opts = parser.parse_args()

    import torch
    from bench_kda_prefill import event_times_ms, make_inputs, median, named_configs
    from host_overhead_kda import GpuSleep, host_us

    from cula.kda import kda_prefill

    sleep = GpuSleep()
    for cfg in named_configs(opts.configs):
        kwargs = make_inputs(cfg)
        for _ in range(30):
            kda_prefill(**kwargs)
        torch.cuda.synchronize()
        eager = median(event_times_ms(lambda kw=kwargs: kda_prefill(**kw), opts.reps))
        host, _, busy = host_us(lambda kw=kwargs: kda_prefill(**kw), 300, sleep, sleep_ms=100.0)
        print(f"AB {opts.tag} {cfg.name} eager_ms {eager:.4f} host_us {host:.1f} gpu_busy {busy}", flush=True)


if __name__ == "__main__":
    main()
