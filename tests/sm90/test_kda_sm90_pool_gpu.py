"""The sm90 kernels' state-pool form of ``kda_prefill`` on the H200: what is particular to the sm90 recurrence (a pool
kernel of its own beside the dense one, both V blocks, the programmatic launch and CUDA-graph replays with new slot
values, pools whose slots are spread out or only element-aligned, device slots past the pool, a call without
tokens). Accuracy of the pool form against the fp64 oracle, per backend: the backend-parametrised tests in tests/gpu/.
"""

from __future__ import annotations

import pytest
import torch

from cula_runtime.kda_args import validate_kda_prefill
from tests.gpu_backends import poison_allocator, use_backend
from tests.kda_cases import CASES, UNBOUNDED_CASES, make_inputs

pytestmark = pytest.mark.gpu

SLOT = 128 * 128  # elements of one value head's state


def _sm90(monkeypatch: pytest.MonkeyPatch):
    use_backend("sm90", monkeypatch)
    from cula_sm90 import kda

    return kda


def _case(name: str):
    return next(c for c in CASES + UNBOUNDED_CASES if c.name == name)


class Pool:
    """A pool of ``P`` slots inside a flat storage that holds more: one guard slot before it, two after, and with
    ``spread`` > 1 the gaps between slots; ``misaligned``: the pool starts one element into its storage (only
    element-aligned). Everything outside the named slots must come out bit-unchanged."""

    def __init__(self, P: int, HV: int, dtype: torch.dtype, *, spread: int = 1, misaligned: bool = False,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.P, self.HV, self.spread = P, HV, spread
        self.offset = spread * HV * SLOT + int(misaligned)
        count = self.offset + (P + 2) * spread * HV * SLOT
        self.storage = torch.randn(count, generator=gen).to(dtype).cuda()

    def view(self, storage: torch.Tensor | None = None) -> torch.Tensor:
        """The pool ``[P, HV, 128, 128]`` on ``storage`` (default: its own)."""
        storage = self.storage if storage is None else storage
        return storage.as_strided((self.P, self.HV, 128, 128), (self.spread * self.HV * SLOT, SLOT, 128, 1),
                                  self.offset)

    def bits(self, storage: torch.Tensor | None = None) -> torch.Tensor:
        storage = self.storage if storage is None else storage
        return storage.view(torch.int32 if storage.dtype == torch.float32 else torch.int16)


def _slots(N: int, P: int, seed: int) -> tuple[list[int], list[bool]]:
    """Distinct slots for N sequences; from N = 3 sequence 1 a padding row (-1), from N = 4 the last one's slot past
    the pool (P + 1: a padding row on the device, and a guard slot if it were written); sequence 0 starts from zeros
    (has_initial_state False), the others from their slots."""
    slots = torch.randperm(P, generator=torch.Generator().manual_seed(seed))[:N].tolist()
    if N >= 3:
        slots[1] = -1
    if N >= 4:
        slots[-1] = P + 1
    return slots, [n != 0 for n in range(N)]


def _padding_rows_zeroed(o: torch.Tensor, slots: list[int], P: int, cu: tuple[int, ...] | None) -> torch.Tensor:
    o = o.clone()
    for n, slot in enumerate(slots):
        if not 0 <= slot < P:
            if cu is None:
                o[n] = 0
            else:
                o[0, cu[n]:cu[n + 1]] = 0
    return o


def _dense_run(kda, kwargs: dict, pool: Pool, slots: list[int], has: list[bool], block_v: int):
    """The same call through the dense form of the same kernels: the start states gathered into initial_state (in the
    pool's dtype: the dense recurrence reads fp32 and bf16 alike), the final states scattered back rounded to the
    pool's dtype (as the pool form rounds them), padding rows' o zeroed. Returns (o, expected storage)."""
    slot_view = pool.view()
    N = len(slots)
    h0 = torch.zeros((N, pool.HV, 128, 128), dtype=pool.storage.dtype, device="cuda")
    for n, slot in enumerate(slots):
        if 0 <= slot < pool.P and has[n]:
            h0[n] = slot_view[slot]
    o, ht, _ = kda.run_kernels(validate_kda_prefill(**{**kwargs, "initial_state": h0, "output_final_state": True}),
                               block_v=block_v)
    expected = pool.storage.clone()
    expected_view = pool.view(expected)
    for n, slot in enumerate(slots):
        if 0 <= slot < pool.P:
            expected_view[slot] = ht[n].to(expected.dtype)
    return o, expected


def _pool_kwargs(name: str, seed: int) -> tuple[dict, int]:
    case = _case(name)
    kwargs = make_inputs(case, "cuda", seed=seed)
    kwargs.pop("initial_state", None)
    kwargs["output_final_state"] = False
    return kwargs, case.B if case.cu is None else len(case.cu) - 1


POOL_CASES = {  # name: (pool slots spread, misaligned)
    "varlen-0-100-100-228": (1, False),
    "varlen-6seqs-GVA2-vk": (1, True),
    "B2-T257-H2-vk": (2, False),
    "B2-T200-H2-HV4": (1, False),
    "B3-T130-H2-noh0": (1, False),
    "kimi-precomputed-fp32-varlen-serving": (3, True),
}


@pytest.mark.parametrize("block_v", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(POOL_CASES))
def test_pool_form_gives_the_dense_forms_bits(name: str, dtype: torch.dtype, block_v: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool kernel (start states read from device slots, final states written back in place, rounded to nearest
    for bf16) gives the bits of the dense kernel on the gathered states, scattered back: o (padding rows zeros, the
    outputs poisoned first) and the whole storage around the pool (other slots, gaps and guards bit-unchanged; the
    slot past the pool never written), at both V blocks."""
    kda = _sm90(monkeypatch)
    spread, misaligned = POOL_CASES[name]
    kwargs, N = _pool_kwargs(name, seed=31)
    case = _case(name)
    P = N + 3
    pool = Pool(P, case.HV, dtype, spread=spread, misaligned=misaligned, seed=32)
    slots, has = _slots(N, P, seed=33)
    o_dense, expected = _dense_run(kda, kwargs, pool, slots, has, block_v)
    poison_allocator(8 * case.B * case.T * case.HV * 128 * 2)
    args = validate_kda_prefill(**kwargs, state=pool.view(),
                                state_indices=torch.tensor(slots, dtype=torch.int32, device="cuda"),
                                has_initial_state=torch.tensor(has, device="cuda"))
    assert kda.verify_kda_prefill(args)[0]
    o, ht, _ = kda.run_kernels(args, block_v=block_v)
    torch.cuda.synchronize()
    assert ht is None
    assert torch.equal(o, _padding_rows_zeroed(o_dense, slots, P, case.cu))
    assert torch.equal(pool.bits(), pool.bits(expected))


@pytest.mark.parametrize("name", ["varlen-6seqs-GVA2-vk", "B2-T200-H2-HV4"])
def test_pool_form_programmatic_launch_gives_the_same_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool kernel launched as a programmatic dependent of the intra kernel (CULA_SM90_PDL=1: its CTAs read the
    slot indices, has_initial_state and the start states before they wait for it) gives the bits of the plain
    launch (CULA_SM90_PDL=0), over 5 replays from the same pool contents; and captured in a CUDA graph (the fixed-length
    case) with persistent index buffers, each replay with new slot values in them gives the eager call's bits."""
    kda = _sm90(monkeypatch)
    kwargs, N = _pool_kwargs(name, seed=41)
    case = _case(name)
    P = N + 3
    pool = Pool(P, case.HV, torch.float32, seed=42)
    start = pool.storage.clone()
    slots, has = _slots(N, P, seed=43)
    indices = torch.tensor(slots, dtype=torch.int32, device="cuda")
    has_initial = torch.tensor(has, device="cuda")
    args = validate_kda_prefill(**kwargs, state=pool.view(), state_indices=indices, has_initial_state=has_initial)

    def run(knob: str) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, knob)
        pool.storage.copy_(start)
        poison_allocator(8 * case.B * case.T * case.HV * 128 * 2)
        o, _ = kda.kda_prefill(args)
        torch.cuda.synchronize()
        return o, pool.storage.clone()

    o_ref, pool_ref = run("0")
    for replay in range(5):
        o, after = run("1")
        assert torch.equal(o, o_ref), replay
        assert torch.equal(pool.bits(after), pool.bits(pool_ref)), replay
    if case.cu is not None:
        return
    monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "1")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up off the capturing stream, as torch asks)
        kda.kda_prefill(args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, _ = kda.kda_prefill(args)
    for seed in range(3):  # new slot values in the captured buffers, the pool back at its start
        new_slots = torch.randperm(P, generator=torch.Generator().manual_seed(50 + seed))[:N].tolist()
        new_has = [bool((n + seed) % 2) for n in range(N)]
        eager = Pool(P, case.HV, torch.float32, seed=42)
        o_eager, _ = kda.kda_prefill(validate_kda_prefill(
            **kwargs, state=eager.view(), state_indices=torch.tensor(new_slots, dtype=torch.int32, device="cuda"),
            has_initial_state=torch.tensor(new_has, device="cuda")))
        indices.copy_(torch.tensor(new_slots, dtype=torch.int32))
        has_initial.copy_(torch.tensor(new_has))
        pool.storage.copy_(start)
        o_graph.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o_graph, o_eager), seed
        assert torch.equal(pool.bits(), pool.bits(eager.storage)), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_pool_call_without_tokens_writes_the_start_states_back(varlen: bool, dtype: torch.dtype,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """B * T == 0 with N zero-length sequences (the recurrence alone): a sequence without an initial state gets zeros
    in its slot, one with it keeps its slot's bits, padding rows (negative, or past the pool on the device) and every
    other element are untouched; as the reference does."""
    kda = _sm90(monkeypatch)
    HV, P = 2, 4
    slots, has = [2, -1, 0, P + 1], [False, True, True, True]
    pool = Pool(P, HV, dtype, seed=61)
    B = 1 if varlen else len(slots)
    q = torch.zeros(B, 0, 2, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros(B, 0, HV, 128, dtype=torch.bfloat16, device="cuda")
    args = validate_kda_prefill(
        q, q, v, torch.zeros(B, 0, HV, 128, device="cuda"), torch.zeros(B, 0, HV, device="cuda"), safe_gate=True,
        cu_seqlens=torch.zeros(len(slots) + 1, dtype=torch.int32, device="cuda") if varlen else None,
        state=pool.view(), state_indices=torch.tensor(slots, dtype=torch.int32, device="cuda"),
        has_initial_state=torch.tensor(has, device="cuda"))
    expected = pool.storage.clone()
    pool.view(expected)[2] = 0
    o, ht = kda.kda_prefill(args)
    torch.cuda.synchronize()
    assert o.shape == (B, 0, HV, 128) and ht is None
    assert torch.equal(pool.bits(), pool.bits(expected))


def test_recurrence_entry_rejects_bad_pool_arguments_before_any_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool arguments after the stream (defaults: the dense form) are checked before any launch (null pointers
    elsewhere: a launch would fault): a pool or has_initial_state without slot indices, an initial or final state
    beside them, a negative P or slot stride, no pool for P > 0."""
    ext = _sm90(monkeypatch).load_extension()
    dense = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1.0, False, 64, False, 64, 0)
    for pool in ((8, 0, 0, 1, SLOT), (0, 0, 8, 1, SLOT)):
        with pytest.raises(ValueError, match="state_pool and has_initial_state need state_indices"):
            ext.kda_recurrence(*dense, *pool)
    with_h0 = dense[:9] + (8,) + dense[10:]
    for args, pool in ((with_h0, (8, 8, 0, 1, SLOT)), (dense, (8, 8, 0, -1, SLOT)), (dense, (8, 8, 0, 1, -1)),
                       (dense, (0, 8, 0, 1, SLOT))):
        with pytest.raises(ValueError, match="with state_indices \\(the pool form\\)"):
            ext.kda_recurrence(*args, *pool)
