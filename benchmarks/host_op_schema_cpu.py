"""torch's own round trip for a custom op, by how its arguments are passed, on the CPU (issue 27): no GPU, no cuLA
kernel; the op bodies return at once.

    python benchmarks/host_op_schema_cpu.py [--calls 20000] [--out benchmarks/results/custom_op_schema_cpu.md]

Ops are defined in a scratch namespace with ``cula.ops``' own ``kda_prefill`` schema (19 arguments) and with smaller
schemas (1 tensor; 5 tensors; 5 tensors + 10 bools; 5 tensors + 10 optional tensors), each with a body that returns
one pre-made pair of tensors (so no allocation is timed), and called with the arguments of
``benchmarks/host_doors_kda.py``'s prefill door (5 inputs, h0, A_log, dt_bias, five flags True, lower_bound) by
keyword, positionally (every argument in schema order), and with the 5 inputs positional and the rest by keyword;
also the body called directly. Per row: the least over 5 loops of the mean us per call over ``--calls / 5`` calls
(``host_cpu_kda.per_call_us``), under ``torch.no_grad`` and ``torch.inference_mode``. What it shows: the part of
the custom op's time over a plain call that the schema and the calling convention decide, which no body can remove.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SMALL_SCHEMAS = {
    "1 tensor": "(Tensor q) -> (Tensor, Tensor)",
    "5 tensors": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) -> (Tensor, Tensor)",
    "5 tensors + 10 bools": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
                            + ", ".join(f"bool b{i}=False" for i in range(10)) + ") -> (Tensor, Tensor)",
    "5 tensors + 10 optional tensors": "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
                                       + ", ".join(f"Tensor? t{i}=None" for i in range(10)) + ") -> (Tensor, Tensor)",
}


def calls() -> dict:
    """The timed calls by name."""
    import torch

    from cula.ops import SCHEMAS

    library = torch.library.Library("cula_schema_bench", "DEF")
    result = (torch.empty(1), torch.empty(0))

    def body(*args, **kwargs):
        return result

    library.define("kda_prefill" + SCHEMAS["kda_prefill"])
    library.impl("kda_prefill", body, "CompositeExplicitAutograd")
    for i, schema in enumerate(SMALL_SCHEMAS.values()):
        library.define(f"small{i}" + schema)
        library.impl(f"small{i}", body, "CompositeExplicitAutograd")
    ops = torch.ops.cula_schema_bench
    x = torch.zeros(1, 4, 2, 8)
    inputs = dict(q=x, k=x.clone(), v=x.clone(), g=x.clone(), beta=torch.zeros(1, 4, 2))
    rest = dict(initial_state=torch.zeros(1, 2, 8, 8), output_final_state=True, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                A_log=torch.zeros(2), dt_bias=torch.zeros(16))
    given = {**inputs, **rest}
    positional = tuple(given[a.name] if a.name in given else a.default_value
                       for a in ops.kda_prefill.default._schema.arguments)
    five = tuple(inputs.values())
    ten_true = (True,) * 10
    ten_tensors = tuple(x.clone() for _ in range(10))
    return {
        "kda_prefill schema, keywords": lambda: ops.kda_prefill(**given),
        "kda_prefill schema, positional": lambda: ops.kda_prefill(*positional),
        "kda_prefill schema, 5 positional + keywords": lambda: ops.kda_prefill(*five, **rest),
        "kda_prefill schema, 5 inputs only (defaults)": lambda: ops.kda_prefill(*five),
        "the body called directly": lambda: body(**given),
        "1 tensor": lambda: ops.small0(x),
        "5 tensors": lambda: ops.small1(*five),
        "5 tensors + 10 bools, defaults": lambda: ops.small2(*five),
        "5 tensors + 10 bools, all True": lambda: ops.small2(*five, *ten_true),
        "5 tensors + 10 optional tensors, None": lambda: ops.small3(*five, *(None,) * 10),
        "5 tensors + 10 optional tensors, given": lambda: ops.small3(*five, *ten_tensors),
    }, library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--out", default="benchmarks/results/custom_op_schema_cpu.md")
    opts = parser.parse_args()
    import torch
    from host_cpu_kda import per_call_us

    timed, _library = calls()
    rows = {name: {} for name in timed}
    for mode, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        with context():
            for name, fn in timed.items():
                fn()
                rows[name][mode] = per_call_us(fn, opts.calls)
    lines = ["# torch's custom-op round trip by schema and calling convention (CPU)", "",
             f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()} "
             f"({platform.processor() or 'cpu'}); date {time.strftime('%Y-%m-%d')}",
             f"- command: `python benchmarks/host_op_schema_cpu.py --calls {opts.calls}`", "",
             "Method: the script's docstring. us per call, the least of 5 loops' means.", "",
             "| call | no_grad us | inference_mode us |", "|---|---|---|"]
    for name, by_mode in rows.items():
        lines.append(f"| {name} | {by_mode['no_grad']:.2f} | {by_mode['inference_mode']:.2f} |")
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
