"""What a sequence's partial last chunk costs the sm90 intra kernel, against a full chunk (the H200).

    python benchmarks/tail_cost_kda.py [--seqs 80] [--full-chunks 3] [--tails 0,1,16,17,32,33,48,49,64]
                                       [--forms tensor,bands] [--reps 20] [--out FILE.md]

Each batch packs ``--seqs`` sequences of ``64 * full_chunks + tail`` tokens (H = HV = 64, K = V = 128, the
benchmark's flags and random inputs), so each tail adds one partial chunk per sequence and value head to the
``64 * full_chunks`` full ones. For each intra form (``intra_tuned`` of ``cula_sm90.kda.run_kernels``) and tail,
the intra kernel's GPU time (torch.profiler, mean of ``--reps`` calls) gives the cost of one tail item as a fraction
of one full item: ``(intra(tail) - intra(0)) / tails`` over ``intra(0) / full items``. The recurrence's time is
printed beside it (BV 128, ``CULA_SM90_PDL=0``). A microbenchmark for the partial-chunk work; it imports no FLA.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ["CULA_SM90_PDL"] = "0"  # (the two kernels' times apart)

import torch  # noqa: E402
from bench_kda_prefill import Config, make_inputs  # noqa: E402
from profile_kda import stage_times  # noqa: E402

HEADS = 64


def main() -> None:
    from cula_runtime.kda_args import validate_kda_prefill
    from cula_sm90.kda import run_kernels

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=80)
    parser.add_argument("--full-chunks", type=int, default=3)
    parser.add_argument("--tails", default="0,1,16,17,32,33,48,49,64")
    parser.add_argument("--forms", default="tensor,bands")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="")
    opts = parser.parse_args()
    tails = [int(x) for x in opts.tails.split(",")]
    if tails[0] != 0:
        raise SystemExit("--tails: the first must be 0 (the batch without partial chunks)")
    full_items = opts.seqs * opts.full_chunks * HEADS
    tail_items = opts.seqs * HEADS
    forms = opts.forms.split(",")
    rows: dict[str, list[str]] = {form: [] for form in forms}
    base: dict[str, float] = {}  # each form's intra time without partial chunks (the first tail, 0)
    for tail in tails:  # (each batch's inputs made once, for every form)
        n = 64 * opts.full_chunks + tail
        cfg = Config(f"{opts.seqs}x{n}", 1, opts.seqs * n, HEADS, HEADS, (n,) * opts.seqs)
        args = validate_kda_prefill(**make_inputs(cfg))
        for form in forms:
            t = stage_times(lambda a, bv, form=form: run_kernels(a, block_v=bv, intra_tuned=form), args, 128,
                            opts.reps, ("intra", "recurrence"))
            base.setdefault(form, t["intra"])
            ratio = (t["intra"] - base[form]) / tail_items / (base[form] / full_items) if tail else 0.0
            rows[form].append(f"| {form} | {tail} | {t['intra']:.1f} | {t['recurrence']:.1f} | {ratio:.2f} |")
            print(rows[form][-1], flush=True)
    lines = ["| form | tail tokens | intra us | recurrence us | tail item / full item |", "|---|---|---|---|---|"]
    lines += [row for form in forms for row in rows[form]]
    header = [
        "# sm90 intra kernel: the cost of a partial last chunk",
        "",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
        f"- command: `python benchmarks/tail_cost_kda.py {' '.join(sys.argv[1:])}`",
        f"- batches: {opts.seqs} sequences of 64 x {opts.full_chunks} + tail tokens, H = HV = {HEADS}; "
        f"{full_items} full items, plus {tail_items} tail items when tail > 0",
        "",
    ]
    if opts.out:
        Path(opts.out).write_text("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()
