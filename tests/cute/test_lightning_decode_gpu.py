"""The CuTeDSL Lightning decode kernel (``lightning_decode_cutedsl``) and its backend on a GPU, against a float64
torch loop written here (KDA_SPEC.md §5, §10).

The reference runs ``S ← λ_h S + k_tᵀ v_t``, ``o_t = scale · q_t S`` (the updated S) in float64 from each
sequence's slot of a copy of the pool, on the kernel's inputs, and writes the states back rounded to the pool's dtype.
Covered: both pool layouts, fp32 and bf16 pools, bf16 and fp16 q/k/v, H = 2..64, fixed length T in {0, 1, 2, 5} and
packed sequences of lengths 0, 1, 2 and 5, padding rows (a negative slot, a slot past the pool) whose o rows must
be zeros, slots nobody names (bit-unchanged), decays 0 and down to -8 (and FLA's layer formula), the default scale
and a given one. The output is NaN-poisoned (every token row of a sequence must be written); replays are
bit-identical; a CUDA graph captured once replays correctly after its index and input tensors change value in
place. The backend entry points run on validated arguments (``cula_runtime.lightning_args``): int64 cu_seqlens,
the call plan, no allocation with ``out``.

Bounds (rel-L2 against the float64 loop): o 5e-3 (its bf16 rounding alone is ≈ 2e-3); the written states 1e-5 in an
fp32 pool, 5e-3 in a bf16 pool (one rounding of each element).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from cula_runtime import cute as cula_cute
from tests.helpers import AllocationCounter, assert_k_first_lines_same_bits, rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cula_cute.is_available(),
                       reason="CuTeDSL or TVM-FFI is missing (cula-runtime brings them on Linux x86_64/aarch64)"),
]

K = 128
O_BOUND = 5e-3
STATE_BOUND = {torch.float32: 1e-5, torch.bfloat16: 5e-3}


@dataclass(frozen=True)
class Case:
    name: str
    H: int = 2
    B: int = 6
    T: int = 1
    cu: tuple[int, ...] | None = None  # packed sequences (B = 1)
    dtype: torch.dtype = torch.bfloat16  # q/k/v/o
    pool_dtype: torch.dtype = torch.float32
    v_first: bool = False
    decay: str = "range"  # "range": g_gamma from 0 down to -8; "zero": no decay; "fla": FLA's layer formula
    scale: float | None = None
    padding: bool = True  # a negative slot and one past the pool on the first and last running sequences


VARLEN = (0, 1, 3, 3, 8, 8, 9, 11)  # lengths 1, 2, 0, 5, 0, 1, 2
CASES = [
    Case("T1-fp32-kv"),
    Case("T1-fp32-vk-scale0.5", v_first=True, scale=0.5),
    Case("T1-bf16pool-kv-H64-fla", H=64, B=8, pool_dtype=torch.bfloat16, decay="fla"),
    Case("T1-fp32-kv-H64-N8-fla", H=64, B=8, decay="fla"),
    Case("T2-bf16pool-vk-fp16", T=2, dtype=torch.float16, pool_dtype=torch.bfloat16, v_first=True),
    Case("T2-fp32-kv-fp16-zero", T=2, dtype=torch.float16, decay="zero"),
    Case("T5-fp32-vk-H4", H=4, B=5, T=5),
    Case("T5-bf16pool-kv-zero-scale2", B=5, T=5, pool_dtype=torch.bfloat16, decay="zero", scale=2.0),
    Case("T0-fp32-kv", T=0, padding=False),
    Case("T0-bf16pool-vk", T=0, pool_dtype=torch.bfloat16, v_first=True, padding=False),
    Case("varlen-fp32-kv", B=1, T=11, cu=VARLEN),
    Case("varlen-fp32-vk-fp16", B=1, T=11, cu=VARLEN, v_first=True, dtype=torch.float16),
    Case("varlen-bf16pool-kv-H8", H=8, B=1, T=11, cu=VARLEN, pool_dtype=torch.bfloat16),
    Case("varlen-bf16pool-vk-scale0.25", B=1, T=11, cu=VARLEN, pool_dtype=torch.bfloat16, v_first=True, scale=0.25),
]


def _lens(case: Case) -> list[int]:
    if case.cu is None:
        return [case.T] * case.B
    return [case.cu[i + 1] - case.cu[i] for i in range(len(case.cu) - 1)]


def _g_gamma(case: Case) -> torch.Tensor:
    H = case.H
    if case.decay == "zero":
        return torch.zeros(H)
    if case.decay == "fla":  # FLA's chunk_lightning_attn(layer_idx=1, num_layers=4): head 0 has no decay
        return -(8.0 / H) * (1 - 1 / 4) * torch.arange(H, dtype=torch.float32)
    return torch.linspace(0.0, -8.0, H)


def make_case(case: Case, seed: int, device: str = "cuda") -> dict:
    """Random inputs, a random pool and slot indices (with padding rows) for ``case``."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H = case.B, case.T, case.H
    lens = _lens(case)
    N = len(lens)
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    P = N + 5
    idx = torch.tensor(torch.randperm(P, generator=gen)[:N].tolist(), dtype=torch.int32)
    active = [n for n in range(N) if lens[n] > 0]
    if case.padding and len(active) >= 3:
        idx[active[0]] = -1
        idx[active[-1]] = P + 7
    pool = torch.randn(P, H, K, K, generator=gen) * 0.5
    tensors = dict(q=q.to(case.dtype), k=k.to(case.dtype), v=v.to(case.dtype), g_gamma=_g_gamma(case),
                   state=pool.to(case.pool_dtype), state_indices=idx,
                   cu_seqlens=None if case.cu is None else torch.tensor(case.cu, dtype=torch.int32))
    return {name: None if t is None else t.to(device) for name, t in tensors.items()}


def reference(case: Case, args: dict) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """``(o, pool after the call, slots written)``: the float64 loop on a copy of the pool."""
    f64 = torch.float64
    lens = _lens(case)
    pool = args["state"].clone()
    P = pool.shape[0]
    q, k, v = (args[name].to(f64) for name in ("q", "k", "v"))
    decay = torch.exp(args["g_gamma"].to(f64))[:, None, None]  # [H, 1, 1]
    scale = K**-0.5 if case.scale is None else case.scale
    o = torch.zeros(case.B, case.T, case.H, K, dtype=f64, device=q.device)
    written: set[int] = set()
    for n, (length, slot) in enumerate(zip(lens, args["state_indices"].tolist(), strict=True)):
        b, bos = (0, case.cu[n]) if case.cu is not None else (n, 0)
        if length == 0 or not 0 <= slot < P:
            continue
        S = pool[slot].to(f64)
        S = (S.transpose(-1, -2) if case.v_first else S).clone()  # [H, K, V]
        for tok in range(bos, bos + length):
            S = decay * S + k[b, tok][:, :, None] * v[b, tok][:, None, :]
            o[b, tok] = scale * torch.einsum("hk,hkv->hv", q[b, tok], S)
        pool[slot] = (S.transpose(-1, -2) if case.v_first else S).to(pool.dtype)
        written.add(slot)
    return o, pool, written


def run_kernel(case: Case, args: dict, out: torch.Tensor) -> torch.Tensor:
    from cula_runtime.cute.lightning.decode import lightning_decode_cutedsl

    return lightning_decode_cutedsl(args["q"], args["k"], args["v"], args["g_gamma"], state=args["state"],
                                    state_indices=args["state_indices"], scale=case.scale,
                                    state_v_first=case.v_first, cu_seqlens=args["cu_seqlens"], out=out)


def _poisoned_out(case: Case) -> torch.Tensor:
    return torch.full((case.B, case.T, case.H, K), float("nan"), dtype=case.dtype, device="cuda")


def _check(case: Case, args: dict, before: torch.Tensor, out: torch.Tensor) -> None:
    o_ref, pool_ref, written = reference(case, dict(args, state=before))
    assert not torch.isnan(out).any(), "an output row was not written"
    if o_ref.numel() and o_ref.any():
        assert rel_l2(out, o_ref) < O_BOUND
    pool = args["state"]
    untouched = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(pool[untouched], before[untouched]), "a slot nobody writes changed"
    if written:
        rows = sorted(written)
        assert rel_l2(pool[rows], pool_ref[rows]) < STATE_BOUND[pool.dtype]
    P = pool.shape[0]
    for n, (length, slot) in enumerate(zip(_lens(case), args["state_indices"].tolist(), strict=True)):
        if length and not 0 <= slot < P:  # a padding row: zeros, exactly
            b, bos = (0, case.cu[n]) if case.cu is not None else (n, 0)
            assert not out[b, bos:bos + length].float().any(), f"padding row {n} has non-zero o"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lightning_decode_matches_float64_loop(case: Case) -> None:
    args = make_case(case, seed=zlib.crc32(case.name.encode()) % 1000)
    before = args["state"].clone()
    out = _poisoned_out(case)
    assert run_kernel(case, args, out) is out
    torch.cuda.synchronize()
    _check(case, args, before, out)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[10], CASES[13]],
                         ids=[CASES[i].name for i in (0, 4, 10, 13)])
def test_replays_are_bit_identical(case: Case) -> None:
    args = make_case(case, seed=7)
    start = args["state"].clone()
    results = []
    for _ in range(20):
        args["state"].copy_(start)
        out = _poisoned_out(case)
        run_kernel(case, args, out)
        results.append((out.clone(), args["state"].clone()))
    torch.cuda.synchronize()
    for out, pool in results[1:]:
        assert torch.equal(out.view(torch.int16), results[0][0].view(torch.int16))
        assert torch.equal(pool.view(torch.int16) if pool.dtype == torch.bfloat16 else pool.view(torch.int32),
                           results[0][1].view(torch.int16) if pool.dtype == torch.bfloat16
                           else results[0][1].view(torch.int32))


@pytest.mark.parametrize("case", [CASES[0], CASES[6], CASES[11], CASES[12]],
                         ids=[CASES[i].name for i in (0, 6, 11, 12)])
def test_cuda_graph_replays_with_new_values(case: Case) -> None:
    """Capture one call; change every input's and the index tensors' values in place (a new batch: other slots,
    other decays, other lengths under the same cu_seqlens buffer); replay; check."""
    args = make_case(case, seed=11)
    out = _poisoned_out(case)
    run_kernel(case, args, out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(case, args, out)
    torch.cuda.synchronize()

    for seed in (21, 22):
        fresh = make_case(case, seed=seed)
        fresh["g_gamma"] = fresh["g_gamma"].flip(0)  # other decays per head
        if case.cu is not None:  # same buffer, new lengths (the same total)
            lens = _lens(case)[::-1] if seed == 21 else _lens(case)
            fresh["cu_seqlens"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                                               device="cuda")
        for name, value in fresh.items():
            if isinstance(value, torch.Tensor):
                args[name].copy_(value)
        now = replace(case, cu=tuple(args["cu_seqlens"].tolist())) if case.cu is not None else case
        before = args["state"].clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(now, args, before, out)


K_FIRST_CASES = [c for c in CASES if not c.v_first and c.T > 0]


@pytest.mark.parametrize("case", K_FIRST_CASES, ids=[c.name for c in K_FIRST_CASES])
def test_k_first_lines_give_the_same_bits(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """K-first CTAs of every count of lines per K row (``k_first_lines``: 1, 2, 4 in an fp32 pool, 1, 2 in bf16)
    give the default's o and pool bit for bit, in both forms (single-token, token loop), padding rows and packed
    sequences included; the default itself is checked against float64 above."""
    from cula_runtime.cute.lightning import decode

    args = make_case(case, seed=3)
    start = args["state"].clone()

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        args["state"].copy_(start)
        out = _poisoned_out(case)
        run_kernel(case, args, out)
        torch.cuda.synchronize()
        return out.clone(), args["state"].clone()

    assert_k_first_lines_same_bits(decode, run, case.pool_dtype == torch.float32, monkeypatch)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4]], ids=[CASES[i].name for i in (0, 1, 2, 4)])
def test_single_token_form_agrees_with_the_general_form(case: Case) -> None:
    """A fixed-length T = 1 call runs the single-token form; the same batch as packed sequences of one token each
    runs the general form (the token loop): the same state and o up to rounding (T = 2 cases: one token each)."""
    one = replace(case, T=1)
    args = make_case(one, seed=13)
    start = args["state"].clone()
    fixed = _poisoned_out(one)
    run_kernel(one, args, fixed)
    after_fixed = args["state"].clone()
    args["state"].copy_(start)
    packed_case = replace(one, B=1, cu=tuple(range(one.B + 1)), T=one.B)
    packed = dict(args, cu_seqlens=torch.arange(one.B + 1, dtype=torch.int32, device="cuda"),
                  **{name: args[name].view(1, one.B, one.H, K) for name in ("q", "k", "v")})
    out = _poisoned_out(packed_case)
    run_kernel(packed_case, packed, out)
    torch.cuda.synchronize()
    assert rel_l2(out.view_as(fixed), fixed) < 1e-3
    assert rel_l2(args["state"], after_fixed) < (1e-6 if args["state"].dtype == torch.float32 else 1e-2)
    assert torch.equal(out.view_as(fixed).float() == 0, fixed.float() == 0)  # the same padding rows


# ---------------------------------------------------------------------------------------------------------------
# The backend entry points on validated arguments

def _validated(case: Case, args: dict, out: torch.Tensor | None = None, cu_dtype: torch.dtype = torch.int32):
    from cula_runtime.lightning_args import validate_lightning_decode

    cu = args["cu_seqlens"]
    return validate_lightning_decode(args["q"], args["k"], args["v"], args["g_gamma"], scale=case.scale,
                                     state=args["state"], state_indices=args["state_indices"],
                                     state_v_first=case.v_first, cu_seqlens=None if cu is None else cu.to(cu_dtype),
                                     out=out)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", [CASES[0], CASES[10], CASES[13]], ids=[CASES[i].name for i in (0, 10, 13)])
def test_backend_and_plan(case: Case, cu_dtype: torch.dtype) -> None:
    """verify accepts; the backend's o (allocated) and the plan's (into out) match the loop and each other's bits;
    the plan narrows an int64 cu_seqlens as the backend does."""
    from cula_runtime.cute.lightning.decode_backend import (
        lightning_decode_cutedsl_backend,
        plan_lightning_decode,
        verify_lightning_decode,
    )

    if case.cu is None and cu_dtype == torch.int64:
        pytest.skip("no cu_seqlens")
    args = make_case(case, seed=3)
    start = args["state"].clone()
    validated = _validated(case, args, cu_dtype=cu_dtype)
    ok, reason = verify_lightning_decode(validated)
    assert ok, reason
    o = lightning_decode_cutedsl_backend(validated)
    torch.cuda.synchronize()
    assert o.dtype == case.dtype and tuple(o.shape) == (case.B, case.T, case.H, K)
    _check(case, args, start, o)
    after = args["state"].clone()

    args["state"].copy_(start)
    plan = plan_lightning_decode(validated)
    assert plan is not None
    out = _poisoned_out(case)
    cu = validated.cu_seqlens
    assert plan(args["q"], args["k"], args["v"], args["g_gamma"], args["state"], args["state_indices"], cu, out) is out
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), o.view(torch.int16))
    assert torch.equal(args["state"], after)


def test_backend_allocates_nothing_with_out() -> None:
    from cula_runtime.cute.lightning.decode_backend import lightning_decode_cutedsl_backend

    case = CASES[10]
    args = make_case(case, seed=5)
    out = _poisoned_out(case)
    validated = _validated(case, args, out=out)
    lightning_decode_cutedsl_backend(validated)  # compiles
    with AllocationCounter() as counted:
        assert lightning_decode_cutedsl_backend(validated) is out
    assert counted.count == 0


def test_verify_declines_with_reasons() -> None:
    """fp32 q/k/v and K = V = 64 go to the reference, each with its reason (the other declines are tested on the CPU
    in test_lightning_decode_compile.py, on stand-in arguments)."""
    from cula_runtime.cute.lightning.decode_backend import verify_lightning_decode

    case = CASES[0]
    args = make_case(case, seed=9)
    f32 = {**args, **{name: args[name].float() for name in ("q", "k", "v")}}
    assert verify_lightning_decode(_validated(case, f32)) == (False, "needs bf16 or fp16 q/k/v, got torch.float32")
    small = {**args, **{name: args[name][..., :64].contiguous() for name in ("q", "k", "v")},
             "state": args["state"][..., :64, :64].contiguous()}
    ok, reason = verify_lightning_decode(_validated(case, small))
    assert not ok and "K = V = 128" in reason
