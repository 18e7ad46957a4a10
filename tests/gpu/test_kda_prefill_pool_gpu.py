"""``kda_prefill``'s state-pool form (``state=``, ``state_indices=``, ``has_initial_state=``; issue 26) on each GPU
backend (forced with CULA_BACKEND), on the H200.

Inputs: cases of the GPU matrix (``tests/kda_cases.py``, seed 0: the inputs FLA's errors were measured on), bounded
and unbounded gates, fixed length and varlen with empty sequences, GVA; the pool holds each sequence's ``h0`` of the
case at a slot of its own (in fp32, or rounded to bf16), in both layouts, and NaN in every slot no sequence names.
Checked:

* against the fp64 recurrence run per sequence from its slot (``tests/reference/pool_oracle.py``), within the case's
  frozen bounds (``tests/gpu_backends.py``; a bf16 pool's final state adds its one rounding, at most 2^-9 relative per
  element), with ``has_initial_state`` mixed, a padding row (negative index) and an index past the pool (padding on
  the device): o NaN-poisoned before the call and finite after it, padding rows' o exactly zero, slots no sequence
  names bit-unchanged;
* the gathered call: the same bits as the plain call an engine makes today (``initial_state=`` the slots, zeros where
  ``has_initial_state`` is False, ``output_final_state=True``, the final states scattered back, rounded to the pool's
  dtype), for every sequence that is not padding;
* a prefill continued from the pool (the first part of every sequence, then the rest from the same slots) against the
  oracle on the whole sequences;
* a call without tokens (each named slot gets its start state back, zeros where ``has_initial_state`` is False);
* CUDA-graph capture: replays with new index values in the captured index tensor give the eager call's bits.

A backend whose ``verify`` still refuses the pool form (``POOL_REFUSAL``) is skipped, saying so.
"""

from __future__ import annotations

import functools

import pytest
import torch

from cula_runtime.kda_args import POOL_REFUSAL
from tests.gpu_backends import BACKENDS, bound, poison_allocator, use_backend
from tests.helpers import rel_l2
from tests.kda_cases import CASES, HEAD_DIM, UNBOUNDED_CASES, make_inputs
from tests.reference.pool_oracle import oracle

pytestmark = pytest.mark.gpu

K = HEAD_DIM
BF16_ROUNDING = 2.0**-9  # a bf16 pool's final state: one round to nearest, relative error <= 2^-9 per element
# (case of tests/kda_cases.py: h0 fp32 and final state, so the pool's slots hold the very h0 the bound was measured on)
POOL_CASES = ["B2-T200-H2-HV4", "B2-T257-H2-vk", "varlen-0-100-100-228", "varlen-6seqs-GVA2-vk",
              "kimi-B2-T257-H2-betabf16-vk", "kimi-precomputed-fp32-varlen-serving", "extreme-varlen-GVA2-vk"]
_CASES = {case.name: case for case in [*CASES, *UNBOUNDED_CASES]}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = {"kv": False, "vk": True}


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``x`` (NaN == NaN), for bit-exact comparisons."""
    return x.view({4: torch.int32, 2: torch.int16}[x.element_size()])


def _lens(kwargs: dict) -> list[int]:
    cu = kwargs.get("cu_seqlens")
    if cu is None:
        B, T = kwargs["q"].shape[:2]
        return [T] * B
    bounds = cu.tolist()
    return [end - begin for begin, end in zip(bounds, bounds[1:], strict=False)]


def _token_rows(kwargs: dict, n: int) -> tuple:
    """The index of sequence ``n``'s rows of o: ``(n,)`` for a fixed-length batch, else its packed token range."""
    cu = kwargs.get("cu_seqlens")
    if cu is None:
        return (n,)
    return (0, slice(int(cu[n]), int(cu[n + 1])))


@functools.cache
def _problem(name: str, v_first: bool, dtype_name: str, mixed: bool) -> tuple:
    """``(kwargs without states, pool, slots, has_initial)`` on the CPU: the case's inputs, its h0 in a pool of
    ``N + 4`` slots (sequence n at slot ``N + 3 - n``, the others NaN). ``mixed``: every third sequence starts from
    zeros, sequence 1 is a padding row (-1) and sequence 2 (if any) names a slot past the pool (``P + 7``)."""
    case = _CASES[name]
    kwargs = make_inputs(case, "cpu", seed=0)
    h0 = kwargs.pop("initial_state")
    kwargs.pop("output_final_state")
    if v_first != case.state_v_first:  # the same states in the other layout
        h0 = h0.transpose(-1, -2).contiguous()
    kwargs["state_v_first"] = v_first
    N = h0.shape[0]
    P = N + 4
    pool = torch.full((P, *h0.shape[1:]), float("nan"))
    slots = [N + 3 - n for n in range(N)]
    pool[slots] = h0
    pool = pool.to(DTYPES[dtype_name])
    has_initial = [True] * N
    if mixed:
        has_initial = [n % 3 != 0 for n in range(N)]
        if N > 1:
            slots[1] = -1
        if N > 2:
            slots[2] = P + 7
    return kwargs, pool, slots, has_initial


def _on_device(kwargs: dict) -> dict:
    return {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}


def _pool_prefill(backend: str, **call):
    """``kda_prefill(**call)`` on the forced backend; skips while that backend still refuses the pool form."""
    from cula.kda import kda_prefill

    try:
        return kda_prefill(**call)
    except NotImplementedError as error:
        if POOL_REFUSAL in str(error):
            pytest.skip(f"{backend} does not take the state-pool form yet: {POOL_REFUSAL}")
        raise


def _live(slots: list[int], P: int) -> list[int]:
    return [n for n, slot in enumerate(slots) if 0 <= slot < P]


@pytest.mark.parametrize("mixed", [False, True], ids=["all-slots", "mixed-padding-flags"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", POOL_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_prefill_matches_the_oracle(backend: str, name: str, layout: str, dtype_name: str, mixed: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Against the per-sequence fp64 oracle. The final states' bound is the case's frozen one, measured for FLA with
    every sequence starting from the case's h0 and taken over all of them: it is asserted for ``all-slots``, the very
    problem it was measured on. With ``mixed`` flags some sequences start from zeros and others are padding, so the
    named states are another problem (a subset, or states made of this call's tokens alone, whose relative error is
    the kernel's own: 2.7-3.3e-3 on the H200 against the varlen cases' h0-dominated bounds of 2.8-8.2e-4): there the
    states' bits are checked against the plain call's (``test_pool_prefill_gives_the_bits_of_the_gathered_call``,
    whose accuracy the dense tests check), and this test checks o, the padding rows and the untouched slots."""
    use_backend(backend, monkeypatch)
    kwargs, pool, slots, has_initial = _problem(name, LAYOUTS[layout], dtype_name, mixed)
    P = pool.shape[0]
    live = _live(slots, P)
    lens = _lens(kwargs)
    call = _on_device(kwargs)
    result = pool.to(DEVICE, copy=True)
    poison_allocator(8 * call["v"].numel() * 2)
    o, final = _pool_prefill(backend, **call, state=result, state_indices=torch.tensor(slots, dtype=torch.int32,
                             device=DEVICE), has_initial_state=torch.tensor(has_initial, device=DEVICE))
    _sync()
    assert final is None
    o, result = o.cpu(), result.cpu()
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all(), "o has unwritten or non-finite entries"

    oracle_slots = [slot if n in live else -1 for n, slot in enumerate(slots)]
    o_ref, pool_ref = oracle(kwargs, pool, oracle_slots, lens, v_first=LAYOUTS[layout], has_initial=has_initial)
    for n in range(len(slots)):
        if n not in live:  # a padding row (negative, or past the pool): zeros
            rows = o[_token_rows(kwargs, n)]
            assert torch.equal(rows, torch.zeros_like(rows)), f"padding row {n} (slot {slots[n]}) has output"
    assert rel_l2(o, o_ref) <= bound(name, 0)
    named = [slots[n] for n in live]
    extra = BF16_ROUNDING * (1 + bound(name, 1)) if dtype_name == "bf16" else 0.0
    assert torch.isfinite(result[named]).all()
    if not mixed:
        assert rel_l2(result[named], pool_ref[named]) <= max(bound(name, 1), 1e-6) + extra
    for n in live:  # a zero-length sequence without an initial state leaves zeros
        if lens[n] == 0 and not has_initial[n]:
            assert torch.equal(result[slots[n]], torch.zeros_like(result[slots[n]]))
    kept = [p for p in range(P) if p not in named]
    assert torch.equal(_bits(result[kept]), _bits(pool[kept])), "a slot no sequence names changed"


@pytest.mark.parametrize("mixed", [False, True], ids=["all-slots", "mixed-padding-flags"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", ["B2-T200-H2-HV4", "varlen-6seqs-GVA2-vk", "kimi-precomputed-fp32-varlen-serving"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_prefill_gives_the_bits_of_the_gathered_call(backend: str, name: str, dtype_name: str, mixed: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool form against what an engine does without it: gather the start states (zeros where has_initial_state
    is False), prefill with initial_state and output_final_state, scatter the final states back in the pool's
    dtype: the same o bits on every sequence that is not padding, the same pool bits."""
    from cula.kda import kda_prefill

    use_backend(backend, monkeypatch)
    case = _CASES[name]
    kwargs, pool, slots, has_initial = _problem(name, case.state_v_first, dtype_name, mixed)
    P = pool.shape[0]
    live = _live(slots, P)
    call = _on_device(kwargs)
    pool = pool.to(DEVICE)
    result = pool.clone()
    o, _ = _pool_prefill(backend, **call, state=result, state_indices=torch.tensor(slots, dtype=torch.int32,
                         device=DEVICE), has_initial_state=torch.tensor(has_initial, device=DEVICE))
    h0 = torch.zeros((len(slots), *pool.shape[1:]), dtype=pool.dtype, device=DEVICE)
    for n in live:
        if has_initial[n]:
            h0[n] = pool[slots[n]]
    o_ref, ht = kda_prefill(**call, initial_state=h0, output_final_state=True)
    expected = pool.clone()
    for n in live:
        expected[slots[n]] = ht[n].to(pool.dtype)
    for n in range(len(slots)):
        rows = _token_rows(kwargs, n)
        assert torch.equal(o[rows], o_ref[rows] if n in live else torch.zeros_like(o[rows])), f"sequence {n}"
    assert torch.equal(_bits(result), _bits(expected))


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", ["B2-T200-H2-HV4", "kimi-B2-T257-H2-betabf16-vk"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefill_continued_from_the_pool_matches_the_oracle(backend: str, name: str, dtype_name: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens ``:split`` of every sequence into the pool, then the rest from the same slots: o and the final states
    against the oracle on the whole sequences (a bf16 pool rounds the state between the calls too)."""
    use_backend(backend, monkeypatch)
    case = _CASES[name]
    kwargs, pool, slots, has_initial = _problem(name, case.state_v_first, dtype_name, False)
    split = 137  # inside a chunk
    token_names = ("q", "k", "v", "g", "beta")
    parts = [{**kwargs, **{t: kwargs[t][:, :split] for t in token_names}},
             {**kwargs, **{t: kwargs[t][:, split:] for t in token_names}}]
    result = pool.to(DEVICE, copy=True)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    outputs = []
    for part in parts:
        o, _ = _pool_prefill(backend, **_on_device({t: x.contiguous() if isinstance(x, torch.Tensor) else x
                                                    for t, x in part.items()}), state=result, state_indices=idx)
        outputs.append(o.cpu())
    o_ref, pool_ref = oracle(kwargs, pool, slots, _lens(kwargs), v_first=case.state_v_first)
    extra = 2 * BF16_ROUNDING * (1 + bound(name, 1)) if dtype_name == "bf16" else 0.0
    assert rel_l2(torch.cat(outputs, dim=1), o_ref) <= bound(name, 0) + extra
    assert rel_l2(result.cpu()[slots], pool_ref[slots]) <= bound(name, 1) + extra


@pytest.mark.parametrize("cu", [None, (0, 0, 0, 0)], ids=["fixed-B3-T0", "varlen-three-empty"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pool_call_without_tokens_passes_the_states_through(backend: str, dtype_name: str, cu,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(backend, monkeypatch)
    gen = torch.Generator().manual_seed(4)
    N, H, HV = 3, 2, 4
    B, T = (N, 0) if cu is None else (1, 0)
    q, k = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in range(2))
    call = dict(q=q, k=k, v=torch.randn(B, T, HV, K, generator=gen).bfloat16(),
                g=-torch.rand(B, T, HV, K, generator=gen), beta=torch.rand(B, T, HV, generator=gen), safe_gate=True)
    if cu is not None:
        call["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    pool = torch.randn(6, HV, K, K, generator=gen).to(DTYPES[dtype_name])
    slots, has_initial = [4, -1, 1], [False, True, True]
    result = pool.to(DEVICE, copy=True)
    o, final = _pool_prefill(backend, **_on_device(call), state=result,
                             state_indices=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                             has_initial_state=torch.tensor(has_initial, device=DEVICE))
    assert final is None and o.numel() == 0
    expected = pool.clone()
    expected[4] = 0  # no initial state: the zero state is its final state
    assert torch.equal(_bits(result.cpu()), _bits(expected))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pool_form_replays_in_a_cuda_graph(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured once (fixed length: no host read of any value), replayed with new slot values and flags copied into
    the captured index tensors: each replay gives the bits of the eager call on those values."""
    use_backend(backend, monkeypatch)
    name = "B2-T200-H2-HV4"
    kwargs, pool, slots, _ = _problem(name, False, "fp32", False)
    call = _on_device(kwargs)
    pool = pool.to(DEVICE)
    P = pool.shape[0]
    idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    has = torch.ones(len(slots), dtype=torch.bool, device=DEVICE)
    captured_pool = pool.clone()
    _pool_prefill(backend, **call, state=captured_pool, state_indices=idx, has_initial_state=has)  # compile, warm
    _sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, _ = _pool_prefill(backend, **call, state=captured_pool, state_indices=idx, has_initial_state=has)
    for new_slots, new_has in (([P - 1, P - 2], [True, True]), ([-1, P - 1], [True, False]),
                               ([P + 3, P - 2], [False, True])):
        captured_pool.copy_(pool)
        idx.copy_(torch.tensor(new_slots, dtype=torch.int32))
        has.copy_(torch.tensor(new_has))
        graph.replay()
        eager_pool = pool.clone()
        o_eager, _ = _pool_prefill(backend, **call, state=eager_pool,
                                   state_indices=torch.tensor(new_slots, dtype=torch.int32, device=DEVICE),
                                   has_initial_state=torch.tensor(new_has, device=DEVICE))
        _sync()
        assert torch.equal(o_graph, o_eager), new_slots
        assert torch.equal(_bits(captured_pool), _bits(eager_pool)), new_slots
