"""Determinism stress: replay one kda_prefill (or kda_decode) call many times and count outputs that differ by a
single bit.

    python benchmarks/stress_kda_determinism.py --backend sm90 --replays 1000000
    python benchmarks/stress_kda_determinism.py --backend cutedsl --op decode --replays 100000

Two problems, fixed length (B=2, T=1000, H=4, HV=8) and varlen (cu = [0, 1, 64, 65, 700, 700, 2000], H=2, HV=4),
bf16, safe gate in kernel, fp32 initial state. Each is captured in a CUDA graph of ``--per-graph`` calls, each
followed by a bitwise comparison with the first result, accumulated on the device; the host reads the count
once at the end. ``--op decode``: two cases of ``tests/gpu/test_kda_decode_gpu.py`` (Kimi's softplus gate at H = 32,
N = 4 with two padding rows; GVA packed lengths 0/1/2/5 on a V-first pool), each replay restoring the pool from a
copy, decoding into a fixed ``out`` and comparing o and the whole pool with the first call's. Writes a markdown
summary to ``--out`` (default: stdout only).
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


def replay(graph: torch.cuda.CUDAGraph, mismatches: torch.Tensor, replays: int, per_graph: int,
           ) -> tuple[int, int, float]:
    """Replay ``graph`` (``per_graph`` calls each) until at least ``replays`` calls ran; (calls, the device's count
    of differing outputs, read once at the end, wall seconds)."""
    rounds = -(-replays // per_graph)
    start = time.perf_counter()
    for _ in range(rounds):
        graph.replay()
    torch.cuda.synchronize()
    return rounds * per_graph, int(mismatches.item()), time.perf_counter() - start


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
    return replay(graph, mismatches, replays, per_graph)


# --op decode: cases of tests/gpu/test_kda_decode_gpu.py, by name
DECODE_PROBLEMS = {
    "decode H32 N4 T1 (2 padding rows), softplus gate, fp32 K-first pool": "kimi-H32-N4-T1",
    "decode GVA H2 HV8, packed 0/1/2/5, fp32 V-first pool": "gva-H2-HV8-packed-0-1-2-5-vfirst",
}


def stress_decode(name: str, replays: int, per_graph: int) -> tuple[int, int, float]:
    from cula.kda import kda_decode
    from tests.gpu.test_kda_decode_gpu import CASES, make_call

    call = make_call(next(c for c in CASES if c.name == name), seed=11)
    pool = call["state"]
    start = pool.clone()
    o0 = kda_decode(**call).clone()  # warm-up: compiles, makes the call plan
    after = pool.clone()
    out = torch.empty_like(o0)
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            pool.copy_(start)
            kda_decode(**call, out=out)
            mismatches += (out.view(torch.int16) != o0.view(torch.int16)).any().long()
            mismatches += (pool.view(torch.uint8) != after.view(torch.uint8)).any().long()
    return replay(graph, mismatches, replays, per_graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="sm90", choices=["sm90", "cutedsl", "reference"])
    parser.add_argument("--replays", type=int, default=1_000_000)
    parser.add_argument("--per-graph", type=int, default=100)
    parser.add_argument("--out", default="")
    parser.add_argument("--gate", default="safe", choices=["safe", "unbounded"],
                        help="the problems' gate: the safe lower-bound form, or the unbounded forms")
    parser.add_argument("--op", default="prefill", choices=["prefill", "decode"])
    args = parser.parse_args()
    os.environ["CULA_BACKEND"] = args.backend
    lines = [f"# kda_{args.op} determinism stress ({args.backend})", "",
             f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
             f"- command: `python {' '.join(sys.argv)}`", "",
             "| problem | replays | differing outputs (per call: o, final state; any bit) | wall s |",
             "|---|---|---|---|"]
    if args.op == "decode":
        runs = {name: (lambda c=case: stress_decode(c, args.replays, args.per_graph))
                for name, case in DECODE_PROBLEMS.items()}
    else:
        runs = {name: (lambda c=case: stress(c, args.replays, args.per_graph))
                for name, case in (PROBLEMS if args.gate == "safe" else UNBOUNDED_PROBLEMS).items()}
    for name, run in runs.items():
        done, bad, wall = run()
        lines.append(f"| {name} | {done} | {bad} | {wall:.1f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
