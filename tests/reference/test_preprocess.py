"""Tests of the KDA input preprocessing (KDA_SPEC §2) and GVA head order (§1.1)."""

from __future__ import annotations

import math

import pytest
import torch

from cula_runtime.reference.preprocess import (
    expand_qk_heads,
    kda_beta,
    kda_gate,
    l2norm,
    merge_sequences,
    prepare_kda_inputs,
    split_sequences,
    validate_cu_seqlens,
)


def _softplus_exact(x: float) -> float:
    """torch softplus semantics: log(1 + e^x) for x <= 20, x above."""
    return x if x > 20.0 else math.log1p(math.exp(x))


def test_l2norm_eps_inside_sqrt() -> None:
    x = torch.zeros(2, 8, dtype=torch.float64)
    x[0, 0] = 1e-3  # sum of squares 1e-6 = eps: x / sqrt(2e-6) = 1/sqrt(2)
    x[1] = torch.arange(1, 9, dtype=torch.float64)
    out = l2norm(x)
    assert out[0, 0].item() == pytest.approx(1.0 / math.sqrt(2.0), rel=1e-12)
    # eps added to the norm instead would give 1e-3 / (1e-3 + 1e-6) ~ 0.999
    assert abs(out[0, 0].item() - 1e-3 / (1e-3 + 1e-6)) > 0.1
    expected = x[1] / math.sqrt(float((x[1] ** 2).sum()) + 1e-6)
    torch.testing.assert_close(out[1], expected, rtol=1e-14, atol=0)


def test_l2norm_random_and_dtype() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, 16)
    out = l2norm(x)
    assert out.dtype == torch.float32
    ref = x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-7)
    assert l2norm(x.bfloat16()).dtype == torch.float32
    assert l2norm(x.double()).dtype == torch.float64


def test_gate_softplus_form_matches_loop() -> None:
    torch.manual_seed(1)
    B, T, HV, K = 2, 3, 3, 5
    g_raw = torch.randn(B, T, HV, K, dtype=torch.float64) * 4
    A_log = torch.randn(HV, dtype=torch.float64)
    dt_bias = torch.randn(HV * K, dtype=torch.float64)
    out = kda_gate(g_raw, A_log=A_log, dt_bias=dt_bias)
    for b in range(B):
        for t in range(T):
            for hv in range(HV):
                for kk in range(K):
                    x = float(g_raw[b, t, hv, kk]) + float(dt_bias[hv * K + kk])
                    ref = -math.exp(float(A_log[hv])) * _softplus_exact(x)
                    assert out[b, t, hv, kk].item() == pytest.approx(ref, rel=1e-12, abs=1e-300)
    # dt_bias given as [HV, K] is the same thing
    torch.testing.assert_close(kda_gate(g_raw, A_log=A_log, dt_bias=dt_bias.view(HV, K)), out, rtol=0, atol=0)


def test_gate_softplus_threshold_20() -> None:
    x = torch.tensor([19.5, 20.0, 20.5, 25.0, -30.0], dtype=torch.float64).view(1, 1, 1, 5)
    out = kda_gate(x, A_log=torch.zeros(1, dtype=torch.float64))
    # above 20 softplus is exactly x; at or below it is log1p(exp(x)) (which differs from x by ~1e-9 at 20.5)
    assert out[0, 0, 0, 2].item() == -20.5
    assert out[0, 0, 0, 3].item() == -25.0
    assert out[0, 0, 0, 0].item() == pytest.approx(-math.log1p(math.exp(19.5)), rel=1e-15)
    assert out[0, 0, 0, 0].item() != -19.5
    assert out[0, 0, 0, 4].item() == pytest.approx(-math.log1p(math.exp(-30.0)), rel=1e-12)
    assert out[0, 0, 0, 4].item() < 0


def test_gate_safe_form_with_and_without_A_log() -> None:
    torch.manual_seed(2)
    HV, K = 4, 6
    g_raw = torch.randn(2, 7, HV, K, dtype=torch.float64) * 3
    A_log = torch.randn(HV, dtype=torch.float64)
    dt_bias = torch.randn(HV, K, dtype=torch.float64)
    x = g_raw + dt_bias
    out = kda_gate(g_raw, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    ref = -5.0 * torch.sigmoid(torch.exp(A_log).view(HV, 1) * x)
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=0)
    assert bool((out < 0).all()) and bool((out > -5.0).all())

    # A_log None: the multiplier is exactly 1 (not exp(1))
    out_none = kda_gate(g_raw, A_log=None, dt_bias=dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(out_none, -5.0 * torch.sigmoid(x), rtol=1e-14, atol=0)
    assert (out_none - (-5.0 * torch.sigmoid(math.e * x))).abs().max().item() > 1e-2
    # A_log = 0 is the same as A_log None
    torch.testing.assert_close(kda_gate(g_raw, torch.zeros(HV, dtype=torch.float64), dt_bias, -5.0), out_none)


def test_gate_validation_and_dtype() -> None:
    g = torch.randn(1, 2, 2, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        kda_gate(g)  # softplus form needs A_log
    with pytest.raises(ValueError):
        kda_gate(g, A_log=torch.zeros(3))
    assert kda_gate(g, A_log=torch.zeros(2)).dtype == torch.float32


def test_beta_sigmoid_and_neg_eigval() -> None:
    torch.manual_seed(3)
    b = torch.randn(2, 9, 3, dtype=torch.float64) * 3
    torch.testing.assert_close(kda_beta(b), 1.0 / (1.0 + torch.exp(-b)), rtol=1e-14, atol=0)
    torch.testing.assert_close(kda_beta(b, allow_neg_eigval=True), 2.0 / (1.0 + torch.exp(-b)), rtol=1e-14, atol=0)
    assert float(kda_beta(b, allow_neg_eigval=True).max()) > 1.0
    out = kda_beta(b.bfloat16())
    assert out.dtype == torch.float32


@pytest.mark.parametrize("H,HV", [(1, 4), (2, 4), (2, 8), (3, 3)], ids=lambda x: str(x))
def test_gva_repeat_interleave_order(H: int, HV: int) -> None:
    torch.manual_seed(4)
    x = torch.randn(2, 5, H, 7)
    out = expand_qk_heads(x, HV)
    assert out.shape == (2, 5, HV, 7)
    G = HV // H
    for hv in range(HV):
        torch.testing.assert_close(out[:, :, hv], x[:, :, hv // G], rtol=0, atol=0)
    if 1 < H < HV:  # tiling (hv % H) would be a different tensor
        assert not torch.equal(out, x.repeat(1, 1, G, 1))


def test_gva_rejects_non_multiple() -> None:
    with pytest.raises(ValueError):
        expand_qk_heads(torch.zeros(1, 1, 2, 4), 3)


def test_prepare_kda_inputs_order_and_flags() -> None:
    torch.manual_seed(5)
    B, T, H, HV, K = 2, 6, 2, 4, 8
    q = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    g = torch.randn(B, T, HV, K, dtype=torch.bfloat16)
    beta = torch.randn(B, T, HV, dtype=torch.bfloat16)
    A_log = torch.randn(HV)
    dt_bias = torch.randn(HV * K)
    f64 = torch.float64
    qo, ko, go, bo = prepare_kda_inputs(
        q, k, g, beta, dtype=f64, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias,
    )  # fmt: skip
    assert all(t.dtype == f64 for t in (qo, ko, go, bo))
    torch.testing.assert_close(qo, l2norm(q.to(f64)), rtol=0, atol=0)
    torch.testing.assert_close(ko, l2norm(k.to(f64)), rtol=0, atol=0)
    torch.testing.assert_close(bo, 2.0 * torch.sigmoid(beta.to(f64)), rtol=0, atol=0)
    ref_g = -5.0 * torch.sigmoid(torch.exp(A_log.to(f64)).view(HV, 1) * (g.to(f64) + dt_bias.to(f64).view(HV, K)))
    torch.testing.assert_close(go, ref_g, rtol=1e-14, atol=0)

    # all flags off: inputs are only cast
    qo, ko, go, bo = prepare_kda_inputs(q, k, g, beta, dtype=torch.float32)
    assert torch.equal(qo, q.float()) and torch.equal(go, g.float()) and torch.equal(bo, beta.float())

    with pytest.raises(ValueError):
        prepare_kda_inputs(q, k, g, beta, dtype=f64, allow_neg_eigval=True)


def test_cu_seqlens_helpers() -> None:
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    assert validate_cu_seqlens(cu, 1, 7) == [0, 3, 3, 7]
    for bad, B, T in [([0, 3, 2, 7], 1, 7), ([1, 3, 7], 1, 7), ([0, 3, 6], 1, 7), ([0, 3, 7], 2, 7)]:
        with pytest.raises(ValueError):
            validate_cu_seqlens(torch.tensor(bad, dtype=torch.int32), B, T)
    with pytest.raises(TypeError, match="cu_seqlens"):
        validate_cu_seqlens(torch.tensor([0.0, 7.0]), 1, 7)
    x = torch.randn(1, 7, 2, 3)
    padded, lens = split_sequences(x, [0, 3, 3, 7])
    assert padded.shape == (3, 4, 2, 3) and lens.tolist() == [3, 0, 4]
    torch.testing.assert_close(padded[2, :4], x[0, 3:7], rtol=0, atol=0)
    assert float(padded[0, 3:].abs().sum()) == 0.0
    torch.testing.assert_close(merge_sequences(padded, [0, 3, 3, 7]), x, rtol=0, atol=0)
