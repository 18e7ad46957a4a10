"""Host time of one eager call through each door into cuLA, on a CUDA GPU (the H200): FLA's dispatch (FLA's
``chunk_kda`` with cuLA registered as its backend), the custom op (``torch.ops.cula.kda_prefill``) and the plain
Python API (``cula.kda.kda_prefill``); for decode the same three doors (FLA's ``fused_recurrent_kda_fwd`` on a pool,
``torch.ops.cula.kda_decode_out``, ``cula.kda.kda_decode(..., out=)``).

    python benchmarks/host_doors_kda.py [--backend sm90|cutedsl|all] [--configs "fixed B1 T512,..."]
        [--calls 100] [--rounds 5] [--out benchmarks/results/kda_host_doors_h200.md]

Each door gets the same tensors (prefill: ``bench_kda_prefill.py``'s inputs and flags, bf16, gate / L2 norm / beta
sigmoid in kernel, safe gate, fp32 h0, final state out; FLA's door takes ``cu_seqlens`` as int64, as FLA's callers
pass it; decode: ``--decode-batch`` sequences of one token, H = HV = 32, a pool of 4x as many slots). Before timing,
each door's results are checked against the plain call's, bit for bit, and the FLA door is checked to have been
served by cuLA (else the row says why cuLA declined, and times FLA's own kernels). Then, per grad mode (``no_grad``;
``inference_mode``, where the custom op skips autograd's dispatch key), in ``--rounds`` rounds over the doors in
turn: the median host wall time of one call over ``--calls`` calls issued while the GPU sleeps (so no call waits for
the GPU; "GPU busy" = yes says the sleep outlasted every loop), the median over rounds; and the eager time (CUDA
events around one call, synchronised, median of ``--calls``). "over plain" is the door's host time minus the plain
call's in the same mode. Goals (issue 27): <= 10 us over plain for the custom op, <= 25 us for the FLA door. FLA's
own Triton path (``FLA_CULA=0``) is timed too, for scale; so are the custom op with every argument positional (as
an engine's generated call passes them: keywords are parsed against the schema on every call) and the custom op's
schema with a body that does nothing ("op dispatch only": torch's own round trip for the op's arguments, the part
of the custom op's cost that no implementation can remove) and, for prefill, the op's body called directly ("op body
alone": what the body costs without the dispatcher).

Writes a markdown report (environment, command, date) to ``--out`` and prints the table. Imports torch and FLA only
at start (``--help`` works without them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_OUT = "benchmarks/results/kda_host_doors_h200.md"
DEFAULT_CONFIGS = "fixed B1 T512"
BACKENDS = ("sm90", "cutedsl")
DECODE_BACKENDS = ("cutedsl",)  # cula-sm90 has no decode kernel: the CuTeDSL one serves SM90 (sm90 refuses)
#: the door that times torch's custom-op round trip alone (``_dispatch_only``): no goal, not compared with the plain
#: call (its body returns the plain call's outputs)
DISPATCH_ONLY = "op dispatch only"
#: the custom op called with every argument in its schema's order (what an engine's generated call does): the
#: keywords the "custom op" door passes are parsed against the schema on every call
POSITIONAL = "custom op, positional"
#: the custom op's Python body called directly (no dispatcher): with "op dispatch only" it splits the custom op's time
#: over the plain call into torch's round trip and the body's own work
BODY_ONLY = "op body alone"
GOALS_US = {"custom op": 10.0, POSITIONAL: 10.0, "FLA": 25.0}
MODES = ("no_grad", "inference_mode")


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="all", choices=(*BACKENDS, "all"))
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="bench_kda_prefill.py config names, comma-separated, plus 'varlen T1024 4 seqs'")
    parser.add_argument("--decode-batch", type=int, default=8, help="decode sequences (0: no decode rows)")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=DEFAULT_OUT)
    return parser.parse_args()


def main() -> None:
    opts = parse()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("host_doors_kda.py needs a CUDA GPU")
    import fla.ops.kda  # noqa: F401  (FLA's KDA ops, loaded: import cula registers its FLA backend with them)
    from bench_kda_prefill import environment
    from host_overhead_kda import GpuSleep

    import cula  # noqa: F401  (the custom ops and the FLA backend)

    # (bench_kda_prefill sets FLA_CULA=0 on import, for its own FLA contender: here FLA's door must reach cuLA)
    os.environ.pop("FLA_CULA", None)

    sleep = GpuSleep()
    rows: list[dict] = []
    env = environment()
    report = _report(rows, env, opts)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)

    def add(measured: list[dict]) -> None:  # (the report written after each call: a time-capped run keeps it)
        nonlocal report
        rows.extend(measured)
        report = _report(rows, env, opts)
        Path(opts.out).write_text(report)

    for backend in BACKENDS if opts.backend == "all" else (opts.backend,):
        os.environ["CULA_BACKEND"] = backend
        for cfg in _configs(opts.configs):
            add(measure(_prefill_doors(cfg), f"prefill {cfg.name}", backend, opts, sleep))
        if opts.decode_batch and backend in DECODE_BACKENDS:
            add(measure(_decode_doors(opts.decode_batch), f"decode B{opts.decode_batch} T1 H32", backend, opts, sleep))
    print(report)


def _configs(names: str):
    from bench_kda_prefill import named_configs
    from host_overhead_kda import SMALL_VARLEN

    wanted = [name for name in names.split(",") if name]
    extra = [SMALL_VARLEN] if SMALL_VARLEN.name in wanted else []
    rest = ",".join(name for name in wanted if name != SMALL_VARLEN.name)
    return (named_configs(rest) if rest else []) + extra


class Door:
    """One way into cuLA: ``call()`` runs it; ``results(returned)`` the tensors to compare with the plain call's.

    A door spec (``_prefill_doors``, ``_decode_doors``) is ``(doors, served, reason, reset)``: the doors, plain
    first; whether an FLA call reached cuLA and why not (``_fla_probe``); and a reset of the state the calls write
    (the decode pools)."""

    def __init__(self, name: str, call: Callable[[], object], results: Callable[[object], tuple]) -> None:
        self.name, self.call, self.results = name, call, results


def _prefill_doors(cfg) -> tuple:
    import torch
    from bench_kda_prefill import fla_inputs, make_inputs
    from fla.ops.kda import chunk_kda

    import cula.ops
    from cula.kda import kda_prefill

    kwargs = make_inputs(cfg)
    fla_kwargs = fla_inputs(kwargs)
    doors = [
        Door("plain", lambda: kda_prefill(**kwargs), lambda r: r),
        Door("custom op", lambda: torch.ops.cula.kda_prefill(**kwargs), lambda r: r),
        Door("FLA", lambda: chunk_kda(**fla_kwargs), lambda r: r),
    ]
    positional = _positional(torch.ops.cula.kda_prefill.default, kwargs)
    doors.append(Door(POSITIONAL, lambda: torch.ops.cula.kda_prefill(*positional), lambda r: r))
    floor = _dispatch_only("kda_prefill", lambda: kda_prefill(**kwargs))
    doors.append(Door(DISPATCH_ONLY, lambda: floor(**kwargs), lambda r: r))
    body = cula.ops._IMPLEMENTATIONS["kda_prefill"][0]  # (the body as registered)
    doors.append(Door(BODY_ONLY, lambda: body(**kwargs), lambda r: r))
    return doors, *_fla_probe("chunk_kda", lambda: chunk_kda(**fla_kwargs)), lambda: None


def _decode_doors(batch: int) -> tuple:
    import torch
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from cula.kda import kda_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    H = HV = 32
    K = V = 128

    def randn(*shape: int, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q, k, v, g = randn(batch, 1, H, K), randn(batch, 1, H, K), randn(batch, 1, HV, V), randn(batch, 1, HV, K)
    beta = randn(batch, 1, HV, dtype=torch.float32)
    A_log, dt_bias = randn(HV, dtype=torch.float32), randn(HV * K, dtype=torch.float32)
    start = randn(4 * batch, HV, K, V, dtype=torch.float32)
    pools = {door: start.clone() for door in ("plain", "custom op", "FLA", POSITIONAL)}
    slots = torch.randperm(4 * batch, device="cuda")[:batch].to(torch.int32)
    outs = {door: torch.empty_like(v) for door in pools}
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 A_log=A_log, dt_bias=dt_bias)

    def fla_call():
        return fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pools["FLA"], ssm_state_indices=slots,
                                       out=outs["FLA"], **flags)

    doors = [
        Door("plain", lambda: kda_decode(q, k, v, g, beta, state=pools["plain"], state_indices=slots,
                                         out=outs["plain"], **flags), lambda r: (outs["plain"],)),
        Door("custom op", lambda: torch.ops.cula.kda_decode_out(q, k, v, g, beta, pools["custom op"], slots,
                                                                outs["custom op"], **flags),
             lambda r: (outs["custom op"],)),
        Door("FLA", fla_call, lambda r: (outs["FLA"],)),
    ]
    positional = _positional(torch.ops.cula.kda_decode_out.default, dict(
        q=q, k=k, v=v, g=g, beta=beta, state=pools[POSITIONAL], state_indices=slots, out=outs[POSITIONAL], **flags))
    doors.append(Door(POSITIONAL, lambda: torch.ops.cula.kda_decode_out(*positional), lambda r: (outs[POSITIONAL],)))
    floor = _dispatch_only("kda_decode_out", lambda: None)
    doors.append(Door(DISPATCH_ONLY, lambda: floor(q, k, v, g, beta, pools["custom op"], slots, outs["custom op"],
                                                   **flags), lambda r: (outs["custom op"],)))

    def reset() -> None:
        for pool in pools.values():
            pool.copy_(start)

    return doors, *_fla_probe("fused_recurrent_kda_fwd", fla_call), reset


def _positional(op, given: dict) -> tuple:
    """``given`` (argument name -> value) as the positional arguments of the custom op overload ``op``, in its
    schema's order, its defaults where ``given`` lacks a name."""
    values = []
    for argument in op._schema.arguments:
        if argument.name in given:
            values.append(given[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            raise KeyError(f"{op}: no value for {argument.name}")
    return tuple(values)


_bench_library = None
_dispatch_results: dict[str, object] = {}  # op name -> what its dispatch-only body returns


def _dispatch_only(name: str, first_result: Callable[[], object]):
    """``torch.ops.cula_bench.<name>``: ``cula.ops``' schema of the op ``name`` with a body that returns what
    ``first_result()`` returned once (the plain call's outputs), so that timing it with the custom op's arguments
    gives torch's own round trip for them (argument parsing against the schema, the dispatcher, the call into the
    Python body and back), which no body can go under: the custom op's time over the plain call, less this floor,
    is what cuLA's op adds itself."""
    import torch

    from cula.ops import SCHEMAS

    global _bench_library
    if _bench_library is None:
        _bench_library = torch.library.Library("cula_bench", "DEF")
    if name not in _dispatch_results:  # (defined once; each call of this function only sets what it returns)
        _bench_library.define(name + SCHEMAS[name])
        _bench_library.impl(name, lambda *args, **kwargs: _dispatch_results[name], "CompositeExplicitAutograd")
    _dispatch_results[name] = first_result()
    return getattr(torch.ops.cula_bench, name)


def _fla_probe(entry: str, call: Callable[[], object]) -> tuple[Callable[[], bool], Callable[[], str]]:
    """``(served, reason)``: whether one FLA call reached cuLA, and why not (cuLA's verifier's answer)."""
    import torch

    from cula.integrations import fla as cula_fla

    answers: list[tuple[bool, str | None]] = []

    def served() -> bool:
        verifier = getattr(cula_fla.CulaBackend, f"{entry}_verifier")
        real = cula_fla.CulaBackend.__dict__[f"{entry}_verifier"]

        def spy(self, *args, **kwargs):
            answer = real(self, *args, **kwargs)
            answers.append(answer)
            return answer

        setattr(cula_fla.CulaBackend, f"{entry}_verifier", spy)
        try:
            with torch.no_grad():
                call()
        finally:
            setattr(cula_fla.CulaBackend, f"{entry}_verifier", verifier)
        return bool(answers) and answers[-1][0]

    def reason() -> str:
        return "never asked (FLA_CULA=0, or not registered)" if not answers else str(answers[-1][1])

    return served, reason


def _same(a: tuple, b: tuple) -> bool:
    import torch

    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b, strict=True))


def measure(spec, label: str, backend: str, opts: argparse.Namespace, sleep) -> list[dict]:
    """The rows of one call (``spec``: the doors, the FLA probe and a reset of their state) on ``backend``."""
    import torch
    from bench_kda_prefill import event_times_ms, median
    from host_overhead_kda import host_us

    doors, served, reason, reset = spec
    fla_served = served()
    note = "" if fla_served else f"cuLA declined: {reason()}"
    with torch.no_grad():
        for door in doors:  # warm-up (compiles, plans)
            door.call()
        reset()  # (the decode pools back to one start: the bit-for-bit check against the plain call)
        plain = doors[0].results(doors[0].call())
        checks = {door.name: _same(door.results(door.call()), plain) for door in doors[1:]
                  if door.name != DISPATCH_ONLY}
    if not fla_served:
        checks["FLA"] = None
    own = Door("FLA's own (FLA_CULA=0)", doors[2].call, doors[2].results)
    rows = []
    for mode in MODES:
        context = torch.no_grad if mode == "no_grad" else torch.inference_mode
        timed = [*doors, own]
        per_round: dict[str, list[float]] = {door.name: [] for door in timed}
        busy: dict[str, bool] = {door.name: True for door in timed}
        eager: dict[str, float] = {}
        with context():
            for _ in range(opts.rounds):
                for door in timed:
                    with _fla_off() if door is own else contextlib.nullcontext():
                        door.call()
                        us, _, was_busy = host_us(door.call, opts.calls, sleep, sleep_ms=opts.calls * 0.5)
                    per_round[door.name].append(us)
                    busy[door.name] &= was_busy
            for door in timed:
                with _fla_off() if door is own else contextlib.nullcontext():
                    eager[door.name] = median(event_times_ms(door.call, opts.calls))
        plain_us = statistics.median(per_round["plain"])
        for door in timed:
            us = statistics.median(per_round[door.name])
            over = us - plain_us
            goal = GOALS_US.get(door.name)
            rows.append(dict(backend=backend, call=label, mode=mode, door=door.name, host_us=us,
                             spread=(min(per_round[door.name]), max(per_round[door.name])), over=over,
                             goal=goal, met=None if goal is None or checks.get(door.name) is None else over <= goal,
                             eager_ms=eager[door.name], busy=busy[door.name], same=checks.get(door.name),
                             note=note if door.name == "FLA" else ""))
    return rows


@contextlib.contextmanager
def _fla_off():
    """FLA's own kernels for the calls inside (``FLA_CULA=0``, which FLA reads on every call)."""
    previous = os.environ.get("FLA_CULA")
    os.environ["FLA_CULA"] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["FLA_CULA"]
        else:
            os.environ["FLA_CULA"] = previous


def _report(rows: list[dict], environment: list[str], opts: argparse.Namespace) -> str:
    import cula  # (its version attribute: the lent H200 runs the tree's sources, with no installed metadata)

    lines = ["# Host time per eager call through each door into cuLA", "", *environment,
             f"- cula {cula.__version__}; calls {opts.calls}, rounds {opts.rounds}", "",
             "Method: see the docstring of `benchmarks/host_doors_kda.py`. host us: median over rounds of the median "
             "host wall time of one call (GPU asleep: no call waits for it), [min, max] over rounds; over plain: "
             "minus the plain call's in the same mode; eager ms: CUDA events around one synchronised call. Goals: "
             "custom op <= 10 us over plain, FLA door <= 25 us.", "",
             "| backend | call | mode | door | host us [min, max] | over plain us | goal | met | eager ms | "
             "same as plain | GPU busy | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        goal = "" if r["goal"] is None else f"<= {r['goal']:.0f}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        same = "" if r["same"] is None else ("yes" if r["same"] else "**no**")
        lines.append(f"| {r['backend']} | {r['call']} | {r['mode']} | {r['door']} | {r['host_us']:.1f} "
                     f"[{r['spread'][0]:.1f}, {r['spread'][1]:.1f}] | {r['over']:+.1f} | {goal} | {met} | "
                     f"{r['eager_ms']:.3f} | {same} | {'yes' if r['busy'] else 'no'} | {r['note']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
