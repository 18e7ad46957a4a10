"""The cutedsl Lightning prefill's two forms side by side on a GPU (issue 28): the three launches over segments
(kernels A, B, C) against the direct form (kernel C alone, each sequence one segment from its initial to its final
state), on bench_lightning.py's prefill rows and a few serving-like packed batches.

    python benchmarks/ab_lightning_prefill_forms.py [--only "varlen,B2 T1024"] [--out FILE.md] [--reps 30]

Per row: the backend on validated arguments (what ``cula.lightning.lightning_prefill`` runs after dispatch) with
``direct=False`` ("segments", the per-call seg_len), ``direct=True`` ("direct") and the per-call rule ("auto", which
the table names), bench_lightning.py's inputs (bf16 q/k/v, fp32 h0, final states out, FLA's layer-0 decays).
Time = median of CUDA-event timings of eager calls in interleaved rounds (``bench_kda_prefill.interleaved_ms``);
floor = bench_lightning.py's bytes floor at 4.3 TB/s. "same o": the direct form's outputs against the segments
form's, bit for bit (they are the same bits where the per-call seg_len cuts no sequence); the errors: rel. L2 of o
and of the final states against the fp64 recurrence on two heads (the first and the last). A timing decides the
rule (``prefill_backend.uses_direct_form``); nothing here is asserted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_kda_prefill import _varlen, environment, interleaved_ms, warm_up_gpu  # noqa: E402
from bench_lightning import (  # noqa: E402
    PrefillCase,
    cula_prefill_kwargs,
    errors,
    floor_us,
    make_prefill_inputs,
    prefill_cases,
    prefill_floor_bytes,
    prefill_reference,
)

# packed batches of many short sequences (a serving engine's chunked prefill): (total tokens, sequences, H)
SERVING = ((8192, 64, 16), (8192, 32, 64), (16384, 24, 64), (4096, 128, 8))
FORMS = {"segments": False, "direct": True, "auto": None}  # the backend's ``direct`` per contender


def rows() -> list[tuple[str, PrefillCase]]:
    """bench_lightning.py's prefill rows, then the serving-like packed batches."""
    serving = [PrefillCase(1, T, H, _varlen(T, n, "random", seed=T + n + H)) for T, n, H in SERVING]
    return [(case.name, case) for case in prefill_cases()] + [(f"{case.name} (serving)", case) for case in serving]


def selected_rows(only: str) -> list[tuple[str, PrefillCase]]:
    """:func:`rows` whose names contain one of the comma-separated substrings of ``only`` (all where it is empty)."""
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    return [(name, case) for name, case in rows() if not wanted or any(s in name for s in wanted)]


def report_head(title: str, legend: str, columns: list[str], sms: int) -> list[str]:
    """A results file's first lines: the title, the environment, the SM count, the legend and the table's head."""
    return [f"# {title}", "", *environment(), f"- {sms} SMs", "", legend, "", "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns)]


def add_row(lines: list[str], row: str, out: str) -> None:
    """Print a table row and rewrite the results file with it (a cut run keeps the rows it made)."""
    print(row, flush=True)
    lines.append(row)
    Path(out).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated substrings of row names")
    parser.add_argument("--out", default="benchmarks/results/lightning_prefill_forms_ab.md")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()

    from cula_runtime.cute.lightning import prefill_backend as pb
    from cula_runtime.kda_tuning import sm_count
    from cula_runtime.lightning_args import validate_lightning_prefill

    device = torch.device("cuda")
    sms = sm_count(device)
    lines = report_head(
        "The cutedsl Lightning prefill's two forms side by side (issue 28)",
        "us = median CUDA-event time of eager calls, interleaved rounds; auto = the per-call rule's form "
        "(`uses_direct_form`); direct / segments < 1: the direct form is faster; errors: rel. L2 against fp64 on "
        "heads 0 and H-1.",
        ["row", "seg_len", "auto", "floor us", "segments us", "direct us", "auto us", "direct / segments", "same o",
         "o err segments, direct", "state err segments, direct"], sms)
    warm_up_gpu(3.0)
    for name, case in selected_rows(opts.only):
        inp = make_prefill_inputs(case)
        args = validate_lightning_prefill(**cula_prefill_kwargs(inp))
        table = pb.device_segments(case.B, case.T, case.H, inp.cu32, device, sms)
        runs = {form: (lambda a=args, d=direct: pb.lightning_prefill_cutedsl_backend(a, direct=d))
                for form, direct in FORMS.items()}
        outs = {form: runs[form]() for form in ("segments", "direct")}
        ms = interleaved_ms(runs, opts.reps, opts.rounds)
        heads = [0, case.H - 1]
        ref = prefill_reference(inp, heads)
        errs = {form: errors(*outs[form], ref, heads) for form in outs}
        same = torch.equal(outs["direct"][0], outs["segments"][0])
        row = (f"| {name} | {table.seg_len} | {'direct' if table.direct else 'segments'} | "
               f"{floor_us(prefill_floor_bytes(case)):.1f} | {ms['segments'] * 1e3:.1f} | {ms['direct'] * 1e3:.1f} | "
               f"{ms['auto'] * 1e3:.1f} | {ms['direct'] / ms['segments']:.3f} | {'yes' if same else 'no'} | "
               f"{errs['segments']['err_o']:.3e}, {errs['direct']['err_o']:.3e} | "
               f"{errs['segments']['err_state']:.3e}, {errs['direct']['err_state']:.3e} |")
        add_row(lines, row, opts.out)


if __name__ == "__main__":
    main()
