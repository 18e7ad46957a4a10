"""Dispatch of ``lightning_prefill`` / ``lightning_decode``: CPU -> reference; on SM90/SM100/SM103 the CuTeDSL backends
(cula-sm90 answers ``NO_LIGHTNING_KERNEL``), the reference with a ``CulaFallbackWarning`` for calls they reject;
``CULA_BACKEND``; a CuTeDSL Lightning backend module that is missing is that backend's answer (only exactly that
module: any other import error is raised). The GPU is a stand-in (monkeypatched capability, a ``cuda`` device on the
arguments) and the CuTeDSL backends are fake modules in ``sys.modules``: nothing here needs a GPU or CuTeDSL."""

from __future__ import annotations

import dataclasses
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from cula import dispatch
from cula.lightning import lightning_decode, lightning_prefill
from cula_runtime.lightning_args import validate_lightning_decode, validate_lightning_prefill
from cula_runtime.reference import lightning_backend as reference

PREFILL, DECODE = dispatch.LIGHTNING_PREFILL_MODULE, dispatch.LIGHTNING_DECODE_MODULE
CHAINS = [((9, 0), ["sm90", "cutedsl"]), ((10, 0), ["cutedsl"]), ((10, 3), ["cutedsl"])]


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)


def _prefill_call() -> dict:
    gen = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(1, 6, 2, 8, generator=gen), k=torch.randn(1, 6, 2, 8, generator=gen),
                v=torch.randn(1, 6, 2, 4, generator=gen), g_gamma=torch.tensor([0.0, -1.0]))


def _decode_call() -> dict:
    gen = torch.Generator().manual_seed(1)
    return dict(q=torch.randn(3, 1, 2, 8, generator=gen), k=torch.randn(3, 1, 2, 8, generator=gen),
                v=torch.randn(3, 1, 2, 4, generator=gen), g_gamma=torch.tensor([0.0, -1.0]),
                state=torch.randn(4, 2, 8, 4, generator=gen), state_indices=torch.tensor([3, -1, 0], dtype=torch.int32))


def _on_gpu(args) -> SimpleNamespace:
    """Validated CPU arguments presented as a GPU call's (the dispatch reads only ``device``)."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    return SimpleNamespace(**fields, device=torch.device("cuda", 0))


def _fake_backend(monkeypatch: pytest.MonkeyPatch, name: str, kind: str, ok: bool) -> types.ModuleType:
    """A stand-in CuTeDSL Lightning backend module named ``name`` (``kind``: "prefill" or "decode")."""
    module = types.ModuleType(name)

    def verify(args) -> tuple[bool, str]:
        return (True, f"fake {kind} kernel serves it") if ok else (False, f"fake {kind} kernel: needs bf16")

    def run(args):
        return f"{kind} ran"

    def plan(args):
        return None

    setattr(module, f"verify_lightning_{kind}", verify)
    setattr(module, f"lightning_{kind}_cutedsl_backend", run)
    setattr(module, f"plan_lightning_{kind}", plan)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _missing(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make exactly module ``name`` unimportable (as in a cula-runtime without it)."""
    monkeypatch.setitem(sys.modules, name, None)


def test_cpu_calls_run_the_reference() -> None:
    for explain, args, runner in (
            (dispatch.explain_lightning_prefill, validate_lightning_prefill(**_prefill_call()),
             reference.lightning_prefill_reference),
            (dispatch.explain_lightning_decode, validate_lightning_decode(**_decode_call()),
             reference.lightning_decode_reference)):
        choice = explain(args)
        assert [d.backend for d in choice.decisions] == ["reference"] and choice.runner is runner
        assert choice.summary == "CPU tensors run on the torch reference backend" and not choice.gpu_fallback


@pytest.mark.parametrize("cap,chain", CHAINS, ids=["sm90", "sm100", "sm103"])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_gpu_calls_run_the_cutedsl_backend(kind: str, cap, chain, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _fake_backend(monkeypatch, PREFILL if kind == "prefill" else DECODE, kind, ok=True)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: cap)
    monkeypatch.setattr(dispatch, "_planners", {})
    args = validate_lightning_prefill(**_prefill_call()) if kind == "prefill" else \
        validate_lightning_decode(**_decode_call())
    explain = dispatch.explain_lightning_prefill if kind == "prefill" else dispatch.explain_lightning_decode
    choice = explain(_on_gpu(args))
    runner = getattr(module, f"lightning_{kind}_cutedsl_backend")
    assert [d.backend for d in choice.decisions] == chain and not choice.gpu_fallback
    assert choice.runner is runner
    assert dispatch.planner_for(runner) is getattr(module, f"plan_lightning_{kind}")  # (registered on acceptance)
    if cap == (9, 0):
        assert choice.decisions[0] == dispatch.Decision("sm90", False, dispatch.NO_LIGHTNING_KERNEL)
        assert "CuTeDSL" in dispatch.NO_LIGHTNING_KERNEL
    assert choice.summary == f"sm_{cap[0]}{cap[1]}: cutedsl is the first backend in {tuple(chain)} to accept this call"


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_rejected_gpu_call_falls_back_to_the_reference_with_a_warning(kind: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_backend(monkeypatch, PREFILL if kind == "prefill" else DECODE, kind, ok=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (10, 0))
    args = validate_lightning_prefill(**_prefill_call()) if kind == "prefill" else \
        validate_lightning_decode(**_decode_call())
    select = dispatch.select_lightning_prefill_backend if kind == "prefill" else \
        dispatch.select_lightning_decode_backend
    expected = reference.lightning_prefill_reference if kind == "prefill" else reference.lightning_decode_reference
    with pytest.warns(dispatch.CulaFallbackWarning,
                      match=rf"cula\.lightning\.lightning_{kind}: sm_100: no GPU kernel accepted this call "
                            rf"\(cutedsl: fake {kind} kernel: needs bf16\); running the torch reference"):
        assert select(_on_gpu(args)) is expected


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_missing_cutedsl_module_is_that_backends_answer(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name = PREFILL if kind == "prefill" else DECODE
    _missing(monkeypatch, name)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    args = validate_lightning_prefill(**_prefill_call()) if kind == "prefill" else \
        validate_lightning_decode(**_decode_call())
    explain = dispatch.explain_lightning_prefill if kind == "prefill" else dispatch.explain_lightning_decode
    choice = explain(_on_gpu(args))
    assert choice.gpu_fallback and [d.backend for d in choice.decisions] == ["sm90", "cutedsl", "reference"]
    assert choice.decisions[1] == dispatch.Decision(
        "cutedsl", False, f"this cula-runtime has no CuTeDSL Lightning backend ({name} is missing)")


def test_another_import_error_inside_the_backend_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a missing backend module is an answer; a module it imports that is missing is a failure, raised."""
    real = dispatch.importlib.import_module

    def broken(name: str, package=None):
        if name == DECODE:
            raise ModuleNotFoundError("No module named 'cutlass'", name="cutlass")
        return real(name, package)

    monkeypatch.setattr(dispatch.importlib, "import_module", broken)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (10, 3))
    with pytest.raises(ModuleNotFoundError, match="cutlass"):
        dispatch.explain_lightning_decode(_on_gpu(validate_lightning_decode(**_decode_call())))


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_an_unsupported_gpu_raises_with_the_fix(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    select = dispatch.select_lightning_prefill_backend if kind == "prefill" else \
        dispatch.select_lightning_decode_backend
    with pytest.raises(NotImplementedError, match=rf"cula\.lightning\.lightning_{kind}: no cuLA GPU kernel targets "
                                                  r"sm_80 .* CULA_BACKEND=reference"):
        select(SimpleNamespace(device=torch.device("cuda", 0)))


def test_forced_reference_runs_both_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CULA_BACKEND", "reference")
    choice = dispatch.explain_lightning_decode(_on_gpu(validate_lightning_decode(**_decode_call())))
    assert choice.runner is reference.lightning_decode_reference and not choice.gpu_fallback
    assert choice.summary == "CULA_BACKEND=reference forces the reference backend"
    forced_o, _ = lightning_prefill(**_prefill_call())
    kwargs = _decode_call()
    forced_pool = kwargs["state"].clone()
    forced_decode = lightning_decode(**{**kwargs, "state": forced_pool})
    monkeypatch.delenv("CULA_BACKEND")
    assert torch.equal(lightning_prefill(**_prefill_call())[0], forced_o)
    assert torch.equal(lightning_decode(**kwargs), forced_decode) and torch.equal(kwargs["state"], forced_pool)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_forced_gpu_backends_refuse_with_the_reason(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    call = (lambda: lightning_prefill(**_prefill_call())) if kind == "prefill" else \
        (lambda: lightning_decode(**_decode_call()))
    monkeypatch.setenv("CULA_BACKEND", "sm90")
    with pytest.raises(NotImplementedError, match=r"CULA_BACKEND=sm90 .*sm90 rejected it: cula-sm90 has no Lightning"):
        call()
    monkeypatch.setenv("CULA_BACKEND", "cutedsl")
    _missing(monkeypatch, PREFILL if kind == "prefill" else DECODE)
    with pytest.raises(NotImplementedError, match=rf"cula\.lightning\.lightning_{kind}: CULA_BACKEND=cutedsl forces "
                                                  r"the cutedsl backend \(cutedsl rejected it: this cula-runtime has "
                                                  r"no CuTeDSL Lightning backend"):
        call()
    fake = _fake_backend(monkeypatch, PREFILL if kind == "prefill" else DECODE, kind, ok=True)
    monkeypatch.setattr(dispatch, "_planners", {})
    assert call() == f"{kind} ran"  # (forced: the backend's own verify decides, even for CPU tensors)
    assert getattr(fake, f"lightning_{kind}_cutedsl_backend") in dispatch._planners


def test_kda_dispatch_messages_are_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    with pytest.raises(NotImplementedError, match=r"^cula\.kda\.kda_decode: no cuLA GPU kernel targets sm_80"):
        dispatch.select_decode_backend(SimpleNamespace(device=torch.device("cuda", 0)))
    with pytest.raises(NotImplementedError, match=r"^cula\.kda\.kda_prefill: no cuLA GPU kernel targets sm_80"):
        dispatch.select_backend(SimpleNamespace(device=torch.device("cuda", 0)))
