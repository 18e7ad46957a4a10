"""``cula.lightning`` on a GPU, for each backend that can serve it there (the reference forced, the CuTeDSL kernels
forced: ``CULA_BACKEND``): the public prefill and decode against the float64 recurrence (``lightning_naive``, per
sequence: tests/reference/lightning_pool_oracle.py), fixed and packed batches with tails and empty sequences,
h0 present and absent, both layouts, fp32 and bf16 pools, padding rows (negative and past the pool), slots no
sequence names bit-unchanged, the prefill + decode round trip, a CUDA graph of ``lightning_decode`` replayed after
the inputs' and indices' values changed in place (CuTeDSL only: the reference reads the indices back), and
determinism (the same bits over 20 repeats).

Bounds (rel. L2 against fp64 on the same bf16 inputs): 2e-2 for o and for the states, PROVISIONAL until FLA's error
on these cases is measured (``fla.ops.lightning_attn`` / ``simple_gla`` in bf16, then FA4's rule: a small multiple
of it). Outputs are poisoned (NaN-filled allocator blocks) before each call, so an unwritten entry fails the test.
A CuTeDSL backend whose ``verify`` rejects a case skips it with the reason (run with ``-rs`` to see them).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cula import dispatch
from cula.lightning import lightning_decode, lightning_prefill
from cula_runtime.lightning_args import validate_lightning_decode, validate_lightning_prefill
from cula_runtime.reference.lightning import lightning_naive
from tests.gpu_backends import poison_allocator
from tests.helpers import rel_l2
from tests.reference.lightning_pool_oracle import make_inputs, make_pool, pool_oracle

pytestmark = pytest.mark.gpu

H, K, V = 4, 128, 128
BOUND = 2e-2  # provisional (see the module docstring)
BACKENDS = ("reference", "cutedsl")
PREFILL_CASES = {  # name: (lens or None, B, T, h0)
    "fixed-B2-T200-h0": (None, 2, 200, True),
    "fixed-B3-T64": (None, 3, 64, False),
    "packed-0-1-64-130-0-257-h0": ([0, 1, 64, 130, 0, 257], 1, 452, True),
    "packed-63-65-tails": ([63, 65], 1, 128, False),
}


def _gamma() -> torch.Tensor:
    return torch.tensor([0.0, -0.05, -0.5, -8.0], device="cuda")  # head 0: no decay; head 3: -8 per token


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _cu(lens: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    out = [0]
    for length in lens:
        out.append(out[-1] + length)
    return torch.tensor(out, dtype=dtype, device="cuda")


def use_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force ``backend`` for this test; skip the CuTeDSL one where it is not installed here."""
    if backend == "cutedsl":
        from cula_runtime.cute import is_available

        if not is_available():
            pytest.skip("CuTeDSL / TVM-FFI not installed")
        for name in (dispatch.LIGHTNING_PREFILL_MODULE, dispatch.LIGHTNING_DECODE_MODULE):
            if importlib.util.find_spec(name) is None:
                pytest.skip(f"{name} is not in this cula-runtime yet")
    monkeypatch.setenv("CULA_BACKEND", backend)


def _skip_if_rejected(backend: str, choice: dispatch.Choice) -> None:
    if backend == "cutedsl" and choice.runner is None:
        pytest.skip(f"cutedsl rejects this call: {choice.decisions[0].reason}")


def _check_pool(pool: torch.Tensor, expected: torch.Tensor, written: list[int], before: torch.Tensor) -> None:
    P = pool.shape[0]
    pool, before = pool.cpu(), before.cpu()
    others = [s for s in range(P) if s not in written]
    assert torch.equal(pool[others], before[others]), "a slot no sequence names changed"
    if written:
        assert torch.isfinite(pool[written]).all()
        assert rel_l2(pool[written], expected[written]) <= BOUND


@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("name", list(PREFILL_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_matches_fp64(backend: str, name: str, v_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(backend, monkeypatch)
    lens, B, T, with_h0 = PREFILL_CASES[name]
    q, k, v = make_inputs(B, T, H, K, V, seed=1, dtype=torch.bfloat16, device="cuda")
    N = B if lens is None else len(lens)
    h0 = make_pool(N, H, K, V, v_first=v_first, seed=2, device="cuda") if with_h0 else None
    cu = None if lens is None else _cu(lens)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, state_v_first=v_first)
    _skip_if_rejected(backend, dispatch.explain_lightning_prefill(validate_lightning_prefill(q, k, v, _gamma(),
                                                                                             **kwargs)))
    poison_allocator(8 * q.numel() * 4)
    o, ht = lightning_prefill(q, k, v, _gamma(), **kwargs)
    torch.cuda.synchronize()
    o_ref, ht_ref = lightning_naive(q.cpu(), k.cpu(), v.cpu(), _gamma().cpu(),
                                    initial_state=None if h0 is None else h0.cpu(), output_final_state=True,
                                    cu_seqlens=None if cu is None else cu.cpu(), state_v_first=v_first)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all() and ht.dtype == torch.float32
    assert rel_l2(o.cpu(), o_ref) <= BOUND and rel_l2(ht.cpu(), ht_ref) <= BOUND


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_with_the_layer_decay_and_no_final_state(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(backend, monkeypatch)
    q, k, v = make_inputs(2, 100, H, K, V, seed=3, dtype=torch.bfloat16, device="cuda")
    _skip_if_rejected(backend, dispatch.explain_lightning_prefill(
        validate_lightning_prefill(q, k, v, layer_idx=3, num_layers=8)))
    o, ht = lightning_prefill(q, k, v, layer_idx=3, num_layers=8)
    gamma = torch.tensor([-(8.0 / H) * (1 - 3 / 8) * h for h in range(H)])
    assert ht is None and rel_l2(o.cpu(), lightning_naive(q.cpu(), k.cpu(), v.cpu(), gamma)[0]) <= BOUND


POOL_PREFILL_CASES = {  # name: (lens or None, B, T, indices, has)
    "fixed-B4-T80-padding": (None, 4, 80, [6, -1, 0, 99], [True, True, False, True]),
    "packed-0-5-64-200-padding": ([0, 5, 64, 200], 1, 269, [2, 7, -3, 0], None),
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("name", list(POOL_PREFILL_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_prefill_matches_the_per_sequence_oracle(backend: str, name: str, v_first: bool,
                                                      pool_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots past the pool (99) are padding on a GPU, as negative ones: nothing read or written."""
    use_backend(backend, monkeypatch)
    lens, B, T, indices, has = POOL_PREFILL_CASES[name]
    P = 8
    q, k, v = make_inputs(B, T, H, K, V, seed=4, dtype=torch.bfloat16, device="cuda")
    pool = make_pool(P, H, K, V, v_first=v_first, dtype=pool_dtype, device="cuda")
    before = pool.clone()
    kwargs = dict(cu_seqlens=None if lens is None else _cu(lens), state_v_first=v_first, state=pool,
                  state_indices=_i32(indices), has_initial_state=None if has is None else
                  torch.tensor(has, device="cuda"))
    _skip_if_rejected(backend, dispatch.explain_lightning_prefill(validate_lightning_prefill(q, k, v, _gamma(),
                                                                                             **kwargs)))
    o_ref, expected = pool_oracle(q, k, v, _gamma(), None, before, indices, lens, v_first=v_first, decode=False,
                                  has_initial_state=has)
    poison_allocator(8 * q.numel() * 4)
    o, none = lightning_prefill(q, k, v, _gamma(), **kwargs)
    torch.cuda.synchronize()
    assert none is None and torch.isfinite(o).all() and rel_l2(o.cpu(), o_ref) <= BOUND
    _check_pool(pool, expected, [s for s in indices if 0 <= s < P], before)


DECODE_CASES = {  # name: (lens or None, B, T, indices)
    "fixed-B6-T1": (None, 6, 1, [3, -1, 0, 9, 5, 7]),
    "packed-0-1-2-5": ([0, 1, 2, 5], 1, 8, [1, 4, 0, 6]),
    "packed-5-2-0-1-padding": ([5, 2, 0, 1, 3], 1, 11, [2, -1, 3, 6, 100]),
}


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("name", list(DECODE_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_matches_the_per_sequence_oracle(backend: str, name: str, v_first: bool, pool_dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(backend, monkeypatch)
    lens, B, T, indices = DECODE_CASES[name]
    P = 8
    q, k, v = make_inputs(B, T, H, K, V, seed=5, dtype=torch.bfloat16, device="cuda")
    pool = make_pool(P, H, K, V, v_first=v_first, dtype=pool_dtype, device="cuda")
    before = pool.clone()
    kwargs = dict(state=pool, state_indices=_i32(indices), state_v_first=v_first,
                  cu_seqlens=None if lens is None else _cu(lens, torch.int64))
    _skip_if_rejected(backend, dispatch.explain_lightning_decode(validate_lightning_decode(q, k, v, _gamma(),
                                                                                           **kwargs)))
    o_ref, expected = pool_oracle(q, k, v, _gamma(), None, before, indices, lens, v_first=v_first, decode=True)
    poison_allocator(8 * q.numel() * 4)
    o = lightning_decode(q, k, v, _gamma(), **kwargs)
    torch.cuda.synchronize()
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all() and rel_l2(o.cpu(), o_ref) <= BOUND
    flat, starts = o.cpu().reshape(B * T, H, V), ([n * T for n in range(B + 1)] if lens is None else
                                                  _cu(lens).tolist())
    for n, slot in enumerate(indices):
        if not 0 <= slot < P:
            assert (flat[starts[n]:starts[n + 1]] == 0).all(), f"padding row {n} has non-zero outputs"
    written = [s for n, s in enumerate(indices) if 0 <= s < P and starts[n + 1] > starts[n]]
    _check_pool(pool, expected, written, before)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("v_first", [False, True], ids=["kfirst", "vfirst"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_into_the_pool_then_decode_steps_equals_one_longer_prefill(backend: str, v_first: bool,
                                                                           pool_dtype: torch.dtype,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(backend, monkeypatch)
    lens, M, slots = [130, 0, 64, 7], 3, [5, 0, 2, 7]
    total = [n + M for n in lens]
    q, k, v = make_inputs(1, sum(total), H, K, V, seed=6, dtype=torch.bfloat16, device="cuda")
    bounds = [0]
    for n in total:
        bounds.append(bounds[-1] + n)
    pool = make_pool(8, H, K, V, v_first=v_first, dtype=pool_dtype, device="cuda")
    before = pool.clone()
    prefix = [torch.cat([x[:, b:b + n] for b, n in zip(bounds[:-1], lens, strict=True)], dim=1) for x in (q, k, v)]
    kwargs = dict(cu_seqlens=_cu(lens), state_v_first=v_first, state=pool, state_indices=_i32(slots),
                  has_initial_state=torch.zeros(4, dtype=torch.bool, device="cuda"))
    _skip_if_rejected(backend, dispatch.explain_lightning_prefill(validate_lightning_prefill(*prefix, _gamma(),
                                                                                             **kwargs)))
    lightning_prefill(*prefix, _gamma(), **kwargs)
    steps = []
    for m in range(M):
        token = [torch.stack([x[0, b + n + m] for b, n in zip(bounds[:-1], lens, strict=True)]).unsqueeze(1)
                 for x in (q, k, v)]
        step_kwargs = dict(state=pool, state_indices=_i32(slots), state_v_first=v_first)
        _skip_if_rejected(backend, dispatch.explain_lightning_decode(validate_lightning_decode(*token, _gamma(),
                                                                                               **step_kwargs)))
        steps.append(lightning_decode(*token, _gamma(), **step_kwargs))
    torch.cuda.synchronize()
    o_ref, ht_ref = lightning_naive(q.cpu(), k.cpu(), v.cpu(), _gamma().cpu(), output_final_state=True,
                                    cu_seqlens=_cu(total).cpu(), state_v_first=v_first)
    for m, o_step in enumerate(steps):
        expected = torch.stack([o_ref[0, b + n + m] for b, n in zip(bounds[:-1], lens, strict=True)])
        assert rel_l2(o_step[:, 0].cpu(), expected) <= BOUND
    assert rel_l2(pool[slots].cpu(), ht_ref) <= BOUND
    assert torch.equal(pool[[1, 3, 4, 6]], before[[1, 3, 4, 6]])


def test_a_graph_of_decode_replays_new_values_without_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CuTeDSL decode through the public API: int32 indices and cu_seqlens on the GPU, ``out`` given: no
    allocation, no host synchronisation (the capture would fail), replays after every input and index changed in
    place (the oracle from the pool as it was before each replay)."""
    use_backend("cutedsl", monkeypatch)
    monkeypatch.delenv("CULA_BACKEND")  # (the dispatch's own choice: it must be the kernel, no fallback)
    lens, P = [1, 0, 2, 1, 3], 9
    q, k, v = make_inputs(1, sum(lens), H, K, V, seed=7, dtype=torch.bfloat16, device="cuda")
    pool = make_pool(P, H, K, V, v_first=False, device="cuda")
    idx, cu, gamma = _i32([4, 1, -1, 7, 0]), _cu(lens), _gamma()
    out = torch.full_like(v, float("nan"))
    call = dict(state=pool, state_indices=idx, cu_seqlens=cu, out=out)
    choice = dispatch.explain_lightning_decode(validate_lightning_decode(q, k, v, gamma, **call))
    if choice.runner is None or choice.gpu_fallback:
        pytest.skip(f"the dispatch does not reach the kernel: {choice.summary}")
    lightning_decode(q, k, v, gamma, **call)  # (compiles, outside the capture)
    torch.cuda.synchronize()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    lightning_decode(q, k, v, gamma, **call)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations, "a call with out allocated"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lightning_decode(q, k, v, gamma, **call)
    for seed, new_idx in ((8, [2, 5, 8, -1, 3]), (9, [0, 6, 1, 4, 40])):
        q2, k2, v2 = make_inputs(1, sum(lens), H, K, V, seed=seed, dtype=torch.bfloat16, device="cuda")
        q.copy_(q2), k.copy_(k2), v.copy_(v2), idx.copy_(_i32(new_idx))
        before = pool.clone()
        o_ref, expected = pool_oracle(q, k, v, gamma, None, before, new_idx, lens, v_first=False, decode=True)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and rel_l2(out.cpu(), o_ref) <= BOUND
        starts = _cu(lens).tolist()
        written = [s for n, s in enumerate(new_idx) if 0 <= s < P and starts[n + 1] > starts[n]]
        _check_pool(pool, expected, written, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeats_are_bit_identical(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(backend, monkeypatch)
    lens = [0, 70, 129, 1]
    q, k, v = make_inputs(1, sum(lens), H, K, V, seed=10, dtype=torch.bfloat16, device="cuda")
    pool0 = make_pool(6, H, K, V, v_first=True, dtype=torch.bfloat16, device="cuda")
    prefill = dict(cu_seqlens=_cu(lens), state_v_first=True, state_indices=_i32([5, 0, -1, 3]))
    decode = dict(cu_seqlens=_cu(lens), state_v_first=True, state_indices=_i32([1, 2, 4, 0]))
    _skip_if_rejected(backend, dispatch.explain_lightning_prefill(
        validate_lightning_prefill(q, k, v, _gamma(), state=pool0.clone(), **prefill)))
    _skip_if_rejected(backend, dispatch.explain_lightning_decode(
        validate_lightning_decode(q, k, v, _gamma(), state=pool0.clone(), **decode)))
    results = []
    for _ in range(20):
        pool = pool0.clone()
        o_prefill, _ = lightning_prefill(q, k, v, _gamma(), state=pool, **prefill)
        o_decode = lightning_decode(q, k, v, _gamma(), state=pool, **decode)
        results.append((o_prefill.clone(), o_decode.clone(), pool.clone()))
    torch.cuda.synchronize()
    for later in results[1:]:
        for a, b in zip(results[0], later, strict=True):
            assert torch.equal(a, b)


def test_the_dispatch_serves_every_call_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unforced: a call the kernels may not take (fp16, K = V = 64, fp32 pool) runs on them or on the reference with
    a ``CulaFallbackWarning``; either way the result matches fp64."""
    import warnings

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    q, k, v = make_inputs(3, 1, H, 64, 64, seed=11, dtype=torch.float16, device="cuda")
    pool = make_pool(4, H, 64, 64, v_first=False, device="cuda")
    before = pool.clone()
    kwargs = dict(state=pool, state_indices=_i32([2, -1, 0]))
    choice = dispatch.explain_lightning_decode(validate_lightning_decode(q, k, v, _gamma(), **kwargs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = lightning_decode(q, k, v, _gamma(), **kwargs)
    torch.cuda.synchronize()
    fallbacks = [w for w in caught if issubclass(w.category, dispatch.CulaFallbackWarning)]
    assert len(fallbacks) == int(choice.gpu_fallback)
    o_ref, expected = pool_oracle(q, k, v, _gamma(), None, before, [2, -1, 0], None, v_first=False, decode=True)
    assert rel_l2(o.cpu(), o_ref) <= BOUND
    _check_pool(pool, expected, [2, 0], before)
