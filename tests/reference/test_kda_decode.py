"""``kda_decode`` on the reference backend against the fp64 recurrence run per sequence from its slot: every gate
form, both layouts, fp32 and bf16 pools, GVA, T_n in {0, 1, 2, 5}, padding rows, per-token slots with accepted
counts, the values a device kernel treats as padding, and the round trip prefill(T) + M decode steps =
prefill(T + M)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cula.kda import kda_decode, kda_prefill
from cula_runtime.kda_decode_args import validate_kda_decode
from cula_runtime.reference.kda_decode import kda_decode_reference
from cula_runtime.reference.kda_naive import kda_naive
from tests.helpers import rel_l2
from tests.reference.pool_oracle import GATES, V, make_inputs, make_pool, oracle, untouched

FP32_BOUND = 2e-6  # the fp32 reference against fp64, on fp32 inputs (measured: at most 1.5e-7)

# packed: five sequences of 1, 0, 2, 5, 2 tokens; the third is a padding row, the second a zero-length one
LENS = [1, 0, 2, 5, 2]
CU = [0, 1, 1, 3, 8, 10]
SLOTS = [3, 5, -1, 0, 6]
P = 8


def _double(kwargs: dict) -> dict:
    return {name: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for name, x in kwargs.items()}


def _check(kwargs: dict, pool: torch.Tensor, result_pool: torch.Tensor, o: torch.Tensor, indices: list,
           lens: list[int], *, v_first: bool, accepted: list[int] | None = None, bound: float = FP32_BOUND) -> None:
    o_ref, pool_ref = oracle(kwargs, pool, indices, lens, v_first=v_first, accepted=accepted)
    assert rel_l2(o, o_ref) < bound
    kept = untouched(pool.shape[0], indices, lens, accepted)
    written = [p for p in range(pool.shape[0]) if p not in kept]
    assert written and rel_l2(result_pool[written], pool_ref[written]) < bound
    assert torch.equal(result_pool[kept], pool[kept])  # bit-unchanged


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("gate", list(GATES))
def test_packed_decode_matches_the_oracle_and_a_bf16_pool_is_the_fp32_one_rounded(gate: str, v_first: bool) -> None:
    kwargs = make_inputs(gate, 1, CU[-1], seed=1, cu=CU)
    pool = make_pool(P, seed=2, v_first=v_first)
    idx = torch.tensor(SLOTS, dtype=torch.int32)
    fp32 = pool.clone()
    o = kda_decode(**kwargs, state=fp32, state_indices=idx, state_v_first=v_first)
    _check(kwargs, pool, fp32, o, SLOTS, LENS, v_first=v_first)
    padding = slice(CU[2], CU[3])
    assert torch.equal(o[0, padding], torch.zeros_like(o[0, padding]))
    # a bf16 pool: the same start states (bf16-representable), the same fp32 math, rounded once when written
    bf16 = pool.bfloat16()
    o_bf16 = kda_decode(**kwargs, state=bf16, state_indices=idx, state_v_first=v_first)
    assert torch.equal(o_bf16, o)
    assert torch.equal(bf16, fp32.bfloat16())


GVA = {"HV4-H4": (4, 4), "HV4-H1": (1, 4), "HV4-H2": (2, 4)}


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("heads", list(GVA), ids=list(GVA))
def test_fixed_length_decode_with_gva_and_out(heads: str, T: int) -> None:
    h, hv = GVA[heads]
    B = 3
    kwargs = make_inputs("softplus-in-kernel", B, T, seed=3, h=h, hv=hv)
    pool = make_pool(P, seed=4, v_first=False)
    slots = [6, -1, 2]
    result = pool.clone()
    out = torch.full((B, T, hv, V), float("nan"))
    o = kda_decode(**kwargs, state=result, state_indices=torch.tensor(slots, dtype=torch.int32), out=out)
    assert o is out
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    _check(kwargs, pool, result, o, slots, [T] * B, v_first=False)


def test_bf16_inputs_and_beta_give_bf16_output_within_its_rounding() -> None:
    kwargs = make_inputs("precomputed-unbounded", 4, 1, seed=5, dtype=torch.bfloat16)
    kwargs["beta"] = kwargs["beta"].bfloat16()  # bf16 beta as values
    pool = make_pool(P, seed=6, v_first=True)
    result = pool.clone()
    slots = [1, 7, 0, 4]
    o = kda_decode(**kwargs, state=result, state_indices=torch.tensor(slots, dtype=torch.int32), state_v_first=True)
    assert o.dtype == torch.bfloat16
    o_ref, pool_ref = oracle(kwargs, pool, slots, [1] * 4, v_first=True)
    assert rel_l2(o, o_ref) < 1e-2  # one bf16 rounding of o
    assert rel_l2(result[slots], pool_ref[slots]) < FP32_BOUND  # the state from the same (bf16) inputs, in fp32


# per-token slots (speculative verification): W = 4 columns; the second row is padding (its start entry is negative)
SPEC_SLOTS = [[0, 1, 2, 3], [-1, 9, 9, 9], [4, 5, -1, 7]]
SPEC_ACCEPTED = [2, 1, 4]


@pytest.mark.parametrize("accepted", [None, SPEC_ACCEPTED], ids=["from-column-0", "accepted"])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed-T3", "packed-lens-0-2-3"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
def test_speculative_verification_writes_each_tokens_state(v_first: bool, packed: bool, accepted) -> None:
    if packed:
        lens, cu = [0, 2, 3], [0, 0, 2, 5]
        kwargs = make_inputs("lower-bound-in-kernel", 1, 5, seed=7, cu=cu)
    else:
        lens = [3, 3, 3]
        kwargs = make_inputs("lower-bound-in-kernel", 3, 3, seed=7)
    pool = make_pool(10, seed=8, v_first=v_first)
    result = pool.clone()
    count = None if accepted is None else torch.tensor(accepted, dtype=torch.int32)
    o = kda_decode(**kwargs, state=result, state_indices=torch.tensor(SPEC_SLOTS, dtype=torch.int32),
                   num_accepted_tokens=count, state_v_first=v_first)
    _check(kwargs, pool, result, o, SPEC_SLOTS, lens, v_first=v_first, accepted=accepted)


def test_a_bf16_pool_rounds_each_written_state_but_runs_on_in_fp32() -> None:
    kwargs = make_inputs("precomputed-bounded", 3, 3, seed=9)
    pool = make_pool(10, seed=10, v_first=False)
    idx = torch.tensor(SPEC_SLOTS, dtype=torch.int32)
    fp32, bf16 = pool.clone(), pool.bfloat16()
    kda_decode(**kwargs, state=fp32, state_indices=idx)
    kda_decode(**kwargs, state=bf16, state_indices=idx)
    assert torch.equal(bf16, fp32.bfloat16())  # (rounding the running state per token would differ from this)


def test_values_a_kernel_treats_as_padding_on_the_device() -> None:
    """What the validator refuses on the CPU, the reference meets on a GPU (it reads the values itself): a start slot
    past the pool or a count outside [1, W] makes a padding row; an entry past the pool is a state not written."""
    kwargs = make_inputs("precomputed-bounded", 3, 2, seed=11)
    pool = make_pool(6, seed=12, v_first=False)
    valid = validate_kda_decode(**kwargs, state=pool.clone(), state_indices=torch.tensor([0, 1, 2], dtype=torch.int32))
    result = pool.clone()
    device_like = dataclasses.replace(valid, state=result, slots=None,
                                      state_indices=torch.tensor([9, -1, 4], dtype=torch.int32))
    o = kda_decode_reference(device_like)
    assert torch.equal(o[:2], torch.zeros_like(o[:2])) and o[2].abs().sum() > 0
    _check(kwargs, pool, result, o, [-1, -1, 4], [2] * 3, v_first=False)

    per_token = validate_kda_decode(**kwargs, state=pool.clone(), num_accepted_tokens=torch.ones(3, dtype=torch.int32),
                                    state_indices=torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32))
    result = pool.clone()
    device_like = dataclasses.replace(per_token, state=result, slots=None,
                                      state_indices=torch.tensor([[0, 1], [2, 3], [4, 60]], dtype=torch.int32),
                                      num_accepted_tokens=torch.tensor([0, 3, 1], dtype=torch.int32))
    o = kda_decode_reference(device_like)
    assert torch.equal(o[:2], torch.zeros_like(o[:2]))
    _check(kwargs, pool, result, o, [[-1, -1], [-1, -1], [4, -1]], [2] * 3, v_first=False)


def test_fp64_oracle_path_matches_the_recurrence_tightly() -> None:
    kwargs = _double(make_inputs("softplus-in-kernel", 1, CU[-1], seed=13, cu=CU))
    pool = make_pool(P, seed=14, v_first=True, dtype=torch.float64)
    result = pool.clone()
    args = validate_kda_decode(**kwargs, state=result, state_indices=torch.tensor(SLOTS, dtype=torch.int32),
                               state_v_first=True)
    o = kda_decode_reference(args, compute_dtype=torch.float64)
    assert o.dtype == torch.float64
    _check(kwargs, pool, result, o, SLOTS, LENS, v_first=True, bound=1e-12)


# ---- the round trip: prefill of T tokens into the pool, then M one-token decode steps, = one prefill of T + M


PREFILL_LENS = [37, 20]
M = 3
ROUND_TRIP_BOUND = 2e-6  # fp32 prefill (chunked) + fp32 decode against fp64 (measured: at most 1.7e-7)


def _packed(kwargs: dict, ranges: list[tuple[int, int]]) -> dict:
    """The rows' token ranges packed into one varlen batch, with the gate form's arguments."""
    packed = {name: torch.cat([kwargs[name][n:n + 1, a:b] for n, (a, b) in enumerate(ranges)], dim=1)
              for name in ("q", "k", "v", "g", "beta")}
    cu = [0]
    for a, b in ranges:
        cu.append(cu[-1] + b - a)
    flags = {key: x for key, x in kwargs.items() if key not in packed}
    return {**packed, **flags, "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("gate", ["precomputed-unbounded", "softplus-in-kernel"])
def test_round_trip_equals_one_prefill(gate: str, v_first: bool) -> None:
    # two rows of tokens; row n's first PREFILL_LENS[n] + M are used
    kwargs = make_inputs(gate, 2, max(PREFILL_LENS) + M, seed=15)
    flags = {key: x for key, x in kwargs.items() if key not in ("q", "k", "v", "g", "beta")}
    slots = [5, 1]
    pool = make_pool(6, seed=16, v_first=v_first)
    h0 = pool[slots]
    whole = _packed(kwargs, [(0, length + M) for length in PREFILL_LENS])
    o_ref, ht_ref = kda_naive(**whole, initial_state=h0, output_final_state=True, state_v_first=v_first)
    cu_whole = whole["cu_seqlens"].tolist()

    def steps(run_decode) -> list[torch.Tensor]:
        outputs = []
        for m in range(M):
            rows = {name: torch.cat([kwargs[name][n:n + 1, length + m:length + m + 1]
                                     for n, length in enumerate(PREFILL_LENS)])
                    for name in ("q", "k", "v", "g", "beta")}
            outputs.append(run_decode({**rows, **flags}))
        return outputs

    def compare(prefill_o: torch.Tensor, outputs: list[torch.Tensor], final: torch.Tensor, bound: float) -> None:
        for n, length in enumerate(PREFILL_LENS):
            begin = cu_whole[n]
            prefix_o = prefill_o[0, sum(PREFILL_LENS[:n]):sum(PREFILL_LENS[:n]) + length]
            assert rel_l2(prefix_o, o_ref[0, begin:begin + length]) < bound
            decoded = torch.stack([o[n, 0] for o in outputs])
            assert rel_l2(decoded, o_ref[0, begin + length:begin + length + M]) < bound
        assert rel_l2(final[slots], ht_ref) < bound

    # fp64: the oracle's prefill written into an fp64 pool, then the decode's fp64 path: equal to rounding
    prefix = _packed(kwargs, [(0, length) for length in PREFILL_LENS])
    pool64 = pool.double()
    o64, ht64 = kda_naive(**_double(prefix), initial_state=pool64[slots], output_final_state=True,
                          state_v_first=v_first)
    pool64[slots] = ht64
    idx = torch.tensor(slots, dtype=torch.int32)

    def decode64(rows: dict) -> torch.Tensor:
        args = validate_kda_decode(**_double(rows), state=pool64, state_indices=idx, state_v_first=v_first)
        return kda_decode_reference(args, compute_dtype=torch.float64)

    compare(o64, steps(decode64), pool64, 1e-12)

    # fp32: the public prefill into the pool (the chunked reference), then the public decode
    pool32 = pool.clone()
    o32, none = kda_prefill(**prefix, state=pool32, state_indices=idx, state_v_first=v_first)
    assert none is None
    outputs = steps(lambda rows: kda_decode(**rows, state=pool32, state_indices=idx, state_v_first=v_first))
    compare(o32, outputs, pool32, ROUND_TRIP_BOUND)
    assert torch.equal(pool32[[0, 2, 3, 4]], pool[[0, 2, 3, 4]])
    # and against one public prefill of T + M tokens into a pool
    pool_once = pool.clone()
    kda_prefill(**whole, state=pool_once, state_indices=idx, state_v_first=v_first)
    assert rel_l2(pool32[slots], pool_once[slots]) < ROUND_TRIP_BOUND
