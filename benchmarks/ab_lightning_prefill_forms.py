"""The cutedsl Lightning prefill's forms side by side on a GPU (issue 28): the three launches over segments (kernels
A, B, C) against the direct form (kernel C alone, each sequence one segment from its initial to its final state) in
8-warp CTAs (V block 128) and in half-V CTAs (V block 64, two 4-warp CTAs per sequence and head), on
bench_lightning.py's prefill rows, a few serving-like packed batches, and rows that load the half-V CTAs to other
ratios (the longest sequence over the tokens per SM) than B1 H64's 2.06.

    python benchmarks/ab_lightning_prefill_forms.py [--only "varlen,B2 T1024"] [--out FILE.md] [--reps 30]

Per row: the backend on validated arguments (what ``cula.lightning.lightning_prefill`` runs after dispatch) with
``direct=False`` ("segments", the per-call seg_len), ``direct=True`` at ``direct_block_v`` 128 ("direct") and 64
("direct64"), and the per-call rule ("auto", which the table names), bench_lightning.py's inputs (bf16 q/k/v, fp32
h0, final states out, FLA's layer-0 decays). Time = median of CUDA-event timings of eager calls in interleaved
rounds (``bench_kda_prefill.interleaved_ms``); floor = bench_lightning.py's bytes floor at 4.3 TB/s. "same o": the
direct form's outputs against the segments form's, bit for bit (they are the same bits where the per-call seg_len
cuts no sequence), and direct64's against direct's (always the same bits); the errors: rel. L2 of o and of the final
states against the fp64 recurrence on two heads (the first and the last). A timing decides the rule
(``prefill_backend.uses_direct_form``, ``choose_direct_block_v``); nothing here is asserted.
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
# the half-V CTAs at other load ratios (132 SMs): (B, T, H, lens or None); B1 H56 2.36, B1 H48 2.75, a packed pair
# [12288, 4096] at H32 3.09, B1 H40 3.30 (all at most 132 half-V CTAs)
HALF_V_LOADS = ((1, 16384, 56, None), (1, 16384, 48, None), (1, 16384, 32, (12288, 4096)), (1, 16384, 40, None))
# the backend's form arguments per contender
FORMS = {"segments": dict(direct=False), "direct": dict(direct=True, direct_block_v=128),
         "direct64": dict(direct=True, direct_block_v=64), "auto": {}}


def rows() -> list[tuple[str, PrefillCase]]:
    """bench_lightning.py's prefill rows, then the serving-like packed batches, then the half-V load rows."""
    serving = [PrefillCase(1, T, H, _varlen(T, n, "random", seed=T + n + H)) for T, n, H in SERVING]
    loads = [PrefillCase(B, T, H, lens) for B, T, H, lens in HALF_V_LOADS]
    return ([(case.name, case) for case in prefill_cases()] + [(f"{case.name} (serving)", case) for case in serving]
            + [(f"{case.name} (half-V load)", case) for case in loads])


def is_selected(name: str, only: str) -> bool:
    """Whether a row named ``name`` contains one of the comma-separated substrings of ``only`` (every row does where
    ``only`` is empty): the A/B scripts' ``--only``."""
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    return not wanted or any(s in name for s in wanted)


def selected_rows(only: str) -> list[tuple[str, PrefillCase]]:
    """:func:`rows` selected by ``only`` (:func:`is_selected`)."""
    return [(name, case) for name, case in rows() if is_selected(name, only)]


def report_head(title: str, legend: str, columns: list[str], sms: int) -> list[str]:
    """A results file's first lines: the title, the environment, the SM count, the legend and the table's head."""
    return [f"# {title}", "", *environment(), f"- {sms} SMs", "", legend, "", "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns)]


def add_row(lines: list[str], row: str, out: str) -> None:
    """Print a table row and rewrite the results file with it (a cut run keeps the rows it made)."""
    print(row, flush=True)
    lines.append(row)
    Path(out).write_text("\n".join(lines) + "\n")


def ab_parser(doc: str, default_out: str) -> argparse.ArgumentParser:
    """The A/B scripts' common options (``--only``, ``--out``, ``--reps``, ``--rounds``); each adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated substrings of row names")
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    return parser


def forms_side_by_side(args, inp, case: PrefillCase, forms: dict[str, dict], checked: tuple[str, ...],
                       opts: argparse.Namespace) -> tuple[dict, dict, dict]:
    """``(ms, outs, errs)``: the cutedsl backend on validated ``args`` in each of ``forms`` (name -> its keyword
    arguments), ms per eager call in interleaved rounds; the ``(o, final_state)`` of the ``checked`` forms (one call
    each, before the timing) and their errors against the fp64 recurrence of ``inp`` on heads 0 and H-1."""
    from cula_runtime.cute.lightning import prefill_backend as pb

    runs = {form: (lambda a=args, f=how: pb.lightning_prefill_cutedsl_backend(a, **f)) for form, how in forms.items()}
    outs = {form: runs[form]() for form in checked}
    ms = interleaved_ms(runs, opts.reps, opts.rounds)
    heads = [0, case.H - 1]
    ref = prefill_reference(inp, heads)
    return ms, outs, {form: errors(*outs[form], ref, heads) for form in checked}


def main() -> None:
    opts = ab_parser(__doc__, "benchmarks/results/lightning_prefill_forms_ab.md").parse_args()

    from cula_runtime.cute.lightning import prefill_backend as pb
    from cula_runtime.kda_tuning import sm_count
    from cula_runtime.lightning_args import validate_lightning_prefill

    device = torch.device("cuda")
    sms = sm_count(device)
    lines = report_head(
        "The cutedsl Lightning prefill's forms side by side (issue 28)",
        "us = median CUDA-event time of eager calls, interleaved rounds; auto = the per-call rule's form "
        "(`uses_direct_form`; direct64: in half-V CTAs, `choose_direct_block_v`); x / segments < 1: x is faster; "
        "same o: direct's against segments', direct64's against direct's; errors: rel. L2 against fp64 on heads 0 "
        "and H-1 (segments, direct, direct64).",
        ["row", "seg_len", "auto", "floor us", "segments us", "direct us", "direct64 us", "auto us",
         "direct / segments", "direct64 / segments", "same o", "o err", "state err"], sms)
    warm_up_gpu(3.0)
    for name, case in selected_rows(opts.only):
        inp = make_prefill_inputs(case)
        args = validate_lightning_prefill(**cula_prefill_kwargs(inp))
        table = pb.device_segments(case.B, case.T, case.H, inp.cu32, device, sms)
        forms = ("segments", "direct", "direct64")
        ms, outs, errs = forms_side_by_side(args, inp, case, FORMS, forms, opts)
        same = ["yes" if torch.equal(outs[a][0], outs[b][0]) else "no"
                for a, b in (("direct", "segments"), ("direct64", "direct"))]
        auto = f"direct{64 if table.block_v == 64 else ''}" if table.direct else "segments"
        row = (f"| {name} | {table.seg_len} | {auto} | {floor_us(prefill_floor_bytes(case)):.1f} | "
               + " | ".join(f"{ms[form] * 1e3:.1f}" for form in (*forms, "auto")) + " | "
               f"{ms['direct'] / ms['segments']:.3f} | {ms['direct64'] / ms['segments']:.3f} | {', '.join(same)} | "
               + ", ".join(f"{errs[form]['err_o']:.3e}" for form in forms) + " | "
               + ", ".join(f"{errs[form]['err_state']:.3e}" for form in forms) + " |")
        add_row(lines, row, opts.out)


if __name__ == "__main__":
    main()
