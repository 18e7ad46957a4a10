"""KDA decode on the H200 (issue 26 item 6): cuLA's ``kda_decode`` against FLA Triton ``fused_recurrent_kda_fwd``,
side by side in one process, on an in-place state pool; and, with ``--pool-prefill``, the pool form of
``kda_prefill`` against gather + prefill + scatter.

    python benchmarks/bench_kda_decode.py [--only "fp32 kfirst"] [--merge benchmarks/results/kda_decode_h200.json]
        [--out benchmarks/results/kda_decode_h200.md] [--skip fla] [--gate fp32|in-kernel] [--cula-form dense|varlen]
    python benchmarks/bench_kda_decode.py --pool-prefill [--only "fixed B1"] [--merge ...] [--out ...]

Decode rows: one decode step of N sequences (N in 1, 8, 32, 128, 512), (H, HV) in (32, 32), (8, 8), (16, 64),
K = V = 128, an fp32 or bf16 pool of P = 2N + 1 slots laid out K-first [P, HV, K, V] ("kfirst") or V-first
[P, HV, V, K] ("vfirst", ``state_v_first``), the N slots a random subset of the pool (int32 indices); bf16 q/k/v,
beta already a sigmoid (fp32), the Kimi-like gate g = -exp(A_log) softplus(raw + dt_bias) precomputed in fp32
(``--gate in-kernel``: the raw gate in bf16 with A_log and dt_bias, activated in kernel), q/k L2 norm in kernel, o
written into a buffer given as ``out`` (no allocation or memset in the call). Contenders:

- ``cula``: ``cula.kda.kda_decode`` (validation and dispatch included), inputs [N, 1, ...] (``--cula-form varlen``:
  [1, N, ...] with int32 ``cu_seqlens``, as FLA gets them); left out, with the reason, when its dispatch would run the
  torch reference (not capturable);
- ``cutedsl-direct``: ``cula_runtime.cute.kda.decode.kda_decode_cutedsl`` on the same arguments (no validation, no
  dispatch: cula - cutedsl-direct is the host cost of the API);
- ``fla``: ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` on its continuous-batching path (B = 1, T = N,
  int64 ``cu_seqlens``, ``initial_state`` = the pool, ``ssm_state_indices``, ``inplace_final_state=True``), with
  FLA_FLASH_KDA=0; imported only here, and only without ``--skip fla``.

Per row and contender: accuracy first (one call on a fresh copy of the pool: relative L2 error of o and of the
written states against ``cula_runtime.reference``'s decode in float64, and whether the slots no index names kept
their bits); then, interleaved over the contenders (``bench_kda_prefill.interleaved_ms``, CUDA events, median):
CUDA-graph replays of ``--graph-calls`` calls captured in one graph (per call: the launch latency of the replay
shared out), replays of a one-call graph (the launch latency included), and lone eager calls (the GPU idle before
each: host time to the launch included); then the GPU time per eager call with the host ahead (``--host-calls``
calls enqueued behind a GPU sleep, CUDA events around them) and the host time per eager call
(``host_overhead_kda.host_us``: the median wall time of one call while the GPU sleeps). The pool is updated in
place by every timed call; its states stay bounded (decays < 1, unit-norm keys, beta in (0, 1)) and are checked
finite after the timings.

Each decode row also times a yardstick among the contenders' graphs: one in-place pass over a buffer of the states'
bytes (torch's ``mul_``; ``state_pass``), what moving those bytes alone costs at the row's size.

The HBM floor of a row: the state read and written (N HV K V, twice, in the pool's dtype) plus q, k, v, o (bf16), g
(fp32, or the bf16 raw gate), beta (fp32) and the indices, at 4.3 TB/s (the measured ceiling bench_kda_prefill.py
uses; the datasheet's 4.8 TB/s in KDA_SPEC §8). Goals (issue 26): graph replay <= 1.15x the floor at N >= 128,
<= 6 us per step at N <= 8, eager host time <= 20 us per call, the bf16 pool <= 0.6x the fp32 pool's time at
N >= 128; accuracy no worse than FLA's (flagged past 1.25x, the factor of the frozen bounds). "(short)" marks a miss.

``--pool-prefill`` rows: the 28 configs of bench_kda_prefill.py (its inputs and flags), each backend forced in turn
(``CULA_BACKEND``): ``kda_prefill(..., state=pool, state_indices=idx)`` against ``initial_state=pool[idx]``,
``output_final_state=True`` then ``pool[idx] = final`` (fp32 K-first pool of 2N + 1 slots), eager CUDA-event
timings in interleaved rounds, and whether both forms give the same bits (o and the pool).

``--only``: comma-separated selectors; a selector is words that must all be words of a row's name ("fp32 kfirst",
"N1", "HV64 N512", "fixed B2"). Results are written after every row, as markdown to ``--out`` and as JSON beside it
(same name, ``.json``); ``--merge`` keeps the rows of an earlier run's JSON that this run does not measure, so a run
split over several device calls ends in one file.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")
# FLA's own kernels: cuLA registers itself as a backend of FLA's registry, which would make "FLA" run cuLA
os.environ["FLA_CULA"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_kda_prefill import (  # noqa: E402
    PEAK_BYTES,
    _Contender,
    configs,
    environment,
    interleaved_ms,
    warm_up_gpu,
)
from bench_kda_prefill import make_inputs as prefill_inputs  # noqa: E402
from host_overhead_kda import GpuSleep, host_us  # noqa: E402

K = V = 128
NS = (1, 8, 32, 128, 512)
HEADS = ((32, 32), (8, 8), (16, 64))
POOL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTENDERS = ("cula", "cutedsl-direct", "fla")
#: the yardstick timed beside the contenders in each decode row (:func:`state_pass`)
STATE_PASS = "state pass"
PREFILL_BACKENDS = ("sm90", "cutedsl")
PREFILL_FORMS = ("pool", "gather")
# goals of issue 26 item 6
FLOOR_GOAL, FLOOR_GOAL_MIN_N = 1.15, 128
SMALL_GOAL_US, SMALL_GOAL_MAX_N = 6.0, 8
HOST_GOAL_US = 20.0
BF16_GOAL, BF16_GOAL_MIN_N = 0.6, 128
ACCURACY_FACTOR = 1.25  # error / FLA's error flagged beyond this (FLA_FACTOR of tests/gpu_backends.py)
TITLE = "# KDA decode on the H200: cuLA kda_decode vs FLA fused_recurrent_kda_fwd, on an in-place state pool"


# ----------------------------------------------------------------------------------------------- rows and the floor

@dataclass(frozen=True)
class DecodeCase:
    """One decode row: the pool's dtype ("fp32" or "bf16") and layout, the heads, the sequences (one token each)."""

    pool_dtype: str
    v_first: bool
    H: int
    HV: int
    N: int

    @property
    def name(self) -> str:
        return f"{self.pool_dtype} {'vfirst' if self.v_first else 'kfirst'} H{self.H} HV{self.HV} N{self.N}"

    @property
    def slots(self) -> int:
        """The pool's size P: the N slots in use and N + 1 others (a random subset is used)."""
        return 2 * self.N + 1


def decode_cases() -> list[DecodeCase]:
    """Every decode row of issue 26 item 6, grouped so that rows sharing a compiled kernel run one after another."""
    return [DecodeCase(dtype, v_first, H, HV, N) for dtype in POOL_DTYPES for v_first in (False, True)
            for H, HV in HEADS for N in NS]


def matches(name: str, only: str) -> bool:
    """Whether ``name`` is selected by ``only``: comma-separated selectors, each a set of words that must all be
    words of the name (so "N1" selects N1 and not N128); an empty ``only`` selects everything."""
    words = set(name.split())
    selectors = [s.split() for s in only.split(",") if s.strip()]
    return not selectors or any(set(sel) <= words for sel in selectors)


def floor_bytes(case: DecodeCase, g_itemsize: int) -> int:
    """Bytes one decode step moves at the least: the states read and written, q/k/v/o in bf16, g (``g_itemsize``:
    4 for the fp32 log-gate, 2 for the bf16 raw gate), fp32 beta and the int32 indices."""
    state = case.N * case.HV * K * V * (4 if case.pool_dtype == "fp32" else 2) * 2
    qk = 2 * case.N * case.H * K * 2
    vo = 2 * case.N * case.HV * V * 2
    gate = case.N * case.HV * K * g_itemsize
    beta = case.N * case.HV * 4
    return state + qk + vo + gate + beta + case.N * 4


def floor_us(case: DecodeCase, g_itemsize: int) -> float:
    """The HBM floor of one step at :data:`bench_kda_prefill.PEAK_BYTES` (4.3 TB/s), in microseconds."""
    return floor_bytes(case, g_itemsize) / PEAK_BYTES * 1e6


# ------------------------------------------------------------------------------------------------------- the inputs

@dataclass
class DecodeInputs:
    """One row's tensors: q/k [N, 1, H, K], v [N, 1, HV, V] bf16; g fp32 [N, 1, HV, K] and the raw gate (bf16) with
    A_log [HV] and dt_bias [HV * K]; beta [N, 1, HV] fp32; the pool and its untouched copy; the int32 slots; out;
    int32 cu_seqlens [0, 1, ..., N] for the packed form."""

    case: DecodeCase
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    raw: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    beta: torch.Tensor
    pool: torch.Tensor
    pristine: torch.Tensor
    idx: torch.Tensor
    out: torch.Tensor
    cu_seqlens: torch.Tensor


def make_decode_inputs(case: DecodeCase, device: str = "cuda", seed: int = 0) -> DecodeInputs:
    """The Kimi-like inputs of one row (see the module docstring), on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N, H, HV, P = case.N, case.H, case.HV, case.slots

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    A_log = torch.log(1 + 15 * torch.rand(HV, generator=gen, device=device))
    dt_bias = 0.5 * randn(HV * K)
    raw = randn(N, 1, HV, K)
    g = -A_log.exp()[:, None] * torch.nn.functional.softplus(raw + dt_bias.view(HV, K))
    shape = (P, HV, V, K) if case.v_first else (P, HV, K, V)
    pool = randn(*shape, dtype=POOL_DTYPES[case.pool_dtype])
    idx = torch.randperm(P, generator=gen, device=device)[:N].to(torch.int32)
    return DecodeInputs(
        case=case, q=randn(N, 1, H, K, dtype=torch.bfloat16), k=randn(N, 1, H, K, dtype=torch.bfloat16),
        v=randn(N, 1, HV, V, dtype=torch.bfloat16), g=g, raw=raw.to(torch.bfloat16), A_log=A_log, dt_bias=dt_bias,
        beta=torch.sigmoid(randn(N, 1, HV)), pool=pool, pristine=pool.clone(), idx=idx,
        out=torch.zeros(N, 1, HV, V, dtype=torch.bfloat16, device=device),
        cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device=device),
    )


def gate_kwargs(inp: DecodeInputs, gate: str) -> dict:
    """The gate arguments both APIs name alike: the fp32 log-gate, or the raw gate with its in-kernel parameters."""
    if gate == "fp32":
        return {"g": inp.g}
    return {"g": inp.raw, "A_log": inp.A_log, "dt_bias": inp.dt_bias, "use_gate_in_kernel": True}


def cula_kwargs(inp: DecodeInputs, gate: str, form: str = "dense") -> dict:
    """``cula.kda.kda_decode``'s (and ``kda_decode_cutedsl``'s) arguments: [N, 1, ...] inputs, or with ``form``
    "varlen" [1, N, ...] and int32 ``cu_seqlens``."""
    kw = {"q": inp.q, "k": inp.k, "v": inp.v, "beta": inp.beta, **gate_kwargs(inp, gate), "state": inp.pool,
          "state_indices": inp.idx, "use_qk_l2norm_in_kernel": True, "state_v_first": inp.case.v_first,
          "out": inp.out}
    if form == "varlen":
        kw = {**kw, **_packed(kw), "cu_seqlens": inp.cu_seqlens}
    return kw


def fla_kwargs(inp: DecodeInputs, gate: str) -> dict:
    """``fused_recurrent_kda_fwd``'s arguments on its continuous-batching path: [1, N, ...] views of the same
    tensors, int64 ``cu_seqlens``, the pool as ``initial_state`` updated in place at ``ssm_state_indices``."""
    kw = {"q": inp.q, "k": inp.k, "v": inp.v, "beta": inp.beta, **gate_kwargs(inp, gate), "out": inp.out}
    return {**kw, **_packed(kw), "initial_state": inp.pool, "ssm_state_indices": inp.idx,
            "inplace_final_state": True, "cu_seqlens": inp.cu_seqlens.long(), "use_qk_l2norm_in_kernel": True,
            "state_v_first": inp.case.v_first}


def _packed(kw: dict) -> dict:
    """The per-token tensors of ``kw`` as [1, N, ...] views (one packed batch of N one-token sequences)."""
    return {name: kw[name].view(1, -1, *kw[name].shape[2:]) for name in ("q", "k", "v", "g", "beta", "out")}


# ------------------------------------------------------------------------------------------------------ contenders

@dataclass(frozen=True)
class Decoder:
    """A decode contender: the function and the maker of its keyword arguments from a row's inputs."""

    fn: Callable
    kwargs: Callable[[DecodeInputs], dict]


def decode_contenders(skip: tuple[str, ...], gate: str, form: str) -> dict[str, Decoder | str]:
    """The contenders by name (:data:`CONTENDERS`, less ``skip``); a string in place of one says why it is absent."""
    runs: dict[str, Decoder | str] = {}
    if "cula" not in skip:
        from cula.kda import kda_decode

        runs["cula"] = Decoder(kda_decode, lambda inp: cula_kwargs(inp, gate, form))
    if "cutedsl-direct" not in skip:
        try:
            from cula_runtime.cute.kda.decode import kda_decode_cutedsl

            runs["cutedsl-direct"] = Decoder(kda_decode_cutedsl, lambda inp: cula_kwargs(inp, gate, form))
        except ImportError as error:
            runs["cutedsl-direct"] = f"not importable ({str(error)[:80]})"
    if "fla" not in skip:
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

            runs["fla"] = Decoder(fused_recurrent_kda_fwd, lambda inp: fla_kwargs(inp, gate))
        except ImportError as error:
            runs["fla"] = f"not importable ({str(error)[:80]})"
    return runs


def cula_refusal(kwargs: dict) -> tuple[str | None, str]:
    """Why ``cula.kda.kda_decode`` cannot be timed on ``kwargs`` (None: it can) and the backend dispatch picks."""
    from cula.dispatch import explain_decode
    from cula_runtime.kda_decode_args import validate_kda_decode

    choice = explain_decode(validate_kda_decode(**kwargs))
    served = next((d.backend for d in reversed(choice.decisions) if d.ok), "none")
    if choice.runner is None:
        return f"no backend: {choice.summary[:120]}", served
    if choice.gpu_fallback or served == "reference":
        return f"dispatch runs the torch reference, not capturable ({choice.summary[:120]})", served
    return None, served


# -------------------------------------------------------------------------------------------------------- accuracy

def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def reference_step(inp: DecodeInputs, gate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """o [N, 1, HV, V] and the new states [N, HV, ...] (the pool's layout) of one step in float64, from the pristine
    pool (``cula_runtime.reference``'s decode with ``compute_dtype=float64``, on a compact float64 pool; q/k/v upcast
    to fp32 exactly, so o comes back unrounded to bf16)."""
    from cula_runtime.kda_decode_args import validate_kda_decode
    from cula_runtime.reference.kda_decode import kda_decode_reference

    start = inp.pristine.index_select(0, inp.idx.long()).double()
    slots = torch.arange(inp.case.N, dtype=torch.int32, device=start.device)
    kw = {**cula_kwargs(inp, gate), "q": inp.q.float(), "k": inp.k.float(), "v": inp.v.float(), "state": start,
          "state_indices": slots, "out": None}
    o = kda_decode_reference(validate_kda_decode(**kw), compute_dtype=torch.float64)
    return o, start


def accuracy(call: Callable[[], object], inp: DecodeInputs, ref: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """One call of ``call`` on a fresh copy of the pool: its errors (o, the written states) against ``ref``
    (:func:`reference_step`) and whether every slot no index names kept its bits."""
    inp.pool.copy_(inp.pristine)
    inp.out.zero_()
    call()
    used = inp.idx.long()
    others = torch.ones(inp.case.slots, dtype=torch.bool, device=used.device)
    others[used] = False
    return {"err_o": rel_l2(inp.out, ref[0]), "err_state": rel_l2(inp.pool.index_select(0, used), ref[1]),
            "others_kept": bool(torch.equal(inp.pool[others], inp.pristine[others]))}


# --------------------------------------------------------------------------------------------------------- timings

def capture_graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` captured in one CUDA graph (after a warm-up call on a side stream), replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def queued_gpu_us(fn: Callable[[], object], calls: int, sleep: GpuSleep, sleep_ms: float) -> tuple[float, bool]:
    """GPU microseconds per eager call with the host ahead: ``calls`` calls enqueued while the GPU sleeps, CUDA
    events around them; and whether the sleep outlasted the enqueueing (if not, the host held the GPU up)."""
    done = sleep.start(sleep_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    ahead = not done.query()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls, ahead


def timed_fns(ready: dict[str, Callable[[], object]], graph_calls: int, notes: dict[str, str]) -> dict:
    """What ``interleaved_ms`` times, by "contender|kind": the graph of ``graph_calls`` calls ("graph"), the one-call
    graph ("replay"), the eager call ("eager"). A capture that fails leaves a note and times eager calls only."""
    fns = {}
    for name, fn in ready.items():
        try:
            many, one = capture_graph(fn, graph_calls), capture_graph(fn, 1)
            fns[f"{name}|graph"], fns[f"{name}|replay"] = many.replay, one.replay
        except RuntimeError as error:
            torch.cuda.synchronize()
            notes[name] = f"graph capture failed ({str(error)[:100]})"
        fns[f"{name}|eager"] = fn
    return fns


def in_place_pass(elements: int, dtype: torch.dtype) -> Callable[[], object]:
    """One in-place pass over a contiguous buffer of ``elements`` values of ``dtype`` (read and written by torch's
    ``mul_``)."""
    buffer = torch.rand(elements, device="cuda").to(dtype)
    return lambda: buffer.mul_(1.0)


def state_pass(case: DecodeCase) -> Callable[[], object]:
    """One in-place pass over as many bytes as a step's states (N HV K V elements in the pool's dtype): what moving
    the states alone costs at this size, the yard stick beside the floor's 4.3 TB/s (a large copy's rate, which
    smaller transfers do not reach)."""
    return in_place_pass(case.N * case.HV * K * V, POOL_DTYPES[case.pool_dtype])


def time_decode(ready: dict[str, Callable[[], object]], opts: argparse.Namespace, sleep: GpuSleep,
                notes: dict[str, str], yardstick: Callable[[], object] | None = None) -> dict[str, dict]:
    """Every timing of the row per contender, in microseconds (see the module docstring); with ``yardstick``, its
    graph replays too, timed among the contenders' (key :data:`STATE_PASS`)."""
    fns = timed_fns(ready, opts.graph_calls, notes)
    if yardstick is not None:
        fns[f"{STATE_PASS}|graph"] = capture_graph(yardstick, opts.graph_calls).replay
    ms = interleaved_ms(fns, opts.reps, opts.rounds) if fns else {}  # (it needs one contender at least)
    per_call = {"graph": 1e3 / opts.graph_calls, "replay": 1e3, "eager": 1e3}
    out: dict[str, dict] = {name: {} for name in ready}
    if yardstick is not None:
        out[STATE_PASS] = {}
    for key, value in ms.items():
        name, kind = key.split("|")
        out[name][f"{kind}_us"] = value * per_call[kind]
    for name, fn in ready.items():
        host_median, _, busy = host_us(fn, opts.host_calls, sleep, max(5.0, 0.5 * opts.host_calls))
        gpu, ahead = queued_gpu_us(fn, opts.host_calls, sleep, 2e-3 * opts.host_calls * host_median + 2.0)
        out[name].update(host_us=host_median, host_gpu_busy=busy, gpu_us=gpu, host_ahead=ahead)
    return out


# -------------------------------------------------------------------------------------------------- one decode row

def first_calls(runs: dict[str, Decoder | str], inp: DecodeInputs, ref: tuple, row: dict,
                ) -> dict[str, Callable[[], object]]:
    """Each contender's first call (compilation included, timed) and its accuracy, into ``row["results"]``; the
    contenders that ran, as zero-argument calls. Those that cannot run leave a note in ``row["notes"]``."""
    results, notes = row["results"], row["notes"]
    ready = {}
    for name, run in runs.items():
        if isinstance(run, str):
            notes[name] = run
            continue
        kw = run.kwargs(inp)
        if name == "cula":
            refusal, row["served"][name] = cula_refusal(kw)
            if refusal:
                notes[name] = refusal
                continue
        call = functools.partial(run.fn, **kw)
        try:
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            results[name] = {"first_s": first_s, **accuracy(call, inp, ref)}
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
            notes[name] = f"{type(error).__name__}: {str(error)[:120]}"
            continue
        ready[name] = call
    return ready


def measure_decode(case: DecodeCase, runs: dict, opts: argparse.Namespace, sleep: GpuSleep,
                   warm: Callable[[], None]) -> dict:
    """One decode row: ``{"name", "case", "floor_us", "results": {contender: {...}}, "notes", "served"}``."""
    row = {"name": case.name, "case": asdict(case), "floor_us": floor_us(case, 4 if opts.gate == "fp32" else 2),
           "results": {}, "notes": {}, "served": {}}
    inp = make_decode_inputs(case, seed=opts.seed)
    ready = first_calls(runs, inp, reference_step(inp, opts.gate), row)
    warm()
    timings = time_decode(ready, opts, sleep, row["notes"], state_pass(case))
    row["pass_us"] = timings.pop(STATE_PASS).get("graph_us")
    for name, measured in timings.items():
        row["results"][name].update(measured)
    if not bool(torch.isfinite(inp.pool.index_select(0, inp.idx.long())).all()):
        row["notes"]["pool"] = "states not finite after the timings"
    return row


# ------------------------------------------------------------------------------------------------- the pool prefill

def pool_prefill_state(kwargs: dict, seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """bench_kda_prefill's ``kwargs`` without ``initial_state`` / ``output_final_state``, an fp32 K-first pool of
    2N + 1 slots (the N start states at a random subset of them) and those slots (int32)."""
    h0 = kwargs["initial_state"]
    N = h0.shape[0]
    gen = torch.Generator(device=h0.device).manual_seed(seed)
    pool = torch.randn(2 * N + 1, *h0.shape[1:], generator=gen, device=h0.device, dtype=torch.float32)
    idx = torch.randperm(2 * N + 1, generator=gen, device=h0.device)[:N].to(torch.int32)
    pool[idx.long()] = h0
    base = {name: value for name, value in kwargs.items() if name not in ("initial_state", "output_final_state")}
    return base, pool, idx


def pool_prefill(kda_prefill: Callable, base: dict, pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The pool form: one ``kda_prefill`` call that reads and writes the pool's slots in place; o."""
    return kda_prefill(**base, state=pool, state_indices=idx)[0]


def gather_prefill(kda_prefill: Callable, base: dict, pool: torch.Tensor, idx64: torch.Tensor) -> torch.Tensor:
    """What a caller does without the pool form: gather the start states, prefill with the final states out,
    scatter them back; o."""
    o, final = kda_prefill(**base, initial_state=pool.index_select(0, idx64), output_final_state=True)
    pool.index_copy_(0, idx64, final)
    return o


def prefill_refusal(contender: _Contender, kwargs: dict) -> str | None:
    """Why the forced backend of ``contender`` does not serve ``kwargs`` itself (None: it does)."""
    from cula.dispatch import explain
    from cula_runtime.kda_args import validate_kda_prefill

    with contender.knobs():
        choice = explain(validate_kda_prefill(**kwargs))
    rejected = [f"{d.backend}: {d.reason}" for d in choice.decisions if not d.ok]
    if choice.runner is None or rejected:
        return ("; ".join(rejected) or choice.summary)[:160]
    return None


def prefill_contenders(skip: tuple[str, ...]) -> dict[str, tuple[str, _Contender]]:
    """The contenders by name, "<backend> <form>": (form, the call forced onto that backend, taking
    ``(base, pool, idx, idx64)``)."""
    from cula.kda import kda_prefill

    def make(form: str) -> Callable:
        if form == "pool":
            return lambda a: pool_prefill(kda_prefill, a[0], a[1], a[2])
        return lambda a: gather_prefill(kda_prefill, a[0], a[1], a[3])

    return {f"{backend} {form}": (form, _Contender(make(form), {"CULA_BACKEND": backend}))
            for backend in PREFILL_BACKENDS if f"cula-{backend}" not in skip for form in PREFILL_FORMS}


def measure_prefill(cfg, runs: dict, opts: argparse.Namespace, warm: Callable[[], None]) -> dict:
    """One pool-prefill row: ms per contender, whether each backend's two forms gave the same bits, notes."""
    base, pool, idx = pool_prefill_state(prefill_inputs(cfg, seed=opts.seed), opts.seed)
    pristine, idx64 = pool.clone(), idx.long()
    checked = {"pool": {**base, "state": pool, "state_indices": idx},
               "gather": {**base, "initial_state": pool.index_select(0, idx64), "output_final_state": True}}
    notes, ready, knobs, outputs = {}, {}, {}, {}
    for name, (form, contender) in runs.items():
        refusal = prefill_refusal(contender, checked[form])
        if refusal:
            notes[name] = refusal
            continue
        pool.copy_(pristine)
        try:  # (the first call compiles)
            with contender.knobs():
                o = contender((base, pool, idx, idx64))
            torch.cuda.synchronize()
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
            notes[name] = f"{type(error).__name__}: {str(error)[:120]}"
            continue
        outputs[name] = (o.clone(), pool.index_select(0, idx64))
        ready[name] = functools.partial(contender, (base, pool, idx, idx64))
        knobs[name] = contender.knobs
    warm()
    times = interleaved_ms(ready, opts.reps, opts.rounds, knobs=knobs) if ready else {}
    same = {backend: _same_bits(outputs.get(f"{backend} pool"), outputs.get(f"{backend} gather"))
            for backend in PREFILL_BACKENDS}
    return {"name": cfg.name, "results": times, "same_bits": same, "notes": notes}


def _same_bits(a: tuple | None, b: tuple | None) -> bool | None:
    """Whether two (o, states) pairs are bit-identical; None when either is missing."""
    if a is None or b is None:
        return None
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------------------- results

def fresh_state() -> dict:
    """What a results file holds: each run's header lines, the decode rows and the pool-prefill rows."""
    return {"runs": [], "decode": [], "prefill": []}


def load_state(path: str | None) -> dict:
    """An earlier run's results (its JSON) to merge into, or a fresh state."""
    if not path:
        return fresh_state()
    state = json.loads(Path(path).read_text())
    return {**fresh_state(), **state}


def put_row(rows: list[dict], row: dict, order: list[str]) -> list[dict]:
    """``rows`` with ``row`` in place of the row of its name (added if new), sorted by ``order`` (names)."""
    kept = [r for r in rows if r["name"] != row["name"]] + [row]
    rank = {name: i for i, name in enumerate(order)}
    return sorted(kept, key=lambda r: rank.get(r["name"], len(rank)))


def write_results(out: str, state: dict) -> None:
    """The markdown report at ``out`` and the state as JSON beside it."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(state, indent=1) + "\n")
    path.write_text(render(state))


def _num(x: object, digits: int = 1) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) else "-"


def _short(missed: bool) -> str:
    return " (short)" if missed else ""


def _cell(row: dict, name: str, key: str, fmt: Callable[[float], str]) -> str:
    """A contender's value formatted, "n/a" where it could not run, "-" where the value is missing."""
    value = row["results"].get(name, {}).get(key)
    if isinstance(value, float):
        return fmt(value)
    return "n/a" if name in row["notes"] else "-"


def step_us(us: float, N: int) -> str:
    """A graph time per call, short of the small-N goal where N <= 8 and it is over 6 us."""
    return f"{us:.2f}" + _short(N <= SMALL_GOAL_MAX_N and us > SMALL_GOAL_US)


def over_floor(us: float, floor: float, N: int) -> str:
    """A graph time over the floor, short of the goal where N >= 128 and it is over 1.15."""
    return f"{us / floor:.2f}" + _short(N >= FLOOR_GOAL_MIN_N and us / floor > FLOOR_GOAL)


def host_time(us: float, waited: bool) -> str:
    """A host time per call, short of the goal over 20 us; "(waited)" where a call waited for the GPU."""
    return f"{us:.1f}" + (" (waited)" if waited else "") + _short(us > HOST_GOAL_US)


def gpu_time(us: float, host_bound: bool) -> str:
    """A GPU time per eager call; "(host-bound)" where the host fell behind while enqueueing."""
    return f"{us:.2f}" + (" (host-bound)" if host_bound else "")


def present(rows: list[dict]) -> list[str]:
    """The contenders that ran or left a note in any row, in :data:`CONTENDERS` order."""
    return [c for c in CONTENDERS if any(c in r["results"] or c in r["notes"] for r in rows)]


def graph_table(rows: list[dict]) -> list[str]:
    """CUDA-graph replay time per call against the floor, with the goals."""
    names = present(rows)
    head = "| row | floor us | state pass us (x floor) | " + " | ".join(
        f"{n} us/call | {n} x floor | {n} 1-call replay us" for n in names)
    lines = [head + " |", "|---" * (3 + 3 * len(names)) + "|"]
    for r in rows:
        N, floor, passed = r["case"]["N"], r["floor_us"], r.get("pass_us")
        cells = [r["name"], f"{floor:.2f}", "-" if passed is None else f"{passed:.2f} ({passed / floor:.2f}x)"]
        for n in names:
            cells += [_cell(r, n, "graph_us", functools.partial(step_us, N=N)),
                      _cell(r, n, "graph_us", functools.partial(over_floor, floor=floor, N=N)),
                      _cell(r, n, "replay_us", "{:.2f}".format)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def eager_table(rows: list[dict]) -> list[str]:
    """Eager calls: a lone call's time, the GPU time with the host ahead, the host time, with the host goal."""
    names = present(rows)
    head = "| row | " + " | ".join(f"{n} lone call us | {n} GPU us | {n} host us" for n in names)
    lines = [head + " |", "|---" * (1 + 3 * len(names)) + "|"]
    for r in rows:
        cells = [r["name"]]
        for n in names:
            res = r["results"].get(n, {})
            cells += [_cell(r, n, "eager_us", "{:.1f}".format),
                      _cell(r, n, "gpu_us", functools.partial(gpu_time, host_bound=not res.get("host_ahead", True))),
                      _cell(r, n, "host_us", functools.partial(host_time, waited=not res.get("host_gpu_busy", True)))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def accuracy_table(rows: list[dict]) -> list[str]:
    """Errors against fp64, each against FLA's, and whether the other slots kept their bits."""
    names = present(rows)
    ours = [n for n in names if n != "fla"]
    head = "| row | " + " | ".join(f"{n} o err | {n} state err | {n} others kept" for n in names)
    head += "".join(f" | {n} / FLA (o, state)" for n in ours if "fla" in names)
    lines = [head + " |", "|---" * (1 + 3 * len(names) + (len(ours) if "fla" in names else 0)) + "|"]
    for r in rows:
        cells = [r["name"]]
        for n in names:
            kept = r["results"].get(n, {}).get("others_kept")
            cells += [_cell(r, n, "err_o", "{:.3e}".format), _cell(r, n, "err_state", "{:.3e}".format),
                      "-" if kept is None else ("yes" if kept else "NO")]
        if "fla" in names:
            cells += [_error_ratios(r, n) for n in ours]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _error_ratios(row: dict, name: str) -> str:
    """``name``'s errors over FLA's, "(worse)" past :data:`ACCURACY_FACTOR`."""
    ours, fla = row["results"].get(name, {}), row["results"].get("fla", {})
    ratios = [ours[k] / fla[k] for k in ("err_o", "err_state") if isinstance(ours.get(k), float)
              and isinstance(fla.get(k), float) and fla[k] > 0]
    if len(ratios) < 2:
        return "-"
    return ", ".join(f"{x:.3f}" for x in ratios) + (" (worse)" if max(ratios) > ACCURACY_FACTOR else "")


def bf16_table(rows: list[dict]) -> list[str]:
    """The bf16 pool's graph time over the fp32 pool's on the same row, at N >= 128."""
    by_name = {r["name"]: r for r in rows}
    names = present(rows)
    lines = ["| row | " + " | ".join(f"{n} bf16 / fp32" for n in names) + " |", "|---" * (1 + len(names)) + "|"]
    for r in rows:
        if r["case"]["pool_dtype"] != "bf16" or r["case"]["N"] < BF16_GOAL_MIN_N:
            continue
        twin = by_name.get(r["name"].replace("bf16", "fp32", 1))
        if twin is None:
            continue
        cells = [r["name"].replace("bf16 ", "", 1)]
        for n in names:
            a, b = r["results"].get(n, {}).get("graph_us"), twin["results"].get(n, {}).get("graph_us")
            ok = isinstance(a, float) and isinstance(b, float)
            cells.append(f"{a / b:.3f}" + _short(a / b > BF16_GOAL) if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def notes_lines(rows: list[dict]) -> list[str]:
    """Each distinct note (why a contender did not run, or what went wrong) once, with its rows; who served cula."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        for who, text in r["notes"].items():
            seen.setdefault((who, text), []).append(r["name"])
        for who, backend in r.get("served", {}).items():
            seen.setdefault((who, f"served by the {backend} backend"), []).append(r["name"])
    return [f"- {who}: {text} ({len(names)} rows: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
            for (who, text), names in seen.items()]


def first_call_lines(rows: list[dict]) -> list[str]:
    """The slowest first call (compilation, autotuning included) of each contender, and where."""
    slowest: dict[str, tuple[float, str]] = {}
    for r in rows:
        for who, res in r["results"].items():
            s = res.get("first_s") if isinstance(res, dict) else None
            if isinstance(s, float) and s > slowest.get(who, (-1.0, ""))[0]:
                slowest[who] = (s, r["name"])
    if not slowest:
        return []
    return ["First calls (compilation included), the slowest per contender: "
            + ", ".join(f"{who} {s:.1f} s ({name})" for who, (s, name) in slowest.items())]


def prefill_table(rows: list[dict]) -> list[str]:
    """Pool form against gather + prefill + scatter, per backend: ms, the ratio, the same bits."""
    head = "| config | " + " | ".join(f"{b} pool ms | {b} gather+scatter ms | {b} gather / pool | {b} same bits"
                                      for b in PREFILL_BACKENDS)
    lines = [head + " |", "|---" * (1 + 4 * len(PREFILL_BACKENDS)) + "|"]
    for r in rows:
        cells = [r["name"]]
        for b in PREFILL_BACKENDS:
            pool, gather = r["results"].get(f"{b} pool"), r["results"].get(f"{b} gather")
            same = r["same_bits"].get(b)
            cells += [_num(pool, 3), _num(gather, 3),
                      f"{gather / pool:.2f}" if isinstance(pool, float) and isinstance(gather, float) else "-",
                      "-" if same is None else ("yes" if same else "NO")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


DECODE_METHOD = (
    "One decode step per row (bench_kda_decode.py's docstring: inputs, contenders, how each time is taken). "
    "floor = the bytes of the state read and written plus the inputs and o, at 4.3 TB/s; state pass = one in-place "
    "pass (torch's mul_) over a buffer of the states' bytes, timed in the same graphs: what moving those bytes alone "
    "costs at this size. Graph: us per call in a "
    "graph of several calls (its replay's launch latency shared out; the goals are judged on it), and a one-call "
    "graph's replay. Eager: a lone call with the GPU idle before it (host time to the launch included), the GPU time "
    "per call with the host ahead, and the host time per call (median, GPU asleep). Goals (issue 26): graph <= "
    f"{FLOOR_GOAL}x floor at N >= {FLOOR_GOAL_MIN_N}, <= {SMALL_GOAL_US:g} us per step at N <= {SMALL_GOAL_MAX_N}, "
    f"host <= {HOST_GOAL_US:g} us per call, bf16 pool <= {BF16_GOAL}x the fp32 pool at N >= {BF16_GOAL_MIN_N}, "
    f"accuracy no worse than FLA's (flagged past {ACCURACY_FACTOR}x); \"(short)\" marks a miss (FLA's too, for "
    "context). \"(host-bound)\": the host fell behind the GPU while the calls were enqueued; \"(waited)\": a call "
    "waited for the GPU during the host timing.")


def render(state: dict) -> str:
    """The markdown report of ``state``."""
    lines = [TITLE, ""]
    for i, header in enumerate(state["runs"], 1):
        lines += ([f"Run {i}:"] if len(state["runs"]) > 1 else []) + header + [""]
    decode = state["decode"]
    if decode:
        lines += ["## Decode", "", DECODE_METHOD, "", "### CUDA-graph replays against the HBM floor", "",
                  *graph_table(decode), "", "### Eager calls", "", *eager_table(decode), "",
                  "### Accuracy against fp64 (one step from the pristine pool)", "", *accuracy_table(decode), ""]
        bf16 = bf16_table(decode)
        if bf16:
            lines += ["### The bf16 pool against the fp32 pool (graph us per call)", "", *bf16, ""]
        lines += [*notes_lines(decode), *first_call_lines(decode), ""]
    if state["prefill"]:
        lines += ["## The pool form of kda_prefill against gather + prefill + scatter", "",
                  "bench_kda_prefill.py's configs, inputs and flags; an fp32 K-first pool of 2N + 1 slots; ms = median "
                  "CUDA-event time of eager calls in interleaved rounds; \"same bits\": o and the pool's slots after "
                  "one call of each form from the same pool.", "", *prefill_table(state["prefill"]), "",
                  *notes_lines(state["prefill"]), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/kda_decode_h200.md")
    parser.add_argument("--merge", default="", help="an earlier run's JSON whose other rows the results keep")
    parser.add_argument("--only", default="", help='comma-separated selectors of rows, e.g. "fp32 kfirst,bf16 N512"')
    parser.add_argument("--skip", default="",
                        help='comma-separated contenders left out: "cula", "cutedsl-direct", "fla" (decode); '
                             '"cula-sm90", "cula-cutedsl" (--pool-prefill)')
    parser.add_argument("--pool-prefill", action="store_true",
                        help="time the pool form of kda_prefill against gather + prefill + scatter instead")
    parser.add_argument("--gate", choices=("fp32", "in-kernel"), default="fp32")
    parser.add_argument("--cula-form", choices=("dense", "varlen"), default="dense")
    parser.add_argument("--reps", type=int, default=50, help="CUDA-event timings per contender and kind")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds the timings are split over")
    parser.add_argument("--graph-calls", type=int, default=10, help="decode calls captured in the timed graph")
    parser.add_argument("--host-calls", type=int, default=100, help="calls per host-time and queued-GPU-time loop")
    parser.add_argument("--warm-up-s", type=float, default=3.0, help="seconds of GPU load before the first timings")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def settings_line(opts: argparse.Namespace) -> str:
    """The run's settings, for its header (the defaults are not in the command line)."""
    if opts.pool_prefill:
        return f"- settings: --pool-prefill, reps {opts.reps}, rounds {opts.rounds}, seed {opts.seed}"
    return (f"- settings: gate {opts.gate}, cula form {opts.cula_form}, reps {opts.reps}, rounds {opts.rounds}, "
            f"graph calls {opts.graph_calls}, host calls {opts.host_calls}, seed {opts.seed}")


def once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run on the first call only (the GPU warm-up before the first timings)."""
    done = []

    def call() -> None:
        if not done:
            done.append(True)
            fn()
    return call


def main() -> None:
    opts = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kda_decode.py needs a CUDA GPU (run it on the H200)")
    skip = tuple(x for x in opts.skip.split(",") if x)
    state = load_state(opts.merge)
    state["runs"].append([*environment(), settings_line(opts)])
    warm = once(lambda: warm_up_gpu(opts.warm_up_s))
    if opts.pool_prefill:
        runs = prefill_contenders(skip)
        order = [cfg.name for cfg in configs()]
        for cfg in (c for c in configs() if matches(c.name, opts.only)):
            row = measure_prefill(cfg, runs, opts, warm)
            state["prefill"] = put_row(state["prefill"], row, order)
            write_results(opts.out, state)
            print(row["name"], {k: round(v, 4) for k, v in row["results"].items()}, row["same_bits"], row["notes"],
                  flush=True)
            _release()
        return
    runs = decode_contenders(skip, opts.gate, opts.cula_form)
    sleep = GpuSleep()
    order = [case.name for case in decode_cases()]
    for case in (c for c in decode_cases() if matches(c.name, opts.only)):
        row = measure_decode(case, runs, opts, sleep, warm)
        state["decode"] = put_row(state["decode"], row, order)
        write_results(opts.out, state)
        brief = {n: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}
                 for n, res in row["results"].items()}
        print(row["name"], f"floor {row['floor_us']:.2f} us", brief, row["notes"], flush=True)
        _release()


def _release() -> None:
    """Free the row's tensors and graphs before the next row (the largest pools are gigabytes)."""
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
