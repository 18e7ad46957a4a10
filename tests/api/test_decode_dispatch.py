"""Dispatch of ``kda_decode`` and of ``kda_prefill`` with a state pool: CPU -> reference; on SM90/SM100/SM103 the
reference with a ``CulaFallbackWarning`` (no GPU decode kernel yet; the GPU prefill kernels refuse the pool form
through the shared ``gpu_kernel_rejection``, issue 26); forced backends."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from cula import dispatch
from cula.kda import kda_decode, kda_prefill
from cula_runtime.kda_args import POOL_REFUSAL, gpu_kernel_rejection, validate_kda_prefill
from cula_runtime.kda_decode_args import validate_kda_decode
from cula_runtime.reference import backend as reference
from tests.api.fake_sm90 import shim

CHAINS = [((9, 0), ["sm90", "cutedsl", "reference"]), ((10, 0), ["cutedsl", "reference"]),
          ((10, 3), ["cutedsl", "reference"])]


def _decode_inputs() -> dict:
    gen = torch.Generator().manual_seed(2)
    B, H, HV, K, V = 2, 1, 2, 16, 8
    return dict(q=torch.randn(B, 1, H, K, generator=gen), k=torch.randn(B, 1, H, K, generator=gen),
                v=torch.randn(B, 1, HV, V, generator=gen), g=-torch.rand(B, 1, HV, K, generator=gen),
                beta=torch.rand(B, 1, HV, generator=gen), state=torch.randn(4, HV, K, V, generator=gen),
                state_indices=torch.tensor([3, 0], dtype=torch.int32))


def _pool_prefill_args():
    """Validated pool-form prefill arguments the GPU kernels would otherwise take (bf16, K = V = 128)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 70, 2, 128, generator=gen).bfloat16()
    return validate_kda_prefill(q, q.clone(), torch.randn(1, 70, 2, 128, generator=gen).bfloat16(),
                                -torch.rand(1, 70, 2, 128, generator=gen), torch.rand(1, 70, 2, generator=gen),
                                state=torch.zeros(3, 2, 128, 128), state_indices=torch.tensor([2], dtype=torch.int32))


def test_cpu_decode_runs_the_reference(monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    choice = dispatch.explain_decode(validate_kda_decode(**_decode_inputs()))
    assert [d.backend for d in choice.decisions] == ["reference"] and not choice.gpu_fallback
    assert choice.runner is reference.kda_decode_reference
    assert choice.summary == "CPU tensors run on the torch reference backend"


@pytest.mark.parametrize("cap,expected", CHAINS, ids=["sm90", "sm100", "sm103"])
def test_gpu_decode_falls_back_to_the_reference_saying_the_kernel_is_not_written(cap, expected, monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: cap)
    call = SimpleNamespace(device=torch.device("cuda", 0))
    choice = dispatch.explain_decode(call)
    assert [d.backend for d in choice.decisions] == expected
    assert choice.gpu_fallback and choice.runner is reference.kda_decode_reference
    assert all(d.reason == dispatch.NO_DECODE_KERNEL for d in choice.decisions[:-1])
    with pytest.warns(dispatch.CulaFallbackWarning,
                      match=r"cula\.kda\.kda_decode: .*not written yet \(issue 26\).*torch reference on the GPU"):
        assert dispatch.select_decode_backend(call) is reference.kda_decode_reference


def test_decode_on_an_unsupported_gpu_raises_with_the_fix(monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    with pytest.raises(NotImplementedError, match=r"cula\.kda\.kda_decode: no cuLA GPU kernel targets sm_80"):
        dispatch.select_decode_backend(SimpleNamespace(device=torch.device("cuda", 0)))


@pytest.mark.parametrize("name", ["sm90", "cutedsl"])
def test_forced_gpu_backend_refuses_decode(name: str, monkeypatch) -> None:
    monkeypatch.setenv("CULA_BACKEND", name)
    with pytest.raises(NotImplementedError, match=f"CULA_BACKEND={name}.*{name} rejected it: the GPU decode kernel"):
        kda_decode(**_decode_inputs())


def test_forced_reference_runs_decode(monkeypatch) -> None:
    monkeypatch.setenv("CULA_BACKEND", "reference")
    kwargs = _decode_inputs()
    expected_pool = kwargs["state"].clone()
    expected = kda_decode(**{**kwargs, "state": expected_pool})
    monkeypatch.delenv("CULA_BACKEND")
    assert torch.equal(kda_decode(**kwargs), expected) and torch.equal(kwargs["state"], expected_pool)


def test_the_shared_kernel_checks_pass_the_pool_form() -> None:
    """The pool is each backend's own matter (its verify); the shared dtype/shape checks pass it."""
    args = _pool_prefill_args()
    assert gpu_kernel_rejection(args) is None
    assert "issue 26" in POOL_REFUSAL and "reference" in POOL_REFUSAL


def test_sm90_verify_refuses_the_pool_form(monkeypatch) -> None:
    kda = shim()
    monkeypatch.setattr(kda, "device_capability", lambda device: (9, 0))
    args = _pool_prefill_args()
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    on_gpu = SimpleNamespace(**fields, device=torch.device("cuda", 0))
    assert kda.verify_kda_prefill(on_gpu) == (False, POOL_REFUSAL)
    assert kda.verify_kda_prefill(SimpleNamespace(**{**fields, "state": None}, device=on_gpu.device))[0]


def test_cutedsl_verify_refuses_the_pool_form(monkeypatch) -> None:
    from cula_runtime.cute.kda import backend

    monkeypatch.setattr(backend, "is_available", lambda: True)  # (CuTeDSL need not be installed: nothing compiles)
    monkeypatch.setattr(backend, "device_capability", lambda device: (10, 0))
    args = _pool_prefill_args()
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    assert backend.verify(SimpleNamespace(**fields, device=torch.device("cuda", 0))) == (False, POOL_REFUSAL)


@pytest.mark.parametrize("cap,expected", CHAINS, ids=["sm90", "sm100", "sm103"])
def test_gpu_pool_prefill_falls_back_to_the_reference_with_the_reason(cap, expected, monkeypatch) -> None:
    """On a (stand-in) GPU whose backends are installed, a pool-form prefill reaches the reference with a warning
    that gives the shared refusal."""
    kda = shim()
    from cula_runtime.cute.kda import backend

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: cap)
    monkeypatch.setattr(kda, "device_capability", lambda device: cap)
    monkeypatch.setattr(dispatch, "_sm90_found", (kda.verify_kda_prefill, kda.kda_prefill))
    monkeypatch.setattr(backend, "is_available", lambda: True)
    monkeypatch.setattr(backend, "device_capability", lambda device: cap)
    args = _pool_prefill_args()
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    call = SimpleNamespace(**fields, device=torch.device("cuda", 0))
    choice = dispatch.explain(call)
    assert [d.backend for d in choice.decisions] == expected and choice.gpu_fallback
    assert all(d.reason == POOL_REFUSAL for d in choice.decisions[:-1])
    with pytest.warns(dispatch.CulaFallbackWarning, match=r"cula\.kda\.kda_prefill: .*state-pool form"):
        assert dispatch.select_backend(call) is reference.kda_prefill_reference


def test_pool_prefill_calls_are_never_planned(monkeypatch) -> None:
    from cula import call_plans

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    args = _pool_prefill_args()
    remembered = []
    monkeypatch.setattr(call_plans, "remember", lambda *a: remembered.append(a))
    q = args.q.float()
    for _ in range(2):
        kda_prefill(q, q.clone(), args.v.float(), args.g, args.beta, state=args.state, state_indices=args.state_indices)
    assert remembered == []
    assert call_plans.call_signature(q, q, q, args.g, args.beta, None, None, False, False, False, False, False, False,
                                     None, None, None, None, False, None, state=args.state) is None
