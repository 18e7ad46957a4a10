"""The CuTeDSL KDA chunk-intra kernel (``chunk_kda_fwd_intra_from_raw``) on a GPU, against the float32 reference
``kda_fwd_intra`` on the reference preprocessing of the same raw inputs (KDA_SPEC.md §2, §3.1-3.4, §3.7, §3.8, §4).

Fresh random raw inputs (q/k L2-normalised in the kernel or already normalised; the safe gate from its raw input,
the softplus form, or an already activated log-gate in [-5, 0]; β as logits or activated; g and β bf16 or fp32);
the caching allocator poisoned with NaN beforehand (an element the kernel misses stays NaN); fixed length with tail
chunks and T < 64; varlen with tails, one-token sequences, a zero-length sequence and a padding row of the chunk
indices; GVA (HV = 2H, 4H). Bounds: relative L2 error <= 1e-2 for every bf16 output (the factored bf16 operands and
bf16 outputs cost about 3e-3), Aqk exactly zero above the diagonal; the decay rows ``g_last`` within 1e-6 relative L2
of the float64 cumulative gate; 100 replays bit-identical; a packed sequence's rows do not depend on its neighbours;
one compilation serves every length.

Unbounded gates (the kernel's unbounded form, ``KdaIntraConfig.unbounded``: the diagonal blocks by the levels split):
Kimi-Linear's ``-exp(A_log) softplus(g + dt_bias)`` with A_log up to ln 16, in the kernel or precomputed in fp32; an
extreme precomputed gate (channels at -50 and -1e4 per step, a chunk decaying fully on every channel); the
lower-bound form with lower_bound -12. The same bounds, every output finite, and Aqk also against a float64 pairwise
oracle.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from cula_runtime import cute as cula_cute
from cula_runtime.reference.kda_chunked import ChunkLayout, chunk_local_cumsum, kda_chunk_scores, kda_fwd_intra
from cula_runtime.reference.preprocess import kda_beta, kda_gate, l2norm
from tests.gpu_backends import poison_allocator
from tests.helpers import rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not cula_cute.is_available(),
        reason="CuTeDSL or TVM-FFI is missing (cula-runtime brings them on Linux x86_64/aarch64)",
    ),
]

C = 64
K = 128
NAMES = ("w", "u", "qg", "kg", "Aqk")
f32, bf16 = torch.float32, torch.bfloat16
CASES = {
    "B2-T200-H2-HV4-safe-fp32": dict(B=2, T=200, H=2, HV=4, cu=None),
    "B1-T63-H4-HV4-safe-bf16-noAlog": dict(B=1, T=63, H=4, HV=4, cu=None, g=bf16, beta=bf16, A_log=False),
    "B3-T64-H1-HV4-softplus-negeig": dict(B=3, T=64, H=1, HV=4, cu=None, form="softplus", neg_eig=True),
    "varlen-0-100-100-228-H2-HV4-safe-pad": dict(B=1, T=228, H=2, HV=4, cu=[0, 100, 100, 228], pad_row=True),
    "varlen-0-1-64-65-300-H1-HV2-safe-bf16": dict(B=1, T=300, H=1, HV=2, cu=[0, 1, 64, 65, 300], g=bf16,
                                                  dt_bias=False),
    "varlen-0-15-100-300-H2-HV4-none-nol2norm": dict(B=1, T=300, H=2, HV=4, cu=[0, 15, 100, 300], form="none",
                                                     l2norm=False, sigmoid=False, beta=bf16),
    "B2-T130-H2-HV8-none-bf16": dict(B=2, T=130, H=2, HV=8, cu=None, form="none", g=bf16),
}


def _inputs(case: dict, seed: int, gate_spread: float = 1.0) -> dict:
    """Keyword arguments of chunk_kda_fwd_intra_from_raw (on the GPU) for ``case``."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV = case["B"], case["T"], case["H"], case["HV"]
    form, l2norm_in_kernel, sigmoid = case.get("form", "safe"), case.get("l2norm", True), case.get("sigmoid", True)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if not l2norm_in_kernel:
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    if form == "none":  # an activated safe log-gate: every step in [-5, 0]
        g = -5.0 * torch.sigmoid(gate_spread * randn(B, T, HV, K))
    elif form == "kimi":  # Kimi-Linear's gate, activated in fp32 as an engine passes it: steps reach -30 and below
        A_log = torch.log(1.0 + 15.0 * torch.rand(HV, generator=gen))
        g = -A_log.exp()[:, None] * torch.nn.functional.softplus(randn(B, T, HV, K) + 0.5 * randn(HV, K))
    elif form == "extreme":
        g = -torch.rand(B, T, HV, K, generator=gen)
        channels = torch.rand(HV, K, generator=gen)
        g = torch.where(channels < 0.2, torch.full_like(g, -50.0), g)
        g = torch.where(channels > 0.9, torch.full_like(g, -1e4), g)
        g[:, 64:128] = -1e4  # every token of the second chunk decays fully, on every channel
    else:
        g = randn(B, T, HV, K)
    beta = randn(B, T, HV) if sigmoid else torch.sigmoid(randn(B, T, HV))
    gate = {}
    in_kernel = form in ("safe", "softplus", "softplus-kimi", "wide")
    if form == "safe":
        gate = dict(lower_bound=-5.0, A_log=0.5 * randn(HV) if case.get("A_log", True) else None)
    elif form == "wide":  # the lower-bound form below the safe gate's -5: unbounded
        gate = dict(lower_bound=-12.0, A_log=0.5 * randn(HV))
    elif form == "softplus":  # -exp(A_log) softplus(g + dt_bias): keep the steps small (|g| mostly below 5)
        gate = dict(lower_bound=None, A_log=-1.0 + 0.1 * randn(HV))
    elif form == "softplus-kimi":  # Kimi-Linear's A_log: exp(A_log) in [1, 16]
        gate = dict(lower_bound=None, A_log=torch.log(1.0 + 15.0 * torch.rand(HV, generator=gen)))
    if in_kernel and case.get("dt_bias", True):
        gate["dt_bias"] = 0.5 * randn(HV * K)
    if not in_kernel:
        gate["safe_gate"] = form == "none"
    cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32)
    inp = dict(q=q.to(bf16), k=k.to(bf16), v=randn(B, T, HV, K).to(bf16), g=g.to(case.get("g", f32)),
               beta=beta.to(case.get("beta", f32)), scale=K**-0.5, cu_seqlens=cu,
               use_qk_l2norm_in_kernel=l2norm_in_kernel, use_gate_in_kernel=in_kernel,
               use_beta_sigmoid_in_kernel=sigmoid, allow_neg_eigval=case.get("neg_eig", False), **gate)
    return {name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in inp.items()}


def _chunk_indices(case: dict, cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    if cu_seqlens is None:
        return None
    from cula_runtime.index import prepare_chunk_indices

    rows = prepare_chunk_indices(cu_seqlens, C)
    if case.get("pad_row"):  # a CUDA-graph padding row: sequence id -1, which the kernel skips
        rows = torch.cat([rows, torch.tensor([[-1, 0]], dtype=rows.dtype, device=rows.device)])
    return rows


def _run(inp: dict, chunk_indices=None) -> dict:
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra_from_raw

    out = chunk_kda_fwd_intra_from_raw(**inp, chunk_indices=chunk_indices)
    return dict(zip((*NAMES, "g_last"), out, strict=True))


def _activated_gate(cpu: dict, dtype: torch.dtype) -> torch.Tensor:
    """The per-step log-gate of the raw inputs in ``dtype`` (at least float32)."""
    g = cpu["g"].to(dtype)
    if not cpu["use_gate_in_kernel"]:
        return g
    A_log, dt_bias = (None if cpu.get(n) is None else cpu[n].to(dtype) for n in ("A_log", "dt_bias"))
    return kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=cpu["lower_bound"])


def _reference(inp: dict) -> dict:
    """The float32 reference of the five bf16 outputs (on the preprocessed inputs, q/k rounded to bf16 after the L2
    norm as the kernel rounds them) and the float64 decay rows ``[NC, HV, K]`` in log2 units."""
    cpu = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in inp.items()}
    q, k = cpu["q"], cpu["k"]
    if cpu["use_qk_l2norm_in_kernel"]:
        q, k = l2norm(q).to(bf16), l2norm(k).to(bf16)
    beta = cpu["beta"].float()
    if cpu["use_beta_sigmoid_in_kernel"]:
        beta = kda_beta(beta, allow_neg_eigval=cpu["allow_neg_eigval"])
    cu = cpu["cu_seqlens"]
    g_cum = chunk_local_cumsum(_activated_gate(cpu, f32), C, cu, log2=True)
    out = kda_fwd_intra(q, k, cpu["v"], g_cum, beta, cpu["scale"], chunk_size=C, cu_seqlens=cu, g_cum_log2=True)
    ref = dict(zip(NAMES, out[:5], strict=True))
    B, T = q.shape[:2]
    layout = ChunkLayout.build(B, T, cu, C, "cpu")
    gamma = layout.to_chunks(_activated_gate(cpu, torch.float64)).cumsum(2) / math.log(2.0)
    ref["g_last"] = layout.last_rows(gamma)
    return ref


def _local_index(case: dict) -> torch.Tensor:
    """[B, T] index of every token within its chunk (chunks restart at every sequence start)."""
    B, T = case["B"], case["T"]
    if case["cu"] is None:
        return (torch.arange(T) % C).expand(B, T)
    local = torch.empty(1, T, dtype=torch.long)
    for bos, eos in itertools.pairwise(case["cu"]):
        local[0, bos:eos] = torch.arange(eos - bos) % C
    return local


def _check(case: dict, got: dict, ref: dict, bound: float = 1e-2) -> None:
    local = _local_index(case)[:, :, None, None]  # [B, T, 1, 1]
    cols = torch.arange(C)[None, None, None, :]
    for name in NAMES:
        out = got[name].cpu()
        assert out.dtype == bf16
        assert torch.isfinite(out).all(), f"{name}: elements left unwritten (NaN poison) or non-finite"
        if name == "Aqk":
            assert (out[(cols > local).expand_as(out)] == 0).all(), "Aqk must be zero above the diagonal"
        err = rel_l2(out, ref[name])
        assert err < bound, f"{name}: relative L2 error {err:.2e} >= {bound}"
    g_last = got["g_last"].cpu()
    B, HV = case["B"], case["HV"]
    rows = ref["g_last"].shape[0] // B  # (a padding row of the chunk indices has a row of its own, never written)
    g_last = g_last[:, :rows].reshape(-1, HV, K)
    assert g_last.dtype == f32 and torch.isfinite(g_last).all(), "g_last: rows left unwritten"
    assert rel_l2(g_last.double(), ref["g_last"]) < 1e-6


@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_reference(case_id: str) -> None:
    case = CASES[case_id]
    inp = _inputs(case, seed=zlib.crc32(case_id.encode()))
    poison_allocator(16 * case["B"] * case["T"] * case["HV"] * K * 2)
    got = _run(inp, _chunk_indices(case, inp["cu_seqlens"]))
    torch.cuda.synchronize()
    _check(case, got, _reference(inp))


@pytest.mark.parametrize("spread", [0.0, 4.0], ids=["gate-2.5", "gate-near-bounds"])
def test_extreme_safe_gates(spread: float) -> None:
    """Log-gates at -2.5 everywhere, and pushed to the ends of [-5, 0]: the sub-chunk factors span up to
    2^(15 * 5 / ln 2) on the diagonal blocks and must neither overflow nor lose the result."""
    case = {**CASES["varlen-0-15-100-300-H2-HV4-none-nol2norm"], "cu": [0, 100, 100, 228, 300], "pad_row": True}
    inp = _inputs(case, seed=11, gate_spread=spread)
    _check(case, _run(inp, _chunk_indices(case, inp["cu_seqlens"])), _reference(inp))


def test_strongest_gate_underflows_cleanly() -> None:
    """Every step at -5 (the safe gate's bound): far-apart entries underflow to 0 and nothing becomes inf/NaN."""
    case = CASES["B2-T130-H2-HV8-none-bf16"]
    inp = _inputs(case, seed=5)
    inp["g"] = torch.full_like(inp["g"], -5.0)
    _check(case, _run(inp), _reference(inp))


UNBOUNDED_CASES = {
    "varlen-0-15-100-300-H2-HV4-kimi-fp32": dict(B=1, T=300, H=2, HV=4, cu=[0, 15, 100, 300], form="kimi"),
    "B2-T130-H2-HV2-kimi-fp32-nol2norm-beta-bf16": dict(B=2, T=130, H=2, HV=2, cu=None, form="kimi", l2norm=False,
                                                        sigmoid=False, beta=bf16),
    "B1-T200-H2-HV2-extreme-fp32": dict(B=1, T=200, H=2, HV=2, cu=None, form="extreme"),
    "varlen-0-63-64-200-H2-HV4-extreme-fp32-pad": dict(B=1, T=200, H=2, HV=4, cu=[0, 63, 64, 200], form="extreme",
                                                       pad_row=True),
    "B2-T200-H2-HV4-softplus-kimi": dict(B=2, T=200, H=2, HV=4, cu=None, form="softplus-kimi"),
    "varlen-0-1-17-17-81-200-H1-HV2-softplus-kimi-bf16-negeig": dict(B=1, T=200, H=1, HV=2,
                                                                     cu=[0, 1, 17, 17, 81, 200],
                                                                     form="softplus-kimi", g=bf16, neg_eig=True,
                                                                     dt_bias=False),
    "B1-T130-H2-HV2-wide-lb12": dict(B=1, T=130, H=2, HV=2, cu=None, form="wide"),
}


def _aqk_oracle(inp: dict) -> torch.Tensor:
    """Aqk in float64, pair by pair (KDA_SPEC §3.2): ``scale Σ q_i k_j exp(Γi - Γj)`` for ``j <= i`` in a chunk, the
    exponent summed from the float64 log-gate steps (``[B, T, HV, 64]``)."""
    cpu = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in inp.items()}
    q, k = cpu["q"], cpu["k"]
    if cpu["use_qk_l2norm_in_kernel"]:
        q, k = l2norm(q).to(bf16), l2norm(k).to(bf16)
    B, T, H = q.shape[:3]
    HV = cpu["v"].shape[2]
    layout = ChunkLayout.build(B, T, cpu["cu_seqlens"], C, "cpu")
    f64 = torch.float64

    def heads(x):  # [B, T, H, K] -> [NC, HV, C, K]
        return layout.to_chunks(x.to(f64).repeat_interleave(HV // H, dim=2))

    step = layout.to_chunks(_activated_gate(cpu, f64))
    beta = layout.to_chunks(torch.ones(B, T, HV, dtype=f64))
    _, aqk = kda_chunk_scores(heads(q), heads(k), beta, cpu["scale"], g_step=step)
    return layout.to_tokens(aqk)


@pytest.mark.parametrize("case_id", list(UNBOUNDED_CASES))
def test_unbounded_gates_match_reference(case_id: str) -> None:
    """The unbounded form on gates the safe-gate form overflows on: every output finite and within the bounds of
    the safe gate's cases, Aqk also against the float64 oracle."""
    case = UNBOUNDED_CASES[case_id]
    inp = _inputs(case, seed=zlib.crc32(case_id.encode()))
    poison_allocator(16 * case["B"] * case["T"] * case["HV"] * K * 2)
    got = _run(inp, _chunk_indices(case, inp["cu_seqlens"]))
    torch.cuda.synchronize()
    _check(case, got, _reference(inp))
    aqk = got["Aqk"].cpu().double()
    err = rel_l2(aqk, _aqk_oracle(inp))
    assert err < 1e-2, f"Aqk against the float64 oracle: relative L2 error {err:.2e}"


def test_replays_are_bit_identical() -> None:
    case = CASES["varlen-0-1-64-65-300-H1-HV2-safe-bf16"]
    inp = _inputs(case, seed=7)
    chunk_indices = _chunk_indices(case, inp["cu_seqlens"])
    first = {name: t.clone() for name, t in _run(inp, chunk_indices).items()}
    for _ in range(100):
        again = _run(inp, chunk_indices)
        assert all(torch.equal(first[name], again[name]) for name in first)


def test_sequences_are_isolated() -> None:
    """A packed sequence's rows of every output (and its decay rows) are the same bits whatever sequences are packed
    around it and in which order: the batch reversed gives each sequence's rows unchanged."""
    case = CASES["varlen-0-1-64-65-300-H1-HV2-safe-bf16"]
    inp = _inputs(case, seed=8)
    got = _run(inp)
    bounds = list(itertools.pairwise(case["cu"]))
    order = list(reversed(range(len(bounds))))
    lens = [bounds[n][1] - bounds[n][0] for n in order]
    chunks = [-(-(e - s) // C) for s, e in bounds]
    offsets = [0, *itertools.accumulate(chunks)]
    tokens = torch.cat([torch.arange(*bounds[n]) for n in order]).cuda()
    rows = torch.cat([torch.arange(offsets[n], offsets[n + 1]) for n in order]).cuda()
    swapped = dict(inp, cu_seqlens=torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda"),
                   **{name: inp[name][:, tokens] for name in ("q", "k", "v", "g", "beta")})
    again = _run(swapped)
    for name in NAMES:
        assert torch.equal(again[name], got[name][:, tokens]), name
    assert torch.equal(again["g_last"], got["g_last"][:, rows])


def test_one_compilation_serves_every_length() -> None:
    from cula_runtime.cute import compile_cache

    compile_cache.clear_cache()
    fixed = CASES["B2-T200-H2-HV4-safe-fp32"]
    for T in (200, 1000, 64, 1):
        case = {**fixed, "T": T}
        inp = _inputs(case, seed=T)
        _check(case, _run(inp), _reference(inp))
    varlen = {**CASES["varlen-0-100-100-228-H2-HV4-safe-pad"], "pad_row": False}
    for cu in ([0, 300], [0, 0, 7, 300], [0, 128, 129, 300]):
        case = {**varlen, "cu": cu, "T": cu[-1]}
        inp = _inputs(case, seed=len(cu))
        _check(case, _run(inp), _reference(inp))
    info = compile_cache.cache_info()
    assert (info.misses, info.size) == (2, 2), info  # one fixed-length and one varlen binary


def test_runs_on_the_current_stream() -> None:
    case = CASES["B2-T200-H2-HV4-safe-fp32"]
    inp = _inputs(case, seed=3)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        got = _run(inp)
    stream.synchronize()
    _check(case, got, _reference(inp))


def test_scale_is_folded_into_aqk_only() -> None:
    case = CASES["B1-T63-H4-HV4-safe-bf16-noAlog"]
    inp = _inputs(case, seed=9)
    base = _run(inp)
    doubled = _run({**inp, "scale": 2 * inp["scale"]})
    for name in base:
        if name == "Aqk":  # x2 is exact in fp32 and bf16 except near the subnormal range
            assert rel_l2(doubled[name], base[name] * 2) < 1e-6
        else:
            assert torch.equal(doubled[name], base[name])
