"""Dispatch of ``kda_decode`` and of ``kda_prefill`` with a state pool: CPU -> reference; on SM90/SM100/SM103 the
CuTeDSL decode kernel (cula-sm90 has none), the reference with a ``CulaFallbackWarning`` for calls outside it; the
pool form of the prefill; forced backends."""

from __future__ import annotations

import dataclasses
import re
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


def _gpu_decode_call(**changes) -> SimpleNamespace:
    """Validated decode arguments the CuTeDSL kernel takes (bf16, K = V = 128), as if on a GPU."""
    gen = torch.Generator().manual_seed(4)
    B, H, HV, K = 3, 2, 4, 128
    kwargs = dict(q=torch.randn(B, 1, H, K, generator=gen).bfloat16(),
                  k=torch.randn(B, 1, H, K, generator=gen).bfloat16(),
                  v=torch.randn(B, 1, HV, K, generator=gen).bfloat16(), g=-torch.rand(B, 1, HV, K, generator=gen),
                  beta=torch.rand(B, 1, HV, generator=gen), state=torch.zeros(5, HV, K, K),
                  state_indices=torch.tensor([4, -1, 0], dtype=torch.int32))
    kwargs.update(changes)
    args = validate_kda_decode(**kwargs)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    return SimpleNamespace(**fields, device=torch.device("cuda", 0))


@pytest.fixture
def cutedsl_decode(monkeypatch):
    """The CuTeDSL decode backend as if CuTeDSL were installed (nothing compiles: verify only)."""
    from cula_runtime.cute.kda import decode_backend

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr("cula_runtime.cute.is_available", lambda: True)
    return decode_backend


@pytest.mark.parametrize("cap,expected", CHAINS, ids=["sm90", "sm100", "sm103"])
def test_gpu_decode_runs_the_cutedsl_kernel(cap, expected, monkeypatch, cutedsl_decode) -> None:
    monkeypatch.setattr(dispatch, "device_capability", lambda device: cap)
    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: cap)
    choice = dispatch.explain_decode(_gpu_decode_call())
    assert [d.backend for d in choice.decisions] == expected[:-1] and not choice.gpu_fallback
    assert choice.runner is cutedsl_decode.kda_decode_cutedsl_backend
    if cap == (9, 0):  # (Hopper: the portable kernel, cula-sm90 has none)
        assert choice.decisions[0].reason == dispatch.NO_DECODE_KERNEL and "CuTeDSL" in dispatch.NO_DECODE_KERNEL


@pytest.mark.parametrize("change,reason", [
    (dict(q="fp16"), "needs bf16 q/k/v, got torch.float16"),
    (dict(state="fp64"), "needs an fp32 or bf16 state pool, got torch.float64"),
    (dict(state="misaligned"), r"needs each pool head a dense \[128, 128\] block, 16-byte aligned"),
    (dict(K=64), "needs K = V = 128, got K=64 V=64"),
], ids=["fp16", "fp64-pool", "misaligned-pool", "K64"])
def test_gpu_decode_outside_the_kernel_falls_back_with_the_reason(change, reason, monkeypatch, cutedsl_decode) -> None:
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (10, 0))
    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: (10, 0))
    call = _gpu_decode_call()
    if "q" in change:
        call = _gpu_decode_call(q=call.q.half(), k=call.k.half(), v=call.v.half())
    elif change.get("state") == "fp64":
        call = _gpu_decode_call(state=torch.zeros(5, 4, 128, 128, dtype=torch.float64))
    elif change.get("state") == "misaligned":  # a pool starting 4 bytes into its storage
        call = _gpu_decode_call(state=torch.zeros(5 * 4 * 128 * 128 + 1)[1:].view(5, 4, 128, 128))
    else:
        gen = torch.Generator().manual_seed(5)
        call = _gpu_decode_call(q=torch.randn(3, 1, 2, 64, generator=gen).bfloat16(),
                                k=torch.randn(3, 1, 2, 64, generator=gen).bfloat16(),
                                v=torch.randn(3, 1, 4, 64, generator=gen).bfloat16(),
                                g=-torch.rand(3, 1, 4, 64, generator=gen), state=torch.zeros(5, 4, 64, 64))
    choice = dispatch.explain_decode(call)
    assert choice.gpu_fallback and choice.runner is reference.kda_decode_reference
    assert choice.decisions[0].backend == "cutedsl"
    assert re.search(reason, choice.decisions[0].reason)
    with pytest.warns(dispatch.CulaFallbackWarning, match=r"cula\.kda\.kda_decode: .*cutedsl: .*torch reference"):
        assert dispatch.select_decode_backend(call) is reference.kda_decode_reference


def test_gpu_decode_without_cutedsl_falls_back_naming_why(monkeypatch) -> None:

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr("cula_runtime.cute.is_available", lambda: False)
    monkeypatch.setattr("cula_runtime.cute.unavailable_reason", lambda: "CuTeDSL is not installed")
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (10, 3))
    choice = dispatch.explain_decode(_gpu_decode_call())
    assert choice.gpu_fallback and choice.decisions[0].reason == "needs CuTeDSL and TVM-FFI: CuTeDSL is not installed"


def test_cutedsl_decode_runner_passes_the_call_through(monkeypatch, cutedsl_decode) -> None:
    """The runner hands the kernel wrapper the validated tensors, with an int64 cu_seqlens narrowed to int32 and the
    gate parameters in fp32."""
    seen = {}
    monkeypatch.setattr(cutedsl_decode, "_kernel", lambda: lambda *a, **kw: seen.update(args=a, **kw) or "o")
    gen = torch.Generator().manual_seed(6)
    call = _gpu_decode_call(q=torch.randn(1, 3, 2, 128, generator=gen).bfloat16(),
                            k=torch.randn(1, 3, 2, 128, generator=gen).bfloat16(),
                            v=torch.randn(1, 3, 4, 128, generator=gen).bfloat16(),
                            g=torch.randn(1, 3, 4, 128, generator=gen), beta=torch.rand(1, 3, 4, generator=gen),
                            cu_seqlens=torch.tensor([0, 1, 1, 3]), use_gate_in_kernel=True,
                            A_log=torch.zeros(4, dtype=torch.bfloat16), dt_bias=torch.zeros(4, 128).bfloat16())
    assert cutedsl_decode.kda_decode_cutedsl_backend(call) == "o"
    assert seen["args"] == (call.q, call.k, call.v, call.g, call.beta) and seen["state"] is call.state
    assert seen["cu_seqlens"].dtype == torch.int32 and seen["cu_seqlens"].tolist() == [0, 1, 1, 3]
    assert seen["A_log"].dtype == torch.float32 and seen["dt_bias"].dtype == torch.float32
    assert seen["state_indices"] is call.state_indices and seen["out"] is None and seen["scale"] == call.scale


def test_decode_on_an_unsupported_gpu_raises_with_the_fix(monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    with pytest.raises(NotImplementedError, match=r"cula\.kda\.kda_decode: no cuLA GPU kernel targets sm_80"):
        dispatch.select_decode_backend(SimpleNamespace(device=torch.device("cuda", 0)))


@pytest.mark.parametrize("name,reason", [("sm90", "cula-sm90 has no decode kernel"),
                                         ("cutedsl", "needs (CuTeDSL|CUDA tensors)")])
def test_forced_gpu_backend_refuses_cpu_decode(name: str, reason: str, monkeypatch) -> None:
    monkeypatch.setenv("CULA_BACKEND", name)
    with pytest.raises(NotImplementedError, match=f"CULA_BACKEND={name}.*{name} rejected it: {reason}"):
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


def test_sm90_verify_serves_the_pool_form(monkeypatch) -> None:
    """The sm90 recurrence updates fp32 and bf16 pools in place (any slot stride that keeps slots apart); an fp64
    pool, or one whose slots overlap, is refused with the reason; on a (stand-in) SM90 the call runs on sm90."""
    kda = shim()
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(kda, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "_sm90_found", (kda.verify_kda_prefill, kda.kda_prefill))
    args = _pool_prefill_args()
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}

    def on_gpu(**changes) -> SimpleNamespace:
        return SimpleNamespace(**{**fields, **changes}, device=torch.device("cuda", 0))

    assert kda.verify_kda_prefill(on_gpu()) == (True, "sm_90a kernels serve this call")
    assert kda.verify_kda_prefill(on_gpu(state=args.state.bfloat16()))[0]
    assert kda.verify_kda_prefill(on_gpu(state=torch.zeros(6, 2, 128, 128)[::2]))[0]  # (slots apart: a free stride)
    assert kda.verify_kda_prefill(on_gpu(state=args.state.double())) == (
        False, "needs the state pool in fp32 or bf16, got torch.float64")
    ok, reason = kda.verify_kda_prefill(on_gpu(state=torch.zeros(1, 2, 128, 128).expand(3, -1, -1, -1)))
    assert not ok and reason.startswith("needs the state pool's slots apart (slot stride 0 < 32768")
    assert kda.verify_kda_prefill(on_gpu(state=None))[0]
    choice = dispatch.explain(on_gpu())
    assert [d.backend for d in choice.decisions] == ["sm90"] and choice.runner is kda.kda_prefill
    assert not choice.gpu_fallback


def test_cutedsl_verify_serves_the_pool_form(monkeypatch) -> None:
    """The CuTeDSL recurrence reads and writes fp32 and bf16 pools in place; an fp64 pool is refused with the
    reason."""
    from cula_runtime.cute.kda import backend

    # (CuTeDSL need not be installed: nothing compiles)
    monkeypatch.setattr("cula_runtime.cute.is_available", lambda: True)
    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: (10, 0))
    args = _pool_prefill_args()
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}

    def verify(**changes) -> tuple[bool, str]:
        return backend.verify(SimpleNamespace(**{**fields, **changes}, device=torch.device("cuda", 0)))

    assert verify() == (True, "CuTeDSL kernels serve this call (unbounded gate)")
    assert verify(state=args.state.bfloat16())[0]
    assert verify(state=args.state.double()) == (False, "needs the state pool in fp32 or bf16, got torch.float64")


@pytest.mark.parametrize("cap,expected", CHAINS[1:], ids=["sm100", "sm103"])  # (sm90 serves it: above)
def test_gpu_pool_prefill_runs_on_the_cutedsl_kernels(cap, expected, monkeypatch) -> None:
    """On a (stand-in) SM100/SM103 whose backends are installed, a pool-form prefill runs on cutedsl, the first
    backend of the chain, without a fallback."""
    kda = shim()
    from cula_runtime.cute.kda import backend

    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: cap)
    monkeypatch.setattr(kda, "device_capability", lambda device: cap)
    monkeypatch.setattr(dispatch, "_sm90_found", (kda.verify_kda_prefill, kda.kda_prefill))
    monkeypatch.setattr("cula_runtime.cute.is_available", lambda: True)
    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: cap)
    args = _pool_prefill_args()
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    call = SimpleNamespace(**fields, device=torch.device("cuda", 0))
    choice = dispatch.explain(call)
    assert [d.backend for d in choice.decisions] == expected[:1] == ["cutedsl"] and not choice.gpu_fallback
    assert choice.runner is backend.kda_prefill_cutedsl


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
