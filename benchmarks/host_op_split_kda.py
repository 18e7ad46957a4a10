"""Where the custom op's host time over the plain call goes: one ``torch.ops.cula.kda_prefill`` call split into
torch's way in (argument parsing, dispatcher, the call into the Python body), the body's own steps (the call
signature, the plan lookup, the plan's run) and torch's way out, beside the same body called directly.

    python benchmarks/host_op_split_kda.py [--backend sm90|cutedsl|all] [--config "fixed B1 T512"] [--calls 200]
        [--out benchmarks/results/kda_host_op_split_h100.md]

The doors of ``host_doors_kda.py`` (the op by keyword, the op positional, the body directly) with time stamps
(``time.perf_counter_ns``) taken before the call, on entering and leaving the op's body, and around the three steps of
``cula.kda.kda_prefill``'s planned path (``call_signature``, ``lookup``, ``run_prefill_plan``, wrapped where
``cula.kda`` looks them up): every door carries the same stamps, so their differences are the doors' own. Calls are
issued while the GPU sleeps (``host_overhead_kda.GpuSleep``), so no call waits for it; each cell is the median over
``--calls`` calls of one part, in microseconds. A part that is slower inside the op than in the direct call is work
the dispatcher's thread state makes dearer; "in" and "out" are torch's alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = ("in", "signature", "lookup", "plan", "body rest", "out", "total")
DOORS = ("body directly", "op, keywords", "op, positional")
MODES = ("no_grad", "inference_mode")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="all", choices=("sm90", "cutedsl", "all"))
    parser.add_argument("--config", default="fixed B1 T512", help="a bench_kda_prefill.py config name")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default="benchmarks/results/kda_host_op_split_h100.md")
    return parser.parse_args()


class Stamps:
    """Named time stamps of the call being timed (``mark(name)``), cleared before each call."""

    def __init__(self) -> None:
        self.at: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.at[name] = time.perf_counter_ns()


def _wrap_steps(stamps: Stamps) -> None:
    """Stamp each step of ``cula.kda.kda_prefill``'s planned path where ``cula.kda`` looks the step up."""
    import cula.kda as kda

    def stamped(name: str, fn):
        def step(*args, **kwargs):
            stamps.mark(f"{name} start")
            result = fn(*args, **kwargs)
            stamps.mark(f"{name} end")
            return result
        return step

    for name, attr in (("signature", "call_signature"), ("lookup", "lookup"), ("plan", "run_prefill_plan")):
        setattr(kda, attr, stamped(name, getattr(kda, attr)))


def _doors(cfg, stamps: Stamps) -> dict:
    """The three doors' calls, each through a body that stamps its entry and exit."""
    import torch
    from bench_kda_prefill import make_inputs
    from host_doors_kda import _positional

    import cula.ops
    from cula.ops import SCHEMAS

    body = cula.ops._IMPLEMENTATIONS["kda_prefill"][0]

    def stamped_body(*args, **kwargs):
        stamps.mark("enter")
        result = body(*args, **kwargs)
        stamps.mark("leave")
        return result

    library = torch.library.Library("cula_split", "DEF")
    library.define("kda_prefill" + SCHEMAS["kda_prefill"])
    library.impl("kda_prefill", stamped_body, "CompositeExplicitAutograd")
    op = torch.ops.cula_split.kda_prefill
    kwargs = make_inputs(cfg)
    positional = _positional(op.default, kwargs)
    return library, {"body directly": lambda: stamped_body(**kwargs), "op, keywords": lambda: op(**kwargs),
                     "op, positional": lambda: op(*positional)}


def _parts(stamps: Stamps, start: int, end: int) -> dict[str, float]:
    at = stamps.at
    # (a step the call did not take, e.g. no plan yet, counts 0)
    steps = {name: (at.get(f"{name} end", 0) - at.get(f"{name} start", 0)) / 1e3
             for name in ("signature", "lookup", "plan")}
    body = (at["leave"] - at["enter"]) / 1e3
    return {"in": (at["enter"] - start) / 1e3, **steps, "body rest": body - sum(steps.values()),
            "out": (end - at["leave"]) / 1e3, "total": (end - start) / 1e3}


def measure(calls: dict, stamps: Stamps, n: int, sleep) -> dict[str, dict[str, float]]:
    """Per door, each part's median microseconds over ``n`` calls issued while the GPU sleeps."""
    import torch

    result = {}
    for door, call in calls.items():
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        samples: list[dict[str, float]] = []
        done = sleep.start(n * 0.5)
        for _ in range(n):
            stamps.at.clear()
            start = time.perf_counter_ns()
            call()
            end = time.perf_counter_ns()
            samples.append(_parts(stamps, start, end))
        busy = not done.query()
        torch.cuda.synchronize()
        result[door] = {part: statistics.median(s[part] for s in samples) for part in PARTS}
        result[door]["GPU busy"] = busy
    return result


def main() -> None:
    opts = parse()
    import os

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("host_op_split_kda.py needs a CUDA GPU")
    from bench_kda_prefill import environment, named_configs
    from host_overhead_kda import GpuSleep

    stamps = Stamps()
    _wrap_steps(stamps)
    (cfg,) = named_configs(opts.config)
    _library, calls = _doors(cfg, stamps)
    sleep = GpuSleep()
    lines = ["# The custom op's host time, split", "", *environment(),
             f"- config {cfg.name}; calls {opts.calls}", "",
             "Method: `benchmarks/host_op_split_kda.py`'s docstring. Medians in us over the calls; 'in' = call to "
             "the body's entry, 'out' = the body's exit to the return.", "",
             "| backend | mode | door | " + " | ".join(PARTS) + " | GPU busy |",
             "|---|---|---|" + "---|" * len(PARTS) + "---|"]
    for backend in ("sm90", "cutedsl") if opts.backend == "all" else (opts.backend,):
        os.environ["CULA_BACKEND"] = backend
        for mode in MODES:
            context = torch.no_grad if mode == "no_grad" else torch.inference_mode
            with context():
                rows = measure(calls, stamps, opts.calls, sleep)
            for door in DOORS:
                row = rows[door]
                lines.append(f"| {backend} | {mode} | {door} | " + " | ".join(f"{row[p]:.2f}" for p in PARTS)
                             + f" | {'yes' if row['GPU busy'] else 'no'} |")
            Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
