"""The CPU side of the Lightning GPU tests' bounds (tests/lightning_cases.py): the bound lookup against the frozen
FLA errors (1.25x, the provisional fallback for missing and non-finite entries, the ceiling and the floor), the
cases' determinism (the same seed gives the same bits, in the documented draw order), and the cases' plumbing (the
reference backend on the CPU against each case's fp64 oracle, within the provisional bound)."""

from __future__ import annotations

import math

import pytest
import torch

from tests import lightning_cases as lc
from tests.helpers import rel_l2


def test_the_case_names_are_unique_and_cover_every_call_form() -> None:
    assert len(lc.BY_NAME) == len(lc.CASES)
    assert {c.op for c in lc.CASES} == {"prefill", "decode"}
    assert any(c.pool and c.op == "prefill" for c in lc.CASES) and lc.LAYER_CASE in lc.CASES
    assert {c.v_first for c in lc.CASES} == {False, True}
    assert {c.pool_dtype for c in lc.CASES if c.pool} == {torch.float32, torch.bfloat16}


def test_the_bound_is_fla_times_1_25_between_the_floor_and_the_provisional_bound() -> None:
    table = {"a": (2e-3, 4e-4), "b": (0.5, float("nan")), "c": (0.0, 1e-9)}
    assert lc.bound("a", 0, table) == pytest.approx(2.5e-3) and lc.bound("a", 1, table) == pytest.approx(5e-4)
    assert lc.bound("b", 0, table) == lc.PROVISIONAL_BOUND  # (FLA worse than the provisional bound: the ceiling)
    assert lc.bound("b", 1, table) == lc.PROVISIONAL_BOUND  # NaN: not measured, the documented fallback
    assert lc.bound("c", 0, table) == lc.ROUNDING_FLOOR and lc.bound("c", 1, table) == lc.ROUNDING_FLOOR
    assert lc.bound("missing", 0, table) == lc.PROVISIONAL_BOUND
    with pytest.raises(ValueError, match="which"):
        lc.bound("a", 2, table)


def test_a_nan_entry_takes_fla_s_largest_finite_error_of_the_same_op_and_bf16_pools_their_floor() -> None:
    prefill, other_prefill, pool_prefill = lc.PREFILL_CASES[0].name, lc.PREFILL_CASES[1].name, lc.POOL_PREFILL_CASES
    decode = lc.DECODE_CASES[0].name
    bf16_pool = next(c.name for c in pool_prefill if c.pool_dtype == torch.bfloat16)
    fp32_pool = next(c.name for c in pool_prefill if c.pool_dtype == torch.float32)
    table = {prefill: (2e-3, float("nan")), other_prefill: (2e-3, 4e-4), fp32_pool: (2e-3, float("nan")),
             bf16_pool: (2e-3, 2e-4), decode: (1e-3, 9e-3)}
    # (the decode case's larger state error is another op's: not taken)
    assert lc.bound(prefill, 1, table) == pytest.approx(5e-4) == lc.bound(fp32_pool, 1, table)
    assert lc.bound(bf16_pool, 1, table) == pytest.approx(2.5e-4)  # (its own finite error: no rounding added)
    table[bf16_pool] = (2e-3, float("nan"))  # (a NaN bf16 pool: the fp32 sibling's error and two bf16 roundings)
    assert lc.bound(bf16_pool, 1, table) == pytest.approx(5e-4 + 2 * lc.BF16_ROUNDING)
    assert lc.bound(decode, 1, {decode: (1e-3, float("nan"))}) == lc.PROVISIONAL_BOUND  # (no finite sibling)
    assert lc.bound(bf16_pool, 1, {bf16_pool: (2e-3, 0.0)}) == lc.BF16_POOL_FLOOR
    assert lc.bound(bf16_pool, 0, {bf16_pool: (0.0, 0.0)}) == lc.ROUNDING_FLOOR  # (o is bf16 output, not the pool)
    assert lc.bound(fp32_pool, 1, {fp32_pool: (2e-3, 0.0)}) == lc.ROUNDING_FLOOR


def test_the_frozen_table_is_well_formed_and_the_default_lookup_reads_it() -> None:
    from tests.lightning_fla_errors import LIGHTNING_FLA_ERRORS

    for name, errors in LIGHTNING_FLA_ERRORS.items():
        assert name in lc.BY_NAME, f"frozen error for unknown case {name!r}"
        assert len(errors) == 2 and all(isinstance(e, float) and (math.isnan(e) or e >= 0) for e in errors)
    for case in lc.CASES:
        for which in (0, 1):
            assert lc.bound(case.name, which) == lc.bound(case.name, which, LIGHTNING_FLA_ERRORS)


@pytest.mark.parametrize("case", lc.CASES, ids=[c.name for c in lc.CASES])
def test_the_same_seed_gives_the_same_bits(case: lc.LightningCase) -> None:
    first, again, other = lc.make_inputs(case, "cpu"), lc.make_inputs(case, "cpu"), lc.make_inputs(case, "cpu", 1)
    assert first.keys() == again.keys()
    for name, value in first.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == again[name].dtype and torch.equal(value, again[name]), name
        else:
            assert value == again[name], name
    assert not torch.equal(first["q"], other["q"])


def test_the_draw_order_is_q_k_v_then_the_state() -> None:
    case = lc.BY_NAME["prefill-fixed-B2-T200-h0-vfirst"]
    gen = torch.Generator().manual_seed(0)
    shape = (case.B, case.T, lc.H, lc.K)
    q = (0.5 * torch.randn(*shape, generator=gen)).to(torch.bfloat16)
    k = (0.5 * torch.randn(*shape, generator=gen)).to(torch.bfloat16)
    v = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    h0 = 0.3 * torch.randn(case.N, lc.H, lc.V, lc.K, generator=gen)
    got = lc.make_inputs(case, "cpu")
    for name, value in (("q", q), ("k", k), ("v", v), ("initial_state", h0)):
        assert torch.equal(got[name], value), name


def test_start_states_gather_the_slots_and_zero_padding_and_fresh_rows() -> None:
    case = lc.BY_NAME["pool-prefill-fixed-B4-T80-padding-kfirst-bf16-pool"]  # slots (6, -1, 0, 99), has[2] False
    kwargs = lc.make_inputs(case, "cpu")
    h0 = lc.start_states(case, kwargs)
    assert h0.dtype == torch.float32 and h0.shape == (4, lc.H, lc.K, lc.V)
    assert torch.equal(h0[0], kwargs["state"][6].float())
    assert not h0[1].any() and not h0[2].any() and not h0[3].any()
    assert case.written() == [6, 0]
    assert lc.BY_NAME["decode-packed-0-1-2-5-kfirst-fp32-pool"].written() == [4, 0, 6]  # (no tokens: no write)


@pytest.mark.parametrize("case", lc.CASES, ids=[c.name for c in lc.CASES])
def test_the_reference_backend_meets_the_provisional_bound_on_the_cpu(case: lc.LightningCase,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from cula.lightning import lightning_decode, lightning_prefill

    monkeypatch.setenv("CULA_BACKEND", "reference")
    kwargs = lc.make_inputs(case, "cpu")
    before = kwargs["state"].clone() if case.pool else None
    o_ref, states_ref = lc.oracle(case, kwargs, before)
    if case.pool:  # (past the pool is padding on a GPU only: the CPU validator rejects it; -1 is the same padding)
        kwargs["state_indices"] = torch.where(kwargs["state_indices"] >= lc.POOL_SLOTS, -1, kwargs["state_indices"])
    if case.op == "decode":
        o, states = lightning_decode(**kwargs), kwargs["state"]
    else:
        o, states = lightning_prefill(**kwargs)
        states = kwargs["state"] if case.pool else states
    assert o.shape == o_ref.shape and rel_l2(o, o_ref) <= lc.PROVISIONAL_BOUND
    if case.pool:
        written = case.written()
        assert rel_l2(states[written], states_ref[written]) <= lc.PROVISIONAL_BOUND
    elif case.layer is None:
        assert rel_l2(states, states_ref) <= lc.PROVISIONAL_BOUND
    else:
        assert states is None and states_ref is None
