"""Host time of the planned ``kda_decode`` / ``lightning_decode`` call, piece by piece (issue 26 item 6: eager host
time <= 20 us per call on the H200).

    python benchmarks/host_path_decode.py [--calls 20000] [--profile]        # on the CPU: no GPU, nothing compiled
    python benchmarks/host_path_decode.py --gpu [--out benchmarks/results/decode_host_path_h200.md]
        [--before-src DIR] [--rounds 3] [--host-calls 300]

**CPU** (the default): the rows' inputs of ``bench_kda_decode.py`` and ``bench_lightning.py`` made on the CPU, and
the planned path forced with stand-ins (:func:`stand_ins`): dispatch picks the CuTeDSL decode backends, their
planners accept CPU tensors, CPU index tensors pass the signature as a GPU call's do, the device reports sm_90a, and
the compiled kernel is a no-op callable taking the launch's arguments (it records them). Everything else is the
code a GPU call runs after its first call. Per case, the median wall time of one call (``time.perf_counter_ns``
around each of ``--calls`` calls, the least of three such medians, the timer's own cost taken off), in us:

- ``call``: the public call with the benchmark's keywords (``cula.kda.kda_decode(**kwargs)``);
- ``signature``: ``cula.call_plans``' signature of the call, and in it ``knobs`` (the ``CULA_CALL_PLANS`` read and
  the knob snapshot, ``cula_runtime.env``; a KDA decode signature that holds no tensor metadata takes the snapshot
  alone);
- ``lookup``: the plan table's lookup of an equal (not identical) signature, and where the revision keeps a decode's
  plans with guards of its tensors (``call_plans.lookup_guarded``, ``lookup_guarded_lightning``), the guards' check
  of the call's tensors;
- ``plan``: the plan run on the call's tensors (what the call passes it, recorded once), and in it ``o allocation``
  (``torch.empty`` of o, when no ``out`` is given) and ``compiled stand-in`` (the no-op on the recorded launch
  arguments); ``rest`` is ``call`` less the three above (the public function's own frame);
- ``tvm-ffi``: TVM-FFI's ``testing.nop`` on the recorded launch arguments, what a compiled kernel's call costs in
  argument conversion before its own checks and the launch (CPU tensors through the same DLPack exchange as CUDA
  ones), and ``tvm-ffi per tensor``;
- ``allocations``: tensor allocations per call (``tests.helpers.AllocationCounter``).

A piece the revision under test does not have is shown as "-". CPU numbers are not H200 numbers: that host runs
Python 1.5-2x slower, a CUDA ``torch.empty`` costs about 3.4 us there, and the real launch (TVM-FFI's checks,
``cuLaunchKernel``) is missing here.

**GPU** (``--gpu``, on the H200): the real eager calls, host time per call with the GPU asleep
(``host_overhead_kda.host_us``, as ``bench_kda_decode.py``'s host column: the median over ``--host-calls`` calls
after 30 warm-up calls), for kda_decode H32 HV32 N1 and N128 (fp32 K-first pool, the benchmark's inputs: fp32
log-gate, L2 norm in kernel, ``out`` given) and lightning_decode H64 N1 (fp32 K-first, ``g_gamma`` and ``out``
given), ``--rounds`` times, each in a child process with this tree's packages first on ``PYTHONPATH``; beside it
the same for the plan alone on the call's recorded arguments (the launch included) and the signature alone. With
``--before-src DIR`` (a checkout of the older revision, e.g. made with ``git archive REV packages | tar -x -C DIR``),
each round also measures DIR's packages the same way, in alternation (before, now, before, now...), so that drift
of the lent machine lands on both. Writes a markdown table (``--out``): per column the median over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HOST_GOAL_US = 20.0
GPU_CASES = ("kda H32 HV32 N1", "kda H32 HV32 N128", "lightning H64 N1")


@dataclass(frozen=True)
class Case:
    """One timed call: the op ("kda" or "lightning"), its row in the op's benchmark, and the argument form."""

    op: str
    N: int
    H: int = 32
    HV: int = 32
    form: str = "bench"  # "bench": the benchmark's arguments; "gate-no-out" (kda): in-kernel gate, o allocated;
    # "layer" (lightning): layer_idx/num_layers instead of g_gamma

    @property
    def name(self) -> str:
        heads = f"H{self.H} HV{self.HV}" if self.op == "kda" else f"H{self.H}"
        return f"{self.op} {heads} N{self.N}" + ("" if self.form == "bench" else f" {self.form}")


CPU_CASES = (Case("kda", 1), Case("kda", 128), Case("kda", 1, form="gate-no-out"), Case("lightning", 1, 64, 64),
             Case("lightning", 1, 64, 64, form="layer"))


def call_of(case: Case, device: str) -> tuple[Callable, dict]:
    """``(public function, keyword arguments)`` of ``case``, its tensors on ``device`` (the benchmarks' inputs)."""
    if case.op == "kda":
        import bench_kda_decode as bench

        from cula.kda import kda_decode

        inp = bench.make_decode_inputs(bench.DecodeCase("fp32", False, case.H, case.HV, case.N), device=device)
        if case.form == "gate-no-out":
            kwargs = {**bench.cula_kwargs(inp, "in-kernel"), "out": None, "use_beta_sigmoid_in_kernel": True}
        else:
            kwargs = bench.cula_kwargs(inp, "fp32")
        return kda_decode, kwargs
    import bench_lightning as bench

    from cula.lightning import lightning_decode

    inp = bench.make_decode_inputs(bench.DecodeCase("fp32", False, case.N, case.H), device=device)
    kwargs = bench.cula_decode_kwargs(inp)
    if case.form == "layer":
        kwargs = {**kwargs, "g_gamma": None, "layer_idx": bench.LAYER_IDX, "num_layers": bench.NUM_LAYERS}
    return lightning_decode, kwargs


# ------------------------------------------------------------------------------------------------------- timings

def median_us(fn: Callable[[], object], calls: int, rounds: int = 3) -> float:
    """The wall time of one ``fn()`` in us, less the timer's own cost: the median over ``calls`` calls, the least
    of ``rounds`` such medians (a shared machine's other work only ever adds time)."""
    clock = time.perf_counter_ns

    def times(f: Callable[[], object]) -> list[int]:
        out = []
        for _ in range(calls):
            start = clock()
            f()
            out.append(clock() - start)
        return out

    gc.disable()
    try:
        best = min(statistics.median(times(fn)) - statistics.median(times(_nothing)) for _ in range(rounds))
        return max(best, 0.0) / 1e3
    finally:
        gc.enable()


def _nothing() -> None:
    return None


# ---------------------------------------------------------------------------------------------------- stand-ins

class Recorder:
    """The compiled-kernel stand-in: a no-op taking the launch's arguments; keeps the last ones while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.args: tuple = ()

    def kernel(self, *args: object) -> None:
        if self.on:
            self.args = args


@contextlib.contextmanager
def stand_ins() -> Iterator[Recorder]:
    """The planned path on CPU tensors (see the module docstring); everything patched is put back on exit."""
    import cula.kda
    import cula.lightning
    from cula import call_plans, dispatch
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda import decode_backend as kda_backend
    from cula_runtime.cute.lightning import decode_backend as lightning_backend

    recorder = Recorder()
    compiled = recorder.kernel
    patches = [
        (compile_cache, "_launchable", {}),
        (compile_cache, "launch_target", lambda index: "sm_90a"),
        (compile_cache, "compile_kernel", lambda *a, **kw: compiled),
        (call_plans, "indices_checked_on_host", lambda indices: False),
        (lightning_backend, "device_rejection", lambda device: None),
        (cula.kda, "select_decode_backend", lambda args: kda_backend.kda_decode_cutedsl_backend),
        (cula.lightning, "select_lightning_decode_backend",
         lambda args: lightning_backend.lightning_decode_cutedsl_backend),
        (dispatch, "_planners", {kda_backend.kda_decode_cutedsl_backend: kda_backend.plan_kda_decode,
                                 lightning_backend.lightning_decode_cutedsl_backend:
                                     lightning_backend.plan_lightning_decode}),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    call_plans.clear_call_plans()
    try:
        yield recorder
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        call_plans.clear_call_plans()


# ------------------------------------------------------------------------------------------------ the CPU pieces

def _signature_fn(case: Case, kwargs: dict) -> Callable[[], tuple | None]:
    """The call's signature as ``cula.call_plans`` builds it (positional, in the public function's order)."""
    import inspect

    from cula import call_plans

    fn, public = ((call_plans.decode_call_signature, "cula.kda.kda_decode") if case.op == "kda"
                  else (call_plans.lightning_decode_call_signature, "cula.lightning.lightning_decode"))
    module, name = public.rsplit(".", 1)
    params = inspect.signature(getattr(sys.modules[module], name)).parameters
    args = tuple(kwargs.get(p, params[p].default) for p in params)
    return lambda: fn(*args)


_PLAN_TENSORS = ("q", "k", "v", "g", "beta", "state", "state_indices", "A_log", "dt_bias", "cu_seqlens",
                 "num_accepted_tokens", "out")


def _lookup_fn(case: Case, kwargs: dict, signature: tuple | None) -> Callable[[], object]:
    """The plan's lookup for ``signature`` as the call does it: for a KDA decode whose revision guards its plans
    (``call_plans.lookup_guarded``), the table's lookup and the guards' check of the call's tensors; otherwise the
    table's lookup."""
    from cula import call_plans

    guarded = getattr(call_plans, "lookup_guarded", None)
    if case.op == "kda" and guarded is not None:
        tensors = tuple(kwargs.get(name) for name in _PLAN_TENSORS)
        return lambda: guarded(signature, *tensors)
    guarded = getattr(call_plans, "lookup_guarded_lightning", None)
    if case.op == "lightning" and guarded is not None:  # (the decay tensor the plan gets: g_gamma, or its layer's)
        import cula.lightning

        decay = cula.lightning._decay(kwargs.get("g_gamma"), kwargs.get("layer_idx"), kwargs.get("num_layers"),
                                      kwargs["q"])
        tensors = (*(kwargs.get(n) for n in ("q", "k", "v")), decay,
                   *(kwargs.get(n) for n in ("state", "state_indices", "cu_seqlens", "out")))
        return lambda: guarded(signature, *tensors)
    return lambda: call_plans.lookup(signature)


def _keep(signature: tuple, plan: Callable, new: Callable) -> None:
    """Keep ``new`` where ``plan`` is kept for ``signature`` (with its guards, where the revision has them)."""
    from cula import call_plans

    guarded = getattr(call_plans, "_guarded_plans", {})
    if signature in guarded:
        guarded[signature] = tuple((guards, new if kept is plan else kept) for guards, kept in guarded[signature])
    else:
        call_plans.remember(signature, new)


def _knobs_fn() -> Callable[[], object]:
    from cula import call_plans
    from cula_runtime.env import env_snapshot, env_value

    name = call_plans.ENV_CALL_PLANS
    return lambda: (env_value(name, "1"), env_snapshot())


def planned(case: Case, fn: Callable, kwargs: dict) -> tuple[Callable, tuple, dict] | None:
    """After warm-up calls of ``fn(**kwargs)``: ``(plan, args, kwargs)``, the plan ``cula.call_plans`` keeps for the
    call and what the call passes it (recorded on one call), or None when the call is not planned."""
    signature = _signature_fn(case, kwargs)
    for _ in range(3):
        fn(**kwargs)
    plan = _lookup_fn(case, kwargs, signature())()
    if plan is None:
        return None
    seen: list = []

    def recording(*args, **kw):
        seen.append((args, kw))
        return plan(*args, **kw)

    _keep(signature(), plan, recording)
    try:
        fn(**kwargs)
    finally:
        _keep(signature(), recording, plan)
    return plan, *seen[0]


def cpu_pieces(case: Case, calls: int, profile: bool = False) -> dict[str, float | int | str | None]:
    """Every piece of ``case``'s planned call on the CPU (see the module docstring), in us per call."""
    import tvm_ffi

    from tests.helpers import AllocationCounter

    with stand_ins() as recorder:
        fn, kwargs = call_of(case, "cpu")
        signature = _signature_fn(case, kwargs)
        recorder.on = True
        found = planned(case, fn, kwargs)
        recorder.on = False
        if found is None:
            return {"note": "not planned by this revision"}
        (plan, plan_args, plan_kwargs), launch_args = found, recorder.args
        out_given = kwargs.get("out") is not None
        o = fn(**kwargs)
        with AllocationCounter() as allocations:
            fn(**kwargs)
        fresh = signature()
        rows: dict[str, float | int | str | None] = {
            "call": median_us(lambda: fn(**kwargs), calls),
            "signature": median_us(signature, calls),
            "knobs": median_us(_knobs_fn(), calls),
            "lookup": median_us(_lookup_fn(case, kwargs, fresh), calls),
            "plan": median_us(lambda: plan(*plan_args, **plan_kwargs), calls),
            "o allocation": None if out_given else median_us(
                lambda: torch.empty(o.shape, dtype=o.dtype, device=o.device), calls),
            "compiled stand-in": median_us(lambda: recorder.kernel(*launch_args), calls),
        }
        rows["rest"] = rows["call"] - rows["signature"] - rows["lookup"] - rows["plan"]
        nop = tvm_ffi.get_global_func("testing.nop")
        ffi = median_us(lambda: nop(*launch_args), calls) - median_us(nop, calls)
        tensors = sum(isinstance(a, torch.Tensor) for a in launch_args)
        rows.update({"tvm-ffi": ffi, "tvm-ffi per tensor": ffi / max(tensors, 1),
                     "launch arguments": f"{tensors} tensors of {len(launch_args)}",
                     "allocations": allocations.count})
        if profile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [fn(**kwargs) for _ in range(calls)])
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
            rows["profile"] = text.getvalue()
    return rows


CPU_ROWS = ("call", "signature", "knobs", "lookup", "plan", "o allocation", "compiled stand-in", "rest",
            "tvm-ffi", "tvm-ffi per tensor", "launch arguments", "allocations")


def cpu_table(results: dict[str, dict]) -> list[str]:
    """The pieces (rows) by case (columns), markdown."""
    names = list(results)
    lines = ["| piece | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    notes = [f"- {n}: {r['note']}" for n, r in results.items() if "note" in r]
    for row in CPU_ROWS:
        cells = []
        for name in names:
            value = results[name].get(row)
            cells.append("-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value))
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines + ([""] + notes if notes else [])


def run_cpu(opts: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    import cula

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, cula from {Path(cula.__file__).parent}; "
          f"CPU stand-ins (bench inputs on the CPU, kernels no-ops); median of {opts.calls} calls, us per call\n")
    results = {case.name: cpu_pieces(case, opts.calls, opts.profile) for case in CPU_CASES}
    print("\n".join(cpu_table(results)))
    for name, rows in results.items():
        if "profile" in rows:
            print(f"\ncProfile of {name}, {opts.calls} calls:\n```\n{rows['profile'].strip()}\n```")


# -------------------------------------------------------------------------------------------------------- the GPU

def gpu_host_us(host_calls: int) -> dict[str, dict[str, float]]:
    """Per case of :data:`GPU_CASES`, in this process, in us: ``call``, the host time per eager call (GPU asleep);
    ``plan``, the same for the plan alone on the call's arguments (the launch included); ``signature``, the median
    time of the signature (no GPU work)."""
    from host_overhead_kda import GpuSleep, host_us

    sleep = GpuSleep()
    cases = {case.name: case for case in (Case("kda", 1), Case("kda", 128), Case("lightning", 1, 64, 64))}
    out = {}
    for name in GPU_CASES:
        case = cases[name]
        fn, kwargs = call_of(case, "cuda")
        for _ in range(30):
            fn(**kwargs)
        torch.cuda.synchronize()
        sleep_ms = max(5.0, 0.5 * host_calls)
        row = {"call": host_us(lambda fn=fn, kw=kwargs: fn(**kw), host_calls, sleep, sleep_ms)[0],
               "signature": median_us(_signature_fn(case, kwargs), host_calls)}
        found = planned(case, fn, kwargs)
        if found is not None:
            plan, args, kw = found
            row["plan"] = host_us(lambda p=plan, a=args, k=kw: p(*a, **k), host_calls, sleep, sleep_ms)[0]
        out[name] = row
    return out


def _child(src: str, host_calls: int) -> dict[str, dict[str, float]]:
    """:func:`gpu_host_us` in a child process with ``src``'s packages first on ``PYTHONPATH``."""
    paths = [str(Path(src) / "packages" / name / "src") for name in ("cula", "cula-runtime")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, "--gpu-child", "--host-calls", str(host_calls)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the measurement of {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


GPU_COLUMNS = ("call", "signature", "plan")


def gpu_table(rounds: dict[str, list[dict[str, dict[str, float]]]], header: list[str]) -> str:
    """The GPU results as markdown: ``header`` lines, then one row per case of :data:`GPU_CASES` and, per label of
    ``rounds``, its rounds' host times of the call, the signature and the plan (the median over rounds; the call's
    values per round in brackets, "(short)" past the goal)."""
    labels = list(rounds)
    names = [f"{label} {column} us" for label in labels for column in GPU_COLUMNS]
    lines = [*header, "", "| case | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for case in GPU_CASES:
        cells = []
        for label in labels:
            for column in GPU_COLUMNS:
                values = [r[case][column] for r in rounds[label] if column in r[case]]
                if not values:
                    cells.append("-")
                    continue
                med = statistics.median(values)
                cell = f"{med:.1f}"
                if column == "call":
                    cell += f"{' (short)' if med > HOST_GOAL_US else ''} [{', '.join(f'{v:.1f}' for v in values)}]"
                cells.append(cell)
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_gpu(opts: argparse.Namespace) -> None:
    labels = (["before"] if opts.before_src else []) + ["now"]
    rounds: dict[str, list[dict[str, dict[str, float]]]] = {label: [] for label in labels}
    for _ in range(opts.rounds):
        if opts.before_src:
            rounds["before"].append(_child(opts.before_src, opts.host_calls))
        rounds["now"].append(_child(str(ROOT), opts.host_calls))
    header = [
        "# Host time of the planned kda_decode / lightning_decode call on the H200",
        "",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, Python {sys.version.split()[0]}",
        f"- date: {time.strftime('%Y-%m-%dT%H:%M%z')}",
        f"- command: `python benchmarks/host_path_decode.py {' '.join(sys.argv[1:])}`",
        f"- method: host_overhead_kda.host_us (median of {opts.host_calls} calls, GPU asleep), after 30 warm-up "
        f"calls, in child processes, {opts.rounds} rounds" + (" in alternation (before, now)" if opts.before_src
                                                               else "") + "; the median over rounds, each "
        f"round's value in brackets; goal <= {HOST_GOAL_US:g} us",
    ]
    text = gpu_table(rounds, header)
    print(text)
    if opts.out:
        Path(opts.out).write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="CPU: calls per timed piece")
    parser.add_argument("--profile", action="store_true", help="CPU: a cProfile of each case's call")
    parser.add_argument("--gpu", action="store_true", help="time the real eager calls on the GPU")
    parser.add_argument("--gpu-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--before-src", default="", help="GPU: a checkout of the older revision to time alongside")
    parser.add_argument("--rounds", type=int, default=3, help="GPU: rounds (each revision once per round)")
    parser.add_argument("--host-calls", type=int, default=300, help="GPU: calls per host-time measurement")
    parser.add_argument("--out", default="", help="GPU: the markdown file to write")
    opts = parser.parse_args(argv)
    if opts.gpu_child:
        print(json.dumps(gpu_host_us(opts.host_calls)))
    elif opts.gpu:
        run_gpu(opts)
    else:
        run_cpu(opts)


if __name__ == "__main__":
    main()
