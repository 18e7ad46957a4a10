"""The K-first decode CTAs' lines per K row side by side on a GPU (issues 26 and 28): one decode step of the KDA
decode (``cute/kda/decode.py``) and of the Lightning decode (``cute/lightning/decode.py``) with each K-first CTA
reading 1, 2 or 4 128-byte lines of every K row (``k_first_lines``: 4 CTAs per fp32 head reading 128 bytes at a
512-byte stride, down to one CTA reading the head's 64 KB whole), in one process, interleaved.

    python benchmarks/ab_decode_k_first_lines.py [--only "fp32 kfirst H8"] [--lines 1,2,4] [--min-n 128]
        [--out FILE.md]

Rows: the K-first decode rows at N >= ``--min-n`` (128) of ``bench_kda_decode.py`` (the precomputed fp32 log-gate,
L2 norm in kernel; H = HV = 32, 8 and H16/HV64) and of ``bench_lightning.py`` (H = 64), fp32 and bf16 pools, their
inputs. Each variant's kernel is launched directly (the product's configuration of the call with ``k_first_lines``
replaced; the register cap follows, the same threads per SM); time = us per step of a CUDA graph of
``--graph-calls`` steps, median of CUDA-event timings in interleaved rounds (``bench_kda_prefill.interleaved_ms``),
beside an in-place pass over the states' bytes (``bench_kda_decode.in_place_pass``) and the row's floor at 4.3
TB/s. "same bits": one step from the same pool gives the 1-line CTAs' o and pool bit for bit (the lines change
which CTA holds a column, not the order of any sum: expected "yes"). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kda_decode as kda_bench  # noqa: E402
import bench_lightning as la_bench  # noqa: E402
import torch  # noqa: E402
from ab_lightning_decode_caps import steps_side_by_side  # noqa: E402
from ab_lightning_prefill_forms import ab_parser, add_row, is_selected, report_head  # noqa: E402
from bench_kda_prefill import warm_up_gpu  # noqa: E402

K = V = 128


@dataclasses.dataclass
class Row:
    """One row: its name, the pool and its untouched copy, o, the states a step reads and writes (elements), the
    floor, and the step at a number of lines."""

    name: str
    pool: torch.Tensor
    pristine: torch.Tensor
    out: torch.Tensor
    states: int
    floor_us: float
    step: Callable[[int], Callable[[], None]]
    max_lines: int


def kda_decode_step(case, inp) -> Callable[[int], Callable[[], None]]:
    """``step(lines)``: a zero-argument KDA decode step of ``case`` (a ``bench_kda_decode`` row) on its inputs
    ``inp`` (the fp32 log-gate, L2 norm in the kernel), launched directly in the product's configuration of the
    call with ``k_first_lines`` replaced by ``lines`` (0 or None: the product's own)."""
    from cula_runtime.cute.compile_cache import launch
    from cula_runtime.cute.kda import decode

    config, specs, A_log, dt_bias, scalars = decode._launch_args(
        case.H, case.HV, inp.g, inp.beta, inp.pool, inp.idx, None, None, None, None, True, False, False, False,
        case.v_first, None, None)
    tensors = (inp.q, inp.k, inp.v, inp.g, inp.beta, A_log, dt_bias, inp.pool, inp.idx, None, None, inp.out)

    def step(lines: int | None) -> Callable[[], None]:
        lined = dataclasses.replace(config, k_first_lines=lines) if lines else config
        return lambda: launch(decode.KdaDecode, lined, specs, tensors, decode._OUTPUTS, inp.q.device, *scalars)

    return step


def kda_rows(only: str, min_n: int, seed: int) -> Iterator[Row]:
    """The KDA decode's K-first rows at N >= ``min_n`` that ``only`` selects (the fp32 log-gate), made one at a time."""
    for case in kda_bench.decode_cases():
        name = f"kda {case.name}"
        if case.v_first or case.N < min_n or not is_selected(name, only):
            continue
        inp = kda_bench.make_decode_inputs(case, "cuda", seed)
        yield Row(name, inp.pool, inp.pristine, inp.out, case.N * case.HV * K * V, kda_bench.floor_us(case, 4),
                  kda_decode_step(case, inp), 4 if case.pool_dtype == "fp32" else 2)


def lightning_rows(only: str, min_n: int, seed: int) -> Iterator[Row]:
    """The Lightning decode's K-first rows at N >= ``min_n`` that ``only`` selects (its single-token form), one at a
    time."""
    from cula_runtime.cute.compile_cache import launch
    from cula_runtime.cute.lightning import decode

    for case in la_bench.decode_cases():
        name = f"lightning {case.name}"
        if case.v_first or case.N < min_n or not is_selected(name, only):
            continue
        inp = la_bench.make_decode_inputs(case, "cuda", seed)
        config, specs = decode._launch_config(inp.q, inp.pool, False, None)
        tensors = (inp.q, inp.k, inp.v, inp.g_gamma, inp.pool, inp.idx, None, inp.out)

        def step(lines: int, config=config, specs=specs, tensors=tensors, scale=inp.scale, device=inp.q.device):
            lined = dataclasses.replace(config, k_first_lines=lines)
            return lambda: launch(decode.LightningDecode, lined, specs, tensors, decode._OUTPUTS, device, scale)

        yield Row(name, inp.pool, inp.pristine, inp.out, case.N * case.H * K * V,
                  la_bench.floor_us(la_bench.decode_floor_bytes(case)), step, 4 if case.pool_dtype == "fp32" else 2)


def measure(row: Row, lines: list[int], opts: argparse.Namespace) -> list[str]:
    """The row's table lines, one per number of lines (1 first)."""
    steps = {n: row.step(n) for n in [1, *(n for n in lines if n != 1)] if n <= row.max_lines}
    per_step, bits = steps_side_by_side(row, steps, row.states, opts)
    yard = per_step[kda_bench.STATE_PASS]
    return [f"| {row.name} | {n} | {row.floor_us:.1f} | {yard:.1f} | {per_step[str(n)]:.1f} | "
            f"{per_step[str(n)] / row.floor_us:.3f} | {per_step[str(n)] / yard:.3f} | "
            f"{per_step[str(n)] / per_step['1']:.3f} | {'yes' if bits[n] else 'NO'} |" for n in steps]


def main() -> None:
    parser = ab_parser(__doc__, "benchmarks/results/decode_k_first_lines_ab.md")
    parser.add_argument("--lines", default="1,2,4", help="K-first lines per CTA to compile (up to a row's lines)")
    parser.add_argument("--min-n", type=int, default=128, help="the least batch N of the rows")
    parser.add_argument("--graph-calls", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    lines = [int(x) for x in opts.lines.split(",") if x.strip()]
    legend = ("One decode step (T = 1) per number of 128-byte lines of each K row a K-first CTA reads: us per step "
              f"in a CUDA graph of {opts.graph_calls} steps, median of CUDA-event timings in interleaved rounds; "
              "floor = the row's bytes at 4.3 TB/s (the benches' floors); state pass = an in-place pass over the "
              "states' bytes (torch mul_); same bits = o and the pool equal the 1-line CTAs'.")
    columns = ["row", "lines per CTA", "floor us", "state pass us", "us per step", "x floor", "x state pass",
               "x 1 line", "same bits"]
    report = report_head("The K-first decode CTAs' lines per K row side by side (issues 26, 28)", legend, columns,
                         torch.cuda.get_device_properties(0).multi_processor_count)
    warm_up_gpu(2.0)
    for row in itertools.chain(kda_rows(opts.only, opts.min_n, opts.seed),
                                 lightning_rows(opts.only, opts.min_n, opts.seed)):
        for line in measure(row, lines, opts):
            add_row(report, line, opts.out)


if __name__ == "__main__":
    main()
