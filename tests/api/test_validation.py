"""Every bad kda_prefill argument raises TypeError/ValueError naming the argument, before any backend runs."""

from __future__ import annotations

import pytest
import torch

from cula.kda import kda_prefill
from cula_runtime.kda_args import validate_kda_prefill

B, T, H, HV, K, V = 2, 70, 2, 4, 32, 16


def valid(**overrides) -> dict:
    gen = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    kwargs = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=-torch.rand(B, T, HV, K, generator=gen),
                  beta=torch.rand(B, T, HV, generator=gen))
    kwargs.update(overrides)
    return kwargs


def varlen(**overrides) -> dict:
    base = valid()
    packed = {name: base[name][:1] for name in ("q", "k", "v", "g", "beta")}
    packed["cu_seqlens"] = torch.tensor([0, 30, 30, T], dtype=torch.int32)
    packed.update(overrides)
    return packed


def gate_in_kernel(**overrides) -> dict:
    kwargs = valid(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K))
    kwargs.update(overrides)
    return kwargs


BAD = {
    # name: (kwargs, exception, words that must appear in the message)
    "q-not-tensor": (valid(q=[1.0]), TypeError, ["q", "torch.Tensor"]),
    "q-3d": (valid(q=torch.randn(B, T, K)), ValueError, ["q", "[B, T, H, K]"]),
    "k-shape": (valid(k=torch.randn(B, T, H, K + 1)), ValueError, ["k", f"[{B}, {T}, {H}, {K}]"]),
    "v-batch": (valid(v=torch.randn(B, T + 1, HV, V)), ValueError, ["v", f"T={T}"]),
    "hv-not-multiple": (valid(v=torch.randn(B, T, 3, V), g=-torch.rand(B, T, 3, K), beta=torch.rand(B, T, 3)),
                        ValueError, ["HV=3", f"H={H}"]),
    "K-too-big": (valid(q=torch.randn(B, T, H, 300), k=torch.randn(B, T, H, 300), g=-torch.rand(B, T, HV, 300)),
                  ValueError, ["K", "256"]),
    "g-shape": (valid(g=-torch.rand(B, T, H, K)), ValueError, ["g", f"[{B}, {T}, {HV}, {K}]"]),
    "beta-shape": (valid(beta=torch.rand(B, T, H)), ValueError, ["beta", f"[{B}, {T}, {HV}]"]),
    "q-int": (valid(q=torch.ones(B, T, H, K, dtype=torch.int32)), TypeError, ["q", "dtype"]),
    "k-dtype-mismatch": (valid(k=torch.randn(B, T, H, K, dtype=torch.bfloat16)), TypeError, ["k", "float32"]),
    "beta-int": (valid(beta=torch.ones(B, T, HV, dtype=torch.int64)), TypeError, ["beta", "dtype"]),
    "scale-negative": (valid(scale=-1.0), ValueError, ["scale"]),
    "scale-str": (valid(scale="0.1"), TypeError, ["scale"]),
    "flag-not-bool": (valid(output_final_state=1), TypeError, ["output_final_state", "bool"]),
    "cu-int64": (varlen(cu_seqlens=torch.tensor([0, 30, T])), TypeError, ["cu_seqlens", "torch.int32"]),
    "cu-decreasing": (varlen(cu_seqlens=torch.tensor([0, 40, 30, T], dtype=torch.int32)), ValueError,
                      ["cu_seqlens", "non-decreasing"]),
    "cu-last-not-T": (varlen(cu_seqlens=torch.tensor([0, 30, T - 1], dtype=torch.int32)), ValueError,
                      ["cu_seqlens[-1]", f"T={T}"]),
    "cu-first-not-0": (varlen(cu_seqlens=torch.tensor([5, 30, T], dtype=torch.int32)), ValueError,
                       ["cu_seqlens[0]", "0"]),
    "cu-2d": (varlen(cu_seqlens=torch.tensor([[0, T]], dtype=torch.int32)), ValueError, ["cu_seqlens", "1-D"]),
    "cu-batch-2": (valid(cu_seqlens=torch.tensor([0, 30, T], dtype=torch.int32)), ValueError, ["B must be 1"]),
    "h0-wrong-N": (valid(initial_state=torch.zeros(B + 1, HV, K, V)), ValueError,
                   ["initial_state", f"[{B}, {HV}, {K}, {V}]"]),
    "h0-varlen-N": (varlen(initial_state=torch.zeros(1, HV, K, V)), ValueError, ["initial_state", f"[3, {HV}"]),
    "h0-layout": (valid(initial_state=torch.zeros(B, HV, K, V), state_v_first=True), ValueError,
                  ["initial_state", f"[{B}, {HV}, {V}, {K}]", "state_v_first=True"]),
    "h0-dtype": (valid(initial_state=torch.zeros(B, HV, K, V, dtype=torch.float16)), TypeError,
                 ["initial_state", "dtype"]),
    "gate-no-A_log": (valid(use_gate_in_kernel=True), ValueError, ["A_log", "lower_bound"]),
    "A_log-shape": (gate_in_kernel(A_log=torch.zeros(H)), ValueError, ["A_log", f"[{HV}]"]),
    "dt_bias-size": (gate_in_kernel(dt_bias=torch.zeros(HV)), ValueError, ["dt_bias", f"[{HV * K}]"]),
    "safe-gate-no-lower-bound": (gate_in_kernel(safe_gate=True), ValueError, ["safe_gate", "lower_bound"]),
    "safe-gate-lower-bound-too-low": (gate_in_kernel(safe_gate=True, lower_bound=-6.0), ValueError,
                                      ["lower_bound", "[-5, 0)"]),
    "lower-bound-positive": (gate_in_kernel(lower_bound=1.0), ValueError, ["lower_bound", "negative"]),
    "lower-bound-unused": (valid(lower_bound=-5.0), ValueError, ["lower_bound", "use_gate_in_kernel"]),
    "A_log-unused": (valid(A_log=torch.zeros(HV)), ValueError, ["A_log", "use_gate_in_kernel"]),
    "neg-eigval-without-sigmoid": (valid(allow_neg_eigval=True), ValueError,
                                   ["allow_neg_eigval", "use_beta_sigmoid_in_kernel"]),
    "device-mismatch": (valid(initial_state=torch.zeros(B, HV, K, V, device="meta")), ValueError,
                        ["initial_state", "device"]),
    "cu-cpu-without-cu": (valid(cu_seqlens_cpu=torch.tensor([0, T], dtype=torch.int32)), ValueError,
                          ["cu_seqlens_cpu", "pass cu_seqlens"]),
    "cu-cpu-not-tensor": (varlen(cu_seqlens_cpu=[0, 30, 30, T]), TypeError, ["cu_seqlens_cpu", "torch.Tensor"]),
    "cu-cpu-not-on-cpu": (varlen(cu_seqlens_cpu=torch.zeros(4, dtype=torch.int32, device="meta")), ValueError,
                          ["cu_seqlens_cpu", "CPU tensor", "meta"]),
    "cu-cpu-int64": (varlen(cu_seqlens_cpu=torch.tensor([0, 30, 30, T])), TypeError, ["cu_seqlens_cpu", "int32"]),
    "cu-cpu-shape": (varlen(cu_seqlens_cpu=torch.tensor([0, 30, T], dtype=torch.int32)), ValueError,
                     ["cu_seqlens_cpu", "shape of cu_seqlens", "[4]", "[3]"]),
    "cu-cpu-decreasing": (varlen(cu_seqlens_cpu=torch.tensor([0, 40, 30, T], dtype=torch.int32)), ValueError,
                          ["cu_seqlens_cpu", "non-decreasing"]),
    "cu-cpu-last-not-T": (varlen(cu_seqlens_cpu=torch.tensor([0, 30, 30, T + 1], dtype=torch.int32)), ValueError,
                          ["cu_seqlens_cpu", f"T={T}"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_argument_is_rejected_with_its_name(case: str) -> None:
    kwargs, exc, words = BAD[case]
    with pytest.raises(exc) as info:
        kda_prefill(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize("make", [valid, varlen, gate_in_kernel], ids=["fixed", "varlen", "gate-in-kernel"])
def test_valid_arguments_pass(make) -> None:
    args = validate_kda_prefill(**make())
    assert (args.H, args.HV, args.K, args.V) == (H, HV, K, V)
    assert args.scale == pytest.approx(K**-0.5)


def test_non_contiguous_inputs_are_made_contiguous_and_give_the_same_answer() -> None:
    kwargs = valid()
    strided = dict(kwargs)
    strided["q"] = torch.randn(B, T, K, H).transpose(2, 3).copy_(kwargs["q"])
    strided["v"] = torch.randn(B, HV, T, V).transpose(1, 2).copy_(kwargs["v"])
    assert not strided["q"].is_contiguous() and not strided["v"].is_contiguous()
    args = validate_kda_prefill(**strided)
    assert args.q.is_contiguous() and args.v.is_contiguous()
    o_strided, _ = kda_prefill(**strided)
    o_dense, _ = kda_prefill(**kwargs)
    assert torch.equal(o_strided, o_dense)


def test_cu_seqlens_is_rechecked_after_an_in_place_update() -> None:
    kwargs = varlen()
    validate_kda_prefill(**kwargs)
    kwargs["cu_seqlens"][1] = 50
    kwargs["cu_seqlens"][2] = 40  # now decreasing: the cached "ok" must not be reused
    with pytest.raises(ValueError, match="non-decreasing"):
        validate_kda_prefill(**kwargs)


def _kernel_args(**overrides):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 70, 2, 128, generator=gen).bfloat16()
    kwargs = dict(q=q, k=q.clone(), v=torch.randn(1, 70, 2, 128, generator=gen).bfloat16(),
                  g=torch.randn(1, 70, 2, 128, generator=gen), beta=torch.rand(1, 70, 2, generator=gen),
                  use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=torch.zeros(2))
    kwargs.update(overrides)
    return validate_kda_prefill(**kwargs)


def test_gpu_kernel_rejection_names_each_unsupported_feature() -> None:
    from cula_runtime.kda_args import gpu_kernel_rejection

    assert gpu_kernel_rejection(_kernel_args()) is None
    q32 = torch.randn(1, 70, 2, 128)
    cases = {
        "bf16": _kernel_args(q=q32, k=q32.clone(), v=torch.randn(1, 70, 2, 128)),
        "g in fp32 or bf16": _kernel_args(g=torch.randn(1, 70, 2, 128).half()),
    }
    for words, args in cases.items():
        reason = gpu_kernel_rejection(args)
        assert reason is not None and words in reason, (words, reason)
    assert "K = V = 64" in gpu_kernel_rejection(_kernel_args(), head_dim=64)
    # every gate form passes: which kernel form serves it is gate_is_bounded's answer
    for overrides in ({"safe_gate": False, "lower_bound": None}, {"safe_gate": False, "lower_bound": -40.0},
                      {"use_gate_in_kernel": False, "A_log": None, "safe_gate": False, "lower_bound": None}):
        assert gpu_kernel_rejection(_kernel_args(**overrides)) is None, overrides


def test_gate_is_bounded_for_each_gate_form() -> None:
    from cula_runtime.kda_args import gate_is_bounded

    bounded = [
        {},  # in kernel, safe_gate, lower_bound -5
        {"safe_gate": False, "lower_bound": -3.0},  # the lower-bound form inside [-5, 0) without the promise
        {"use_gate_in_kernel": False, "A_log": None},  # precomputed g, safe_gate=True, lower_bound -5
        {"use_gate_in_kernel": False, "A_log": None, "lower_bound": None},  # precomputed, safe_gate=True
    ]
    unbounded = [
        {"safe_gate": False, "lower_bound": None},  # in-kernel softplus (Kimi-Linear)
        {"safe_gate": False, "lower_bound": -5.5},  # the lower-bound form below -5
        {"use_gate_in_kernel": False, "A_log": None, "safe_gate": False, "lower_bound": None},  # precomputed
        {"use_gate_in_kernel": False, "A_log": None, "lower_bound": -6.0},  # safe_gate with a bound below -5
    ]
    for overrides in bounded:
        assert gate_is_bounded(_kernel_args(**overrides)), overrides
    for overrides in unbounded:
        assert not gate_is_bounded(_kernel_args(**overrides)), overrides


def test_cu_seqlens_cpu_is_checked_in_place_of_cu_seqlens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With cu_seqlens_cpu the validator checks that copy and never copies cu_seqlens to the host (on a GPU: no
    synchronisation); the backends get the checked copy as ``cu_seqlens_host`` and give the same answer."""
    from cula_runtime import kda_args

    kwargs = varlen()
    copied = []
    real = kda_args.checked_cu_seqlens_host

    def spy(cu, T_):
        copied.append(cu)
        return real(cu, T_)

    monkeypatch.setattr(kda_args, "checked_cu_seqlens_host", spy)
    cpu = kwargs["cu_seqlens"].clone()
    args = validate_kda_prefill(**kwargs, cu_seqlens_cpu=cpu)
    assert len(copied) == 1 and copied[0] is cpu  # never cu_seqlens itself
    assert args.cu_seqlens_host.tolist() == [0, 30, 30, T] and args.cu_seqlens is kwargs["cu_seqlens"]
    o, ht = kda_prefill(**kwargs, cu_seqlens_cpu=cpu, output_final_state=True)
    o_ref, ht_ref = kda_prefill(**kwargs, output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


def test_numpy_scalars_are_taken_as_numbers_and_named_as_numpy_types() -> None:
    """A NumPy float for ``scale`` / ``lower_bound`` is a number (the same result as the Python float); a NumPy bool
    for a flag is refused, and the message names it as NumPy's type (not as a bare ``bool``)."""
    np = pytest.importorskip("numpy")
    args = validate_kda_prefill(**gate_in_kernel(scale=np.float32(0.5), lower_bound=np.float64(-4.0)))
    assert args.scale == 0.5 and type(args.scale) is float and args.lower_bound == -4.0
    o_np, _ = kda_prefill(**valid(scale=np.float32(0.25)))
    o_py, _ = kda_prefill(**valid(scale=0.25))
    assert torch.equal(o_np, o_py)
    with pytest.raises(TypeError, match=r"^safe_gate must be a bool, got numpy\.bool_?$"):
        kda_prefill(**valid(safe_gate=np.bool_(True)))
    with pytest.raises(TypeError, match=r"^scale must be a float or None \(default K\*\*-0\.5\), got numpy\.bool_?$"):
        kda_prefill(**valid(scale=np.bool_(True)))
    with pytest.raises(TypeError, match=r"^q must be a torch\.Tensor, got numpy\.ndarray$"):
        kda_prefill(**valid(q=np.zeros(3)))
