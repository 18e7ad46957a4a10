"""Lightning Attention on the H200 (issue 28 item 4): cuLA's ``cula.lightning`` (``CULA_BACKEND=cutedsl``) against
FLA 0.6.0 Triton, side by side in one process, on the same inputs; accuracy of both against the float64 recurrence.

    python benchmarks/bench_lightning.py [--only "prefill T16384,decode fp32 kfirst"] [--out FILE.md]
        [--merge FILE.json] [--skip fla] [--oracle-heads 8] [--deadline-s 540]

Prefill rows ("prefill B1 T4096 H64", "prefill varlen T16384 10xrandom H64"): B in {1, 2}, T in {1024, 4096,
16384, 32768}, H in {64, 16}, and packed batches of 10 and 20 sequences (random lengths, bench_kda_prefill.py's
``_varlen``) of 4096 and 16384 tokens at H = 64; K = V = 128, bf16 q/k/v, fp32 initial states [N, H, K, V] and the
final states out, scale K ** -0.5. The decays are FLA's for layer 0 of 2 layers: ``g_gamma[h] = -(8 / H) (1 - 0 / 2)
h`` (head 0 has none), the same fp32 tensor FLA's ``chunk_lightning_attn(layer_idx=0, num_layers=2)`` builds. cuLA:
``lightning_prefill(q, k, v, g_gamma, scale=, initial_state=, output_final_state=True, cu_seqlens=int32)``; FLA:
``fla.ops.lightning_attn.chunk_lightning_attn(q, k, v, layer_idx=0, num_layers=2, scale=, initial_state=,
output_final_state=True, cu_seqlens=int64)``. Time = median of CUDA-event timings of eager calls taken in
interleaved rounds over the contenders after a warm-up (``bench_kda_prefill.interleaved_ms``). The bytes floor: q,
k, v read and o written in bf16, h0 read and ht written in fp32, at 4.3 TB/s (``bench_kda_prefill.PEAK_BYTES``, the
constant bench_kda_decode.py's floor uses; Lightning's arithmetic intensity, ~96 FLOP/B, is below the H200's ridge).
The fp64 oracle (``cula_runtime.reference.lightning.lightning_naive``) runs on ``--oracle-heads`` heads spread over
the H heads, the first and last among them (heads are independent: the errors of both contenders are taken on
those heads; 0: all heads).

Decode rows ("decode fp32 kfirst N128"): one step (T = 1) of N in {1, 8, 32, 128, 512} sequences, H = 64, K = V =
128, bf16 q/v and unit-norm bf16 k, on a state pool of P = 2N + 1 slots, the N slots a random subset (int32
indices): fp32 K-first [P, H, K, V], and as extra rows fp32 V-first [P, H, V, K] and bf16 K-first. cuLA:
``lightning_decode(q, k, v, g_gamma, scale=, state=pool, state_indices=idx, state_v_first=, out=)`` updating the pool
in place; FLA: ``fla.ops.simple_gla.fused_recurrent_simple_gla(q, k, v, g_gamma=, scale=, initial_state=h0,
output_final_state=True, state_v_first=)`` in its dense form (FLA 0.6.0's simple-GLA decode has no state-pool
indices and no in-place update: h0 is the N states gathered from the pool once, outside the timings, in the pool's
dtype; its final state comes back as a new fp32 tensor each call). Timings (bench_kda_decode.time_decode): replays
of a CUDA graph of ``--graph-calls`` steps (per step; the goals are judged on it), of a one-step graph, lone eager
calls, the GPU time per eager call with the host ahead and the host time per call. The HBM floor: the states read
and written (N H K V, in the pool's dtype), q, k, v and o in bf16, the indices and g_gamma.

Goals (issue 28 item 4): prefill FLA / cuLA >= 2 at T >= 4096 (total tokens) and cuLA <= 2.0x the bytes floor at
T >= 16384; decode graph replay <= 1.15x the floor at N >= 128 and <= 6 us per step at N <= 8; errors against fp64
<= 1.25x FLA's. "(short)" marks a miss (FLA's too, for context), "(worse)" an error past 1.25x FLA's.

``--only``: comma-separated selectors; a selector is words that must all be words of a row's name ("prefill",
"decode", "T16384", "decode N8", "fp32 vfirst"; "N1" selects N1, not N128). Results are written after every row,
as markdown to ``--out`` and as JSON beside it; ``--merge`` keeps an earlier run's rows this run does not measure.
Each device call is capped at 10 minutes and FLA's first call per shape autotunes (tens of seconds): progress lines
carry timestamps, and ``--deadline-s`` starts no row past that many seconds (the rows left are listed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import importlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")
# FLA's own kernels: cuLA registers itself as a backend of FLA's registry, which would make "FLA" run cuLA
os.environ["FLA_CULA"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_kda_decode import matches, put_row, rel_l2, time_decode  # noqa: E402
from bench_kda_prefill import PEAK_BYTES, _varlen, environment, interleaved_ms, warm_up_gpu  # noqa: E402

K = V = 128
PREFILL_BS = (1, 2)
PREFILL_TS = (1024, 4096, 16384, 32768)
PREFILL_HEADS = (64, 16)
VARLEN = ((4096, 10), (4096, 20), (16384, 10), (16384, 20))  # (total tokens, sequences), H = 64
DECODE_NS = (1, 8, 32, 128, 512)
DECODE_H = 64
DECODE_POOLS = (("fp32", False), ("fp32", True), ("bf16", False))  # fp32 K-first first: the row
POOL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYER_IDX, NUM_LAYERS = 0, 2  # FLA's decay formula at layer 0 of 2
CONTENDERS = ("cula", "fla")
# goals of issue 28 item 4
SPEEDUP_GOAL, SPEEDUP_MIN_T = 2.0, 4096
PREFILL_FLOOR_GOAL, PREFILL_FLOOR_MIN_T = 2.0, 16384
DECODE_FLOOR_GOAL, DECODE_FLOOR_MIN_N = 1.15, 128
SMALL_GOAL_US, SMALL_GOAL_MAX_N = 6.0, 8
ACCURACY_FACTOR = 1.25
DEVICE = "cuda"  # where the rows' inputs are made (the CPU tests of the harness set "cpu")
TITLE = "# Lightning Attention on the H200: cuLA cula.lightning (cutedsl) vs FLA 0.6.0 Triton"
FLA_DECODE_FORM = ("fused_recurrent_simple_gla(g_gamma=...) in its dense form: no state-pool indices or in-place "
                   "update in FLA 0.6.0; h0 gathered from the pool once outside the timings, the final state a new "
                   "fp32 tensor per call")


def log(message: str) -> None:
    """A progress line with the wall-clock time (a device call is capped: the log shows where the time went)."""
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


def fla_g_gamma(H: int, layer_idx: int = LAYER_IDX, num_layers: int = NUM_LAYERS,
                device: str | torch.device = "cpu") -> torch.Tensor:
    """FLA's Lightning decays, fp32 [H]: ``-(8 / H) (1 - layer_idx / num_layers) h`` for h = 0..H-1, formed with
    FLA's own expression (fla/ops/lightning_attn/chunk.py, 0.6.0), so both contenders get the same bits."""
    return -(8 / H * (1 - layer_idx / num_layers)) * torch.arange(H, dtype=torch.float, device=device)


# ----------------------------------------------------------------------------------------------- rows and floors

@dataclass(frozen=True)
class PrefillCase:
    """One prefill row: B sequences of T tokens, or (``lens``) one packed batch of sequences summing to T."""

    B: int
    T: int
    H: int
    lens: tuple[int, ...] | None = None

    @property
    def N(self) -> int:
        return self.B if self.lens is None else len(self.lens)

    @property
    def name(self) -> str:
        if self.lens is None:
            return f"prefill B{self.B} T{self.T} H{self.H}"
        return f"prefill varlen T{self.T} {len(self.lens)}xrandom H{self.H}"


@dataclass(frozen=True)
class DecodeCase:
    """One decode row: the pool's dtype ("fp32" or "bf16") and layout, N sequences of one token, H heads."""

    pool_dtype: str
    v_first: bool
    N: int
    H: int = DECODE_H

    @property
    def name(self) -> str:
        return f"decode {self.pool_dtype} {'vfirst' if self.v_first else 'kfirst'} N{self.N}"

    @property
    def slots(self) -> int:
        return 2 * self.N + 1


def prefill_cases() -> list[PrefillCase]:
    """The issue's prefill grid, then the packed batches (H = 64)."""
    fixed = [PrefillCase(B, T, H) for H in PREFILL_HEADS for B in PREFILL_BS for T in PREFILL_TS]
    packed = [PrefillCase(1, T, 64, _varlen(T, n, "random", seed=T + n)) for T, n in VARLEN]
    return fixed + packed


def decode_cases() -> list[DecodeCase]:
    """The issue's decode rows (fp32 K-first), then the V-first and bf16 extra rows."""
    return [DecodeCase(dtype, v_first, N) for dtype, v_first in DECODE_POOLS for N in DECODE_NS]


def row_order() -> list[str]:
    return [c.name for c in prefill_cases()] + [c.name for c in decode_cases()]


def prefill_floor_bytes(case: PrefillCase) -> int:
    """q, k, v read and o written in bf16; the N initial states read and the N final states written in fp32."""
    tokens = case.B * case.T
    return tokens * case.H * (2 * K + 2 * V) * 2 + case.N * case.H * K * V * 4 * 2


def decode_floor_bytes(case: DecodeCase) -> int:
    """The N states read and written in the pool's dtype; q, k, v, o in bf16; the int32 indices; fp32 g_gamma."""
    state = case.N * case.H * K * V * (4 if case.pool_dtype == "fp32" else 2) * 2
    return state + case.N * case.H * (2 * K + 2 * V) * 2 + case.N * 4 + case.H * 4


def floor_us(nbytes: int) -> float:
    """Microseconds to move ``nbytes`` at :data:`bench_kda_prefill.PEAK_BYTES` (4.3 TB/s)."""
    return nbytes / PEAK_BYTES * 1e6


def oracle_heads(H: int, count: int) -> list[int]:
    """``count`` heads spread evenly over 0..H-1, the first and the last among them (all of them for 0 or >= H)."""
    if count <= 0 or count >= H:
        return list(range(H))
    if count == 1:
        return [0]
    return sorted({round(i * (H - 1) / (count - 1)) for i in range(count)})


# ---------------------------------------------------------------------------------------------------- the inputs

@dataclass
class PrefillInputs:
    """q/k/v [B, T, H, K|V] bf16, g_gamma [H] fp32, h0 [N, H, K, V] fp32, cu_seqlens int32 and int64 (or None)."""

    case: PrefillCase
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g_gamma: torch.Tensor
    h0: torch.Tensor
    cu32: torch.Tensor | None
    cu64: torch.Tensor | None
    scale: float = K ** -0.5


def make_prefill_inputs(case: PrefillCase, device: str = "cuda", seed: int = 0) -> PrefillInputs:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    cu32 = cu64 = None
    if case.lens is not None:
        cu = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()], device=device)
        cu32, cu64 = cu.to(torch.int32), cu.to(torch.int64)
    return PrefillInputs(case, randn(case.B, case.T, case.H, K), randn(case.B, case.T, case.H, K),
                         randn(case.B, case.T, case.H, V), fla_g_gamma(case.H, device=device),
                         randn(case.N, case.H, K, V, dtype=torch.float32), cu32, cu64)


def cula_prefill_kwargs(inp: PrefillInputs) -> dict:
    """``cula.lightning.lightning_prefill``'s arguments."""
    return {"q": inp.q, "k": inp.k, "v": inp.v, "g_gamma": inp.g_gamma, "scale": inp.scale,
            "initial_state": inp.h0, "output_final_state": True, "cu_seqlens": inp.cu32}


def fla_prefill_kwargs(inp: PrefillInputs) -> dict:
    """``fla.ops.lightning_attn.chunk_lightning_attn``'s arguments (FLA forms g_gamma from layer_idx, num_layers)."""
    return {"q": inp.q, "k": inp.k, "v": inp.v, "layer_idx": LAYER_IDX, "num_layers": NUM_LAYERS,
            "scale": inp.scale, "initial_state": inp.h0, "output_final_state": True, "cu_seqlens": inp.cu64}


@dataclass
class DecodeInputs:
    """q/k/v [N, 1, H, K|V] bf16 (k unit-norm), g_gamma [H] fp32, the pool and its untouched copy, the int32 slots,
    h0 = the pool's N states gathered (FLA's dense form), out [N, 1, H, V] bf16."""

    case: DecodeCase
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g_gamma: torch.Tensor
    pool: torch.Tensor
    pristine: torch.Tensor
    idx: torch.Tensor
    h0: torch.Tensor
    out: torch.Tensor
    scale: float = K ** -0.5


def make_decode_inputs(case: DecodeCase, device: str = "cuda", seed: int = 0) -> DecodeInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    N, H, P = case.N, case.H, case.slots

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    shape = (P, H, V, K) if case.v_first else (P, H, K, V)
    pool = randn(*shape).to(POOL_DTYPES[case.pool_dtype])
    idx = torch.randperm(P, generator=gen, device=device)[:N].to(torch.int32)
    k = torch.nn.functional.normalize(randn(N, 1, H, K), dim=-1)
    return DecodeInputs(case, randn(N, 1, H, K).to(torch.bfloat16), k.to(torch.bfloat16),
                        randn(N, 1, H, V).to(torch.bfloat16), fla_g_gamma(H, device=device), pool, pool.clone(), idx,
                        pool.index_select(0, idx.long()).contiguous(),
                        torch.zeros(N, 1, H, V, dtype=torch.bfloat16, device=device))


def cula_decode_kwargs(inp: DecodeInputs) -> dict:
    """``cula.lightning.lightning_decode``'s arguments: the pool updated in place, o into ``out``."""
    return {"q": inp.q, "k": inp.k, "v": inp.v, "g_gamma": inp.g_gamma, "scale": inp.scale, "state": inp.pool,
            "state_indices": inp.idx, "state_v_first": inp.case.v_first, "out": inp.out}


def fla_decode_kwargs(inp: DecodeInputs) -> dict:
    """``fla.ops.simple_gla.fused_recurrent_simple_gla``'s arguments, dense form (:data:`FLA_DECODE_FORM`)."""
    return {"q": inp.q, "k": inp.k, "v": inp.v, "g_gamma": inp.g_gamma, "scale": inp.scale,
            "initial_state": inp.h0, "output_final_state": True, "state_v_first": inp.case.v_first}


# ------------------------------------------------------------------------------------------------------ contenders

@dataclass(frozen=True)
class Contender:
    """A contender of one row: ``call()`` runs it once; ``read(returned)`` gives (o, the N new states) from what the
    call returned (a pool contender reads its buffers instead)."""

    call: Callable[[], object]
    read: Callable[[object], tuple[torch.Tensor, torch.Tensor]]


def _importable(skip: tuple[str, ...], sources: dict[str, tuple[str, str]]) -> dict[str, Callable | str]:
    """``{name: function}`` for each ``name: (module, attribute)`` of ``sources`` not in ``skip``, imported now; a
    string in place of a function says why it is absent."""
    fns: dict[str, Callable | str] = {}
    for name, (module, attribute) in sources.items():
        if name in skip:
            continue
        try:
            fn = getattr(importlib.import_module(module), attribute, None)
            if fn is None:
                raise ImportError(f"cannot import name {attribute!r} from {module!r}")
            fns[name] = fn
        except ImportError as error:
            fns[name] = f"not importable ({str(error)[:80]})"
    return fns


def prefill_fns(skip: tuple[str, ...]) -> dict[str, Callable | str]:
    """The prefill functions by name; a string in place of one says why it is absent."""
    return _importable(skip, {"cula": ("cula.lightning", "lightning_prefill"),
                              "fla": ("fla.ops.lightning_attn", "chunk_lightning_attn")})


def decode_fns(skip: tuple[str, ...]) -> dict[str, Callable | str]:
    """The decode functions by name; a string in place of one says why it is absent."""
    return _importable(skip, {"cula": ("cula.lightning", "lightning_decode"),
                              "fla": ("fla.ops.simple_gla", "fused_recurrent_simple_gla")})


def prefill_contenders(fns: dict[str, Callable | str], inp: PrefillInputs) -> dict[str, Contender | str]:
    """Each prefill function bound to its arguments; both return (o, final state)."""
    kwargs = {"cula": cula_prefill_kwargs, "fla": fla_prefill_kwargs}
    return {name: fn if isinstance(fn, str) else Contender(functools.partial(fn, **kwargs[name](inp)), tuple)
            for name, fn in fns.items()}


def decode_contenders(fns: dict[str, Callable | str], inp: DecodeInputs) -> dict[str, Contender | str]:
    """cuLA's call reads o from ``out`` and the new states from the pool's slots; FLA's from what it returns."""
    runs: dict[str, Contender | str] = {}
    for name, fn in fns.items():
        if isinstance(fn, str):
            runs[name] = fn
        elif name == "cula":
            runs[name] = Contender(functools.partial(fn, **cula_decode_kwargs(inp)),
                                   lambda _: (inp.out, inp.pool.index_select(0, inp.idx.long())))
        else:
            runs[name] = Contender(functools.partial(fn, **fla_decode_kwargs(inp)), tuple)
    return runs


# -------------------------------------------------------------------------------------------------------- accuracy

def prefill_reference(inp: PrefillInputs, heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, T, len(heads), V] and the final states [N, len(heads), K, V] in float64, on ``heads`` only."""
    from cula_runtime.reference.lightning import lightning_naive

    sel = torch.tensor(heads, device=inp.q.device)
    o, ht = lightning_naive(inp.q.index_select(2, sel), inp.k.index_select(2, sel), inp.v.index_select(2, sel),
                            inp.g_gamma.index_select(0, sel), inp.scale, inp.h0.index_select(1, sel), True,
                            inp.cu32, False)
    return o, ht


def decode_reference(inp: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """o [N, 1, H, V] and the N new states (the pool's layout) of one step from the pristine pool, in float64."""
    from cula_runtime.reference.lightning import lightning_naive

    h0 = inp.pristine.index_select(0, inp.idx.long())
    return lightning_naive(inp.q, inp.k, inp.v, inp.g_gamma, inp.scale, h0, True, None, inp.case.v_first)


def errors(o: torch.Tensor, states: torch.Tensor | None, ref: tuple[torch.Tensor, torch.Tensor],
           heads: list[int] | None = None) -> dict:
    """Relative L2 errors of o and of the states against ``ref``, on ``heads`` (o's axis 2, the states' axis 1);
    no state error where the contender returned no states."""
    if heads is not None:
        sel = torch.tensor(heads, device=o.device)
        o = o.index_select(2, sel)
        states = None if states is None else states.index_select(1, sel)
    out = {"err_o": rel_l2(o, ref[0])}
    if states is not None:
        out["err_state"] = rel_l2(states, ref[1])
    return out


def decode_accuracy(run: Contender, inp: DecodeInputs, ref: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """One call on a fresh copy of the pool: its errors and whether the slots no index names kept their bits."""
    inp.pool.copy_(inp.pristine)
    inp.out.zero_()
    o, states = run.read(run.call())
    others = torch.ones(inp.case.slots, dtype=torch.bool, device=inp.pool.device)
    others[inp.idx.long()] = False
    return {**errors(o, states, ref), "others_kept": bool(torch.equal(inp.pool[others], inp.pristine[others]))}


def first_call(name: str, run: Contender, row: dict) -> object | None:
    """The contender's first call (compilation, autotuning included), timed into ``row``; its return value, or None
    with a note when it failed. Warnings it raised (a fallback, say) become notes."""
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            returned = run.call()
            torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 (a refusal, a Triton compile error: noted, the other contender runs)
        row["notes"][name] = f"{type(error).__name__}: {str(error)[:160]}"
        return None
    row["results"][name] = {"first_s": time.perf_counter() - start}
    if caught:
        row["notes"][name] = "warned: " + "; ".join(sorted({str(w.message)[:120] for w in caught}))
    log(f"  {row['name']}: {name} first call {row['results'][name]['first_s']:.1f} s")
    return returned


# -------------------------------------------------------------------------------------------------------- the rows

def measure_prefill(case: PrefillCase, fns: dict, opts: argparse.Namespace, warm: Callable[[], None]) -> dict:
    """One prefill row: ``{"name", "kind", "case", "floor_us", "oracle_heads", "results", "notes"}``."""
    heads = oracle_heads(case.H, opts.oracle_heads)
    row = {"name": case.name, "kind": "prefill", "case": asdict(case), "floor_us": floor_us(prefill_floor_bytes(case)),
           "oracle_heads": len(heads), "results": {}, "notes": {}}
    inp = make_prefill_inputs(case, DEVICE, opts.seed)
    ready = {}
    returned = {}
    for name, run in prefill_contenders(fns, inp).items():
        if isinstance(run, str):
            row["notes"][name] = run
            continue
        out = first_call(name, run, row)
        if out is not None:
            ready[name], returned[name] = run.call, run.read(out)
    if returned:
        start = time.perf_counter()
        ref = prefill_reference(inp, heads)
        log(f"  {case.name}: fp64 oracle on {len(heads)} of {case.H} heads, {time.perf_counter() - start:.1f} s")
        for name, (o, ht) in returned.items():
            row["results"][name].update(errors(o, ht, ref, heads))
        del ref
    returned.clear()
    warm()
    for name, ms in (interleaved_ms(ready, opts.reps, opts.rounds) if ready else {}).items():
        row["results"][name]["us"] = ms * 1e3
    return row


def measure_decode(case: DecodeCase, fns: dict, opts: argparse.Namespace, sleep: object,
                   warm: Callable[[], None]) -> dict:
    """One decode row: ``{"name", "kind", "case", "floor_us", "results", "notes"}`` (timings in us per step)."""
    row = {"name": case.name, "kind": "decode", "case": asdict(case), "floor_us": floor_us(decode_floor_bytes(case)),
           "results": {}, "notes": {}}
    inp = make_decode_inputs(case, DEVICE, opts.seed)
    ref = decode_reference(inp)
    ready = {}
    for name, run in decode_contenders(fns, inp).items():
        if isinstance(run, str):
            row["notes"][name] = run
            continue
        if first_call(name, run, row) is None:
            continue
        row["results"][name].update(decode_accuracy(run, inp, ref))
        ready[name] = run.call
    warm()
    for name, timings in time_decode(ready, opts, sleep, row["notes"]).items():
        row["results"][name].update(timings)
    if not bool(torch.isfinite(inp.pool.index_select(0, inp.idx.long()).float()).all()):
        row["notes"]["pool"] = "states not finite after the timings"
    return row


# --------------------------------------------------------------------------------------------------------- results

def fresh_state() -> dict:
    """What a results file holds: each run's header lines and the rows (prefill and decode, in :func:`row_order`)."""
    return {"runs": [], "rows": []}


def load_state(path: str | None) -> dict:
    """An earlier run's results (its JSON) to merge into, or a fresh state."""
    if not path:
        return fresh_state()
    return {**fresh_state(), **json.loads(Path(path).read_text())}


def write_results(out: str, state: dict) -> None:
    """The markdown report at ``out`` and the state as JSON beside it."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(state, indent=1) + "\n")
    path.write_text(render(state))


def _short(missed: bool) -> str:
    return " (short)" if missed else ""


def _value(row: dict, name: str, key: str) -> float | None:
    value = row["results"].get(name, {}).get(key)
    return value if isinstance(value, float) else None


def _cell(row: dict, name: str, key: str, fmt: Callable[[float], str]) -> str:
    """A contender's value formatted, "n/a" where it could not run, "-" where the value is missing."""
    value = _value(row, name, key)
    if value is not None:
        return fmt(value)
    return "n/a" if name in row["notes"] and name not in row["results"] else "-"


def speedup_cell(row: dict) -> str:
    """FLA / cuLA, short of the goal (>= 2) at T >= 4096."""
    cula, fla = _value(row, "cula", "us"), _value(row, "fla", "us")
    if cula is None or fla is None:
        return "-"
    return f"{fla / cula:.2f}" + _short(row["case"]["T"] >= SPEEDUP_MIN_T and fla / cula < SPEEDUP_GOAL)


def prefill_floor_cell(row: dict, name: str) -> str:
    """A prefill time over the bytes floor, short of the goal (<= 2.0x) at T >= 16384."""
    us = _value(row, name, "us")
    if us is None:
        return "-"
    ratio = us / row["floor_us"]
    return f"{ratio:.2f}" + _short(row["case"]["T"] >= PREFILL_FLOOR_MIN_T and ratio > PREFILL_FLOOR_GOAL)


def step_cell(us: float, N: int) -> str:
    """A decode graph time per step, short of the goal (<= 6 us) at N <= 8."""
    return f"{us:.2f}" + _short(N <= SMALL_GOAL_MAX_N and us > SMALL_GOAL_US)


def decode_floor_cell(us: float, floor: float, N: int) -> str:
    """A decode graph time over the floor, short of the goal (<= 1.15x) at N >= 128."""
    return f"{us / floor:.2f}" + _short(N >= DECODE_FLOOR_MIN_N and us / floor > DECODE_FLOOR_GOAL)


def error_ratio_cell(row: dict) -> str:
    """cuLA's errors (o, state) over FLA's, "(worse)" past :data:`ACCURACY_FACTOR`."""
    ratios = []
    for key in ("err_o", "err_state"):
        ours, fla = _value(row, "cula", key), _value(row, "fla", key)
        if ours is None or fla is None or fla <= 0:
            return "-"
        ratios.append(ours / fla)
    return ", ".join(f"{x:.3f}" for x in ratios) + (" (worse)" if max(ratios) > ACCURACY_FACTOR else "")


def prefill_table(rows: list[dict]) -> list[str]:
    lines = ["| row | floor us | cuLA us | FLA us | FLA / cuLA | cuLA / floor | FLA / floor | cuLA o err | "
             "FLA o err | cuLA state err | FLA state err | cuLA / FLA err (o, state) | oracle heads |",
             "|---" * 13 + "|"]
    for r in rows:
        sci = "{:.3e}".format
        cells = [r["name"], f"{r['floor_us']:.1f}", _cell(r, "cula", "us", "{:.1f}".format),
                 _cell(r, "fla", "us", "{:.1f}".format), speedup_cell(r), prefill_floor_cell(r, "cula"),
                 prefill_floor_cell(r, "fla"), _cell(r, "cula", "err_o", sci), _cell(r, "fla", "err_o", sci),
                 _cell(r, "cula", "err_state", sci), _cell(r, "fla", "err_state", sci), error_ratio_cell(r),
                 f"{r['oracle_heads']} of {r['case']['H']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def decode_table(rows: list[dict]) -> list[str]:
    names = CONTENDERS
    shown = {"cula": "cuLA", "fla": "FLA"}
    head = "| row | floor us | " + " | ".join(f"{m} graph us/step | {m} x floor | {m} 1-step replay us | "
                                              f"{m} eager us | {m} GPU us | {m} host us"
                                              for m in (shown[n] for n in names))
    lines = [head + " |", "|---" * (2 + 6 * len(names)) + "|"]
    for r in rows:
        N, floor = r["case"]["N"], r["floor_us"]
        cells = [r["name"], f"{floor:.2f}"]
        for n in names:
            cells += [_cell(r, n, "graph_us", functools.partial(step_cell, N=N)),
                      _cell(r, n, "graph_us", functools.partial(decode_floor_cell, floor=floor, N=N)),
                      _cell(r, n, "replay_us", "{:.2f}".format), _cell(r, n, "eager_us", "{:.1f}".format),
                      _cell(r, n, "gpu_us", "{:.2f}".format), _cell(r, n, "host_us", "{:.1f}".format)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def decode_accuracy_table(rows: list[dict]) -> list[str]:
    lines = ["| row | cuLA o err | cuLA state err | cuLA others kept | FLA o err | FLA state err | "
             "cuLA / FLA err (o, state) |", "|---" * 7 + "|"]
    for r in rows:
        kept = r["results"].get("cula", {}).get("others_kept")
        sci = "{:.3e}".format
        lines.append("| " + " | ".join([
            r["name"], _cell(r, "cula", "err_o", sci), _cell(r, "cula", "err_state", sci),
            "-" if kept is None else ("yes" if kept else "NO"), _cell(r, "fla", "err_o", sci),
            _cell(r, "fla", "err_state", sci), error_ratio_cell(r)]) + " |")
    return lines


def notes_lines(rows: list[dict]) -> list[str]:
    """Each distinct note once, with its rows."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        for who, text in r["notes"].items():
            seen.setdefault((who, text), []).append(r["name"])
    return [f"- {who}: {text} ({len(names)} rows: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
            for (who, text), names in seen.items()]


def first_call_lines(rows: list[dict]) -> list[str]:
    """The slowest first call (compilation, autotuning included) of each contender, and where."""
    slowest: dict[str, tuple[float, str]] = {}
    for r in rows:
        for who, res in r["results"].items():
            s = res.get("first_s")
            if isinstance(s, float) and s > slowest.get(who, (-1.0, ""))[0]:
                slowest[who] = (s, r["name"])
    if not slowest:
        return []
    return ["First calls (compilation, autotuning included), the slowest per contender: "
            + ", ".join(f"{who} {s:.1f} s ({name})" for who, (s, name) in slowest.items())]


PREFILL_METHOD = (
    "bench_lightning.py's docstring: bf16 q/k/v, K = V = 128, fp32 h0 and final states, FLA's decays for layer 0 of "
    "2; us = median CUDA-event time of eager calls in interleaved rounds; floor = q, k, v, o (bf16) and h0, ht (fp32) "
    f"at 4.3 TB/s; errors = relative L2 against the fp64 recurrence on the oracle heads. Goals: FLA / cuLA >= "
    f"{SPEEDUP_GOAL:g} at T >= {SPEEDUP_MIN_T}, cuLA <= {PREFILL_FLOOR_GOAL:g}x the floor at T >= "
    f"{PREFILL_FLOOR_MIN_T}, errors <= {ACCURACY_FACTOR}x FLA's; \"(short)\" marks a miss (FLA's too, for context).")
DECODE_METHOD = (
    "One step (T = 1), H = 64, K = V = 128, a pool of 2N + 1 slots. cuLA updates the pool in place; FLA: "
    f"{FLA_DECODE_FORM}. graph = us per step in a graph of several steps (the goals are judged on it); 1-step replay: "
    "a one-step graph's replay (launch latency included); eager: a lone call, GPU idle before it; GPU: per eager call "
    "with the host ahead; host: per call, GPU asleep. floor = the states read and written in the pool's dtype, q, k, "
    f"v, o (bf16), indices, g_gamma, at 4.3 TB/s. Goals: graph <= {DECODE_FLOOR_GOAL}x floor at N >= "
    f"{DECODE_FLOOR_MIN_N}, <= {SMALL_GOAL_US:g} us per step at N <= {SMALL_GOAL_MAX_N}, errors <= "
    f"{ACCURACY_FACTOR}x FLA's.")


def render(state: dict) -> str:
    """The markdown report of ``state``."""
    lines = [TITLE, ""]
    for i, header in enumerate(state["runs"], 1):
        lines += ([f"Run {i}:"] if len(state["runs"]) > 1 else []) + header + [""]
    prefill = [r for r in state["rows"] if r["kind"] == "prefill"]
    decode = [r for r in state["rows"] if r["kind"] == "decode"]
    if prefill:
        lines += ["## Prefill", "", PREFILL_METHOD, "", *prefill_table(prefill), "", *notes_lines(prefill),
                  *first_call_lines(prefill), ""]
    if decode:
        lines += ["## Decode", "", DECODE_METHOD, "", "### Times against the HBM floor", "", *decode_table(decode), "",
                  "### Accuracy against fp64 (one step from the pristine pool)", "", *decode_accuracy_table(decode),
                  "", *notes_lines(decode), *first_call_lines(decode), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/lightning_h200.md")
    parser.add_argument("--merge", default="", help="an earlier run's JSON whose other rows the results keep")
    parser.add_argument("--only", default="", help='comma-separated selectors of rows, e.g. "prefill T4096,decode"')
    parser.add_argument("--skip", default="", help='comma-separated contenders left out: "cula", "fla"')
    parser.add_argument("--backend", default="cutedsl", help="CULA_BACKEND for cuLA's calls")
    parser.add_argument("--oracle-heads", type=int, default=8, help="prefill heads the fp64 oracle runs (0: all)")
    parser.add_argument("--reps", type=int, default=30, help="CUDA-event timings per contender (and decode kind)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds the timings are split over")
    parser.add_argument("--graph-calls", type=int, default=10, help="decode steps captured in the timed graph")
    parser.add_argument("--host-calls", type=int, default=100, help="decode calls per host-time and GPU-time loop")
    parser.add_argument("--warm-up-s", type=float, default=3.0, help="seconds of GPU load before the first timings")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="start no row past this many seconds (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def selected(only: str) -> list[PrefillCase | DecodeCase]:
    """The rows ``--only`` selects, in :func:`row_order`."""
    return [c for c in [*prefill_cases(), *decode_cases()] if matches(c.name, only)]


def settings_line(opts: argparse.Namespace) -> str:
    return (f"- settings: CULA_BACKEND={opts.backend}, oracle heads {opts.oracle_heads or 'all'}, reps {opts.reps}, "
            f"rounds {opts.rounds}, graph calls {opts.graph_calls}, host calls {opts.host_calls}, seed {opts.seed}; "
            f"FLA decode: {FLA_DECODE_FORM}")


def main() -> None:
    opts = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lightning.py needs a CUDA GPU (run it on the H200)")
    os.environ["CULA_BACKEND"] = opts.backend  # (the fp64 oracle is called directly, never through the dispatch)
    began = time.perf_counter()
    skip = tuple(x for x in opts.skip.split(",") if x)
    state = load_state(opts.merge)
    state["runs"].append([*environment(), settings_line(opts)])
    warmed = []

    def warm() -> None:
        if not warmed:
            warmed.append(True)
            warm_up_gpu(opts.warm_up_s)

    cases = selected(opts.only)
    log(f"{len(cases)} rows: {', '.join(c.name for c in cases)}")
    fns: dict[str, dict] = {}
    makers = {"prefill": prefill_fns, "decode": decode_fns}
    sleep = None
    for i, case in enumerate(cases):
        if opts.deadline_s and time.perf_counter() - began > opts.deadline_s:
            log(f"deadline: {len(cases) - i} rows not started: {', '.join(c.name for c in cases[i:])}")
            break
        log(f"row {i + 1}/{len(cases)}: {case.name}")
        kind = "prefill" if isinstance(case, PrefillCase) else "decode"
        if kind not in fns:
            fns[kind] = makers[kind](skip)
        if kind == "prefill":
            row = measure_prefill(case, fns[kind], opts, warm)
        else:
            if sleep is None:
                from host_overhead_kda import GpuSleep

                sleep = GpuSleep()
            row = measure_decode(case, fns[kind], opts, sleep, warm)
        state["rows"] = put_row(state["rows"], row, row_order())
        write_results(opts.out, state)
        brief = {n: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}
                 for n, res in row["results"].items()}
        log(f"{row['name']} floor {row['floor_us']:.2f} us {brief} {row['notes']}")
        _release()


def _release() -> None:
    """Free the row's tensors and graphs before the next row."""
    gc.collect()
    with contextlib.suppress(RuntimeError):
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
