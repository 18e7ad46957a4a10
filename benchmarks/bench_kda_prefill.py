"""KDA prefill on the H200: cuLA's backends against FLA Triton ``chunk_kda``, side by side in one process.

    python benchmarks/bench_kda_prefill.py [--out benchmarks/results/kda_prefill_h200.md] [--reps 100] [--rounds 5]

Every contender gets the same inputs and flags: bf16 q/k/v and raw gate, gate / L2 norm / beta sigmoid in kernel,
safe_gate=True, lower_bound=-5, fp32 initial state, final state out. Time = median of ``--reps`` CUDA-event
timings after warm-up (each contender's first call apart, then ``--warm-up-s`` of GPU load before the first config),
taken in ``--rounds`` interleaved rounds over the contenders (``interleaved_ms``). FLA runs with FLA_FLASH_KDA=0
(never FlashKDA). The table adds the roofline floor of KDA_SPEC.md §8 (measured ceilings 790 TFLOP/s, 4.3 TB/s)
and the goal of the native-kernel issue: cula's time <= 0.8 x FlashKDA's, judged through FLA in this run
(FLA/cula >= 1.25 x FLA/FlashKDA from the issue's anchor run).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")
# FLA's own kernels: cuLA registers itself as a backend of FLA's registry, which would make "FLA" run cuLA
os.environ["FLA_CULA"] = "0"

import torch  # noqa: E402

PEAK_FLOPS = 790e12
PEAK_BYTES = 4.3e12
FLOP_PER_CHUNK_HEAD = 10.89e6  # KDA_SPEC §8, K = V = 128, C = 64
K = V = 128
# recorded in the header: "default" when unset (cula_sm90/kda.py)
SM90_KNOBS = ("CULA_SM90_INTRA_TUNED", "CULA_SM90_PDL")


@dataclass(frozen=True)
class Config:
    name: str
    B: int
    T: int
    H: int
    HV: int
    lens: tuple[int, ...] | None = None  # varlen sequence lengths (B = 1, sum = T)
    fla_ms: float | None = None  # the anchor run
    flashkda_ms: float | None = None


def _varlen(total: int, n: int, kind: str, seed: int) -> tuple[int, ...]:
    if kind == "uniform":
        base = [total // n] * n
        base[-1] += total - sum(base)
        return tuple(base)
    if kind == "skewed":
        half = total // 2
        rest = [(total - half) // (n - 1)] * (n - 1)
        rest[-1] += total - half - sum(rest)
        return (*rest[: (n - 1) // 2], half, *rest[(n - 1) // 2:])
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), n - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True))


ANCHOR_FIXED = {  # (B, T): (FLA ms, FlashKDA ms) from the native-kernel issue
    (1, 512): (1.68, 0.179), (1, 1024): (1.59, 0.258), (1, 4096): (1.31, 0.694), (1, 8192): (2.62, 1.366),
    (1, 16384): (4.25, 2.631), (2, 512): (2.03, 0.221), (2, 1024): (1.30, 0.296), (2, 4096): (2.24, 0.899),
    (2, 8192): (3.96, 1.716), (2, 16384): (7.37, 3.416),
}
ANCHOR_VARLEN_FLASHKDA = {  # (T, n): FlashKDA ms for (uniform, random, skewed)
    (4096, 10): (0.552, 0.599, 0.676), (4096, 20): (0.564, 0.612, 0.760),
    (8192, 10): (0.959, 1.040, 1.221), (8192, 20): (0.970, 1.053, 1.351),
    (16384, 10): (1.729, 1.981, 2.362), (16384, 20): (1.676, 2.092, 2.433),
}


def configs() -> list[Config]:
    out = [Config(f"fixed B{b} T{t}", b, t, 64, 64, None, *ANCHOR_FIXED[(b, t)]) for (b, t) in ANCHOR_FIXED]
    for (t, n), fk in ANCHOR_VARLEN_FLASHKDA.items():
        for kind, fk_ms in zip(("uniform", "random", "skewed"), fk, strict=True):
            out.append(Config(f"varlen T{t} {n}x{kind}", 1, t, 64, 64, _varlen(t, n, kind, seed=t + n), None, fk_ms))
    out.append(Config("GVA H16 HV64 B2 T8192", 2, 8192, 16, 64))
    out.append(Config("B1 H16 T32768", 1, 32768, 16, 16))
    return out


def named_configs(names: str) -> list[Config]:
    """The configs named in ``names`` (comma-separated, as ``--configs`` of the profiling scripts takes them), in
    :func:`configs` order; ``SystemExit`` naming the unknown ones."""
    wanted = names.split(",")
    chosen = [cfg for cfg in configs() if cfg.name in wanted]
    unknown = sorted(set(wanted) - {cfg.name for cfg in chosen})
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}")
    return chosen


def make_inputs(cfg: Config, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    N = cfg.B if cfg.lens is None else len(cfg.lens)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    kwargs = dict(
        q=randn(cfg.B, cfg.T, cfg.H, K), k=randn(cfg.B, cfg.T, cfg.H, K), v=randn(cfg.B, cfg.T, cfg.HV, V),
        g=randn(cfg.B, cfg.T, cfg.HV, K), beta=randn(cfg.B, cfg.T, cfg.HV, dtype=torch.float32),
        initial_state=randn(N, cfg.HV, K, V, dtype=torch.float32), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
        lower_bound=-5.0, A_log=randn(cfg.HV, dtype=torch.float32), dt_bias=randn(cfg.HV * K, dtype=torch.float32),
    )
    if cfg.lens is not None:
        cu = [0]
        for length in cfg.lens:
            cu.append(cu[-1] + length)
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return kwargs


def floor_ms(cfg: Config) -> float:
    lens = cfg.lens if cfg.lens is not None else (cfg.T,) * cfg.B
    N = len(lens)
    chunks = sum(math.ceil(n / 64) for n in lens)
    G = cfg.HV // cfg.H
    flops = chunks * cfg.HV * FLOP_PER_CHUNK_HEAD
    per_token_head = (2 + 2) * K / G + 2 * V + 2 * K + 4 + 2 * V  # q,k (shared by G), v, raw g bf16, beta fp32, o
    bytes_ = cfg.B * cfg.T * cfg.HV * per_token_head + N * cfg.HV * 2 * 4 * K * V
    return max(flops / PEAK_FLOPS, bytes_ / PEAK_BYTES) * 1e3


def event_times_ms(fn, reps: int) -> list[float]:
    """``reps`` CUDA-event timings (ms) of one call of ``fn`` each, the GPU idle before each call (host time to the
    first launch included, as a caller who waits for each result sees it)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def time_ms(fn, reps: int, warmup: int = 5) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return median(event_times_ms(fn, reps))


def interleaved_ms(fns: dict, reps: int, rounds: int, warmup: int = 5, knobs: dict | None = None,
                   ) -> dict[str, float]:
    """Median of ``reps`` CUDA-event timings per contender of ``fns`` (name -> zero-argument callable), taken in
    ``rounds`` rounds that each time every contender in turn (the order rotated by one per round), after ``warmup``
    calls each. The H200's clocks drift by 5-10% over seconds (the same config measured 0.54 ms in a process's first
    timings and 0.48 ms a minute later, 2026-11-30); interleaving puts that drift on every contender alike instead of
    on whichever was timed during a slow spell, which matters for the ratios of the table. ``knobs``: name -> the
    contender's environment as a context manager factory (:class:`_Contender`), entered around each of its batches."""
    names = list(fns)
    knobs = knobs or {}
    for name in names:
        with knobs.get(name, contextlib.nullcontext)():
            for _ in range(warmup):
                fns[name]()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in names}
    per_round = -(-reps // rounds)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with knobs.get(name, contextlib.nullcontext)():
                samples[name] += event_times_ms(fns[name], per_round)
    return {name: median(values) for name, values in samples.items()}


def warm_up_gpu(seconds: float) -> None:
    """Keep the GPU busy with bf16 matmuls for ``seconds``, so that the first config is not timed while its clocks
    ramp up from idle."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def contenders(extra: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> dict:
    """The timed calls by name: FLA, cula on each backend, and the ``extra`` knob variants; the names in ``skip``
    ("fla", "cula-sm90", "cula-cutedsl") left out."""
    from cula.kda import kda_prefill

    runs = {}
    if "fla" not in skip:  # (not imported when skipped)
        try:
            from fla.ops.kda import chunk_kda

            def fla(kw):  # (kw's cu_seqlens already int64: fla_inputs)
                return chunk_kda(**kw)

            runs["fla"] = fla
        except ImportError as error:
            print(f"FLA not importable ({error}); FLA columns stay empty")
    for backend in ("sm90", "cutedsl"):
        if f"cula-{backend}" not in skip:
            runs[f"cula-{backend}"] = _cula_run(kda_prefill, backend, {})
    for spec in extra:  # "backend:NAME=value[,NAME=value]": the backend with those knobs, side by side
        backend, _, knobs = spec.partition(":")
        env = dict(item.split("=", 1) for item in knobs.split(",") if item)
        runs[f"cula-{backend}[{knobs}]"] = _cula_run(kda_prefill, backend, env)
    return runs


class _Contender:
    """A timed call, ``contender(kwargs)``, and the environment it runs in: ``with contender.knobs():`` sets its knobs
    (``CULA_BACKEND`` and any others) and restores them on exit. The benchmark sets them around each batch of calls,
    not inside each timed call: a user does not change ``os.environ`` per call, and setting and restoring two
    variables costs the host several microseconds before the first launch (``os.environ`` writes call ``putenv``)."""

    def __init__(self, fn, env: dict[str, str]) -> None:
        self.fn, self.env = fn, env

    def __call__(self, kw):
        return self.fn(kw)

    @contextlib.contextmanager
    def knobs(self):
        saved = {name: os.environ.get(name) for name in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _cula_run(kda_prefill, backend: str, env: dict) -> _Contender:
    """A contender: ``kda_prefill`` forced onto ``backend`` with the environment knobs ``env`` (set around its
    batches of calls: :class:`_Contender`)."""
    return _Contender(lambda kw: kda_prefill(**kw), {"CULA_BACKEND": backend, **env})


def fla_inputs(kwargs: dict) -> dict:
    """``kwargs`` (:func:`make_inputs`) as FLA's ``chunk_kda`` takes them: ``cu_seqlens`` int64."""
    if "cu_seqlens" not in kwargs:
        return kwargs
    return {**kwargs, "cu_seqlens": kwargs["cu_seqlens"].long()}


def host_loop_ms() -> float:
    """Best of 5 timings of ``sum(range(10**6))``: how fast this machine's host runs Python."""
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        sum(range(10**6))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def environment() -> list[str]:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    try:
        import fla

        fla_version = fla.__version__
    except ImportError:
        fla_version = "absent"
    import importlib.metadata

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return [
        f"- GPU / driver: {smi}",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton_version}, fla-core {fla_version} "
        f"(FLA_FLASH_KDA={os.environ.get('FLA_FLASH_KDA')}), Python {platform.python_version()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}",
        f"- host CPU speed: {host_loop_ms():.1f} ms for a Python sum over 10^6 ints (small-T times are mostly host "
        "time, FLA's above all: lent machines' hosts differ by up to 2x, which moves the ratios)",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- CuTeDSL: nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')} "
        f"(libs: {', '.join(d for d in ('cu12', 'cu13') if version('nvidia-cutlass-dsl-libs-' + d) != 'absent')}), "
        f"apache-tvm-ffi {version('apache-tvm-ffi')}",
        "- cula knobs: sm90: "
        + ", ".join(f"{name}={os.environ.get(name, 'default')}" for name in SM90_KNOBS),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/kda_prefill_h200.md")
    parser.add_argument("--reps", type=int, default=100, help="CUDA-event timings per contender and config")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds the timings are split over (see interleaved_ms)")
    parser.add_argument("--warm-up-s", type=float, default=3.0, help="seconds of GPU load before the first config")
    parser.add_argument("--only", default="", help="comma-separated substrings of config names to run")
    parser.add_argument("--extra", action="append", default=[],
                        help='another contender, "backend:NAME=value[,NAME=value]", e.g. sm90:CULA_SM90_PDL=0 or '
                             'sm90:CULA_SM90_INTRA_TUNED=tensor (repeatable; timed in the same process)')
    parser.add_argument("--skip", default="",
                        help='comma-separated contenders left out: "fla", "cula-sm90", "cula-cutedsl" (quick A/B runs '
                             'of --extra variants; the table then lacks those columns)')
    args = parser.parse_args()
    runs = contenders(tuple(args.extra), tuple(x for x in args.skip.split(",") if x))
    # each contender's environment (cula's knobs), entered around its first call and each batch of its timings
    knobs = {name: fn.knobs for name, fn in runs.items() if isinstance(fn, _Contender)}
    rows = []
    warmed = False
    for cfg in configs():
        if args.only and not any(s in cfg.name for s in args.only.split(",")):
            continue
        kwargs = make_inputs(cfg)
        times: dict[str, float | str] = {}
        ready = {}
        for name, fn in runs.items():  # first calls (compilation, autotuning) apart from the timings
            # (FLA takes int64 boundaries: converted here once, not inside its timings)
            kw = fla_inputs(kwargs) if name == "fla" else kwargs
            try:
                start = time.perf_counter()
                with knobs.get(name, contextlib.nullcontext)():
                    fn(kw)
                torch.cuda.synchronize()
                times[name + " first-call s"] = time.perf_counter() - start
                ready[name] = lambda fn=fn, kw=kw: fn(kw)
            except (NotImplementedError, RuntimeError) as error:
                times[name] = f"n/a ({str(error)[:60]})"
        if not warmed:
            warm_up_gpu(args.warm_up_s)
            warmed = True
        times.update(interleaved_ms(ready, args.reps, args.rounds, knobs=knobs))
        rows.append((cfg, times))
        print(cfg.name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in times.items()}, flush=True)
    write_table(rows, args.out)


def write_table(rows: list, out: str) -> None:
    lines = ["# KDA prefill on the H200: cuLA vs FLA Triton", "", *environment(), "",
             "H=HV=64 unless named, K=V=128, bf16, gate/L2 norm/beta sigmoid in kernel, safe gate lower_bound=-5, "
             "fp32 h0, final state out. ms = median of the CUDA-event timings, taken in interleaved rounds over the "
             "contenders (`interleaved_ms`; reps and rounds in the command). Goal: FLA/cula >= 1.25 x FLA/FlashKDA "
             "(the issue's anchor ratios), i.e. cula <= 0.8 x FlashKDA.", "",
             "| config | FLA ms | cula-sm90 ms | FLA/cula | anchor FLA/FlashKDA | goal ratio | goal met | floor ms | "
             "cula/floor | cula-cutedsl ms | FLA/cutedsl | cutedsl/sm90 |", "|---" * 12 + "|"]
    for cfg, times in rows:
        fla, ours = times.get("fla"), times.get("cula-sm90")
        have = isinstance(fla, float) and isinstance(ours, float)
        ratio = fla / ours if have else None
        anchor_fla = cfg.fla_ms if cfg.fla_ms is not None else None
        anchor = (anchor_fla / cfg.flashkda_ms) if (anchor_fla and cfg.flashkda_ms) else None
        goal = 1.25 * anchor if anchor else None
        if goal and ratio:
            met = "yes" if ratio >= goal else "no"
        elif cfg.flashkda_ms and isinstance(ours, float):
            met = ("yes" if ours <= 0.8 * cfg.flashkda_ms else "no") + " (abs. ms vs 0.8 x FlashKDA)"
        else:
            met = "-"
        floor = floor_ms(cfg)

        def fmt(x, digits=3):
            return f"{x:.{digits}f}" if isinstance(x, float) else (x if x else "-")

        over_floor = ours / floor if isinstance(ours, float) else None
        cute = times.get("cula-cutedsl")
        cute_ms = cute if isinstance(cute, float) else None
        fla_over_cute = fla / cute_ms if (cute_ms and isinstance(fla, float)) else None
        cute_over_native = cute_ms / ours if (cute_ms and isinstance(ours, float)) else None
        lines.append(f"| {cfg.name} | {fmt(fla)} | {fmt(ours)} | {fmt(ratio, 2)} | {fmt(anchor, 2)} | "
                     f"{fmt(goal, 2)} | {met} | {floor:.3f} | {fmt(over_floor, 1)} | {fmt(cute_ms)} | "
                     f"{fmt(fla_over_cute, 2)} | {fmt(cute_over_native, 2)} |")
    extras = sorted({name for _, times in rows for name in times if "[" in name and "first-call" not in name})
    if extras:  # the knob variants beside their base backend, same process
        lines += ["", "Knob variants, timed in the same process (ms; ratio = base backend ms / variant ms):", "",
                  "| config | " + " | ".join(f"{name} ms | ratio" for name in extras) + " |",
                  "|---" * (1 + 2 * len(extras)) + "|"]
        for cfg, times in rows:
            cells = []
            for name in extras:
                base, variant = times.get(name.split("[")[0]), times.get(name)
                ok = isinstance(base, float) and isinstance(variant, float)
                cells += [f"{variant:.3f}" if isinstance(variant, float) else "-",
                          f"{base / variant:.2f}" if ok else "-"]
            lines.append(f"| {cfg.name} | " + " | ".join(cells) + " |")
    first = [f"{name}: {times[name]:.1f} s" for _, times in rows[:1] for name in times
             if name.endswith("first-call s")]
    lines += ["", f"First call (compile/autotune included) on the first config: {', '.join(first)}", ""]
    try:
        from cula_runtime.cute.compile_cache import compile_records

        records = compile_records()
    except ImportError:
        records = []
    if records:
        lines += ["CuTeDSL compile time per kernel configuration (first call):", ""]
        lines += [f"- {r.kernel} for {r.target}: {r.seconds:.1f} s ({r.config})" for r in records]
        lines.append("")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n".join(lines))
    print("\n".join(lines))
    write_plot(rows, Path(out).with_suffix(".png"))


def write_plot(rows: list, path: Path) -> None:
    """Bar chart of ms per config and contender (log scale), beside the markdown table; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot written")
        return
    names = [cfg.name for cfg, _ in rows]
    series = {"FLA": "fla", "cula-sm90": "cula-sm90", "cula-cutedsl": "cula-cutedsl"}
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(names)), 5))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series.items()):
        values = [t.get(key) if isinstance(t.get(key), float) else 0.0 for _, t in rows]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
    floors = [floor_ms(cfg) for cfg, _ in rows]
    ax.plot([x + 0.4 - width / 2 for x in range(len(names))], floors, "k_", markersize=12, label="roofline floor")
    ax.set_yscale("log")
    ax.set_ylabel("ms (median)")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=70, ha="right", fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
