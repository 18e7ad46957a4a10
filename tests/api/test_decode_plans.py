"""Call plans of ``kda_decode`` (``cula.call_plans``): a repeated call with one signature skips validation and
dispatch and launches the CuTeDSL decode kernel with exactly the arguments the unplanned path passes. Driven on CPU
tensors: the kernel's configuration and argument specs are the real ones (CuTeDSL imports, nothing compiles), the
compiled kernel is a recorder, and CPU index tensors are let through the signature as a GPU call's would be."""

from __future__ import annotations

import inspect

import pytest
import torch

import cula.kda
from cula import call_plans, dispatch
from cula_runtime.kda_decode_args import validate_kda_decode

pytest.importorskip("cutlass", reason="CuTeDSL is not installed (the plan builds the kernel's real argument specs)")


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch):
    """(launches, validations): every kernel launch's arguments, and the validator's runs."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda import decode_backend

    launches, validations = [], []
    monkeypatch.setattr(compile_cache, "_launchable", {})
    monkeypatch.setattr(compile_cache, "launch_target", lambda index: "sm_90a")
    monkeypatch.setattr(compile_cache, "compile_kernel", lambda *a, **kw: lambda *args: launches.append(args))

    def counted(*a, **kw):
        validations.append(1)
        return validate_kda_decode(*a, **kw)

    monkeypatch.setattr(cula.kda, "validate_kda_decode", counted)
    monkeypatch.setattr(cula.kda, "select_decode_backend", lambda args: decode_backend.kda_decode_cutedsl_backend)
    monkeypatch.setattr(dispatch, "_planners",
                        {decode_backend.kda_decode_cutedsl_backend: decode_backend.plan_kda_decode})
    monkeypatch.setattr(call_plans, "indices_checked_on_host", lambda idx: False)
    monkeypatch.delenv("CULA_CALL_PLANS", raising=False)
    call_plans.clear_call_plans()
    yield launches, validations
    call_plans.clear_call_plans()


def _call(seed: int, *, packed: bool = False, gate: str = "softplus", out: bool = True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV, K = (1, 4, 2, 4, 128) if packed else (3, 1, 2, 4, 128)

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    kwargs = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, K), beta=torch.rand(B, T, HV, generator=gen),
                  state=torch.zeros(7, HV, K, K), state_indices=torch.tensor([5, -1, 2], dtype=torch.int32),
                  use_qk_l2norm_in_kernel=True)
    if gate == "softplus":
        kwargs.update(g=r(B, T, HV, K, dtype=torch.float32), use_gate_in_kernel=True,
                      A_log=torch.zeros(HV, dtype=torch.bfloat16), dt_bias=r(HV, K, dtype=torch.float32))
    else:
        kwargs["g"] = -torch.rand(B, T, HV, K, generator=gen)
    if packed:
        kwargs["cu_seqlens"] = torch.tensor([0, 1, 1, 4])  # int64: narrowed for the kernel
    if out:
        kwargs["out"] = torch.empty(B, T, HV, K, dtype=torch.bfloat16)
    return kwargs


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_signature_takes_kda_decodes_parameters() -> None:
    ours = list(inspect.signature(call_plans.decode_call_signature).parameters)
    assert ours == list(inspect.signature(cula.kda.kda_decode).parameters)


@pytest.mark.parametrize("packed,gate,out", [(False, "softplus", True), (True, "softplus", False),
                                             (True, "log", True)], ids=["fixed-softplus-out", "packed-cu64-no-out",
                                                                        "packed-log-gate"])
def test_second_call_skips_validation_and_launches_what_the_unplanned_path_launches(packed, gate, out,
                                                                                   recorded) -> None:
    from cula_runtime.cute.kda import decode_backend

    launches, validations = recorded
    first = _call(1, packed=packed, gate=gate, out=out)
    o1 = cula.kda.kda_decode(**first)
    assert validations == [1] and len(launches) == 1
    second = _call(2, packed=packed, gate=gate, out=out)
    o2 = cula.kda.kda_decode(**second)
    assert validations == [1] and len(launches) == 2, "the second call must run the plan"
    assert o2 is second["out"] if out else o2.shape == o1.shape and o2 is not o1
    # the unplanned runner on the second call's validated arguments passes the same arguments
    expected_out = second["out"] if out else torch.empty_like(o2)
    decode_backend.kda_decode_cutedsl_backend(validate_kda_decode(**{**second, "out": expected_out}))
    planned, unplanned = launches[1], launches[2]
    assert len(planned) == len(unplanned)
    for i, (a, b) in enumerate(zip(planned, unplanned, strict=True)):
        if i == 11:  # o: the call's out, or a fresh tensor of the same kind
            assert (a is b) if out else (a.shape == b.shape and a.dtype == b.dtype)
            continue
        assert _same(a, b), f"argument {i} differs"
    assert planned[0] is second["q"] and planned[7] is second["state"] and planned[8] is second["state_indices"]
    if packed:
        assert planned[10].dtype == torch.int32 and planned[10].tolist() == [0, 1, 1, 4]
    if gate == "softplus":
        assert planned[5].dtype == torch.float32 and planned[6].shape == (4, 128)


def test_a_new_signature_is_validated_and_plans_can_be_turned_off(recorded, monkeypatch) -> None:
    launches, validations = recorded
    cula.kda.kda_decode(**_call(1))
    cula.kda.kda_decode(**_call(2, gate="log"))  # another gate form: another signature
    assert validations == [1, 1]
    monkeypatch.setenv("CULA_CALL_PLANS", "0")
    cula.kda.kda_decode(**_call(3))
    assert validations == [1, 1, 1] and len(launches) == 3


def test_a_plan_still_refuses_nothing_the_validator_refuses(recorded) -> None:
    """A call the validator refuses has another signature (shapes, dtypes) than the planned one: it is validated."""
    _, validations = recorded
    cula.kda.kda_decode(**_call(1))
    bad = _call(2)
    bad["state_indices"] = torch.tensor([5, -1], dtype=torch.int32)  # one slot short
    with pytest.raises(ValueError, match="state_indices"):
        cula.kda.kda_decode(**bad)
    assert validations == [1, 1]


def test_non_contiguous_inputs_are_validated_every_call(recorded) -> None:
    _, validations = recorded
    for seed in (1, 2):
        call = _call(seed)
        call["q"] = torch.randn(3, 1, 2, 256).bfloat16()[..., ::2]  # a copy by the validator: never planned
        cula.kda.kda_decode(**call)
    assert validations == [1, 1]


def test_a_pool_the_validator_would_refuse_to_write_is_never_served_by_a_plan(recorded) -> None:
    """Grad mode and inference mode are part of the signature (the guards hold the pool's ``requires_grad`` and
    dispatch keys): a plan made under ``no_grad`` for a pool that requires grad does not serve the same call with
    grad enabled, which the validator refuses before anything is written; a plan made inside inference mode does not
    serve an inference-mode pool outside it."""
    launches, validations = recorded
    call = _call(1)
    call["state"] = torch.zeros(7, 4, 128, 128, requires_grad=True)
    with torch.no_grad():
        for _ in range(2):
            cula.kda.kda_decode(**call)
    assert validations == [1] and len(launches) == 2
    with pytest.raises(ValueError, match="must not require grad while grad mode is enabled"):
        cula.kda.kda_decode(**call)
    with torch.inference_mode():
        call = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in _call(2).items()}
        for _ in range(2):
            cula.kda.kda_decode(**call)
    assert validations == [1, 1, 1] and len(launches) == 4
    with pytest.raises(ValueError, match="inference-mode tensor"):
        cula.kda.kda_decode(**call)
    assert len(launches) == 4
