"""The cutedsl Lightning prefill over segments, with and without lever 5 of ``docs/lightning_notes.md``, side by side
on a GPU (issue 28): kernel A skipping each sequence's last segment and kernel C's last segments writing the final
states ("finals in C", the candidate) against kernel A computing every segment's state and kernel B writing every
final state ("finals in B", ``prefill_backend.FINALS_IN_C = False``, the default until this is timed).

    python benchmarks/ab_lightning_last_segment.py [--only "B2 T16384,H16"] [--out FILE.md] [--reps 30]

Rows: ``ab_lightning_prefill_forms.py``'s (bench_lightning.py's prefill rows, serving-like packed batches, the half-V
load rows), each forced over segments (``direct=False``, the per-call seg_len), with bench_lightning.py's inputs (fp32
h0, the final states out). Time = median of CUDA-event timings of eager calls in interleaved rounds
(``bench_kda_prefill.interleaved_ms``); floor = bench_lightning.py's bytes floor at 4.3 TB/s. "same o": o bit for bit
(the lever moves no output's arithmetic: expected "yes"); the errors: rel. L2 of o and of the final states against
the fp64 recurrence on heads 0 and H-1 (finals in C: kernel C's FFMA state step, as the direct form's). Segments per
sequence: the lever saves kernel A 1 / that of its k and v bytes. Nothing is asserted.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from ab_lightning_prefill_forms import ab_parser, add_row, forms_side_by_side, report_head, selected_rows  # noqa: E402
from bench_kda_prefill import warm_up_gpu  # noqa: E402
from bench_lightning import cula_prefill_kwargs, floor_us, make_prefill_inputs, prefill_floor_bytes  # noqa: E402

# the backend's form arguments per contender
FORMS = {"finals in C": dict(direct=False, finals_in_c=True), "finals in B": dict(direct=False, finals_in_c=False)}


def main() -> None:
    opts = ab_parser(__doc__, "benchmarks/results/lightning_last_segment_ab.md").parse_args()

    from cula_runtime.cute.lightning import prefill_backend as pb
    from cula_runtime.kda_tuning import sm_count
    from cula_runtime.lightning_args import validate_lightning_prefill

    device = torch.device("cuda")
    sms = sm_count(device)
    lines = report_head(
        "The Lightning prefill over segments: final states from kernel C or kernel B (issue 28, lever 5)",
        "us = median CUDA-event time of eager calls over segments, interleaved rounds; C / B < 1: finals in C is "
        "faster; same o: bit for bit; errors: rel. L2 against fp64 on heads 0 and H-1 (finals in C, finals in B).",
        ["row", "seg_len", "segments per sequence", "floor us", "finals in C us", "finals in B us", "C / B",
         "same o", "o err", "state err"], sms)
    warm_up_gpu(3.0)
    for name, case in selected_rows(opts.only):
        inp = make_prefill_inputs(case)
        args = validate_lightning_prefill(**cula_prefill_kwargs(inp))
        table = pb.device_segments(case.B, case.T, case.H, inp.cu32, device, sms, direct=False)
        N = table.seq_segments.shape[0] - 1
        ms, outs, errs = forms_side_by_side(args, inp, case, FORMS, tuple(FORMS), opts)
        c, b = ms["finals in C"], ms["finals in B"]
        same = "yes" if torch.equal(outs["finals in C"][0], outs["finals in B"][0]) else "no"
        row = (f"| {name} | {table.seg_len} | {table.segments.shape[0] / max(N, 1):.2f} | "
               f"{floor_us(prefill_floor_bytes(case)):.1f} | {c * 1e3:.1f} | {b * 1e3:.1f} | {c / b:.3f} | {same} | "
               + ", ".join(f"{errs[form]['err_o']:.3e}" for form in FORMS) + " | "
               + ", ".join(f"{errs[form]['err_state']:.3e}" for form in FORMS) + " |")
        add_row(lines, row, opts.out)


if __name__ == "__main__":
    main()
