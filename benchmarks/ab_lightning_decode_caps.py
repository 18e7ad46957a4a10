"""The Lightning decode's register caps side by side on a GPU (issue 28): one decode step (T = 1, the single-token
form) at each of several CTAs-per-SM caps (``LightningDecodeConfig.min_blocks_per_sm``, ptxas's register cap; 0 =
the default of :data:`~cula_runtime.cute.lightning.decode.MIN_BLOCKS_PER_SM`), in one process, interleaved.

    python benchmarks/ab_lightning_decode_caps.py [--only "bf16 kfirst"] [--caps 4,5,6,7,8] [--out FILE.md]

Rows: ``bench_lightning.py``'s decode rows at N >= 128 (H = 64; fp32 and bf16 pools, both layouts), the same
inputs. Each cap's kernel is launched directly (the validated call's tensors, the pool updated in place); time =
us per step of a CUDA graph of ``--graph-calls`` steps (``bench_kda_decode.capture_graph``), median of CUDA-event
timings in interleaved rounds (``bench_kda_prefill.interleaved_ms``), beside an in-place pass over the states'
bytes (``bench_kda_decode.in_place_pass``, the yardstick of its decode rows) and the floor
(``bench_lightning.decode_floor_bytes`` at 4.3 TB/s). "same bits": one step from the same pool at this cap gives
the default cap's o and pool bit for bit (the caps change registers, not arithmetic: expected "yes"). Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from ab_lightning_prefill_forms import ab_parser, add_row, is_selected, report_head  # noqa: E402
from bench_kda_decode import STATE_PASS, capture_graph, in_place_pass  # noqa: E402
from bench_kda_prefill import interleaved_ms, warm_up_gpu  # noqa: E402
from bench_lightning import (  # noqa: E402
    DecodeCase,
    K,
    V,
    decode_cases,
    decode_floor_bytes,
    floor_us,
    make_decode_inputs,
)


def rows(only: str) -> list[DecodeCase]:
    """The bench's decode rows with N >= 128 that ``only`` selects (the A/B scripts' ``--only``)."""
    return [case for case in decode_cases() if case.N >= 128 and is_selected(case.name, only)]


def default_cap(inp) -> int:
    """The cap the product compiles for the decode step of ``inp`` (its single-token form)."""
    from cula_runtime.cute.lightning import decode

    config, _ = decode._launch_config(inp.q, inp.pool, inp.case.v_first, None)
    return decode.LightningDecode(config).min_blocks_per_sm


def cap_step(inp, cap: int):
    """A zero-argument decode step of ``inp`` (one token per sequence, the pool in place, o into ``inp.out``) with
    the kernel compiled at ``cap`` CTAs per SM (0: the default)."""
    from cula_runtime.cute.compile_cache import launch
    from cula_runtime.cute.lightning import decode

    config, specs = decode._launch_config(inp.q, inp.pool, inp.case.v_first, None)
    config = dataclasses.replace(config, min_blocks_per_sm=cap)
    tensors = (inp.q, inp.k, inp.v, inp.g_gamma, inp.pool, inp.idx, None, inp.out)
    return lambda: launch(decode.LightningDecode, config, specs, tensors, decode._OUTPUTS, inp.q.device, inp.scale)


def step_from_pristine(inp, step) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, pool)`` after one ``step`` from the untouched pool (views of ``inp``'s buffers: compare before the next
    step)."""
    inp.pool.copy_(inp.pristine)
    step()
    torch.cuda.synchronize()
    return inp.out, inp.pool


def steps_side_by_side(inp, steps: dict, states: int, opts: argparse.Namespace) -> tuple[dict, dict]:
    """``(per_step, bits)`` of decode steps of one row's inputs ``inp`` (its ``pool``, ``pristine`` and ``out``):
    us per step of each step (keyed ``str(key)``) and of an in-place pass over ``states`` state elements in the
    pool's dtype (:data:`STATE_PASS`), each in a CUDA graph of ``opts.graph_calls`` steps, interleaved; and whether
    one step of each from the pristine pool gives the first step's o and pool bit for bit (this compiles them)."""
    first = next(iter(steps.values()))
    reference = tuple(t.clone() for t in step_from_pristine(inp, first))
    bits = {key: all(map(torch.equal, step_from_pristine(inp, step), reference)) for key, step in steps.items()}
    fns = {str(key): capture_graph(step, opts.graph_calls).replay for key, step in steps.items()}
    fns[STATE_PASS] = capture_graph(in_place_pass(states, inp.pool.dtype), opts.graph_calls).replay
    ms = interleaved_ms(fns, opts.reps, opts.rounds)
    return {name: value * 1e3 / opts.graph_calls for name, value in ms.items()}, bits


def measure(case: DecodeCase, caps: list[int], opts: argparse.Namespace) -> list[str]:
    """The row's table lines, one per cap (the default's first)."""
    inp = make_decode_inputs(case, "cuda", opts.seed)
    default = default_cap(inp)
    steps = {0: cap_step(inp, 0)}
    steps.update({cap: cap_step(inp, cap) for cap in caps if cap != default})
    per_step, bits = steps_side_by_side(inp, steps, case.N * case.H * K * V, opts)
    floor, yard = floor_us(decode_floor_bytes(case)), per_step[STATE_PASS]
    lines = []
    for cap in steps:
        us = per_step[str(cap)]
        label = f"{default} (default)" if cap == 0 else str(cap)
        lines.append(f"| {case.name} | {label} | {floor:.1f} | {yard:.1f} | {us:.1f} | {us / floor:.3f} | "
                     f"{us / yard:.3f} | {us / per_step['0']:.3f} | {'yes' if bits[cap] else 'NO'} |")
    return lines


def main() -> None:
    parser = ab_parser(__doc__, "benchmarks/results/lightning_decode_caps_ab.md")
    parser.add_argument("--caps", default="4,5,6,7,8,10,12", help="CTAs per SM to compile besides the default")
    parser.add_argument("--graph-calls", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    caps = [int(x) for x in opts.caps.split(",") if x.strip()]
    legend = ("One decode step (T = 1, H = 64, the single-token form) per cap: us per step in a CUDA graph of "
              f"{opts.graph_calls} steps, median of CUDA-event timings in interleaved rounds; floor = the states "
              "read and written in the pool's dtype plus q, k, v, o at 4.3 TB/s; state pass = an in-place pass "
              "over the states' bytes (torch mul_); same bits = o and the pool equal the default cap's.")
    columns = ["row", "CTAs per SM (cap)", "floor us", "state pass us", "us per step", "x floor", "x state pass",
               "x default", "same bits"]
    lines = report_head("The Lightning decode's register caps side by side (issue 28)", legend, columns,
                        torch.cuda.get_device_properties(0).multi_processor_count)
    warm_up_gpu(2.0)
    for case in rows(opts.only):
        for row in measure(case, caps, opts):
            add_row(lines, row, opts.out)


if __name__ == "__main__":
    main()
