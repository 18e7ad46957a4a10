"""Determinism stress for Lightning Attention: replay a CUDA graph of ``cula.lightning`` calls many times and count
the calls whose outputs differ from the first call's by a single bit.

    python benchmarks/stress_lightning_determinism.py [--backend cutedsl] [--replays 100000] [--only prefill]
        [--out FILE.md]

Problems (K = V = 128, bf16 q/k/v, FLA's decays for layer 0 of 2):

* ``prefill fixed B2 T1000 H4``: fp32 initial states, the final states out;
* ``prefill varlen 6 seqs H4``: cu = [0, 1, 64, 65, 700, 700, 2000] (an empty sequence, one-token ones, tails);
* ``prefill pool 6 seqs H4``: the same batch on an fp32 pool of 13 slots (a padding row, one without an initial
  state); the pool is restored from a copy inside the graph before each call, so every call starts alike;
* ``prefill direct 40 seqs H4 pool``: a packed batch the per-call rule sends to the direct form
  (``tools/sanitize_lightning.py``'s ``WIDE_BOUNDS``) on a bf16 V-first pool of 81 slots (padding rows, a False
  has_initial_state), restored the same way;
* ``prefill direct64 3 seqs H32 pool``: a packed batch the per-call rule sends to the direct form's half-V CTAs on
  132 SMs (``tools/sanitize_lightning.py``'s ``HALF_V_BOUNDS``: an empty sequence, two of 500 tokens) on a bf16
  V-first pool of 7 slots (the empty sequence's a padding row), restored the same way;
* ``decode fp32 kfirst N32 H8`` and ``decode bf16 vfirst N8 H8`` (two padding rows each, negative slots): one step
  on a pool restored the same way, o into a given buffer.

Each problem is captured in a CUDA graph of ``--per-graph`` calls, each followed by a bitwise comparison of its
outputs (o, and the final states or the pool's slots) with the first eager call's, accumulated on the device; the
host reads the count once at the end. Writes a markdown summary to ``--out`` (default: stdout only).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stress_kda_determinism import replay  # noqa: E402

from tools.sanitize_lightning import HALF_V_BOUNDS, HALF_V_HEADS, WIDE_BOUNDS  # noqa: E402

K = V = 128
PROBLEMS = ("prefill fixed B2 T1000 H4", "prefill varlen 6 seqs H4", "prefill pool 6 seqs H4",
            "prefill direct 40 seqs H4 pool", "prefill direct64 3 seqs H32 pool", "decode fp32 kfirst N32 H8",
            "decode bf16 vfirst N8 H8")
CU = (0, 1, 64, 65, 700, 700, 2000)
DEVICE = "cuda"  # (the CPU test of the problems' calls sets "cpu")


def _g_gamma(H: int) -> torch.Tensor:
    return -(8 / H * (1 - 0 / 2)) * torch.arange(H, dtype=torch.float, device=DEVICE)


def make_step(name: str, seed: int = 11) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A zero-argument call of problem ``name`` returning the tensors to compare; capturable (no host sync after
    its first call, which fills the caches)."""
    from cula.lightning import lightning_decode, lightning_prefill

    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)

    scale = K ** -0.5
    if name.startswith("prefill"):
        half_v = "direct64" in name  # the direct form's half-V batch, on a bf16 V-first pool
        wide = "direct" in name  # the direct form's wide batch (or the half-V one), on a bf16 V-first pool
        H = HALF_V_HEADS if half_v else 4
        bounds = HALF_V_BOUNDS if half_v else WIDE_BOUNDS if wide else CU
        if "fixed" in name:
            B, T, cu = 2, 1000, None
        else:
            B, T, cu = 1, bounds[-1], torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
        N = B if cu is None else len(bounds) - 1
        q, k, v = (randn(B, T, H, K) for _ in range(3))
        g = _g_gamma(H)
        if "pool" not in name:
            h0 = randn(N, H, K, V, dtype=torch.float32)
            return lambda: lightning_prefill(q, k, v, g, scale=scale, initial_state=h0, output_final_state=True,
                                             cu_seqlens=cu)
        pool = randn(2 * N + 1, H, K, V, dtype=torch.bfloat16 if wide else torch.float32)
        pristine = pool.clone()
        slots = [2 * n + 1 for n in range(N)] if wide else [4, 0, -1, 9, 12, 2]
        flags = [n != 3 for n in range(N)]
        if half_v:
            slots[0] = -1  # the empty sequence: a padding row
        elif wide:
            slots[1], slots[4] = -1, -7  # padding rows (negative: the CPU test's reference is strict past the pool)
        idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        has = torch.tensor(flags, device=DEVICE)

        def pooled() -> tuple[torch.Tensor, ...]:
            pool.copy_(pristine)
            o, _ = lightning_prefill(q, k, v, g, scale=scale, cu_seqlens=cu, state=pool, state_indices=idx,
                                     has_initial_state=has, state_v_first=wide)
            return o, pool
        return pooled
    H = 8
    N = int(name.split(" N")[1].split()[0])
    v_first = "vfirst" in name
    pool = randn(2 * N + 1, H, K, V, dtype=torch.bfloat16 if "bf16" in name else torch.float32)
    pristine = pool.clone()
    idx = torch.randperm(2 * N + 1, generator=gen, device=DEVICE)[:N].to(torch.int32)
    if N >= 8:
        idx[1], idx[5] = -1, -2  # padding rows (tools/sanitize_lightning.py has one past the pool)
    q, k, v = (randn(N, 1, H, K) for _ in range(3))
    g = _g_gamma(H)
    out = torch.empty(N, 1, H, V, dtype=torch.bfloat16, device=DEVICE)

    def step() -> tuple[torch.Tensor, ...]:
        pool.copy_(pristine)
        lightning_decode(q, k, v, g, scale=scale, state=pool, state_indices=idx, state_v_first=v_first, out=out)
        return out, pool
    return step


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def stress(name: str, replays: int, per_graph: int) -> tuple[int, int, float]:
    """Calls replayed, calls whose outputs differed from the first call's, wall seconds of the replays."""
    step = make_step(name)
    first = [t.clone() for t in step() if t is not None]  # compiles, fills the index caches
    torch.cuda.synchronize()
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (a warm-up call on a side stream before capture, as torch's docs advise)
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            outs = [t for t in step() if t is not None]
            differs = torch.zeros((), dtype=torch.bool, device="cuda")
            for got, want in zip(outs, first, strict=True):
                differs |= (_bits(got) != _bits(want)).any()
            mismatches += differs.long()
    return replay(graph, mismatches, replays, per_graph)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cutedsl", choices=["cutedsl", "reference"])
    parser.add_argument("--replays", type=int, default=100_000)
    parser.add_argument("--per-graph", type=int, default=100)
    parser.add_argument("--only", default="", help="comma-separated substrings of the problems' names")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    os.environ["CULA_BACKEND"] = args.backend
    lines = [f"# cula.lightning determinism stress ({args.backend})", "",
             f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
             f"- command: `python {' '.join(sys.argv)}`", "",
             "| problem | replays | differing calls (o and the final states / the pool; any bit) | wall s |",
             "|---|---|---|---|"]
    for name in PROBLEMS:
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        done, bad, wall = stress(name, args.replays, args.per_graph)
        lines.append(f"| {name} | {done} | {bad} | {wall:.1f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
