"""A/B of kernel C of the Lightning prefill on a GPU at its two V blocks: the default, 128 (one 8-warp CTA per
segment and head), against 64 (two 4-warp CTAs), on the same inputs, bits compared and times taken (issue 28: V
block 64 stays selectable until it is timed at T = 1024, where the grid is smallest).

    python benchmarks/ab_lightning_block_v.py [--only "T1024,varlen"] [--reps 60] [--rounds 12]
        [--out benchmarks/results/lightning_block_v_ab_h100.md]

Per shape (:data:`SHAPES`: four at T = 1024, B1 T32768 H64, B2 T16384 H16, a packed batch of 10 sequences with
partial last chunks and one empty sequence, B1 T4096 H64; K = V = 128, bf16 q/k/v drawn from N(0, 1), FLA's decays
for layer 0 of 2 layers, scale K ** -0.5): the prefill backend's own steps up to kernel C (``prefill_backend.py``:
the segment table at its per-call ``seg_len``, kernel A's segment states and kernel B's scan from zero states, no
final state), then kernel C both ways on that ``seg_state``. Each output starts NaN-filled; the check is
``torch.equal`` on the bits (int16 views) of every output against the product's, and that every row was written (no
NaN left).

Times: the median of ``--reps`` CUDA-event timings of one launch each, taken in ``--rounds`` interleaved rounds
(the order rotated by one per round) after a warm-up; before each timed launch the GPU sleeps ~200 us at full
clock (``torch.cuda._sleep``), so the host's launch work is hidden and the events measure the kernel alone. The floor
is kernel C's own traffic at 4.3 TB/s (benchmarks/bench_kda_prefill.py's PEAK_BYTES): q, k, v read and o
written in bf16, and the NSEG · H start states read in fp32.

Prints a markdown table (and writes it to ``--out`` when given); exits 1 when any output's bits differ.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PEAK_BYTES = 4.3e12  # the H200 HBM figure of benchmarks/bench_kda_prefill.py
SLEEP_CYCLES = 400_000  # ~200 us at the H200's clocks: longer than one launch's host work
D = 128


@dataclass(frozen=True)
class Shape:
    """One A/B shape: ``lens`` the sequences' lengths (fixed length: B equal lengths, passed as [B, T]; varlen:
    packed into one row with ``cu_seqlens``)."""

    name: str
    lens: tuple[int, ...]
    heads: int
    varlen: bool = False


SHAPES = (
    Shape("B1 T1024 H64", (1024,), 64),
    Shape("B2 T1024 H64", (1024, 1024), 64),
    Shape("B1 T1024 H16", (1024,), 16),
    Shape("B2 T1024 H16", (1024, 1024), 16),
    Shape("B1 T32768 H64", (32768,), 64),
    Shape("B2 T16384 H16", (16384, 16384), 16),
    Shape("varlen 10 seqs T16384 H64 (tails, one empty)",
          (3001, 0, 4096, 1, 2047, 65, 1500, 777, 4800, 97), 64, varlen=True),
    Shape("B1 T4096 H64", (4096,), 64),
)


def select(shapes: tuple[Shape, ...], only: str | None) -> list[Shape]:
    """The shapes whose name contains one of the comma-separated ``only`` selectors (all without one)."""
    if not only:
        return list(shapes)
    wanted = [word.strip() for word in only.split(",") if word.strip()]
    return [shape for shape in shapes if any(word in shape.name for word in wanted)]


def floor_us(total_tokens: int, heads: int, nseg: int) -> float:
    """Kernel C's traffic floor in us: q, k, v in and o out (bf16), the start states in (fp32)."""
    token_bytes = 4 * total_tokens * heads * D * 2
    state_bytes = nseg * heads * D * D * 4
    return (token_bytes + state_bytes) / PEAK_BYTES * 1e6


def _kernel_times_us(fns: dict[str, Callable[[], None]], reps: int, rounds: int, warmup: int = 3) -> dict:
    """Median GPU time (us) of one call of each of ``fns``, interleaved rounds, the host's work hidden."""
    import torch

    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in names}
    per_round = -(-reps // rounds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(per_round):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(SLEEP_CYCLES)
                start.record()
                fns[name]()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def prepare(shape: Shape, seed: int = 0) -> dict:
    """The inputs of kernel C as the cutedsl prefill backend makes them for this shape: flattened q, k, v, the
    decays, the scan's start states, the segment table, ``seg_len`` and ``scale``."""
    import torch

    from cula_runtime.cute.lightning import chunk_states
    from cula_runtime.cute.lightning.prefill_backend import _flat, device_segments
    from cula_runtime.kda_tuning import recurrence_block_v, sm_count
    from cula_runtime.lightning_args import validate_lightning_prefill

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    H, total = shape.heads, sum(shape.lens)
    if shape.varlen:
        B, T = 1, total
        offsets = [0]
        for length in shape.lens:
            offsets.append(offsets[-1] + length)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    else:
        B, T = len(shape.lens), shape.lens[0]
        if any(length != T for length in shape.lens):
            raise ValueError(f"{shape.name}: a fixed-length shape needs equal lengths, got {shape.lens}")
        cu_seqlens = None
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    args = validate_lightning_prefill(q, k, v, layer_idx=0, num_layers=2, cu_seqlens=cu_seqlens)
    num_sms = sm_count(device)
    seg_len, segments, seq_segments = device_segments(B, T, H, args.cu_seqlens, device, num_sms, 0)
    nseg = segments.shape[0]
    seg_state = torch.empty(nseg, H, D, D, dtype=torch.float32, device=device)
    kf, vf = _flat(args.k), _flat(args.v)
    chunk_states._states_run(kf, vf, args.g_gamma, segments, seg_state, recurrence_block_v(nseg * H, num_sms))
    chunk_states._scan_run(seg_state, segments, seq_segments, args.g_gamma, None, None, args.state_v_first)
    torch.cuda.synchronize()
    return dict(q=_flat(args.q), k=kf, v=vf, g_gamma=args.g_gamma, seg_state=seg_state, segments=segments,
                seg_len=seg_len, scale=args.scale, nseg=nseg, total=total)


def contenders() -> dict[str, Callable]:
    """Kernel C by name: ``launch(inputs, o)`` at V block 128 (the default: the reference) and at 64."""
    from cula_runtime.cute.lightning import chunk_output

    def product(block_v: int) -> Callable:
        def run(x: dict, o) -> None:
            chunk_output.lightning_chunk_output(x["q"], x["k"], x["v"], x["g_gamma"], x["seg_state"], x["segments"],
                                                o, x["scale"], x["seg_len"], block_v=block_v)
        return run

    return {"bv128": product(128), "bv64": product(64)}


def measure(shape: Shape, reps: int, rounds: int) -> dict:
    """One shape's row: bits against the product's default, times, the floor."""
    import torch

    x = prepare(shape)
    runs = contenders()
    outputs = {}
    for name, run in runs.items():
        o = torch.full_like(x["v"], float("nan"))
        run(x, o)
        torch.cuda.synchronize()
        outputs[name] = o
    reference = next(iter(outputs))
    bits = {name: torch.equal(o.view(torch.int16), outputs[reference].view(torch.int16)) for name, o in outputs.items()}
    written = {name: not bool(torch.isnan(o).any()) for name, o in outputs.items()}
    buffers = {name: torch.empty_like(x["v"]) for name in runs}
    times = _kernel_times_us({name: (lambda run=run, o=buffers[name]: run(x, o)) for name, run in runs.items()},
                             reps, rounds)
    return dict(shape=shape.name, seg_len=x["seg_len"], nseg=x["nseg"], floor=floor_us(x["total"], shape.heads,
                x["nseg"]), times=times, bits=bits, written=written, reference=reference)


def table(rows: list[dict]) -> list[str]:
    """The markdown table of the measured rows."""
    names = list(rows[0]["times"]) if rows else []
    reference = rows[0]["reference"] if rows else ""
    head = ["shape", "seg_len", "NSEG", "floor us", *[f"{n} us" for n in names],
            *[f"{n} / {reference}" for n in names[1:]], "bv128 / floor", "bits equal", "every row written"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        t = row["times"]
        cells = [row["shape"], str(row["seg_len"]), str(row["nseg"]), f"{row['floor']:.1f}",
                 *[f"{t[n]:.1f}" for n in names], *[f"{t[n] / t[reference]:.3f}" for n in names[1:]],
                 f"{t['bv128'] / row['floor']:.2f}",
                 "yes" if all(row["bits"].values()) else "NO: " + ", ".join(n for n, ok in row["bits"].items()
                                                                           if not ok),
                 "yes" if all(row["written"].values()) else "NO: " + ", ".join(n for n, ok in row["written"].items()
                                                                              if not ok)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def environment() -> list[str]:
    """Where and how the table was made."""
    import torch

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return [
        f"- GPU: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
        f"- command: `python {' '.join(sys.argv)}`",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated substrings of shape names")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for shape in select(SHAPES, args.only):
        rows.append(measure(shape, args.reps, args.rounds))
        print(f"{datetime.datetime.now():%H:%M:%S} {shape.name}: "
              + ", ".join(f"{n} {t:.1f} us" for n, t in rows[-1]["times"].items()), flush=True)
    text = "\n".join(["# Lightning kernel C: V block 128 against 64", "", *environment(), "", *table(rows), ""])
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if all(all(row["bits"].values()) and all(row["written"].values()) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
