"""``cula.kda.kda_decode`` on a GPU: the dispatch reaches the CuTeDSL decode kernel (no fallback), its results match
the float64 path of the reference on the same inputs, it is capturable in a CUDA graph through the public API, it
allocates nothing with ``out``, and a prefill into the pool followed by decode steps equals one longer prefill.

(The kernel's own matrix of gate forms, layouts, pools and index rules against a float64 loop is
``tests/cute/test_kda_decode_gpu.py``; this file checks the public path on top of it.)

Bounds (rel-L2 against the float64 reference path on the same inputs): o 1e-2 (bf16 output, and the kernel rounds
the L2-normalised q and k to bf16 as the prefill does), written states 5e-3 in an fp32 pool, 1e-2 in a bf16 pool.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from cula import dispatch
from cula.kda import kda_decode, kda_prefill
from cula_runtime.cute import is_available
from cula_runtime.kda_decode_args import validate_kda_decode
from cula_runtime.reference.kda_decode import kda_decode_reference
from tests.helpers import rel_l2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not is_available(), reason="CuTeDSL / TVM-FFI not installed")]

K = V = 128
O_BOUND = 1e-2
STATE_BOUND = {torch.float32: 5e-3, torch.bfloat16: 1e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    H: int
    HV: int
    lens: tuple[int, ...] | None  # packed lengths (cu_seqlens), or None: fixed T = 1 per row
    B: int = 4
    gate: str = "softplus"  # "softplus" (in kernel, unbounded), "fp32-log", "lower-bound"
    pool: torch.dtype = torch.float32
    v_first: bool = False
    cu64: bool = False  # pass cu_seqlens as int64 (narrowed by the backend)
    params_bf16: bool = False  # A_log / dt_bias in bf16
    per_token: bool = False  # [N, W] indices with num_accepted_tokens
    P: int = 13  # pool slots


CASES = [
    Case("kimi-H32-N4-T1", 32, 32, None),
    Case("gva-H2-HV8-packed-0-1-2-5-vfirst", 2, 8, (0, 1, 2, 5), v_first=True, gate="fp32-log"),
    Case("bf16-pool-H4-packed-cu64", 4, 4, (3, 0, 1), pool=torch.bfloat16, cu64=True, params_bf16=True),
    Case("lower-bound-H8-HV16-T1", 8, 16, None, B=9, gate="lower-bound"),
    Case("spec-verify-H4-packed", 4, 4, (2, 3, 1), per_token=True),
    # 64 sequences x 32 heads of 64 KB: a step reads 128 MiB of state, so K-first CTAs take whole rows (4 lines)
    Case("kimi-H32-N64-T1-whole-rows", 32, 32, None, B=64, P=67),
]


def make_call(case: Case, seed: int = 0) -> dict:
    """The call's keyword arguments on the GPU: the pool of ``case.P`` slots, sequence rows 1 and 3 padding (-1, and
    a slot past the pool) where there are more than 3, the others distinct random slots."""
    gen = torch.Generator().manual_seed(seed)
    P = case.P

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).cuda()

    B, T = (1, sum(case.lens)) if case.lens is not None else (case.B, 1)
    N = len(case.lens) if case.lens is not None else B
    kwargs = dict(q=r(B, T, case.H, K), k=r(B, T, case.H, K), v=r(B, T, case.HV, V),
                  beta=torch.rand(B, T, case.HV, generator=gen).cuda(), use_qk_l2norm_in_kernel=True,
                  state_v_first=case.v_first)
    if case.gate == "fp32-log":
        kwargs["g"] = -torch.exp(2.0 * torch.randn(B, T, case.HV, K, generator=gen)).cuda()
    else:
        params = torch.bfloat16 if case.params_bf16 else torch.float32
        kwargs.update(g=r(B, T, case.HV, K, dtype=torch.float32), use_gate_in_kernel=True,
                      A_log=torch.log(1 + 15 * torch.rand(case.HV, generator=gen)).to(params).cuda(),
                      dt_bias=(0.5 * torch.randn(case.HV * K, generator=gen)).to(params).cuda())
        if case.gate == "lower-bound":
            kwargs["lower_bound"] = -5.0
    shape = (P, case.HV, V, K) if case.v_first else (P, case.HV, K, V)
    kwargs["state"] = (0.5 * torch.randn(*shape, generator=gen)).to(case.pool).cuda()
    slots = torch.randperm(P, generator=gen)[:N].to(torch.int32)
    if N > 3:
        slots[1], slots[3] = -1, P + 2
    if case.per_token:
        W = max(case.lens)
        table = torch.randperm(P, generator=gen)[: N * W].view(N, W).to(torch.int32)
        kwargs["state_indices"] = table.cuda()
        kwargs["num_accepted_tokens"] = torch.tensor([1 + n % W for n in range(N)], dtype=torch.int32).cuda()
    else:
        kwargs["state_indices"] = slots.cuda()
    if case.lens is not None:
        cu = torch.tensor([0, *torch.tensor(case.lens).cumsum(0).tolist()])
        kwargs["cu_seqlens"] = cu.to(torch.int64 if case.cu64 else torch.int32).cuda()
    return kwargs


def oracle(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, pool after the call) of the reference's float64 path on a copy of the pool."""
    pool = kwargs["state"].clone()
    o = kda_decode_reference(validate_kda_decode(**{**kwargs, "state": pool}), compute_dtype=torch.float64)
    return o, pool


def check(case: Case, kwargs: dict, o: torch.Tensor, pool: torch.Tensor, o_ref: torch.Tensor,
          pool_ref: torch.Tensor) -> None:
    assert torch.isfinite(o).all(), f"{case.name}: non-finite output"
    touched = (pool_ref != kwargs["_before"]).flatten(1).any(1)
    assert torch.equal(pool[~touched], kwargs["_before"][~touched]), f"{case.name}: a slot nobody names changed"
    err_o = rel_l2(o.double(), o_ref.double())
    err_s = rel_l2(pool[touched].double(), pool_ref[touched].double()) if touched.any() else 0.0
    assert err_o <= O_BOUND, f"{case.name}: o rel-L2 {err_o:.2e} > {O_BOUND:.0e}"
    assert err_s <= STATE_BOUND[case.pool], f"{case.name}: states rel-L2 {err_s:.2e} > {STATE_BOUND[case.pool]:.0e}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kda_decode_runs_the_kernel_and_matches_float64(case: Case, monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    kwargs = make_call(case)
    choice = dispatch.explain_decode(validate_kda_decode(**kwargs))
    assert not choice.gpu_fallback and choice.decisions[-1].backend == "cutedsl", choice.summary
    o_ref, pool_ref = oracle(kwargs)
    kwargs["_before"] = kwargs["state"].clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.CulaFallbackWarning)
        o = kda_decode(**{k: v for k, v in kwargs.items() if k != "_before"})
    check(case, kwargs, o, kwargs["state"], o_ref, pool_ref)


def test_a_call_with_out_allocates_nothing_and_a_graph_of_it_replays_new_values(monkeypatch) -> None:
    """Through the public API: int32 indices and cu_seqlens on the GPU, ``out`` given: no allocation, no host
    synchronisation (the capture would fail), and replays after every input and index tensor changed in place."""
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    case = Case("graph-H4-packed", 4, 8, (1, 0, 2, 1, 1))
    call = make_call(case, seed=1)
    out = torch.full_like(call["v"], float("nan"))
    kda_decode(**call, out=out)  # compiles, outside the capture
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    kda_decode(**call, out=out)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations, "a call with out allocated"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_decode(**call, out=out)
    for seed in (2, 3):
        fresh = make_call(case, seed=seed)
        for name, value in fresh.items():
            if isinstance(value, torch.Tensor):
                call[name].copy_(value)
        o_ref, pool_ref = oracle(call)
        call["_before"] = call["state"].clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(case, call, out, call["state"], o_ref, pool_ref)
        del call["_before"]


def test_replays_are_bit_identical(monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    call = make_call(CASES[1], seed=4)
    start = call["state"].clone()
    first = kda_decode(**call).clone()
    after = call["state"].clone()
    for _ in range(20):
        call["state"].copy_(start)
        assert torch.equal(kda_decode(**call), first) and torch.equal(call["state"], after)


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
def test_prefill_into_the_pool_then_decode_steps_equals_one_longer_prefill(v_first: bool, monkeypatch) -> None:
    """Prefill T = 100 tokens of 3 sequences into pool slots (4, 0, 7), then M = 3 decode steps (each step one token
    per sequence), against one prefill of T + M tokens per sequence with the final state out."""
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    gen = torch.Generator().manual_seed(7)
    N, T, M, H, HV = 3, 100, 3, 2, 4

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).cuda()

    full = dict(q=r(N, T + M, H, K), k=r(N, T + M, H, K), v=r(N, T + M, HV, V), g=r(N, T + M, HV, K,
                dtype=torch.float32), beta=torch.rand(N, T + M, HV, generator=gen).cuda())
    gate = dict(use_gate_in_kernel=True, A_log=torch.log(1 + 15 * torch.rand(HV, generator=gen)).cuda(),
                dt_bias=(0.5 * torch.randn(HV * K, generator=gen)).cuda(), use_qk_l2norm_in_kernel=True,
                state_v_first=v_first)
    h0 = (0.5 * torch.randn(N, HV, K, V, generator=gen)).cuda()
    h0 = h0.transpose(-1, -2).contiguous() if v_first else h0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.CulaFallbackWarning)  # (the pool prefill may still run the reference)
        o_full, h_full = kda_prefill(**full, **gate, initial_state=h0, output_final_state=True)
        pool = torch.zeros(9, HV, *h0.shape[2:], device="cuda")
        slots = torch.tensor([4, 0, 7], dtype=torch.int32, device="cuda")
        pool[slots.long()] = h0
        part = {name: x[:, :T] for name, x in full.items()}
        o_pre, _ = kda_prefill(**part, **gate, state=pool, state_indices=slots)
    steps = []
    for t in range(T, T + M):
        step = {name: x[:, t:t + 1] for name, x in full.items()}
        steps.append(kda_decode(**step, **gate, state=pool, state_indices=slots))
    o_all = torch.cat([o_pre, *steps], dim=1)
    assert rel_l2(o_all.double(), o_full.double()) <= O_BOUND
    assert rel_l2(pool[slots.long()].double(), h_full.double()) <= STATE_BOUND[torch.float32]
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[[4, 0, 7]] = False
    assert not pool[untouched.cuda()].any(), "slots no sequence names must stay zero"
