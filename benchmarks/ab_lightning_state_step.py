"""Kernel C's state step, two sources side by side on a GPU (issue 28): the Lightning prefill's direct form (kernel C
alone, where the state step runs every chunk of every sequence) with the current ``chunk_output.py`` and with
another revision's copy of that file, in one process, interleaved; and both forms' final-state errors.

    git show REV:packages/cula-runtime/src/cula_runtime/cute/lightning/chunk_output.py \
        > benchmarks/chunk_output_before.py
    python benchmarks/ab_lightning_state_step.py --before benchmarks/chunk_output_before.py [--only "B2 T32768"]

Rows: ``ab_lightning_prefill_forms.py``'s (bench_lightning.py's prefill rows and the serving batches), each run in
the direct form whatever the per-call rule picks; the inputs and the errors' heads (0 and H-1) as there. Time =
median of CUDA-event timings of eager launches in interleaved rounds (``bench_kda_prefill.interleaved_ms``); no
host work but the launch. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from ab_lightning_prefill_forms import add_row, report_head, selected_rows  # noqa: E402
from bench_kda_prefill import interleaved_ms, warm_up_gpu  # noqa: E402
from bench_lightning import cula_prefill_kwargs, errors, make_prefill_inputs, prefill_reference  # noqa: E402


def load_before(path: str):
    """The file at ``path`` imported as a sibling of ``chunk_output`` (its relative imports resolve there)."""
    name = "cula_runtime.cute.lightning._chunk_output_before"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def direct_launch(kernel, args, segments: torch.Tensor, o: torch.Tensor, ht: torch.Tensor):
    """A zero-argument launch of ``kernel``'s direct form on validated ``args`` into ``o`` and ``ht``."""
    from cula_runtime.cute.lightning.prefill_backend import _flat

    q, k, v, o_flat = _flat(args.q), _flat(args.k), _flat(args.v), _flat(o)
    return lambda: kernel.direct_output_run(q, k, v, args.g_gamma, segments, o_flat, args.scale, args.initial_state,
                                            ht, args.state_v_first, None, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="another revision's chunk_output.py")
    parser.add_argument("--only", default="", help="comma-separated substrings of row names")
    parser.add_argument("--out", default="benchmarks/results/lightning_state_step_ab.md")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()

    from cula_runtime.cute.lightning import chunk_output
    from cula_runtime.cute.lightning import prefill_backend as pb
    from cula_runtime.kda_tuning import sm_count
    from cula_runtime.lightning_args import validate_lightning_prefill

    kernels = {"before": load_before(opts.before), "now": chunk_output}
    device = torch.device("cuda")
    sms = sm_count(device)
    lines = report_head(
        "Kernel C's state step: two sources of chunk_output.py in the direct form (issue 28)",
        "us = median CUDA-event time of eager launches of the direct form, interleaved rounds; now / before > 1: the "
        "current source is slower; errors: rel. L2 against fp64 on heads 0 and H-1.",
        ["row", "before us", "now us", "now / before", "o err before, now", "state err before, now"], sms)
    warm_up_gpu(3.0)
    for name, case in selected_rows(opts.only):
        inp = make_prefill_inputs(case)
        a = validate_lightning_prefill(**cula_prefill_kwargs(inp))
        table = pb.device_segments(case.B, case.T, case.H, inp.cu32, device, sms, direct=True)
        outs, runs = {}, {}
        for label, kernel in kernels.items():
            outs[label] = (torch.empty_like(a.q), torch.empty(a.state_shape, dtype=torch.float32, device=device))
            runs[label] = direct_launch(kernel, a, table.segments, *outs[label])
            runs[label]()
        torch.cuda.synchronize()
        ms = interleaved_ms(runs, opts.reps, opts.rounds)
        heads = [0, case.H - 1]
        ref = prefill_reference(inp, heads)
        errs = {label: errors(*outs[label], ref, heads) for label in outs}
        row = (f"| {name} | {ms['before'] * 1e3:.1f} | {ms['now'] * 1e3:.1f} | {ms['now'] / ms['before']:.3f} | "
               f"{errs['before']['err_o']:.3e}, {errs['now']['err_o']:.3e} | "
               f"{errs['before']['err_state']:.3e}, {errs['now']['err_state']:.3e} |")
        add_row(lines, row, opts.out)


if __name__ == "__main__":
    main()
