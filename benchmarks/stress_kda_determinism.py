"""Determinism stress: replay one kda_prefill call many times and count outputs that differ by a single bit.

    python benchmarks/stress_kda_determinism.py --backend sm90 --replays 1000000

Two problems, fixed length (B=2, T=1000, H=4, HV=8) and varlen (cu = [0, 1, 64, 65, 700, 700, 2000], H=2, HV=4),
bf16, safe gate in kernel, fp32 initial state. Each is captured in a CUDA graph of ``--per-graph`` calls, each
followed by a bitwise comparison with the first result, accumulated on the device; the host reads the count
once at the end. Writes a markdown summary to ``--out`` (default: stdout only).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.kda_cases import KdaCase, make_inputs  # noqa: E402

PROBLEMS = {
    "fixed B2 T1000 H4 HV8": KdaCase("stress-fixed", B=2, T=1000, H=4, HV=8),
    "varlen 6 seqs H2 HV4": KdaCase("stress-varlen", B=1, T=2000, H=2, HV=4, cu=(0, 1, 64, 65, 700, 700, 2000)),
}
# --gate unbounded: the same shapes with the unbounded gate forms (issue 25): Kimi-Linear's softplus gate in kernel
# (fixed) and its precomputed fp32 gate (varlen)
UNBOUNDED_PROBLEMS = {
    "fixed B2 T1000 H4 HV8, softplus gate": KdaCase("stress-fixed-kimi", B=2, T=1000, H=4, HV=8, gate="kimi"),
    "varlen 6 seqs H2 HV4, fp32 Kimi gate": KdaCase("stress-varlen-kimi", B=1, T=2000, H=2, HV=4,
                                                    cu=(0, 1, 64, 65, 700, 700, 2000), gate="kimi",
                                                    gate_in_kernel=False),
}


def stress(case: KdaCase, replays: int, per_graph: int) -> tuple[int, int, float]:
    from cula.kda import kda_prefill

    kwargs = make_inputs(case, "cuda", seed=11)
    o0, ht0 = kda_prefill(**kwargs)  # warm-up: compiles, fills the index caches (no sync inside the graph)
    o0, ht0 = o0.clone(), ht0.clone()
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            o, ht = kda_prefill(**kwargs)
            mismatches += (o.view(torch.int16) != o0.view(torch.int16)).any().long()
            mismatches += (ht.view(torch.int32) != ht0.view(torch.int32)).any().long()
    rounds = -(-replays // per_graph)
    start = time.perf_counter()
    for _ in range(rounds):
        graph.replay()
    torch.cuda.synchronize()
    return rounds * per_graph, int(mismatches.item()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sm90", choices=["sm90", "cutedsl", "reference"])
    parser.add_argument("--replays", type=int, default=1_000_000)
    parser.add_argument("--per-graph", type=int, default=100)
    parser.add_argument("--out", default="")
    parser.add_argument("--gate", default="safe", choices=["safe", "unbounded"],
                        help="the problems' gate: the safe lower-bound form, or the unbounded forms")
    args = parser.parse_args()
    os.environ["CULA_BACKEND"] = args.backend
    lines = [f"# kda_prefill determinism stress ({args.backend})", "",
             f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
             f"- command: `python {' '.join(sys.argv)}`", "",
             "| problem | replays | differing outputs (per call: o, final state; any bit) | wall s |",
             "|---|---|---|---|"]
    for name, case in (PROBLEMS if args.gate == "safe" else UNBOUNDED_PROBLEMS).items():
        done, bad, wall = stress(case, args.replays, args.per_graph)
        lines.append(f"| {name} | {done} | {bad} | {wall:.1f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
