"""Where the host time of one ``kda_prefill`` call goes, on a CUDA GPU (the H200): eager against CUDA-graph replay
against GPU kernel time, then the host wall time of each stage, and a cProfile of the call.

    python benchmarks/host_overhead_kda.py --backend sm90|cutedsl|all [--out FILE.md] [--calls 100] [--reps 50]
        [--only SUBSTRINGS] [--configs "fixed B1 T16384,varlen T16384 10xuniform"] [--top 25]

For each backend (forced through ``CULA_BACKEND``) and a few small configs of ``bench_kda_prefill.py`` (same inputs
and flags: bf16, gate / L2 norm / beta sigmoid in kernel, safe gate, fp32 h0, final state out), after warm-up:

- eager ms: median CUDA-event time around one call, synchronised after each (as ``bench_kda_prefill.py``); the
  repeated call runs its call plan (``cula.call_plans``); "unplanned" times validate + dispatch + the backend's
  runner, what every call ran before plans; with
  a varlen config also with a new ``cu_seqlens`` tensor every call (the cache-miss path: validation copies it to the
  host, one synchronisation, and the index helpers are built again).
- back-to-back us: CUDA-event time of ``--calls`` calls issued without synchronising, per call: max(host, GPU).
- graph ms: the same call captured once in a ``torch.cuda.CUDAGraph``, median replay time. A replay runs no Python,
  so eager - graph is the host time the GPU waited for.
- GPU us: torch.profiler, the sum of the device activity (kernels, memsets, copies) per call, and the events.
- host us of each stage: the median over ``--calls`` calls, each timed with ``time.perf_counter_ns``, while the GPU
  sleeps (``torch.cuda._sleep`` enqueued first), so no launch waits for the GPU: the whole ``kda_prefill``; the
  unplanned call; ``validate_kda_prefill``; ``select_backend``; the backend's runner; on the cutedsl backend, its
  kernel launches alone (``compile_cache.launch`` on the arguments one runner call gave it: the layout checks and
  the compiled function's call, TVM-FFI and the driver's launch included). "GPU busy" says the sleep
  outlasted every loop; "no" means a stage waited for the GPU (a synchronisation) or the sleep was too short.
- cProfile of ``--calls`` calls (GPU asleep as above): the top entries by own time and by cumulative time, in us
  per call (cProfile's own cost inflates small functions; the header gives the profiled and unprofiled totals).
- a table of what common host calls cost on this machine (allocation, stream and device queries, ...).

Writes a markdown report to ``--out`` (default ``benchmarks/results/kda_host_overhead_h200.md``). Imports torch
only at start (``--help`` works on a CPU machine); never imports FLA.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import importlib
import importlib.metadata
import os
import platform
import pstats
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_kda_prefill import Config, configs, make_inputs, named_configs, time_ms  # noqa: E402

BACKENDS = ("sm90", "cutedsl")
PICK = ("fixed B1 T512", "fixed B2 T1024", "varlen T4096 10xrandom")
SMALL_VARLEN = Config("varlen T1024 4 seqs", 1, 1024, 64, 64, (300, 124, 412, 188))
DEFAULT_OUT = "benchmarks/results/kda_host_overhead_h200.md"


def picked_configs(only: str, names: str = "") -> list[Config]:
    """The fixed B1 T512 and B2 T1024 configs, one varlen config of bench_kda_prefill.py, and a small varlen one; or
    the bench configs named in ``names`` (comma-separated). ``only`` keeps those whose name contains a substring."""
    chosen = named_configs(names) if names else [cfg for cfg in configs() if cfg.name in PICK] + [SMALL_VARLEN]
    if only:
        chosen = [cfg for cfg in chosen if any(part in cfg.name for part in only.split(","))]
    return chosen


class GpuSleep:
    """Keeps the GPU busy for a while (``torch.cuda._sleep``) so that host work issued meanwhile never waits for it."""

    def __init__(self) -> None:
        # Calibrated at the highest rate of a few sleeps: a GPU found idle runs the first at its idle clock (345 MHz
        # on a lent H100, against 1980 MHz under load), and a rate taken from that alone made every later sleep about
        # 6x shorter than asked (a doors run's 50 ms sleeps ended before 12 ms of calls: "GPU busy: no").
        cycles = 10_000_000
        rates = []
        for _ in range(4):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rates.append(cycles / start.elapsed_time(end))
        self.cycles_per_ms = max(rates)

    def start(self, ms: float) -> torch.cuda.Event:
        """Enqueue ``ms`` of sleep; the returned event completes when the sleep ends."""
        torch.cuda.synchronize()
        torch.cuda._sleep(int(ms * self.cycles_per_ms))
        done = torch.cuda.Event()
        done.record()
        return done


def host_us(fn: Callable[[], object], calls: int, sleep: GpuSleep, sleep_ms: float) -> tuple[float, float, bool]:
    """Median and mean host microseconds of one call of ``fn``, over ``calls`` calls issued while the GPU sleeps, and
    whether the sleep outlasted the loop (if not, some call waited for the GPU). The median ignores the odd call
    that a garbage collection or a full launch queue slowed down."""
    clock = time.perf_counter_ns
    times = []
    done = sleep.start(sleep_ms)
    for _ in range(calls):
        start = clock()
        fn()
        times.append(clock() - start)
    busy = not done.query()
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2] / 1e3, sum(times) / len(times) / 1e3, busy


def back_to_back_us(fn: Callable[[], object], calls: int) -> float:
    """CUDA-event microseconds per call over ``calls`` calls issued without synchronising in between."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def graph_ms(fn: Callable[[], object], reps: int) -> float:
    """Median replay time of ``fn`` captured once in a CUDA graph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return time_ms(graph.replay, reps)


def gpu_us(fn: Callable[[], object], calls: int) -> tuple[float, float, dict[str, float]]:
    """torch.profiler: device microseconds per call (all device activity), device events per call, and the mean
    microseconds per call of each kernel name."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    count = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name] += event.device_time / calls
            count += 1
    return sum(per_name.values()), count / calls, dict(per_name)


def cprofile_text(fn: Callable[[], object], calls: int, sleep: GpuSleep, sleep_ms: float, top: int) -> str:
    """cProfile of ``calls`` calls (GPU asleep): the ``top`` entries by own time and by cumulative time, per call."""
    profiler = cProfile.Profile()
    done = sleep.start(sleep_ms)
    start = time.perf_counter_ns()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    elapsed = (time.perf_counter_ns() - start) / calls / 1e3
    busy = not done.query()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    lines = [f"profiled: {elapsed:.1f} us per call (GPU busy throughout: {'yes' if busy else 'no'}); "
             "us/call = seconds / calls * 1e6", ""]
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
        lines += [f"top {top} by {title}:", "", f"{'own us/call':>11} {'cum us/call':>11} {'calls/call':>10}  function"]
        rows = sorted(stats.stats.items(), key=lambda item: item[1][2 if key == "tottime" else 3], reverse=True)
        for (filename, line, name), (_, ncalls, tottime, cumtime, _) in rows[:top]:
            where = f"{_short(filename)}:{line}({name})" if line else name
            lines.append(f"{tottime / calls * 1e6:11.2f} {cumtime / calls * 1e6:11.2f} {ncalls / calls:10.1f}  {where}")
        lines.append("")
    return "\n".join(lines)


def _short(filename: str) -> str:
    """A file name relative to the repository or site-packages, for the report."""
    for marker in ("/packages/", "/site-packages/", "/lib/python"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def reference_costs(calls: int) -> list[tuple[str, float]]:
    """Host microseconds per call of common host calls on this machine (the same calls the backends make)."""
    device = torch.device("cuda", torch.cuda.current_device())
    index = device.index
    x32 = torch.zeros(64, dtype=torch.float32, device=device)
    shape = (1, 512, 64, 128)

    def empty() -> None:
        torch.empty(*shape, dtype=torch.bfloat16, device=device)

    def empty_bytes() -> None:
        torch.empty(8 << 20, dtype=torch.uint8, device=device)

    def device_guard() -> None:
        with torch.cuda.device(device):
            pass

    candidates: list[tuple[str, Callable[[], object]]] = [
        ("torch.empty([1, 512, 64, 128], bf16, cuda)", empty),
        ("torch.empty(8 MiB, uint8, cuda)", empty_bytes),
        ("torch.cuda.current_stream(device).cuda_stream", lambda: torch.cuda.current_stream(device).cuda_stream),
        ("torch.cuda.current_device()", torch.cuda.current_device),
        ("torch.cuda.get_device_capability(device)", lambda: torch.cuda.get_device_capability(device)),
        ("with torch.cuda.device(device): pass", device_guard),
        ("fp32 tensor .float() (returns itself)", x32.float),
        ("tensor.data_ptr()", x32.data_ptr),
        ("tensor.contiguous() (already contiguous)", x32.contiguous),
        ("os.environ.get('CULA_BACKEND')", lambda: os.environ.get("CULA_BACKEND")),
    ]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        candidates.insert(3, ("torch._C._cuda_getCurrentRawStream(index)", lambda: raw(index)))
    out = []
    for name, fn in candidates:
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        out.append((name, (time.perf_counter_ns() - start) / calls / 1e3))
        torch.cuda.synchronize()
    return out


def stream_check() -> str:
    """Whether the raw-stream query the sm90 shim uses names the current stream (on a side stream)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return "torch._C._cuda_getCurrentRawStream is absent: the sm90 shim falls back to torch.cuda.current_stream"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        index = torch.cuda.current_device()
        same = raw(index) == torch.cuda.current_stream(index).cuda_stream == side.cuda_stream
    return ("torch._C._cuda_getCurrentRawStream(index) == torch.cuda.current_stream().cuda_stream on a side "
            f"stream: {same}")


def measure(backend: str, cfg: Config, opts: argparse.Namespace, sleep: GpuSleep) -> dict:
    """Every measurement of one (backend, config); ``{"error": ...}`` when the backend cannot run it."""
    from cula import dispatch
    from cula.kda import kda_prefill
    from cula_runtime.kda_args import validate_kda_prefill

    kwargs = make_inputs(cfg)
    start = time.perf_counter()
    try:
        kda_prefill(**kwargs)
        torch.cuda.synchronize()
    except (NotImplementedError, RuntimeError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    first_s = time.perf_counter() - start

    def call() -> object:
        return kda_prefill(**kwargs)

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    args = validate_kda_prefill(**kwargs)
    runner = dispatch.select_backend(args)
    row: dict = {"first_s": first_s, "runner": f"{runner.__module__}.{runner.__qualname__}"}
    row["eager_ms"] = time_ms(call, opts.reps)

    def unplanned() -> object:  # what every call ran before call plans (cula.call_plans): validate, dispatch, run
        validated = validate_kda_prefill(**kwargs)
        return dispatch.select_backend(validated)(validated)

    row["eager_unplanned_ms"] = time_ms(unplanned, opts.reps)
    if cfg.lens is not None:
        cu = kwargs["cu_seqlens"]

        def fresh_cu() -> object:
            return kda_prefill(**{**kwargs, "cu_seqlens": cu.clone()})

        row["eager_fresh_cu_ms"] = time_ms(fresh_cu, opts.reps)
        cu_cpu = cu.cpu()

        def fresh_cu_with_cpu_copy() -> object:  # the caller's host copy: no synchronisation
            return kda_prefill(**{**kwargs, "cu_seqlens": cu.clone()}, cu_seqlens_cpu=cu_cpu)

        row["eager_fresh_cu_cpu_ms"] = time_ms(fresh_cu_with_cpu_copy, opts.reps)
    row["back_to_back_us"] = back_to_back_us(call, opts.calls)
    try:
        row["graph_ms"] = graph_ms(call, opts.reps)
    except RuntimeError as error:
        row["graph_ms"] = f"n/a ({str(error)[:80]})"
    row["gpu_us"], row["gpu_events"], row["kernels"] = gpu_us(call, min(opts.calls, 50))
    # long enough for every loop: --calls calls at up to 2 ms of host time each
    sleep_ms = max(50.0, opts.calls * 2.0)
    stages = {"kda_prefill": call, "unplanned": unplanned,
              "validate_kda_prefill": lambda: validate_kda_prefill(**kwargs),
              "select_backend": lambda: dispatch.select_backend(args), "backend runner": lambda: runner(args)}
    launches = cutedsl_launches(runner, args) if backend == "cutedsl" else None
    if launches:
        stages["launches only"] = lambda: replay_launches(launches)
    row["host"] = {name: host_us(fn, opts.calls, sleep, sleep_ms) for name, fn in stages.items()}
    row["host"].setdefault("launches only", (None, None, True))
    row["cprofile"] = cprofile_text(call, opts.calls, sleep, sleep_ms, opts.top)
    return row


def cutedsl_launches(runner: Callable, args: object) -> list[tuple]:
    """The ``compile_cache.launch`` arguments of one call of the cutedsl runner (its kernels run as usual)."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda import intra, recurrence

    recorded: list[tuple] = []

    def record(*launch_args) -> None:
        recorded.append(launch_args)
        compile_cache.launch(*launch_args)

    saved = intra.launch, recurrence.launch
    intra.launch = recurrence.launch = record
    try:
        runner(args)
    finally:
        intra.launch, recurrence.launch = saved
    torch.cuda.synchronize()
    return recorded


def replay_launches(launches: list[tuple]) -> None:
    """Launch each recorded kernel call again (the same tensors: the outputs are overwritten, nothing read back)."""
    from cula_runtime.cute import compile_cache

    for launch_args in launches:
        compile_cache.launch(*launch_args)


def environment() -> list[str]:
    """GPU, driver, versions, date and command line, for the report header."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:  # no nvidia-smi on PATH
        smi = ""
    versions = []
    for module in ("cula", "cula_runtime", "cula_sm90"):
        try:
            versions.append(f"{module} {getattr(importlib.import_module(module), '__version__', '?')}")
        except ImportError:
            versions.append(f"{module} absent")
    for distribution in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            versions.append(f"{distribution} {importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{distribution} absent")
    return [
        f"- GPU / driver: {smi or torch.cuda.get_device_name()}",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}, "
        f"{', '.join(versions)}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
        f"- command: `python {' '.join(sys.argv)}`",
        "- knobs: " + (", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("CULA_"))
                       or "none set (the defaults)"),
    ]


def _fmt(value: object, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else (str(value) if value is not None else "-")


def report(results: list[tuple[str, Config, dict]], costs: list[tuple[str, float]], opts: argparse.Namespace,
           checks: list[str]) -> str:
    """The markdown report."""
    lines = ["# Host overhead of one kda_prefill call: eager vs CUDA-graph replay vs GPU time, and where it goes", "",
             *environment(), "",
             f"Method: see the docstring of `benchmarks/host_overhead_kda.py`. eager and graph: median of {opts.reps} "
             f"CUDA-event timings; back-to-back and host stages: {opts.calls} calls. host = eager - graph (the GPU "
             "waiting for Python). Host stage times: median host wall time of one call, GPU asleep (no launch "
             "waits).", "",
             "| backend | config | eager ms | eager unplanned ms | graph ms | eager - graph us | "
             "back-to-back us/call | GPU us (events) | eager, new cu_seqlens ms | same, with cu_seqlens_cpu ms | "
             "host us: kda_prefill | unplanned | validate | select_backend | backend runner | launches only | "
             "GPU busy |",
             "|---" * 17 + "|"]
    for backend, cfg, row in results:
        if "error" in row:
            lines.append(f"| {backend} | {cfg.name} | {row['error']} |" + " |" * 14)
            continue
        graph = row["graph_ms"]
        gap = (row["eager_ms"] - graph) * 1e3 if isinstance(graph, float) else None
        host = row["host"]
        busy = "yes" if all(b for *_, b in host.values()) else "no: " + ", ".join(
            name for name, (*_, b) in host.items() if not b)
        lines.append(
            f"| {backend} | {cfg.name} | {_fmt(row['eager_ms'])} | {_fmt(row['eager_unplanned_ms'])} | {_fmt(graph)} | "
            f"{_fmt(gap, 1)} | "
            f"{_fmt(row['back_to_back_us'], 1)} | {_fmt(row['gpu_us'], 1)} ({row['gpu_events']:.0f}) | "
            f"{_fmt(row.get('eager_fresh_cu_ms'))} | {_fmt(row.get('eager_fresh_cu_cpu_ms'))} | "
            + " | ".join("-" if host[name][0] is None else _fmt(host[name][0], 1) for name in host) + f" | {busy} |")
    lines += ["", "Kernels per call (torch.profiler, mean us):", ""]
    for backend, cfg, row in results:
        if "kernels" in row:
            kernels = sorted(row["kernels"].items(), key=lambda item: -item[1])
            names = "; ".join(f"{name[:60]} {us:.1f}" for name, us in kernels)
            lines.append(f"- {backend}, {cfg.name} (runner {row['runner']}, first call {row['first_s']:.1f} s): "
                         f"{names}")
    lines += ["", "What common host calls cost here (us per call, mean of "
              f"{opts.calls * 10} calls):", "", "| call | us |", "|---|---|"]
    lines += [f"| `{name}` | {us:.2f} |" for name, us in costs]
    lines += ["", *[f"- {check}" for check in checks], ""]
    for backend, cfg, row in results:
        if "cprofile" in row:
            lines += [f"## cProfile: {backend}, {cfg.name}", "", "```", row["cprofile"], "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=(*BACKENDS, "all"), default="all")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--calls", type=int, default=100,
                        help="calls per host-time / back-to-back / cProfile loop (the GPU's launch queue holds "
                             "about a thousand launches while it sleeps: keep calls x kernels per call below that)")
    parser.add_argument("--reps", type=int, default=50, help="CUDA-event timings per eager / graph median")
    parser.add_argument("--only", default="", help="comma-separated substrings of config names to run")
    parser.add_argument("--configs", default="",
                        help="comma-separated bench_kda_prefill.py config names instead of the default few")
    parser.add_argument("--top", type=int, default=25, help="cProfile entries listed per ordering")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (run it on the H200)")
    backends = BACKENDS if opts.backend == "all" else (opts.backend,)
    sleep = GpuSleep()
    results = []
    saved = os.environ.get("CULA_BACKEND")
    try:
        for backend in backends:
            os.environ["CULA_BACKEND"] = backend  # set once, so the timed calls pay no environment writes
            for cfg in picked_configs(opts.only, opts.configs):
                row = measure(backend, cfg, opts, sleep)
                results.append((backend, cfg, row))
                brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                         if k not in ("cprofile", "kernels", "host")}
                host = {name: f"median {median:.1f} mean {mean:.1f}" for name, (median, mean, _) in
                        row.get("host", {}).items()}
                print(backend, cfg.name, brief, host, flush=True)
    finally:
        if saved is None:
            os.environ.pop("CULA_BACKEND", None)
        else:
            os.environ["CULA_BACKEND"] = saved
    text = report(results, reference_costs(opts.calls * 10), opts, [stream_check()])
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
