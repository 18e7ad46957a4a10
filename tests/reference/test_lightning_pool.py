"""The reference backend of ``lightning_prefill`` / ``lightning_decode`` (through the public API on the CPU) against
the per-sequence float64 oracle of tests/reference/lightning_pool_oracle.py: the plain and pool forms of the prefill,
decode with ``T_n`` in {0, 1, 2, 5}, padding rows, untouched slots, the prefill + decode round trip, both layouts,
fp32 and bf16 pools, FLA's layer decay, decays down to -8 per token, the scale, varlen with empty sequences and
tails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cula.lightning import lightning_decode, lightning_prefill
from cula_runtime.lightning_args import layer_g_gamma, validate_lightning_decode, validate_lightning_prefill
from cula_runtime.reference.lightning import lightning_naive
from cula_runtime.reference.lightning_backend import lightning_decode_reference, lightning_prefill_reference
from tests.helpers import rel_l2
from tests.reference.lightning_pool_oracle import bounds_of, make_inputs, make_pool, pool_oracle

H, K, V = 4, 16, 8
FP32_BOUND = 2e-5  # the fp32 reference against fp64 (fp32 inputs)
BF16_OUT_BOUND = 1e-2  # bf16 outputs (rounded once) against fp64
POOL_BOUND = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
STEEP = torch.tensor([0.0, -0.5, -2.0, -8.0])  # head 0: no decay; head 3: -8 per token


@pytest.fixture(autouse=True)
def _reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _cu(lens: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    out = [0]
    for length in lens:
        out.append(out[-1] + length)
    return torch.tensor(out, dtype=dtype)


def _check_pool(pool: torch.Tensor, expected: torch.Tensor, named: list[int], before: torch.Tensor) -> None:
    """Named in-pool slots against the oracle; every other slot bit-unchanged."""
    P = pool.shape[0]
    written = [s for s in named if 0 <= s < P]
    others = [s for s in range(P) if s not in written]
    assert torch.equal(pool[others], before[others]), "a slot no sequence names changed"
    if written:
        assert rel_l2(pool[written], expected[written].double()) <= POOL_BOUND[pool.dtype]


# ---- the plain prefill ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("lens", [None, [0, 1, 64, 70, 0, 130]], ids=["fixed-B3-T70", "packed-0-1-64-70-0-130"])
def test_plain_prefill_matches_fp64_with_h0_and_final_state(lens, v_first: bool) -> None:
    B, T = (3, 70) if lens is None else (1, sum(lens))
    q, k, v = make_inputs(B, T, H, K, V, seed=1)
    N = B if lens is None else len(lens)
    h0 = make_pool(N, H, K, V, v_first=v_first, seed=2)
    cu = None if lens is None else _cu(lens, torch.int64)
    o, ht = lightning_prefill(q, k, v, STEEP, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                              state_v_first=v_first)
    o_ref, ht_ref = lightning_naive(q, k, v, STEEP, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    state_v_first=v_first)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32 and ht.shape == h0.shape
    assert rel_l2(o, o_ref) <= FP32_BOUND and rel_l2(ht, ht_ref) <= FP32_BOUND


def test_prefill_with_no_final_state_returns_none_and_bf16_outputs() -> None:
    q, k, v = make_inputs(2, 33, H, K, V, seed=3, dtype=torch.bfloat16)
    o, ht = lightning_prefill(q, k, v, STEEP)
    assert ht is None and o.dtype == torch.bfloat16
    assert rel_l2(o, lightning_naive(q, k, v, STEEP)[0]) <= BF16_OUT_BOUND


def test_scale_default_is_k_to_the_minus_half_and_a_given_one_is_used() -> None:
    q, k, v = make_inputs(1, 20, H, K, V, seed=4)
    o_default, _ = lightning_prefill(q, k, v, STEEP)
    o_ref, _ = lightning_naive(q, k, v, STEEP, scale=K ** -0.5)
    assert rel_l2(o_default, o_ref) <= FP32_BOUND
    o_scaled, _ = lightning_prefill(q, k, v, STEEP, scale=1.0)
    assert rel_l2(o_scaled, lightning_naive(q, k, v, STEEP, scale=1.0)[0]) <= FP32_BOUND
    assert rel_l2(o_scaled, o_default * K ** 0.5) <= FP32_BOUND


def test_layer_decay_is_flas_formula_head_0_without_decay() -> None:
    """g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h, checked against fp64 values written out here; the
    call with layer_idx equals the call with that g_gamma; the tensor is built once per key."""
    for H_, layer, layers in ((4, 0, 4), (8, 3, 24), (1, 0, 1), (64, 47, 48)):
        gamma = layer_g_gamma(H_, layer, layers, "cpu")
        expected = torch.tensor([-(8.0 / H_) * (1.0 - layer / layers) * h for h in range(H_)], dtype=torch.float64)
        assert gamma.dtype == torch.float32 and gamma.shape == (H_,)
        assert float(gamma[0]) == 0.0
        assert torch.allclose(gamma.double(), expected, rtol=1e-6, atol=0)
        assert layer_g_gamma(H_, layer, layers, torch.device("cpu")) is gamma  # (kept: no allocation per call)
    q, k, v = make_inputs(1, 40, H, K, V, seed=5)
    o, ht = lightning_prefill(q, k, v, layer_idx=1, num_layers=4, output_final_state=True)
    gamma = torch.tensor([-(8.0 / H) * 0.75 * h for h in range(H)])
    o_ref, ht_ref = lightning_naive(q, k, v, gamma, output_final_state=True)
    assert rel_l2(o, o_ref) <= FP32_BOUND and rel_l2(ht, ht_ref) <= FP32_BOUND
    # head 0 has no decay: its state is the plain sum of outer products
    plain = torch.einsum("tk,tv->kv", k[0, :, 0].double(), v[0, :, 0].double())
    assert torch.allclose(ht[0, 0].double(), plain, rtol=1e-5, atol=1e-5)


# ---- the pool form of the prefill -----------------------------------------------------------------------------------

PREFILL_POOL_CASES = {
    "fixed-B3-T70": dict(lens=None, B=3, T=70, indices=[4, -1, 0], has=None),
    "packed-0-5-64-130-has": dict(lens=[0, 5, 64, 130], indices=[2, 5, -3, 0], has=[True, False, True, True]),
    "packed-tails-1-63-65": dict(lens=[1, 63, 65], indices=[1, 3, 6], has=[False, True, True]),
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("name", list(PREFILL_POOL_CASES))
def test_pool_prefill_matches_the_per_sequence_oracle(name: str, v_first: bool, pool_dtype: torch.dtype) -> None:
    case = PREFILL_POOL_CASES[name]
    lens = case["lens"]
    B, T = (case["B"], case["T"]) if lens is None else (1, sum(lens))
    q, k, v = make_inputs(B, T, H, K, V, seed=6)
    pool = make_pool(7, H, K, V, v_first=v_first, dtype=pool_dtype)
    before = pool.clone()
    has = case["has"]
    o_ref, expected = pool_oracle(q, k, v, STEEP, None, pool, case["indices"], lens, v_first=v_first, decode=False,
                                  has_initial_state=has)
    o, none = lightning_prefill(q, k, v, STEEP, cu_seqlens=None if lens is None else _cu(lens),
                                state_v_first=v_first, state=pool, state_indices=_i32(case["indices"]),
                                has_initial_state=None if has is None else torch.tensor(has))
    assert none is None
    assert rel_l2(o, o_ref) <= FP32_BOUND
    _check_padding_rows_zero(o, case["indices"], lens, 7)
    _check_pool(pool, expected, case["indices"], before)


def _check_padding_rows_zero(o: torch.Tensor, indices: list[int], lens: list[int] | None, P: int) -> None:
    """The outputs of every padding row (a slot outside ``[0, P)``) are exactly zero (KDA_SPEC §10)."""
    B, T = o.shape[:2]
    bounds = bounds_of(lens, B, T)
    flat = o.reshape(B * T, *o.shape[2:])
    for n, slot in enumerate(indices):
        if not 0 <= slot < P:
            assert bool((flat[bounds[n]:bounds[n + 1]] == 0).all()), f"padding row {n} has non-zero outputs"


def test_pool_prefill_slot_past_the_pool_is_padding_in_the_backend() -> None:
    """What a GPU call's out-of-pool slot does (the CPU validator refuses it): the reference backend treats it as
    padding, nothing read or written, its outputs zeros."""
    q, k, v = make_inputs(2, 9, H, K, V, seed=8)
    pool = make_pool(3, H, K, V, v_first=False)
    before = pool.clone()
    args = validate_lightning_prefill(q, k, v, STEEP, state=pool, state_indices=_i32([1, 0]))
    args = dataclasses.replace(args, state_indices=_i32([1, 3]))
    o, _ = lightning_prefill_reference(args)
    o_ref, expected = pool_oracle(q, k, v, STEEP, None, before, [1, 3], None, v_first=False, decode=False)
    assert rel_l2(o, o_ref) <= FP32_BOUND
    _check_padding_rows_zero(o, [1, 3], None, 3)
    _check_pool(pool, expected, [1, 3], before)


# ---- decode ---------------------------------------------------------------------------------------------------------

DECODE_CASES = {
    "fixed-B4-T1": dict(lens=None, B=4, T=1, indices=[3, -1, 0, 6]),
    "fixed-B3-T2": dict(lens=None, B=3, T=2, indices=[2, 5, -2]),
    "packed-0-1-2-5": dict(lens=[0, 1, 2, 5], indices=[1, 4, 0, 6]),
    "packed-5-0-1-2-padding": dict(lens=[5, 0, 1, 2, 3], indices=[2, 3, -1, 6, -7]),
    "fixed-B2-T0": dict(lens=None, B=2, T=0, indices=[1, 2]),
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_the_per_sequence_oracle(name: str, v_first: bool, pool_dtype: torch.dtype) -> None:
    case = DECODE_CASES[name]
    lens = case["lens"]
    B, T = (case["B"], case["T"]) if lens is None else (1, sum(lens))
    q, k, v = make_inputs(B, T, H, K, V, seed=9)
    pool = make_pool(7, H, K, V, v_first=v_first, dtype=pool_dtype)
    before = pool.clone()
    o_ref, expected = pool_oracle(q, k, v, STEEP, 0.7, pool, case["indices"], lens, v_first=v_first, decode=True)
    out = torch.full_like(v, float("nan"))
    o = lightning_decode(q, k, v, STEEP, scale=0.7, state=pool, state_indices=_i32(case["indices"]),
                         state_v_first=v_first, cu_seqlens=None if lens is None else _cu(lens, torch.int64), out=out)
    assert o is out and o.shape == (B, T, H, V)
    if o.numel():
        assert rel_l2(o, o_ref) <= FP32_BOUND
    padding = [n for n, s in enumerate(case["indices"]) if not 0 <= s < 7]
    flat = o.reshape(B * T, H, V)
    starts = [n * T for n in range(B + 1)] if lens is None else _cu(lens).tolist()
    for n in padding:
        assert torch.equal(flat[starts[n]:starts[n + 1]], torch.zeros_like(flat[starts[n]:starts[n + 1]]))
    written = [s for n, s in enumerate(case["indices"]) if 0 <= s < 7 and starts[n + 1] > starts[n]]
    _check_pool(pool, expected, written, before)


def test_decode_fp64_path_and_slot_past_the_pool_is_padding_in_the_backend() -> None:
    q, k, v = make_inputs(3, 2, H, K, V, seed=10)
    pool = make_pool(4, H, K, V, v_first=True)
    before = pool.clone()
    args = validate_lightning_decode(q, k, v, STEEP, state=pool, state_indices=_i32([0, 1, 2]), state_v_first=True)
    args = dataclasses.replace(args, state_indices=_i32([0, 9, 2]))
    o = lightning_decode_reference(args, compute_dtype=torch.float64)
    o_ref, expected = pool_oracle(q, k, v, STEEP, None, before, [0, 9, 2], None, v_first=True, decode=True)
    assert rel_l2(o, o_ref) <= 1e-6 and torch.equal(o[1], torch.zeros_like(o[1]))
    _check_pool(pool, expected, [0, 2], before)


def test_decode_with_the_layer_decay_and_bf16_inputs() -> None:
    q, k, v = make_inputs(5, 1, H, K, V, seed=11, dtype=torch.bfloat16)
    pool = make_pool(5, H, K, V, v_first=False)
    before = pool.clone()
    gamma = torch.tensor([-(8.0 / H) * (1 - 2 / 3) * h for h in range(H)])
    o_ref, expected = pool_oracle(q, k, v, gamma, None, pool, [4, 3, 2, 1, 0], None, v_first=False, decode=True)
    o = lightning_decode(q, k, v, layer_idx=2, num_layers=3, state=pool, state_indices=_i32([4, 3, 2, 1, 0]))
    assert o.dtype == torch.bfloat16 and rel_l2(o, o_ref) <= BF16_OUT_BOUND
    _check_pool(pool, expected, [0, 1, 2, 3, 4], before)


# ---- the round trip -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
def test_prefill_into_the_pool_then_decode_steps_equals_one_longer_prefill(v_first: bool,
                                                                           pool_dtype: torch.dtype) -> None:
    """Prefill T_n tokens of three sequences (packed, one of them empty) into slots 5, 0, 2, then M = 4 decode
    steps of one token each: the decode outputs and the final slots equal one fp64 prefill of T_n + M tokens."""
    lens, M = [70, 0, 33], 4
    total = [n + M for n in lens]
    q, k, v = make_inputs(1, sum(total), H, K, V, seed=12)
    bounds = _cu(total).tolist()
    slots = [5, 0, 2]
    pool = make_pool(6, H, K, V, v_first=v_first, dtype=pool_dtype)
    before = pool.clone()

    # each sequence's first T_n tokens, packed
    prefix = [torch.cat([x[:, b:b + n] for b, n in zip(bounds[:-1], lens, strict=True)], dim=1) for x in (q, k, v)]
    lightning_prefill(*prefix, STEEP, cu_seqlens=_cu(lens), state_v_first=v_first, state=pool,
                      state_indices=_i32(slots), has_initial_state=torch.zeros(3, dtype=torch.bool))
    steps = []
    for m in range(M):
        token = [torch.stack([x[0, b + n + m] for b, n in zip(bounds[:-1], lens, strict=True)]).unsqueeze(1)
                 for x in (q, k, v)]
        steps.append(lightning_decode(*token, STEEP, state=pool, state_indices=_i32(slots), state_v_first=v_first))
    o_ref, ht_ref = lightning_naive(q, k, v, STEEP, output_final_state=True, cu_seqlens=_cu(total),
                                    state_v_first=v_first)
    for m, o_step in enumerate(steps):
        expected = torch.stack([o_ref[0, b + n + m] for b, n in zip(bounds[:-1], lens, strict=True)])
        bound = 2e-2 if pool_dtype == torch.bfloat16 else FP32_BOUND  # (a bf16 pool rounds the state per step)
        assert rel_l2(o_step[:, 0], expected) <= bound
    assert rel_l2(pool[slots], ht_ref) <= POOL_BOUND[pool_dtype]
    assert torch.equal(pool[[1, 3, 4]], before[[1, 3, 4]])
