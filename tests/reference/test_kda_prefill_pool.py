"""``kda_prefill`` on a state pool (reference backend) against the fp64 recurrence run per sequence from its slot:
each gate form (precomputed g with safe_gate True/False, the in-kernel lower-bound and softplus forms), both layouts,
fp32 and bf16 pools, GVA, zero-length sequences, padding rows and ``has_initial_state``."""

from __future__ import annotations

import pytest
import torch

from cula.kda import kda_prefill
from tests.helpers import rel_l2
from tests.reference.pool_oracle import make_inputs, make_pool, oracle

BOUND = 2e-6  # the fp32 chunked reference against fp64, fp32 inputs (measured: at most 1.5e-7)

# packed: 70, 0, 5, 130 and 1 tokens (several chunks, a partial one, a zero-length sequence); the third is padding
LENS = [70, 0, 5, 130, 1]
CU = [0, 70, 70, 75, 205, 206]
SLOTS = [4, 0, -1, 2, 6]
HAS_INITIAL = [True, False, True, False, True]
P = 8

FORMS = {  # name: (pool_oracle gate, extra kda_prefill arguments)
    "precomputed-safe-gate": ("precomputed-bounded", dict(safe_gate=True)),
    "precomputed-unbounded": ("precomputed-unbounded", {}),
    "lower-bound-in-kernel": ("lower-bound-in-kernel", dict(safe_gate=True)),
    "softplus-in-kernel": ("softplus-in-kernel", {}),
}


def _check(kwargs: dict, pool: torch.Tensor, result: torch.Tensor, o: torch.Tensor, slots: list[int],
           lens: list[int], *, v_first: bool, has_initial: list[bool] | None) -> None:
    o_ref, pool_ref = oracle(kwargs, pool, slots, lens, v_first=v_first, has_initial=has_initial)
    assert rel_l2(o, o_ref) < BOUND
    named = [s for s in slots if s >= 0]
    kept = [p for p in range(pool.shape[0]) if p not in named]
    # (a zero-length sequence without an initial state leaves zeros: compared exactly)
    assert torch.equal(result[named].double() == 0, pool_ref[named] == 0)
    assert rel_l2(result[named], pool_ref[named]) < BOUND
    assert torch.equal(result[kept], pool[kept])  # bit-unchanged


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("form", list(FORMS))
def test_packed_prefill_into_the_pool_matches_the_oracle(form: str, v_first: bool) -> None:
    gate, extra = FORMS[form]
    kwargs = make_inputs(gate, 1, CU[-1], seed=21, cu=CU)
    pool = make_pool(P, seed=22, v_first=v_first)
    idx = torch.tensor(SLOTS, dtype=torch.int32)
    has = torch.tensor(HAS_INITIAL)
    fp32 = pool.clone()
    o, final = kda_prefill(**kwargs, **extra, state_v_first=v_first, state=fp32, state_indices=idx,
                           has_initial_state=has)
    assert final is None  # the final states are in the pool
    _check(kwargs, pool, fp32, o, SLOTS, LENS, v_first=v_first, has_initial=HAS_INITIAL)
    assert torch.equal(o[0, CU[2]:CU[3]], torch.zeros_like(o[0, CU[2]:CU[3]]))  # the padding row
    # a bf16 pool: the same start states, the same fp32 math, each final state rounded once
    bf16 = pool.bfloat16()
    o_bf16, _ = kda_prefill(**kwargs, **extra, state_v_first=v_first, state=bf16, state_indices=idx,
                            has_initial_state=has)
    assert torch.equal(o_bf16, o)
    assert torch.equal(bf16, fp32.bfloat16())


@pytest.mark.parametrize("heads", [(1, 4), (2, 4), (4, 4)], ids=["HV4-H1", "HV4-H2", "HV4-H4"])
def test_fixed_length_prefill_into_the_pool_with_gva(heads: tuple[int, int]) -> None:
    h, hv = heads
    kwargs = make_inputs("softplus-in-kernel", 3, 67, seed=23, h=h, hv=hv)
    pool = make_pool(P, seed=24, v_first=False)
    slots = [7, 1, -1]
    result = pool.clone()
    o, _ = kda_prefill(**kwargs, state=result, state_indices=torch.tensor(slots, dtype=torch.int32))
    _check(kwargs, pool, result, o, slots, [67] * 3, v_first=False, has_initial=None)
    assert torch.equal(o[2], torch.zeros_like(o[2]))


def test_prefill_into_the_pool_equals_the_gathered_call() -> None:
    """The pool form gives the bits of the call a serving engine makes today: gather the states, prefill with
    initial_state and output_final_state, scatter the final states back."""
    kwargs = make_inputs("precomputed-unbounded", 1, CU[-1], seed=25, cu=CU)
    pool = make_pool(P, seed=26, v_first=True)
    slots = [4, 0, 3, 2, 6]
    result = pool.clone()
    o, _ = kda_prefill(**kwargs, state=result, state_indices=torch.tensor(slots, dtype=torch.int32),
                       state_v_first=True)
    o_ref, ht = kda_prefill(**kwargs, initial_state=pool[slots], output_final_state=True, state_v_first=True)
    expected = pool.clone()
    expected[slots] = ht
    assert torch.equal(o, o_ref) and torch.equal(result, expected)


def test_a_sequence_of_no_tokens_leaves_an_fp64_slot_bit_identical() -> None:
    """A sequence with no tokens that reads its slot leaves it as it was (its state went through fp32 here before),
    as ``kda_decode`` does; the other sequence's slot is written."""
    gen = torch.Generator().manual_seed(4)
    H = HV = 2
    K = V = 8
    q, k, v = (torch.randn(1, 3, H, K, generator=gen) for _ in range(3))
    pool = torch.randn(6, HV, K, V, dtype=torch.float64, generator=gen)
    before = pool.clone()
    kda_prefill(q, 0.3 * k, v, -torch.rand(1, 3, HV, K, generator=gen), torch.rand(1, 3, HV, generator=gen),
                cu_seqlens=torch.tensor([0, 3, 3], dtype=torch.int32), state=pool,
                state_indices=torch.tensor([2, 4], dtype=torch.int32))
    assert torch.equal(pool[4], before[4]) and not torch.equal(pool[2], before[2])
