"""The CuTeDSL KDA decode kernel (``kda_decode_cutedsl``) on a GPU, against a float64 torch loop written here
(KDA_SPEC.md §1.2, §2, §6, §10 and :mod:`cula_runtime.state_pool`'s rules).

The reference runs the per-token recurrence in float64 from each sequence's start slot of a copy of the pool, on the
kernel's inputs, with the kernel's one deliberate rounding modelled (the L2-normalised q and k rounded to bf16, as
the prefill does), and writes the states back rounded to the pool's dtype. Covered: every gate form (precomputed
log-gate fp32 and bf16, the softplus form, the lower-bound form with and without A_log), β as values (fp32, bf16) or
logits (sigmoid, 2·sigmoid), GVA, both state layouts, fp32 and bf16 pools, fixed length T = 1 and T = 3, packed
sequences of lengths 0, 1, 2 and 5, padding rows (negative and past-the-pool start slots), per-token slots with and
without accepted counts (one count out of range, one per-token slot past the pool). The output is NaN-poisoned (every
row must be written: padding rows with zeros); slots nobody writes must keep their bits; replays are bit-identical;
a CUDA graph captured once replays correctly after its index and input tensors change value in place.

Bounds (rel-L2 against the float64 loop): o 5e-3 (its bf16 rounding alone is ≈ 1e-3); the written states 1e-4 in an
fp32 pool, 5e-3 in a bf16 pool (one rounding of each element).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from cula_runtime import cute as cula_cute
from tests.helpers import assert_k_first_lines_same_bits, rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cula_cute.is_available(),
                       reason="CuTeDSL or TVM-FFI is missing (cula-runtime brings them on Linux x86_64/aarch64)"),
]

K = 128
SCALE = K**-0.5
O_BOUND = 5e-3
STATE_BOUND = {torch.float32: 1e-4, torch.bfloat16: 5e-3}


@dataclass(frozen=True)
class Case:
    name: str
    H: int = 2
    HV: int = 4
    B: int = 3
    T: int = 1
    cu: tuple[int, ...] | None = None  # packed sequences (B = 1)
    gate: str = "none"  # "none", "softplus", "safe", "safe-noalog"
    g_dtype: torch.dtype = torch.float32
    beta: str = "value"  # "value", "sigmoid", "sigmoid-neg"
    beta_dtype: torch.dtype = torch.float32
    l2norm: bool = False
    pool_dtype: torch.dtype = torch.float32
    v_first: bool = False
    slots: str = "1d"  # "1d", "2d" (start from column 0), "2d-accepted"
    padding: bool = True  # padding rows (a negative start slot, one past the pool, an accepted count of 0) and a
    # per-token slot past the pool


CASES = [
    Case("T1-fp32-kv-loggate", B=6),
    Case("T1-fp32-vk-loggate-bf16g-bf16beta", B=6, v_first=True, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16),
    Case("T1-bf16pool-kv-softplus-l2-sigmoid-bf16g", B=5, gate="softplus", l2norm=True, beta="sigmoid",
         pool_dtype=torch.bfloat16, g_dtype=torch.bfloat16),
    Case("T1-bf16pool-vk-safe-l2-negeig", B=5, gate="safe", l2norm=True, beta="sigmoid-neg",
         pool_dtype=torch.bfloat16, v_first=True),
    Case("T3-fp32-vk-safe-noalog-MHA", H=4, HV=4, B=5, T=3, gate="safe-noalog", beta="sigmoid", v_first=True),
    Case("varlen-1-2-0-5-fp32-kv-softplus-l2", B=1, T=11, cu=(0, 1, 3, 3, 8, 8, 9, 11), gate="softplus", l2norm=True,
         beta="sigmoid"),
    Case("varlen-1-2-0-5-bf16pool-vk-loggate", B=1, T=11, cu=(0, 1, 3, 3, 8, 8, 9, 11), pool_dtype=torch.bfloat16,
         v_first=True),
    Case("spec-T3-fp32-kv-2d", B=5, T=3, slots="2d", gate="safe", beta="sigmoid", l2norm=True),
    Case("spec-T3-fp32-vk-2d-accepted-GVA4", H=1, HV=4, B=6, T=3, slots="2d-accepted", v_first=True,
         gate="softplus", beta="sigmoid"),
    Case("spec-varlen-2-5-1-bf16pool-kv-accepted", B=1, T=14, cu=(0, 2, 7, 8, 8, 11, 12, 14), slots="2d-accepted",
         pool_dtype=torch.bfloat16, l2norm=True, beta="sigmoid"),
]


def _lens(case: Case) -> list[int]:
    if case.cu is None:
        return [case.T] * case.B
    return [case.cu[i + 1] - case.cu[i] for i in range(len(case.cu) - 1)]


def make_case(case: Case, seed: int, device: str = "cuda") -> dict:
    """Random inputs, a random pool, and index tensors (with padding rows and out-of-range entries) for ``case``."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV = case.B, case.T, case.H, case.HV
    lens = _lens(case)
    N = len(lens)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if not case.l2norm:  # keep |k| ≈ 1 so that β k kᵀ stays a contraction over several tokens
        q, k = q / math.sqrt(K), k / math.sqrt(K)
    v = torch.randn(B, T, HV, K, generator=gen)
    if case.gate == "none":
        g = -torch.exp(torch.randn(B, T, HV, K, generator=gen) - 2.0)  # log-gates, mostly in (-0.5, 0)
    else:
        g = torch.randn(B, T, HV, K, generator=gen)
    if case.beta == "value":
        beta = torch.rand(B, T, HV, generator=gen)
    else:
        beta = torch.randn(B, T, HV, generator=gen)
    A_log = torch.randn(HV, generator=gen) * 0.5 if case.gate in ("softplus", "safe") else None
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5 if case.gate != "none" else None
    lower_bound = -5.0 if case.gate.startswith("safe") else None

    W = max(lens) if case.cu is not None else T
    per_token = case.slots != "1d"
    P = N * max(W, 1) + 5
    order = torch.randperm(P, generator=gen).tolist()
    if per_token:
        idx = torch.tensor(order[:N * W], dtype=torch.int32).view(N, W)
    else:
        idx = torch.tensor(order[:N], dtype=torch.int32)
    accepted = None
    if case.slots == "2d-accepted":
        accepted = torch.randint(1, W + 1, (N,), generator=gen, dtype=torch.int32)
    active = [n for n in range(N) if lens[n] > 0]
    if case.padding and len(active) >= 4:
        # the first and the last running sequences become padding rows: a negative start slot, one past the pool
        for n, bad in ((active[0], -1), (active[-1], P + 7)):
            if per_token:
                idx[n, 0 if accepted is None else int(accepted[n]) - 1] = bad
            else:
                idx[n] = bad
        running = active[1:-1]
        if accepted is not None:  # an accepted count outside [1, W]: a padding row too
            accepted[running[-1]] = 0
            running = running[:-1]
        longest = max(running, key=lambda n: lens[n])
        if per_token and lens[longest] >= 2:  # a token whose state is not written (its slot is past the pool)
            start = 0 if accepted is None else int(accepted[longest]) - 1
            column = lens[longest] - 1 if lens[longest] - 1 != start else 0
            idx[longest, column] = P + 3

    pool = torch.randn(P, HV, K, K, generator=gen) * 0.5
    tensors = dict(
        q=q.to(torch.bfloat16), k=k.to(torch.bfloat16), v=v.to(torch.bfloat16), g=g.to(case.g_dtype),
        beta=beta.to(case.beta_dtype), state=pool.to(case.pool_dtype), state_indices=idx,
        A_log=A_log, dt_bias=dt_bias,
        cu_seqlens=None if case.cu is None else torch.tensor(case.cu, dtype=torch.int32),
        num_accepted_tokens=accepted,
    )
    tensors = {name: None if t is None else t.to(device) for name, t in tensors.items()}
    flags = dict(lower_bound=lower_bound, use_qk_l2norm_in_kernel=case.l2norm,
                 use_gate_in_kernel=case.gate != "none", use_beta_sigmoid_in_kernel=case.beta != "value",
                 allow_neg_eigval=case.beta == "sigmoid-neg", state_v_first=case.v_first)
    return {**tensors, **flags}


def reference(case: Case, args: dict) -> tuple[torch.Tensor, torch.Tensor, set[int]]:
    """``(o, pool after the call, slots written)``: the float64 loop on a copy of the pool."""
    f64 = torch.float64
    lens = _lens(case)
    N, P, HV, H = len(lens), args["state"].shape[0], case.HV, case.H
    G = HV // H
    pool = args["state"].clone()
    q, k, v = (args[name].to(f64) for name in ("q", "k", "v"))
    g, beta = args["g"].to(f64), args["beta"].to(f64)
    idx = args["state_indices"].tolist()
    accepted = None if args["num_accepted_tokens"] is None else args["num_accepted_tokens"].tolist()
    o = torch.zeros(case.B, case.T, HV, K, dtype=f64, device=q.device)
    written: set[int] = set()
    per_token = case.slots != "1d"
    for n in range(N):
        length = lens[n]
        b, bos = (0, case.cu[n]) if case.cu is not None else (n, 0)
        if per_token:
            W = len(idx[n])
            column = 0 if accepted is None else accepted[n] - 1
            slot = idx[n][column] if 0 <= column < W else -1
        else:
            slot = idx[n]
        if length == 0 or not 0 <= slot < P:
            continue
        S = pool[slot].to(f64)
        if case.v_first:
            S = S.transpose(-1, -2)
        S = S.clone()  # [HV, K, V]
        for t in range(length):
            tok = bos + t
            for hv in range(HV):
                qt, kt = q[b, tok, hv // G], k[b, tok, hv // G]
                if case.l2norm:  # fp32 math in the kernel, rounded to bf16 (as the prefill)
                    qt = (qt / torch.sqrt((qt * qt).sum() + 1e-6)).to(torch.bfloat16).to(f64)
                    kt = (kt / torch.sqrt((kt * kt).sum() + 1e-6)).to(torch.bfloat16).to(f64)
                x = g[b, tok, hv]
                if case.gate != "none":
                    x = x + args["dt_bias"].to(f64).view(HV, K)[hv]
                    a = 1.0 if args["A_log"] is None else torch.exp(args["A_log"][hv].to(f64))
                    if case.gate == "softplus":
                        x = -a * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
                    else:
                        x = args["lower_bound"] * torch.sigmoid(a * x)
                bt = beta[b, tok, hv]
                if case.beta != "value":
                    bt = (2.0 if case.beta == "sigmoid-neg" else 1.0) * torch.sigmoid(bt)
                Sd = torch.exp(x)[:, None] * S[hv]
                vp = bt * (v[b, tok, hv] - kt @ Sd)
                S[hv] = Sd + torch.outer(kt, vp)
                o[b, tok, hv] = SCALE * (qt @ S[hv])
            if per_token:
                step = idx[n][t] if t < len(idx[n]) else -1
                if 0 <= step < P:
                    pool[step] = (S.transpose(-1, -2) if case.v_first else S).to(pool.dtype)
                    written.add(step)
        if not per_token:
            pool[slot] = (S.transpose(-1, -2) if case.v_first else S).to(pool.dtype)
            written.add(slot)
    return o, pool, written


def run_kernel(args: dict, out: torch.Tensor) -> torch.Tensor:
    from cula_runtime.cute.kda.decode import kda_decode_cutedsl

    q, k, v, g, beta = (args[name] for name in ("q", "k", "v", "g", "beta"))
    rest = {name: value for name, value in args.items() if name not in ("q", "k", "v", "g", "beta")}
    return kda_decode_cutedsl(q, k, v, g, beta, out=out, **rest)


def _poisoned_out(case: Case, device: str = "cuda") -> torch.Tensor:
    return torch.full((case.B, case.T, case.HV, K), float("nan"), dtype=torch.bfloat16, device=device)


def _check(case: Case, args: dict, before: torch.Tensor, out: torch.Tensor) -> None:
    ref_args = dict(args, state=before)
    o_ref, pool_ref, written = reference(case, ref_args)
    assert not torch.isnan(out).any(), "an output row was not written"
    assert rel_l2(out, o_ref) < O_BOUND
    pool = args["state"]
    untouched = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(pool[untouched], before[untouched]), "a slot nobody writes changed"
    if written:
        rows = sorted(written)
        assert rel_l2(pool[rows], pool_ref[rows]) < STATE_BOUND[pool.dtype]
    # padding rows and zero-length sequences: zero outputs
    lens = _lens(case)
    for n, length in enumerate(lens):
        b, bos = (0, case.cu[n]) if case.cu is not None else (n, 0)
        if length and not o_ref[b, bos:bos + length].any():
            assert not out[b, bos:bos + length].float().any()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kda_decode_matches_float64_loop(case: Case) -> None:
    args = make_case(case, seed=zlib.crc32(case.name.encode()) % 1000)
    before = args["state"].clone()
    out = _poisoned_out(case)
    assert run_kernel(args, out) is out
    torch.cuda.synchronize()
    _check(case, args, before, out)


K_FIRST_CASES = [c for c in CASES if not c.v_first]


@pytest.mark.parametrize("case", K_FIRST_CASES, ids=[c.name for c in K_FIRST_CASES])
def test_k_first_lines_give_the_same_bits(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """K-first CTAs of every count of lines per K row (``k_first_lines``: 1, 2, 4 in an fp32 pool, 1, 2 in bf16)
    give the default's o and pool bit for bit (each line group reduces its columns in the same order), padding
    rows, packed sequences and per-token slots included; the default itself is checked against float64 above."""
    from cula_runtime.cute.kda import decode

    args = make_case(case, seed=3)
    start = args["state"].clone()

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        args["state"].copy_(start)
        out = _poisoned_out(case)
        run_kernel(args, out)
        torch.cuda.synchronize()
        return out.clone(), args["state"].clone()

    assert_k_first_lines_same_bits(decode, run, case.pool_dtype == torch.float32, monkeypatch)


@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[8]], ids=[CASES[i].name for i in (0, 5, 8)])
def test_replays_are_bit_identical(case: Case) -> None:
    args = make_case(case, seed=7)
    start = args["state"].clone()
    results = []
    for _ in range(20):
        args["state"].copy_(start)
        out = _poisoned_out(case)
        run_kernel(args, out)
        results.append((out.clone(), args["state"].clone()))
    torch.cuda.synchronize()
    for out, pool in results[1:]:
        assert torch.equal(out.view(torch.int16), results[0][0].view(torch.int16))
        assert torch.equal(pool, results[0][1])


@pytest.mark.parametrize("case", [CASES[0], CASES[6], CASES[9]], ids=[CASES[i].name for i in (0, 6, 9)])
def test_cuda_graph_replays_with_new_values(case: Case) -> None:
    """Capture one call; change every input's and every index tensor's values in place (a new batch of requests:
    other slots, other accepted counts, other lengths under the same cu_seqlens buffer); replay; check."""
    args = make_case(case, seed=11)
    out = _poisoned_out(case)
    run_kernel(args, out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(args, out)
    torch.cuda.synchronize()

    for seed in (21, 22):
        fresh = make_case(case, seed=seed)
        if case.cu is not None:  # same buffer, new lengths (same total, one zero-length sequence kept)
            lens = _lens(case)
            fresh_cu = torch.tensor([0, *torch.tensor(lens[::-1]).cumsum(0).tolist()], dtype=torch.int32)
            fresh["cu_seqlens"] = fresh_cu.cuda()
        for name, value in fresh.items():
            if isinstance(value, torch.Tensor):
                args[name].copy_(value)
        shuffled = Case(**{**case.__dict__, "cu": tuple(args["cu_seqlens"].tolist())}) if case.cu else case
        before = args["state"].clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(shuffled, args, before, out)
