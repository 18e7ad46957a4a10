"""Dispatch: CPU → reference; the capability table; forced backends; clear NotImplementedError when none serves."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import cula_runtime.cute
from cula import dispatch
from cula.kda import kda_prefill
from cula_runtime.reference.kda_naive import kda_naive
from tests.helpers import rel_l2


def _inputs(dtype: torch.dtype = torch.float32, T: int = 90):
    gen = torch.Generator().manual_seed(7)
    B, H, HV, K, V = 1, 2, 4, 32, 32
    return dict(
        q=torch.randn(B, T, H, K, generator=gen).to(dtype), k=torch.randn(B, T, H, K, generator=gen).to(dtype),
        v=torch.randn(B, T, HV, V, generator=gen).to(dtype), g=torch.randn(B, T, HV, K, generator=gen).to(dtype),
        beta=torch.randn(B, T, HV, generator=gen), initial_state=torch.randn(2, HV, K, V, generator=gen),
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=torch.randn(HV, generator=gen),
        dt_bias=torch.randn(HV * K, generator=gen), cu_seqlens=torch.tensor([0, 70, T], dtype=torch.int32),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_call_runs_the_reference_and_matches_the_oracle(dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    kwargs = _inputs(dtype)
    o, ht = kda_prefill(**kwargs)
    o_ref, ht_ref = kda_naive(**kwargs)
    assert o.dtype == dtype and ht.dtype == torch.float32
    bound = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of o
    assert rel_l2(o, o_ref) < bound
    assert rel_l2(ht, ht_ref) < 1e-5


def test_final_state_is_none_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    kwargs = _inputs()
    kwargs["output_final_state"] = False
    assert kda_prefill(**kwargs)[1] is None


def _fake_cuda_args():
    return SimpleNamespace(device=torch.device("cuda", 0))


CHAINS = [((9, 0), ["sm90", "cutedsl", "reference"]), ((10, 0), ["cutedsl", "reference"]),
          ((10, 3), ["cutedsl", "reference"])]


@pytest.mark.parametrize("cap,expected", CHAINS, ids=["sm90", "sm100", "sm103"])
def test_supported_gpu_without_kernels_falls_back_to_reference_with_a_warning(cap, expected, monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: cap)
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda name: None)  # no cula_sm90, no CuTeDSL
    monkeypatch.setattr(dispatch, "_sm90_found", None)  # (as if neither had ever been found in this process)
    monkeypatch.setattr(cula_runtime.cute, "_found", False)
    choice = dispatch.explain(_fake_cuda_args())
    assert [d.backend for d in choice.decisions] == expected
    assert choice.gpu_fallback and choice.runner is not None
    assert "no GPU kernel accepted" in choice.summary
    with pytest.warns(dispatch.CulaFallbackWarning, match="torch reference on the GPU"):
        dispatch.select_backend(_fake_cuda_args())
    if cap == (9, 0):
        assert "pip install \"cula[sm90]\"" in choice.decisions[0].reason


def test_sm90_is_looked_up_until_found_then_never_again(monkeypatch) -> None:
    """The package lookup, version check and extension load of cula-sm90 cost microseconds on every Hopper call:
    they run until they succeed, then the found backend's verify answers alone. (A stand-in cula_sm90: CI has none.)"""
    lookups, loads = [], []

    def verify(args):
        return args.device.index == 0, "device 0 only"

    def run(args):
        return None

    shim = SimpleNamespace(__version__=dispatch.__version__, load_extension=lambda: loads.append(1))
    modules = {"cula_sm90": shim, "cula_sm90.kda": SimpleNamespace(verify_kda_prefill=verify, kda_prefill=run)}
    monkeypatch.setattr(dispatch, "_sm90_found", None)
    monkeypatch.setattr(dispatch.importlib, "import_module", modules.__getitem__)
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda name: lookups.append(name))
    decision, runner = dispatch._sm90(_fake_cuda_args())
    assert not decision.ok and runner is None and "not installed" in decision.reason and lookups == ["cula_sm90"]
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda name: lookups.append(name) or True)
    for index, ok in ((0, True), (1, False), (0, True)):
        decision, runner = dispatch._sm90(SimpleNamespace(device=torch.device("cuda", index)))
        assert decision.ok == ok and (runner is run) == ok
    assert lookups == ["cula_sm90", "cula_sm90"] and loads == [1]  # found on the second call; not asked again


def test_unsupported_gpu_raises_with_the_fix(monkeypatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    with pytest.raises(NotImplementedError, match="sm_80.*CULA_BACKEND=reference"):
        dispatch.select_backend(_fake_cuda_args())


@pytest.mark.parametrize("name,words", [("sm90", "cula-sm90"), ("cutedsl", "CuTeDSL")], ids=["sm90", "cutedsl"])
def test_forced_backend_that_cannot_serve_raises(name, words, monkeypatch) -> None:
    monkeypatch.setenv("CULA_BACKEND", name)
    monkeypatch.setattr(dispatch.importlib.util, "find_spec", lambda mod: None)
    monkeypatch.setattr(dispatch, "_sm90_found", None)
    monkeypatch.setattr(cula_runtime.cute, "_found", False)
    with pytest.raises(NotImplementedError, match=f"CULA_BACKEND={name}.*{words}"):
        kda_prefill(**_inputs())


def test_forced_reference_runs(monkeypatch) -> None:
    monkeypatch.setenv("CULA_BACKEND", "reference")
    o, _ = kda_prefill(**_inputs())
    assert torch.isfinite(o).all()


def test_unknown_forced_backend_is_a_value_error(monkeypatch) -> None:
    monkeypatch.setenv("CULA_BACKEND", "triton")
    with pytest.raises(ValueError, match="CULA_BACKEND"):
        kda_prefill(**_inputs())


def test_info_command_explains_the_choice() -> None:
    env = {key: value for key, value in os.environ.items() if key != "CULA_BACKEND"}
    out = subprocess.run([sys.executable, "-m", "cula", "info"], capture_output=True, text=True, check=True,
                         env=env).stdout
    for words in ("cula-runtime", "torch", "nvidia-cutlass-dsl", "picks:", "reference", "cutedsl", "sm90",
                  "gate forms", "softplus gate in kernel (Kimi-Linear): unbounded-gate kernels",
                  "kda_decode: CPU tensors run on the torch reference backend", "lightning_prefill: ",
                  "lightning_decode: "):
        assert words in out, out


@pytest.mark.parametrize("cap,accepted", [((9, 0), True), ((10, 0), True), ((10, 3), True), ((8, 0), False),
                                          ((12, 0), False)], ids=["sm90", "sm100", "sm103", "sm80", "sm120"])
def test_cutedsl_backend_serves_its_targets_only(cap, accepted, monkeypatch) -> None:
    """The CuTeDSL backend takes bf16 K=V=128 calls on sm_90/sm_100/sm_103 and says why it refuses the rest (a CPU
    tensor, another GPU, fp16, K=64)."""
    from cula_runtime.cute import is_available
    from cula_runtime.cute.kda import backend
    from cula_runtime.kda_args import validate_kda_prefill

    if not is_available():
        pytest.skip("CuTeDSL / TVM-FFI not installed")
    args = validate_kda_prefill(**_inputs(torch.bfloat16), safe_gate=True)
    ok, reason = backend.verify(args)
    assert not ok and "CUDA" in reason  # CPU tensors
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    on_gpu = SimpleNamespace(**{**fields, "K": 128, "V": 128}, device=torch.device("cuda", 0))
    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: cap)  # the backend's cached query
    ok, reason = backend.verify(on_gpu)
    assert ok is accepted, reason
    if not accepted:
        assert f"sm_{cap[0]}{cap[1]}" in reason
        return
    for change, words in ((dict(q=args.q.half()), "bf16"), (dict(K=64), "K = V = 128")):
        ok, reason = backend.verify(SimpleNamespace(**{**vars(on_gpu), **change}))
        assert not ok and words in reason, reason
    # every unbounded gate form too (the intra kernel's unbounded form): a precomputed fp32 or bf16 g without
    # safe_gate, the in-kernel softplus form, the lower-bound form below -5; β as values or logits, 2 sigmoid(β)
    from cula_runtime.kda_args import gate_is_bounded

    precomputed = dict(use_gate_in_kernel=False, safe_gate=False, lower_bound=None, A_log=None, dt_bias=None)
    for change in (precomputed, dict(precomputed, g=args.g.bfloat16()),
                   dict(lower_bound=None, safe_gate=False), dict(lower_bound=None, dt_bias=None),
                   dict(lower_bound=-12.0),
                   dict(precomputed, allow_neg_eigval=True),
                   dict(precomputed, use_beta_sigmoid_in_kernel=False, beta=args.beta.bfloat16())):
        unbounded = SimpleNamespace(**{**vars(on_gpu), **change})
        assert not gate_is_bounded(unbounded), change
        ok, reason = backend.verify(unbounded)
        assert ok, (change, reason)
