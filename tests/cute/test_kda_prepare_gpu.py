"""The CuTeDSL KdaPrepare kernel on a GPU, against the float64 reference preprocessing (KDA_SPEC.md §2, §3.1, §4).

Fresh random inputs; outputs preallocated and poisoned with NaN (an element the kernel misses stays NaN); fixed
length with a tail chunk and T < 64; varlen with tails, a zero-length sequence and a padding row of the chunk
indices; GVA (HV = 2H and more); all three gate forms; bf16 and fp32 beta; K in {64, 128, 256}. Bounds: q_hat and
k_hat within one bf16 ulp of the float64 result rounded to bf16; g_cum and beta within 1e-6 relative L2 of float64;
100 replays bit-identical; one compilation serves every T.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from cula_runtime import cute as cula_cute
from cula_runtime.reference.preprocess import kda_beta, kda_gate, l2norm
from tests.helpers import rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not cula_cute.is_available(), reason='CuTeDSL or TVM-FFI is missing (pip install "cula-runtime[cute]")'
    ),
]

C = 64
CASES = {
    "B2-T200-H2-HV4-K128-safe-betaf32": dict(B=2, T=200, H=2, HV=4, K=128, cu=None, gate="safe", beta=torch.float32),
    "B1-T63-H4-HV4-K128-softplus-betabf16-negeig": dict(B=1, T=63, H=4, HV=4, K=128, cu=None, gate="softplus",
                                                        beta=torch.bfloat16, neg_eig=True),
    "varlen-0-100-100-228-H2-HV4-K128-safe-noAlog": dict(B=1, T=228, H=2, HV=4, K=128, cu=[0, 100, 100, 228],
                                                        gate="safe", A_log=False, beta=torch.float32, pad_row=True),
    "varlen-0-1-64-65-300-H2-HV8-K128-rawgate-gbf16": dict(B=1, T=300, H=2, HV=8, K=128, cu=[0, 1, 64, 65, 300],
                                                          gate="none", g=torch.bfloat16, beta=torch.bfloat16,
                                                          sigmoid=False),
    "B3-T130-H1-HV2-K64-softplus-nol2norm": dict(B=3, T=130, H=1, HV=2, K=64, cu=None, gate="softplus",
                                                 beta=torch.float32, l2norm=False),
    "varlen-0-15-100-300-H1-HV2-K256-safe": dict(B=1, T=300, H=1, HV=2, K=256, cu=[0, 15, 100, 300], gate="safe",
                                                 beta=torch.float32),
}


def _inputs(case: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV, K = case["B"], case["T"], case["H"], case["HV"], case["K"]

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device="cuda", dtype=dtype)

    gate = case["gate"]
    if gate == "none":  # an already activated log-gate (<= 0)
        g = -torch.nn.functional.softplus(randn(B, T, HV, K)).to(case.get("g", torch.float32))
    else:
        g = randn(B, T, HV, K, dtype=case.get("g", torch.float32))
    use_A_log = gate != "none" and case.get("A_log", True)
    return dict(
        q=randn(B, T, H, K, dtype=torch.bfloat16),
        k=randn(B, T, H, K, dtype=torch.bfloat16),
        g=g,
        beta=randn(B, T, HV, dtype=case["beta"]),
        A_log=torch.log(torch.empty(HV).uniform_(1, 16, generator=gen)).cuda() if use_A_log else None,
        dt_bias=randn(HV * K) if gate != "none" else None,
        lower_bound=-5.0 if gate == "safe" else None,
        use_qk_l2norm_in_kernel=case.get("l2norm", True),
        use_gate_in_kernel=gate != "none",
        use_beta_sigmoid_in_kernel=case.get("sigmoid", True),
        allow_neg_eigval=case.get("neg_eig", False),
        cu_seqlens=None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32, device="cuda"),
    )


def _chunk_indices(case: dict, cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    if cu_seqlens is None:
        return None
    from cula_runtime.index import prepare_chunk_indices

    rows = prepare_chunk_indices(cu_seqlens, C)
    if case.get("pad_row"):  # a CUDA-graph padding row: sequence id -1, which the kernel skips
        rows = torch.cat([rows, torch.tensor([[-1, 0]], dtype=rows.dtype, device=rows.device)])
    return rows


def _poisoned_outputs(inp: dict) -> tuple:
    q, g = inp["q"], inp["g"]
    B, T, HV, K = g.shape
    nan = float("nan")
    qk = (torch.full_like(q, nan), torch.full_like(q, nan)) if inp["use_qk_l2norm_in_kernel"] else (None, None)
    return (*qk, torch.full((B, T, HV, K), nan, device="cuda"), torch.full((B, T, HV), nan, device="cuda"))


def _reference(inp: dict) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """float64 on the CPU: l2norm, gate activation, chunk-local cumsum (restarting at every sequence) / ln 2, beta."""
    f64 = torch.float64
    q, k, g, beta = (inp[name].cpu().to(f64) for name in ("q", "k", "g", "beta"))
    q_hat = l2norm(q) if inp["use_qk_l2norm_in_kernel"] else None
    k_hat = l2norm(k) if inp["use_qk_l2norm_in_kernel"] else None
    if inp["use_gate_in_kernel"]:
        A_log = None if inp["A_log"] is None else inp["A_log"].cpu().to(f64)
        g = kda_gate(g, A_log=A_log, dt_bias=inp["dt_bias"].cpu().to(f64), lower_bound=inp["lower_bound"])
    B, T = g.shape[:2]
    cu = inp["cu_seqlens"]
    spans = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in itertools.pairwise(cu.tolist())]
    g_cum = torch.zeros_like(g)
    for b, bos, eos in spans:
        for start in range(bos, eos, C):
            g_cum[b, start : min(start + C, eos)] = g[b, start : min(start + C, eos)].cumsum(0)
    g_cum = g_cum / math.log(2.0)
    if inp["use_beta_sigmoid_in_kernel"]:
        beta = kda_beta(beta, allow_neg_eigval=inp["allow_neg_eigval"])
    return q_hat, k_hat, g_cum, beta


def _bf16_ulps(out: torch.Tensor, ref_bf16: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps (both tensors bf16 with matching signs; sign-magnitude bit patterns)."""
    assert torch.equal(torch.signbit(out), torch.signbit(ref_bf16))
    return (out.view(torch.int16).int() - ref_bf16.view(torch.int16).int()).abs()


def _run(inp: dict, chunk_indices: torch.Tensor | None, out: tuple | None = None) -> tuple:
    from cula_runtime.cute.kda.prepare import kda_prepare

    return kda_prepare(**inp, chunk_indices=chunk_indices, out=out)


@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_float64_reference(case_id: str) -> None:
    case = CASES[case_id]
    inp = _inputs(case, seed=zlib.crc32(case_id.encode()))
    chunk_indices = _chunk_indices(case, inp["cu_seqlens"])
    out = _poisoned_outputs(inp)
    q_hat, k_hat, g_cum, beta = _run(inp, chunk_indices, out)
    torch.cuda.synchronize()
    assert g_cum is out[2] and beta is out[3]
    ref_q, ref_k, ref_g, ref_beta = _reference(inp)

    for name, got in (("q_hat", q_hat), ("k_hat", k_hat), ("g_cum", g_cum), ("beta", beta)):
        assert torch.isfinite(got).all(), f"{name}: elements left unwritten (NaN poison) or non-finite"
    if inp["use_qk_l2norm_in_kernel"]:
        for got, ref in ((q_hat, ref_q), (k_hat, ref_k)):
            assert got.dtype == torch.bfloat16
            ulps = _bf16_ulps(got.cpu(), ref.to(torch.bfloat16))
            assert ulps.max() <= 1, f"max {int(ulps.max())} bf16 ulps from the float64 result"
            assert (ulps == 0).float().mean() > 0.99
    else:
        assert q_hat is inp["q"] and k_hat is inp["k"]
    assert g_cum.dtype == torch.float32 and beta.dtype == torch.float32
    assert rel_l2(g_cum.cpu(), ref_g) < 1e-6
    if inp["use_beta_sigmoid_in_kernel"]:
        assert rel_l2(beta.cpu(), ref_beta) < 1e-6
    else:
        assert torch.equal(beta.cpu(), inp["beta"].cpu().float())


def test_replays_are_bit_identical() -> None:
    case = CASES["varlen-0-100-100-228-H2-HV4-K128-safe-noAlog"]
    inp = _inputs(case, seed=7)
    chunk_indices = _chunk_indices(case, inp["cu_seqlens"])
    first = [t.clone() for t in _run(inp, chunk_indices)]
    for _ in range(100):
        again = _run(inp, chunk_indices)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_one_compilation_serves_every_length() -> None:
    from cula_runtime.cute import compile_cache

    compile_cache.clear_cache()
    case = dict(CASES["B2-T200-H2-HV4-K128-safe-betaf32"])
    for T in (200, 1000, 64, 1):
        inp = _inputs({**case, "T": T}, seed=T)
        _, _, g_cum, _ = _run(inp, None)
        assert rel_l2(g_cum.cpu(), _reference(inp)[2]) < 1e-6
    varlen = CASES["varlen-0-1-64-65-300-H2-HV8-K128-rawgate-gbf16"]
    for cu in ([0, 1, 64, 65, 300], [0, 300], [0, 0, 7, 300]):
        inp = _inputs({**varlen, "cu": cu}, seed=len(cu))
        _, _, g_cum, _ = _run(inp, None)
        assert rel_l2(g_cum.cpu(), _reference(inp)[2]) < 1e-6
    info = compile_cache.cache_info()
    assert (info.misses, info.size) == (2, 2), info  # one fixed-length and one varlen binary


def test_runs_on_the_current_stream() -> None:
    case = CASES["B2-T200-H2-HV4-K128-safe-betaf32"]
    inp = _inputs(case, seed=3)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        _, _, g_cum, _ = _run(inp, None)
    stream.synchronize()
    assert rel_l2(g_cum.cpu(), _reference(inp)[2]) < 1e-6
