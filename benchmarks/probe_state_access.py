"""Does the K-first decode's access pattern cost bandwidth by itself? An in-place pass over a decode pool's states
(``s <- 0.5 s + 1``, read and written once) in seven CTA shapes, beside torch's own in-place pass (issues 26, 28).

    python benchmarks/probe_state_access.py [--heads 64] [--batch 128,512] [--reps 30]
        [--out benchmarks/results/decode_state_access_probe_h100.md]

The decode kernels (``cute/kda/decode.py``, ``cute/lightning/decode.py``) give a K-first ``[K, V]`` state of a small
pool four CTAs, each one 128-byte line of every K row: 128 lines at a 512-byte stride (fp32; bf16: two CTAs, 128-byte
lines at a 256-byte stride), and take whole rows from 128 MiB of state per step; V-first CTAs read 16 KB that are
contiguous. On a lent H100 the K-first step was 1.08-1.09x an in-place pass over the same bytes and the V-first step
1.03x (``lightning_decode_caps_ab_h100.md``); at whole rows 1.05-1.15x (``decode_k_first_lines_ab_h100.md``). This
probe moves the same bytes with nothing else in the kernel (Triton, one state block per program, 4 warps unless
said):

- ``strips``: program = (state, 32-byte strip), ``[128 rows, 32 bytes]`` at the row stride, one warp: the shape of a
  K-first layout whose warps each hold all 128 rows of a few columns (its reduction over K inside the warp, no
  exchange), each row piece one 32-byte sector;
- ``lines``: the K-first decode's one-line shape: program = (state, line), ``[128 rows, 128 bytes]`` at the row
  stride; ``lines by slot``: the same with the state found as the decode finds it, sequence ``n``'s heads at pool
  entry ``slots[n]`` (a random permutation), one dependent int32 load before the state's (what a CTA's wait for its
  start slot costs: no state bytes in flight meanwhile);
- ``two lines``: program = (state, half): 256 contiguous bytes of every K row, 8 warps;
- ``contiguous``: program = (state, quarter): 32 whole K rows (fp32; bf16: 64), the same bytes per program, contiguous;
- ``whole state``: program = one state (64 KB fp32, 32 KB bf16), 16 warps; ``whole state by slot``: found by slot;
- ``torch``: ``pool.mul_(0.5)``, one in-place pass (the yardstick of ``ab_lightning_decode_caps.py``).

Per row: the mean time of ``--reps`` calls queued back to back between CUDA events
(``host_overhead_kda.back_to_back_us``), the median over interleaved rounds, and the ratio to torch's pass. Run on
an H100 (``decode_state_access_probe_h100.md``, before ``strips``): ``lines`` 1.05-1.06x, the others 1.00-1.02x. If
``strips`` is near 1.00x too, a K-first layout whose warps reduce over K alone (as V-first's do) is a lever for the
rest of the K-first step's excess (its exchange and barrier); if not, that layout would trade one cost for another.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

K = V = 128


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--batch", default="128,512")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/decode_state_access_probe_h100.md")
    return parser.parse_args()


def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def block_pass(pool, slots, ROWS: tl.constexpr, COLS: tl.constexpr, PARTS: tl.constexpr, BY_LINE: tl.constexpr,
                   BY_SLOT: tl.constexpr, HEADS: tl.constexpr, STATE_K: tl.constexpr, STATE_V: tl.constexpr):
        """One program: part ``pid % PARTS`` of state ``pid // PARTS`` ([STATE_K, STATE_V]), a [ROWS, COLS] block,
        in place; ``BY_SLOT``: state (n, h) is read at pool entry ``(slots[n], h)``, ``slots`` int32 ``[N]`` (the
        decode's start slots: one dependent load before the state's)."""
        pid = tl.program_id(0)
        state = pid // PARTS
        part = pid % PARTS
        if BY_SLOT:
            state = tl.load(slots + state // HEADS) * HEADS + state % HEADS
        rows = tl.arange(0, ROWS)[:, None]
        cols = tl.arange(0, COLS)[None, :]
        if BY_LINE:  # every K row, the part's columns
            offsets = rows * STATE_V + part * COLS + cols
        else:  # the part's K rows, every column
            offsets = (part * ROWS + rows) * STATE_V + cols
        ptrs = pool + state.to(tl.int64) * (STATE_K * STATE_V) + offsets
        x = tl.load(ptrs)
        tl.store(ptrs, (x.to(tl.float32) * 0.5 + 1.0).to(x.dtype))

    return block_pass


def forms(dtype) -> dict[str, tuple]:
    """name -> (ROWS, COLS, PARTS, BY_LINE, BY_SLOT, num_warps)."""
    import torch

    line = 128 // torch.tensor([], dtype=dtype).element_size()  # columns in a 128-byte line
    parts = V // line
    return {"strips": (K, line // 4, 4 * parts, True, False, 1), "lines": (K, line, parts, True, False, 4),
            "lines by slot": (K, line, parts, True, True, 4),
            "two lines": (K, 2 * line, parts // 2, True, False, 8),
            "contiguous": (K // parts, V, parts, False, False, 4),
            "whole state": (K, V, 1, False, False, 16), "whole state by slot": (K, V, 1, False, True, 16)}


def probe(block_pass, dtype, N: int, opts: argparse.Namespace) -> list[str]:
    """The table rows of one pool (N states of ``opts.heads`` heads in ``dtype``)."""
    import torch
    from host_overhead_kda import back_to_back_us

    pool = torch.randn(N, opts.heads, K, V, device="cuda").to(dtype)
    slots = torch.randperm(N, generator=torch.Generator().manual_seed(0)).to(torch.int32).cuda()
    states = N * opts.heads
    calls = {"torch": lambda: pool.mul_(0.5)}
    for name, (rows, cols, parts, by_line, by_slot, warps) in forms(dtype).items():
        calls[name] = (lambda rows=rows, cols=cols, parts=parts, by_line=by_line, by_slot=by_slot, warps=warps:
                       block_pass[(states * parts,)](pool, slots, rows, cols, parts, by_line, by_slot, opts.heads, K, V,
                                                     num_warps=warps))
    for call in calls.values():  # compile, warm up
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(opts.rounds):
        for name, call in calls.items():
            times[name].append(back_to_back_us(call, opts.reps))
    us = {name: statistics.median(t) for name, t in times.items()}
    nbytes = 2 * pool.numel() * pool.element_size()
    pool_name = str(dtype).removeprefix("torch.")
    return [f"| {pool_name} | {N} | {opts.heads} | {nbytes / 1e6:.0f} | {name} | {us[name]:.1f} | "
            f"{us[name] / us['torch']:.3f} | {nbytes / us[name] / 1e3:.0f} |" for name in calls]


def main() -> None:
    opts = parse()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("probe_state_access.py needs a CUDA GPU")
    from bench_kda_prefill import environment

    block_pass = kernels()
    lines = ["# An in-place pass over decode states in seven CTA shapes (K-first access probe)", "", *environment(),
             "",
             "Method: `benchmarks/probe_state_access.py`'s docstring. us = median over rounds of the mean time of "
             "`--reps` calls queued back to back between CUDA events; x torch = over `pool.mul_(0.5)` on the same "
             "pool.", "",
             "| pool | N | H | MB (read + written) | form | us | x torch | GB/s |", "|---|---|---|---|---|---|---|---|"]
    for dtype in (torch.float32, torch.bfloat16):
        for N in (int(x) for x in opts.batch.split(",")):
            lines += probe(block_pass, dtype, N, opts)
            Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
