"""Call plans of ``lightning_prefill`` / ``lightning_decode`` (``cula.call_plans``): a repeated call of one signature
skips validation and dispatch and runs the plan its backend made, with the contract's argument order; what is never
planned (CPU ``g_gamma``, CPU index tensors, ``CULA_CALL_PLANS=0``, copied inputs); ``cu_seqlens``' values still
checked by a planned prefill. Driven on CPU tensors with a recording stand-in backend (CPU index tensors let through
the signature as a GPU call's would be, where a test says so)."""

from __future__ import annotations

import pytest
import torch

import cula.lightning
from cula import call_plans, dispatch
from cula_runtime.lightning_args import layer_g_gamma, validate_lightning_decode, validate_lightning_prefill
from tests.api.op_helpers import counted

H, K, V = 2, 8, 4


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch):
    """(plan calls, validations, plans made): a stand-in backend whose planner returns a recording plan."""
    calls, validations, made = [], [], []

    def prefill_runner(args):
        return "prefill unplanned"

    def decode_runner(args):
        return "decode unplanned"

    def planner(args):
        made.append(args)
        return lambda *a: calls.append(a) or "planned"

    monkeypatch.setattr(cula.lightning, "validate_lightning_prefill", counted(validate_lightning_prefill, validations))
    monkeypatch.setattr(cula.lightning, "validate_lightning_decode", counted(validate_lightning_decode, validations))
    monkeypatch.setattr(cula.lightning, "select_lightning_prefill_backend", lambda args: prefill_runner)
    monkeypatch.setattr(cula.lightning, "select_lightning_decode_backend", lambda args: decode_runner)
    monkeypatch.setattr(dispatch, "_planners", {prefill_runner: planner, decode_runner: planner})
    monkeypatch.setattr(call_plans, "indices_checked_on_host", lambda idx: False)
    monkeypatch.delenv("CULA_CALL_PLANS", raising=False)
    call_plans.clear_call_plans()
    yield calls, validations, made
    call_plans.clear_call_plans()


def _inputs(B: int = 1, T: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
            torch.randn(B, T, H, V, generator=gen))


def test_a_repeated_prefill_runs_the_plan_with_the_contract_order(recorded) -> None:
    calls, validations, made = recorded
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    pool, idx, has = torch.zeros(5, H, K, V), torch.tensor([4, 1], dtype=torch.int32), torch.tensor([True, False])
    kwargs = dict(layer_idx=1, num_layers=3, cu_seqlens=cu, state=pool, state_indices=idx, has_initial_state=has)
    q, k, v = _inputs()
    assert cula.lightning.lightning_prefill(q, k, v, **kwargs) == "planned"
    q2, k2, v2 = _inputs(seed=1)
    assert cula.lightning.lightning_prefill(q2, k2, v2, **kwargs) == "planned"
    assert validations == ["validate_lightning_prefill"] and len(made) == 1
    gamma = layer_g_gamma(H, 1, 3, "cpu")
    for (qq, kk, vv), call in zip(((q, k, v), (q2, k2, v2)), calls, strict=True):
        assert call[:3] == (qq, kk, vv) and call[3] is gamma
        assert call[4] is None and call[5] is cu and call[6] is pool and call[7] is idx and call[8] is has


def test_a_planned_prefill_still_checks_cu_seqlens_values(recorded) -> None:
    calls, validations, _ = recorded
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, k, v = _inputs()
    cula.lightning.lightning_prefill(q, k, v, layer_idx=0, num_layers=2, cu_seqlens=cu)
    cu[1] = 9  # (in place: a new version of the same tensor)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing"):
        cula.lightning.lightning_prefill(q, k, v, layer_idx=0, num_layers=2, cu_seqlens=cu)
    assert len(calls) == 1 and validations == ["validate_lightning_prefill"]


@pytest.mark.parametrize("change", [
    dict(scale=0.5), dict(layer_idx=2), dict(num_layers=5), dict(output_final_state=True), dict(state_v_first=True),
    dict(initial_state="h0"), dict(shape=(2, 9)),
], ids=["scale", "layer_idx", "num_layers", "final-state", "layout", "h0", "shape"])
def test_another_signature_is_validated_again(change: dict, recorded) -> None:
    calls, validations, _ = recorded
    kwargs = dict(layer_idx=1, num_layers=4)
    q, k, v = _inputs(B=2)
    cula.lightning.lightning_prefill(q, k, v, **kwargs)
    if "shape" in change:
        q, k, v = _inputs(*change.pop("shape"), seed=3)
    if change.get("initial_state") == "h0":
        change["initial_state"] = torch.zeros(q.shape[0], H, K, V)
    cula.lightning.lightning_prefill(q, k, v, **{**kwargs, **change})
    assert len(validations) == 2 and len(calls) == 2


def test_a_cpu_g_gamma_and_cpu_indices_are_never_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CULA_CALL_PLANS", raising=False)
    q, k, v = _inputs()
    gamma = torch.tensor([0.0, -1.0])
    sig = call_plans.lightning_prefill_call_signature
    assert sig(q, k, v, gamma, None, None, None, None, False, None, False) is None  # (its values are checked)
    assert sig(q, k, v, None, 0, 2, None, None, False, None, False) is not None
    pool, idx = torch.zeros(3, H, K, V), torch.tensor([0], dtype=torch.int32)
    assert sig(q, k, v, None, 0, 2, None, None, False, None, False, pool, idx) is None
    # (the decode's signature holds no tensor metadata: a plan's guards hold the device of the GPU indices it was
    # made with, and a call with CPU indices makes no plan: test_decode_plans_without_the_stand_in_never_serve_...)
    dsig = call_plans.lightning_decode_call_signature
    assert dsig(q, k, v, gamma, None, None, None, pool, idx, False, None, None) is None
    assert dsig(q, k, v, None, 0, 2, None, pool, idx, False, None, None) is not None


class _MarkedParameter(torch.nn.Parameter):
    """A Parameter subclass: the validator sees every call with one (``nn.Parameter`` itself is planned)."""


def test_signatures_refuse_what_the_validator_must_see(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CULA_CALL_PLANS", raising=False)
    monkeypatch.setattr(call_plans, "indices_checked_on_host", lambda idx: False)
    q, k, v = _inputs()
    sig = call_plans.lightning_prefill_call_signature
    base = (q, k, v, None, 0, 2, None, None, False, None, False)
    assert sig(*base) is not None
    assert sig(q, k, v, None, True, 2, None, None, False, None, False) is None  # (a bool layer_idx)
    assert sig(q, k, v, None, 0, None, None, None, False, None, False) is None  # (the validator's error)
    assert sig(q, k, v, None, 0, 2, "0.5", None, False, None, False) is None
    assert sig(q, k, v, None, 0, 2, None, None, 1, None, False) is None
    assert sig(q.as_subclass(_MarkedParameter), k, v, None, 0, 2, None, None, False, None, False) is None
    assert sig(torch.nn.Parameter(q), k, v, None, 0, 2, None, None, False, None, False) is not None  # (as plain)
    assert sig(*base) != sig(q, k, v, None, 1, 2, None, None, False, None, False)
    pool, idx = torch.zeros(3, H, K, V), torch.tensor([0], dtype=torch.int32)
    dsig = call_plans.lightning_decode_call_signature(q, k, v, None, 0, 2, None, pool, idx, False, None, None)
    assert dsig is not None and dsig[0] == "lightning_decode" and sig(*base)[0] == "lightning_prefill"
    assert call_plans.lightning_decode_call_signature(q, k, v, None, 0, None, None, pool, idx, False, None,
                                                      None) is None  # (the validator's error)
    assert call_plans.lightning_decode_call_signature(q, k, v, torch.zeros(H), 0, 2, None, pool, idx, False, None,
                                                      None) is None  # (both decay forms: the validator's error)
    monkeypatch.setenv("CULA_CALL_PLANS", "0")
    assert sig(*base) is None  # (the decode reads it where a plan is made: test_decode_plans_off_with_the_knob)


def test_a_copied_input_is_not_planned(recorded) -> None:
    calls, validations, made = recorded
    q, k, v = _inputs()
    q_strided = torch.randn(1, 7, H, 2 * K)[..., ::2]
    for _ in range(2):
        assert cula.lightning.lightning_prefill(q_strided, k, v, layer_idx=0, num_layers=1) == "prefill unplanned"
    assert len(validations) == 2 and calls == [] and made == []


def test_a_repeated_decode_runs_the_plan_with_the_contract_order(recorded) -> None:
    calls, validations, made = recorded
    pool, idx = torch.zeros(6, H, K, V), torch.tensor([5, -1, 2], dtype=torch.int32)
    out = torch.empty(3, 1, H, V)
    for seed in (0, 1):
        q, k, v = _inputs(B=3, T=1, seed=seed)
        assert cula.lightning.lightning_decode(q, k, v, layer_idx=3, num_layers=4, state=pool, state_indices=idx,
                                               out=out) == "planned"
        assert calls[-1][:3] == (q, k, v) and calls[-1][3] is layer_g_gamma(H, 3, 4, "cpu")
        assert calls[-1][4] is pool and calls[-1][5] is idx and calls[-1][6] is None and calls[-1][7] is out
    assert validations == ["validate_lightning_decode"] and len(made) == 1 and len(calls) == 2


def test_decode_plans_without_the_stand_in_never_serve_cpu_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real dispatch on the CPU: every call validated (the reference makes no plans; CPU indices)."""
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    remembered = []
    monkeypatch.setattr(call_plans, "remember", lambda *a: remembered.append(a))  # (where every op keeps plans)
    q, k, v = _inputs(B=2, T=1)
    pool = torch.zeros(3, H, K, V)
    for _ in range(2):
        cula.lightning.lightning_decode(q, k, v, layer_idx=0, num_layers=2, state=pool,
                                        state_indices=torch.tensor([0, 2], dtype=torch.int32))
    assert remembered == []


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_a_plan_that_declines_sends_the_call_to_validation_and_dispatch(recorded, monkeypatch, op: str) -> None:
    """A kept plan raising LaunchDeclined (TVM-FFI refused a pointer, nothing launched: a misaligned pool, say)
    leaves the call to the unplanned path, which answers it as if there were no plan; the plan stays kept."""
    calls, validations, made = recorded
    declines = [False]

    def planner(args):
        made.append(args)

        def plan(*a):
            if declines[0]:
                raise call_plans.LaunchDeclined
            calls.append(a)
            return "planned"

        return plan

    runners = dict(dispatch._planners)
    monkeypatch.setattr(dispatch, "_planners", {runner: planner for runner in runners})
    q, k, v = _inputs(B=2, T=1)
    if op == "prefill":
        def call():
            return cula.lightning.lightning_prefill(q, k, v, layer_idx=0, num_layers=2)
    else:
        pool, idx = torch.zeros(4, H, K, V), torch.tensor([3, 0], dtype=torch.int32)

        def call():
            return cula.lightning.lightning_decode(q, k, v, layer_idx=0, num_layers=2, state=pool,
                                                   state_indices=idx)
    assert call() == "planned" and call() == "planned" and len(validations) == 1
    declines[0] = True
    # (the unplanned path plans again; that plan declines too, so the runner serves the call and nothing is kept)
    assert call() == f"{op} unplanned" and len(validations) == 2 and len(made) == 2
    declines[0] = False
    assert call() == "planned" and len(validations) == 2 and len(calls) == 3


def test_decode_plans_off_with_the_knob(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CULA_CALL_PLANS=0``: every decode call validated, none planned (the knob is read where a plan is made)."""
    calls, validations, made = recorded
    monkeypatch.setenv("CULA_CALL_PLANS", "0")
    pool, idx = torch.zeros(4, H, K, V), torch.tensor([3, 0], dtype=torch.int32)
    q, k, v = _inputs(B=2, T=1)
    for _ in range(2):
        assert cula.lightning.lightning_decode(q, k, v, layer_idx=0, num_layers=2, state=pool,
                                               state_indices=idx) == "decode unplanned"
    assert len(validations) == 2 and made == [] and calls == []


def test_a_planned_decode_with_another_tensor_layout_is_validated(recorded) -> None:
    """The decode's plans are kept with guards of their tensors: a pool of another slot count or dtype misses the
    plan."""
    calls, validations, made = recorded
    idx = torch.tensor([3, 0], dtype=torch.int32)
    q, k, v = _inputs(B=2, T=1)
    cula.lightning.lightning_decode(q, k, v, layer_idx=0, num_layers=2, state=torch.zeros(4, H, K, V),
                                    state_indices=idx)
    cula.lightning.lightning_decode(q, k, v, layer_idx=0, num_layers=2, state=torch.zeros(4, H, K, V),
                                    state_indices=idx)
    assert len(validations) == 1 and len(calls) == 2
    for pool in (torch.zeros(5, H, K, V), torch.zeros(4, H, K, V, dtype=torch.bfloat16)):
        cula.lightning.lightning_decode(q, k, v, layer_idx=0, num_layers=2, state=pool, state_indices=idx)
    assert len(validations) == 3
