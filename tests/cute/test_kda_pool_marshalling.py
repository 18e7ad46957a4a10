"""The cutedsl backend's state-pool form of ``kda_prefill`` hands the recurrence kernel the pool itself (written in
place, never copied), the slot indices and the ``has_initial_state`` flags as a byte view, on the CPU.

As in ``tests/cute/test_kda_wrapper_marshalling.py``, ``compile_cache.compile_kernel`` is replaced by a recorder, so
nothing compiles or runs; ``compile_cache.launch`` itself runs (a declared tensor left out fails with its
``TypeError``, an output breaking its layout promise with its ``ValueError``). Also: the backend's ``verify`` on
pools the kernel cannot take in place, the public wrapper's checks of its pool arguments, and no call plan for the
pool form.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cula_runtime import cute as cula_cute
from tests.cute.compile_helpers import record_launches

pytestmark = pytest.mark.skipif(
    not cula_cute.is_available(),
    reason="CuTeDSL or TVM-FFI is not installed (cula-runtime brings them on Linux x86_64/aarch64)",
)

K = 128
CU = [0, 1, 64, 64, 130]  # lengths 1, 63, 0, 66


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every launch as ``(kernel class, config, arguments)``; nothing compiles or runs."""
    from cula_runtime.cute.kda import intra, recurrence

    calls = record_launches(monkeypatch)
    for module in (intra, recurrence):  # the CUDA-device part of the token-tensor check
        monkeypatch.setattr(module, "check_token_tensors", lambda named, B, T: None)
    return calls


def _pool_args(cu, *, dtype=torch.float32, v_first=False, flags=True, T=None, pool=None, slots=None):
    from cula_runtime.kda_args import validate_kda_prefill

    gen = torch.Generator().manual_seed(7)
    B, T = (2, 100 if T is None else T) if cu is None else (1, cu[-1])
    N = B if cu is None else len(cu) - 1
    H, HV = 2, 4

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    if pool is None:
        pool = randn(N + 3, HV, K, K).to(dtype)
    if slots is None:
        slots = [N + 2 - n if n % 2 == 0 else -1 for n in range(N)]  # every other row padding
    return validate_kda_prefill(
        randn(B, T, H, K).bfloat16(), randn(B, T, H, K).bfloat16(), randn(B, T, HV, K).bfloat16(),
        -torch.rand(B, T, HV, K, generator=gen), torch.rand(B, T, HV, generator=gen), safe_gate=True,
        cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32), state_v_first=v_first, state=pool,
        state_indices=torch.tensor(slots, dtype=torch.int32),
        has_initial_state=torch.tensor([n % 3 != 1 for n in range(N)]) if flags else None,
    )


@pytest.mark.parametrize("flags", [True, False], ids=["flags", "noflags"])
@pytest.mark.parametrize(("dtype", "v_first"), [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32-kv", "bf16-vk"])
@pytest.mark.parametrize("cu", [None, CU], ids=["fixed", "varlen"])
def test_the_recurrence_gets_the_pool_itself(cu, dtype, v_first: bool, flags: bool, launches: list) -> None:
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl
    from cula_runtime.cute.kda.recurrence import KdaRecurrence

    args = _pool_args(cu, dtype=dtype, v_first=v_first, flags=flags)
    before = args.state.clone()
    o, final = kda_prefill_cutedsl(args, block_v=64)
    assert final is None and o.shape == (args.B, args.T, args.HV, K) and o.dtype == torch.bfloat16
    (intra_cls, _, intra_args), (rec_cls, config, rec_args) = launches
    assert rec_cls is KdaRecurrence
    assert (config.state_pool, config.state_dtype, config.initial_state_flags, config.state_v_first) == \
        (True, {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], flags, v_first)
    assert not config.has_initial_state and not config.output_final_state and config.varlen == (cu is not None)
    specs = KdaRecurrence(config).argument_specs()
    tensors = rec_args[:len(specs)]
    assert [t is None for t in tensors] == [s is None for s in specs]
    assert tensors[6] is None and tensors[8] is None  # no h0, no ht
    assert tensors[12] is args.state  # the pool itself: written in place, never a copy
    assert tensors[13] is args.state_indices
    if flags:  # the bool flags as bytes: a view of the same memory
        assert tensors[14].dtype == torch.uint8 and tensors[14].data_ptr() == args.has_initial_state.data_ptr()
    assert tensors[7] is o and rec_args[5] is intra_args[14]  # o out, the decay rows in
    assert torch.equal(args.state, before)  # (nothing ran: the host path itself touches no slot)


@pytest.mark.parametrize("cu", [None, [0, 0, 0]], ids=["fixed-B2-T0", "varlen-two-empty"])
def test_a_pool_call_without_tokens_still_runs_the_recurrence(cu, launches: list) -> None:
    """Each named slot must still get its start state back (zeros where has_initial_state is False), as the
    reference writes it: the recurrence alone runs, on empty intermediates."""
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl
    from cula_runtime.cute.kda.recurrence import KdaRecurrence

    args = _pool_args(cu, T=0)
    o, final = kda_prefill_cutedsl(args, block_v=64)
    assert final is None and o.numel() == 0
    (rec_cls, config, rec_args), = launches
    assert rec_cls is KdaRecurrence and config.state_pool
    assert rec_args[12] is args.state and all(t.numel() == 0 for t in rec_args[:6])


def test_a_pool_plan_launches_what_the_unplanned_call_launches(launches: list, monkeypatch) -> None:
    """A plan made from a pool-form call takes the pool, indices and flags with each call and launches the kernels
    with exactly the arguments of the unplanned path."""
    from cula_runtime.cute.kda import backend
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl, plan_kda_prefill

    monkeypatch.setattr(backend, "sm_count", lambda device: 132)  # (the V block's choice asks the GPU)
    args = _pool_args(CU)
    plan = plan_kda_prefill(args)
    o_planned, final = plan(args.q, args.k, args.v, args.g, args.beta, None, None, None, args.cu_seqlens,
                            args.cu_seqlens_host, state=args.state, state_indices=args.state_indices,
                            has_initial_state=args.has_initial_state)
    assert final is None
    planned = list(launches)
    launches.clear()
    kda_prefill_cutedsl(args)
    assert [(cls, config) for cls, config, _ in planned] == [(cls, config) for cls, config, _ in launches]
    for (_, _, a), (_, _, b) in zip(planned, launches, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):  # the call's own tensors are the same objects; workspaces alike
            assert (x is y) if x is args.state or x is args.state_indices else type(x) is type(y)
    rec_args = planned[-1][2]
    assert rec_args[12] is args.state and rec_args[13] is args.state_indices


def test_a_pool_breaking_the_kernels_promise_is_refused_not_copied(launches: list) -> None:
    """The launch refuses a pool whose slot stride is odd (ValueError), as any output; verify declines it first."""
    from cula_runtime.cute.kda import backend

    HV, P = 4, 5
    base = torch.zeros(P * (HV * K * K + 1))
    odd = base.as_strided((P, HV, K, K), (HV * K * K + 1, K * K, K, 1))
    args = _pool_args(None, pool=odd, slots=[0, 3])
    assert "slot stride even" in backend.pool_rejection(odd)
    with pytest.raises(ValueError, match="breaks the kernel's layout promise"):
        backend.kda_prefill_cutedsl(args, block_v=64)


@pytest.mark.parametrize(("pool", "reason"), [
    (torch.zeros(3, 4, K, K, dtype=torch.float64), "needs the state pool in fp32 or bf16, got torch.float64"),
    (torch.zeros(3 * 4 * K * K + 1)[1:].view(3, 4, K, K), "8-byte aligned"),
    (torch.zeros(3, 4, K, K), None),
    (torch.zeros(3, 4, K, K, dtype=torch.bfloat16), None),
], ids=["fp64", "misaligned", "fp32", "bf16"])
def test_verify_says_which_pools_it_takes(pool: torch.Tensor, reason: str | None, monkeypatch) -> None:
    import dataclasses

    from cula_runtime.cute.kda import backend

    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: (9, 0))
    args = _pool_args(None, pool=pool, slots=[2, -1], flags=False)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    ok, why = backend.verify(SimpleNamespace(**fields, device=torch.device("cuda", 0)))
    if reason is None:
        assert ok, why
    else:
        assert not ok and reason in why, why


def test_the_wrapper_checks_its_pool_arguments(launches: list) -> None:
    from cula_runtime.cute.kda.recurrence import chunk_kda_fwd_recurrence

    B, T, HV = 2, 70, 2
    bf = [torch.zeros(B, T, HV, K, dtype=torch.bfloat16) for _ in range(4)]
    tail = (torch.zeros(B, T, HV, 64, dtype=torch.bfloat16), torch.zeros(B, 2, HV, K), 0.5)
    pool = torch.zeros(4, HV, K, K)
    idx = torch.tensor([3, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="excludes initial_state and output_final_state"):
        chunk_kda_fwd_recurrence(*bf, *tail, output_final_state=True, state=pool, state_indices=idx)
    with pytest.raises(ValueError, match="float32 or bfloat16 pool"):
        chunk_kda_fwd_recurrence(*bf, *tail, state=pool.double(), state_indices=idx)
    with pytest.raises(ValueError, match=r"state needs state_indices: int32 \[2\]"):
        chunk_kda_fwd_recurrence(*bf, *tail, state=pool, state_indices=idx.long())
    with pytest.raises(ValueError, match=r"has_initial_state must be bool \[2\]"):
        chunk_kda_fwd_recurrence(*bf, *tail, state=pool, state_indices=idx, has_initial_state=idx)
    with pytest.raises(ValueError, match="pass state"):
        chunk_kda_fwd_recurrence(*bf, *tail, state_indices=idx)
    assert not launches
    o, final = chunk_kda_fwd_recurrence(*bf, *tail, state=pool, state_indices=idx,
                                        has_initial_state=torch.tensor([True, False]))
    (_, config, args), = launches
    assert final is None and config.state_pool and config.initial_state_flags and args[12] is pool
