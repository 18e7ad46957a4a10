"""The CuTeDSL KDA chunk-intra kernel on a GPU, against the float32 reference ``kda_fwd_intra`` (KDA_SPEC.md §3.2-3.4,
§3.7, §3.8, §4).

Fresh random inputs as the pipeline produces them (L2-normalised bf16 q/k, safe gate: every step's log-gate in
[-5, 0], its chunk-local cumsum in log2 units, sigmoid beta); outputs preallocated and poisoned with NaN (an element
the kernel misses stays NaN); fixed length with tail chunks and T < 64; varlen with tails, one-token sequences, a
zero-length sequence and a padding row of the chunk indices; GVA (HV = 2H, 4H); K in {64, 128}. Bounds: relative L2
error <= 1e-2 for every bf16 output (the factored bf16 operands and bf16 outputs cost about 3e-3); Aqk and Akk_inv
exactly zero above the diagonal, Akk_inv exactly one on it; 100 replays bit-identical; one compilation serves every
length.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from cula_runtime import cute as cula_cute
from cula_runtime.reference.kda_chunked import chunk_local_cumsum, kda_fwd_intra
from tests.gpu_backends import poison_allocator
from tests.helpers import rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not cula_cute.is_available(), reason='CuTeDSL or TVM-FFI is missing (pip install "cula-runtime[cute]")'
    ),
]

C = 64
NAMES = ("w", "u", "qg", "kg", "Aqk", "Akk_inv")
CASES = {
    "B2-T200-H2-HV4-K128": dict(B=2, T=200, H=2, HV=4, K=128, cu=None),
    "B1-T63-H4-HV4-K128-qg": dict(B=1, T=63, H=4, HV=4, K=128, cu=None, qg=True),
    "B3-T64-H1-HV4-K128": dict(B=3, T=64, H=1, HV=4, K=128, cu=None),
    "varlen-0-100-100-228-H2-HV4-K128-pad": dict(B=1, T=228, H=2, HV=4, K=128, cu=[0, 100, 100, 228], pad_row=True),
    "varlen-0-1-64-65-300-H1-HV2-K128-qg": dict(B=1, T=300, H=1, HV=2, K=128, cu=[0, 1, 64, 65, 300], qg=True),
    "B2-T130-H2-HV2-K64-qg": dict(B=2, T=130, H=2, HV=2, K=64, cu=None, qg=True),
    "varlen-0-15-100-300-H2-HV4-K64": dict(B=1, T=300, H=2, HV=4, K=64, cu=[0, 15, 100, 300]),
}


def _inputs(case: dict, seed: int, gate_spread: float = 1.0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV, K = case["B"], case["T"], case["H"], case["HV"], case["K"]

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32)
    q = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).to(torch.bfloat16)
    v = randn(B, T, HV, K).to(torch.bfloat16)
    g = -5.0 * torch.sigmoid(gate_spread * randn(B, T, HV, K))  # the safe gate: every step in [-5, 0]
    gk = chunk_local_cumsum(g, C, cu, log2=True)
    beta = torch.sigmoid(randn(B, T, HV))
    inp = dict(q=q, k=k, v=v, gk=gk, beta=beta, scale=K**-0.5, cu_seqlens=cu)
    return {name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in inp.items()}


def _chunk_indices(case: dict, cu_seqlens: torch.Tensor | None) -> torch.Tensor | None:
    if cu_seqlens is None:
        return None
    from cula_runtime.index import prepare_chunk_indices

    rows = prepare_chunk_indices(cu_seqlens, C)
    if case.get("pad_row"):  # a CUDA-graph padding row: sequence id -1, which the kernel skips
        rows = torch.cat([rows, torch.tensor([[-1, 0]], dtype=rows.dtype, device=rows.device)])
    return rows


def _local_index(case: dict) -> torch.Tensor:
    """[B, T] index of every token within its chunk (chunks restart at every sequence start)."""
    B, T = case["B"], case["T"]
    if case["cu"] is None:
        return (torch.arange(T) % C).expand(B, T)
    local = torch.empty(1, T, dtype=torch.long)
    for bos, eos in itertools.pairwise(case["cu"]):
        local[0, bos:eos] = torch.arange(eos - bos) % C
    return local


def _poisoned(case: dict) -> tuple:
    B, T, HV, K = case["B"], case["T"], case["HV"], case["K"]
    nan = float("nan")

    def full(last):
        return torch.full((B, T, HV, last), nan, dtype=torch.bfloat16, device="cuda")

    return full(K), full(K), full(K) if case.get("qg") else None, full(K), full(C), full(C)


def _run(inp: dict, case: dict, chunk_indices, out=None, variant: str | None = "wide") -> tuple:
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra

    return chunk_kda_fwd_intra(**inp, chunk_indices=chunk_indices, output_qg=case.get("qg", False), out=out,
                               variant=variant)


def _reference(inp: dict) -> dict:
    cpu = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in inp.items()}
    out = kda_fwd_intra(cpu["q"], cpu["k"], cpu["v"], cpu["gk"], cpu["beta"], cpu["scale"], chunk_size=C,
                        cu_seqlens=cpu["cu_seqlens"], g_cum_log2=True)
    return dict(zip(NAMES, out, strict=True))


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error; an all-zero reference (e.g. Akk_inv's strictly lower part of one-token chunks) must be
    matched exactly."""
    if not ref.count_nonzero():
        return 0.0 if not out.count_nonzero() else math.inf
    return rel_l2(out, ref)


def _check(case: dict, got: dict, ref: dict, bound: float = 1e-2) -> None:
    local = _local_index(case)[:, :, None, None]  # [B, T, 1, 1]
    cols = torch.arange(C)[None, None, None, :]
    for name in NAMES:
        if name == "qg" and not case.get("qg"):
            assert got[name] is None
            continue
        out = got[name].cpu()
        assert out.dtype == torch.bfloat16
        assert torch.isfinite(out).all(), f"{name}: elements left unwritten (NaN poison) or non-finite"
        if name == "Akk_inv":
            assert (out[(cols == local).expand_as(out)] == 1).all(), "Akk_inv: diagonal must be exactly 1"
            strict = (cols < local).expand_as(out)  # compare the strictly lower part (the diagonal would flatter)
            err = _error(out[strict], ref[name][strict])
        else:
            err = _error(out, ref[name])
        if name in ("Aqk", "Akk_inv"):
            assert (out[(cols > local).expand_as(out)] == 0).all(), f"{name}: must be zero above the diagonal"
        assert err < bound, f"{name}: relative L2 error {err:.2e} >= {bound}"


@pytest.mark.parametrize("variant", ["wide", "lean", "lean-unrolled"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_matches_reference(case_id: str, variant: str) -> None:
    case = CASES[case_id]
    inp = _inputs(case, seed=zlib.crc32(case_id.encode()))
    out = _poisoned(case)
    result = _run(inp, case, _chunk_indices(case, inp["cu_seqlens"]), out=out, variant=variant)
    torch.cuda.synchronize()
    assert all(a is b for a, b in zip(result, out, strict=True))
    _check(case, dict(zip(NAMES, result, strict=True)), _reference(inp))


@pytest.mark.parametrize(("case_id", "variant"), [
    *((case_id, variant) for case_id in ("varlen-0-1-64-65-300-H1-HV2-K128-qg", "B2-T130-H2-HV2-K64-qg")
      for variant in ("lean", "lean-unrolled", "lean-unrolled-prefetch", None)),
    *(("varlen-0-1-64-65-300-H1-HV2-K128-qg", variant) for variant in ("lean-unrolled-8warps",
                                                                       "lean-unrolled-prefetch-8warps")),
])  # 8 warps are implemented for K = 128 only; None: the default (4 warps at K = 64)
def test_every_variant_gives_the_wide_variants_bits(case_id: str, variant: str | None) -> None:
    """The variants differ in shared-memory plan and loop structure, not in arithmetic or its order: every output
    bit-identical to the wide (H200-verified) variant's, over 100 replays."""
    case = CASES[case_id]
    inp = _inputs(case, seed=21)
    chunk_indices = _chunk_indices(case, inp["cu_seqlens"])
    wide = [t.clone() if t is not None else None for t in _run(inp, case, chunk_indices)]
    for _ in range(100):
        other = _run(inp, case, chunk_indices, variant=variant)
        for name, a, b in zip(NAMES, wide, other, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("spread", [0.0, 4.0], ids=["gate-2.5", "gate-near-bounds"])
def test_extreme_safe_gates(spread: float) -> None:
    """Gates at -2.5 everywhere, and gates pushed to the ends of [-5, 0]: the sub-chunk factors span up to
    2^(15 * 5 / ln 2) on the diagonal blocks and must neither overflow nor lose the result."""
    case = CASES["varlen-0-100-100-228-H2-HV4-K128-pad"]
    inp = _inputs(case, seed=11, gate_spread=spread)
    result = _run(inp, case, _chunk_indices(case, inp["cu_seqlens"]), out=_poisoned(case))
    _check(case, dict(zip(NAMES, result, strict=True)), _reference(inp))


def test_strongest_gate_underflows_cleanly() -> None:
    """Every step at -5 (the safe gate's bound): far-apart entries underflow to 0 and nothing becomes inf/NaN."""
    case = CASES["B2-T200-H2-HV4-K128"]
    inp = _inputs(case, seed=5)
    g = torch.full(inp["gk"].shape, -5.0)
    inp["gk"] = chunk_local_cumsum(g, C, None, log2=True).cuda()
    result = _run(inp, case, None, out=_poisoned(case))
    _check(case, dict(zip(NAMES, result, strict=True)), _reference(inp))


def test_replays_are_bit_identical() -> None:
    case = CASES["varlen-0-1-64-65-300-H1-HV2-K128-qg"]
    inp = _inputs(case, seed=7)
    chunk_indices = _chunk_indices(case, inp["cu_seqlens"])
    first = [t.clone() for t in _run(inp, case, chunk_indices)]
    for _ in range(100):
        again = _run(inp, case, chunk_indices)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_one_compilation_serves_every_length() -> None:
    from cula_runtime.cute import compile_cache

    compile_cache.clear_cache()
    fixed = CASES["B2-T200-H2-HV4-K128"]
    for T in (200, 1000, 64, 1):
        case = {**fixed, "T": T}
        inp = _inputs(case, seed=T)
        _check(case, dict(zip(NAMES, _run(inp, case, None), strict=True)), _reference(inp))
    varlen = {**CASES["varlen-0-100-100-228-H2-HV4-K128-pad"], "pad_row": False}
    for cu in ([0, 300], [0, 0, 7, 300], [0, 128, 129, 300]):
        case = {**varlen, "cu": cu, "T": cu[-1]}
        inp = _inputs(case, seed=len(cu))
        _check(case, dict(zip(NAMES, _run(inp, case, None), strict=True)), _reference(inp))
    info = compile_cache.cache_info()
    assert (info.misses, info.size) == (2, 2), info  # one fixed-length and one varlen binary


def test_runs_on_the_current_stream() -> None:
    case = CASES["B2-T200-H2-HV4-K128"]
    inp = _inputs(case, seed=3)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        result = _run(inp, case, None)
    stream.synchronize()
    _check(case, dict(zip(NAMES, result, strict=True)), _reference(inp))


def test_scale_is_folded_into_aqk_only() -> None:
    case = CASES["B1-T63-H4-HV4-K128-qg"]
    inp = _inputs(case, seed=9)
    base = dict(zip(NAMES, _run(inp, case, None), strict=True))
    doubled = dict(zip(NAMES, _run({**inp, "scale": 2 * inp["scale"]}, case, None), strict=True))
    for name in NAMES:
        if name == "Aqk":  # x2 is exact in fp32 and bf16 except near the subnormal range
            assert rel_l2(doubled[name], base[name] * 2) < 1e-6
        else:
            assert torch.equal(doubled[name], base[name])



@pytest.mark.parametrize("case_id", ["B2-T200-H2-HV4-K128", "varlen-0-100-100-228-H2-HV4-K128-pad",
                                     "varlen-0-1-64-65-300-H1-HV2-K128-qg", "B2-T130-H2-HV2-K64-qg"])
def test_modular_steps_give_the_one_launch_bits(case_id: str) -> None:
    """scores -> solve_tril -> recompute_w_u (three launches, the FLA-shaped modular path) reproduce the one-launch
    primitive's outputs bit for bit; Akk is fp32, strictly lower (exact zeros on and above the diagonal)."""
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_scores, chunk_kda_recompute_w_u, chunk_kda_solve_tril

    case = CASES[case_id]
    inp = _inputs(case, seed=13)
    chunk_indices = _chunk_indices(case, inp["cu_seqlens"])
    one = dict(zip(NAMES, _run(inp, case, chunk_indices), strict=True))
    cu, qg = inp["cu_seqlens"], case.get("qg", False)
    Aqk, Akk = chunk_kda_fwd_scores(inp["q"], inp["k"], inp["gk"], inp["beta"], inp["scale"], cu, chunk_indices)
    Akk_inv = chunk_kda_solve_tril(Akk, cu, chunk_indices)
    assert torch.equal(chunk_kda_solve_tril(Akk, cu, chunk_indices, unrolled=True), Akk_inv)
    w, u, qg_out, kg = chunk_kda_recompute_w_u(inp["k"], inp["v"], inp["gk"], inp["beta"], Akk_inv,
                                               q=inp["q"] if qg else None, cu_seqlens=cu, chunk_indices=chunk_indices)
    modular = dict(w=w, u=u, qg=qg_out, kg=kg, Aqk=Aqk, Akk_inv=Akk_inv)
    local = _local_index(case)[:, :, None, None].cuda()
    cols = torch.arange(C, device="cuda")[None, None, None, :]
    assert torch.isfinite(Akk).all() and (Akk[(cols >= local).expand_as(Akk)] == 0).all()
    for name in NAMES:
        if one[name] is None:
            assert modular[name] is None
        else:
            assert torch.equal(modular[name], one[name]), name


def test_solve_tril_refuses_tf32() -> None:
    from cula_runtime.cute.kda.intra import chunk_kda_solve_tril

    with pytest.raises(ValueError, match="use_tf32_inverse"):
        chunk_kda_solve_tril(torch.zeros(1, 64, 1, 64, device="cuda"), use_tf32_inverse=True)


# chunk_kda_fwd_intra_from_raw: kda_prepare's work inside the intra kernel (the fused-prepare path)
FROM_RAW = {
    "B2-T200-H2-HV4-safe-fp32": dict(B=2, T=200, H=2, HV=4, cu=None, dtype=torch.float32, gate=True, sigmoid=True),
    "varlen-0-1-64-65-300-H1-HV2-safe-bf16": dict(B=1, T=300, H=1, HV=2, cu=[0, 1, 64, 65, 300], dtype=torch.bfloat16,
                                                  gate=True, sigmoid=True),
    "varlen-0-0-70-H2-HV2-precomputed-activated": dict(B=1, T=70, H=2, HV=2, cu=[0, 0, 70], dtype=torch.float32,
                                                       gate=False, sigmoid=False),
}


@pytest.mark.parametrize("variant", ["fused-prepare", "fused-prepare-prefetch", "fused-prepare-prefetch-8warps"])
@pytest.mark.parametrize("case_id", list(FROM_RAW))
def test_from_raw_gives_prepare_then_intra_bits(case_id: str, variant: str) -> None:
    """One launch from the raw inputs equals kda_prepare followed by chunk_kda_fwd_intra (lean-unrolled) bit for
    bit, and g_last holds g_cum's row at every chunk's last valid token, every row written; with and without the
    loads issued ahead."""
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra, chunk_kda_fwd_intra_from_raw
    from cula_runtime.cute.kda.prepare import kda_prepare
    from cula_runtime.index import prepare_chunk_indices

    case = FROM_RAW[case_id]
    gen = torch.Generator().manual_seed(21)
    B, T, H, HV, K = case["B"], case["T"], case["H"], case["HV"], 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen).cuda()

    q, k, v = randn(B, T, H, K).bfloat16(), randn(B, T, H, K).bfloat16(), randn(B, T, HV, K).bfloat16()
    if case["gate"]:
        g = randn(B, T, HV, K).to(case["dtype"])
        gate = dict(A_log=0.5 * randn(HV), dt_bias=randn(HV * K), lower_bound=-5.0)
    else:  # an already-activated safe log-gate
        g = (-5.0 * torch.sigmoid(randn(B, T, HV, K))).to(case["dtype"])
        gate = dict(A_log=None, dt_bias=None, lower_bound=None)
    beta = randn(B, T, HV) if case["sigmoid"] else torch.sigmoid(randn(B, T, HV))
    beta = beta.to(case["dtype"])
    cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32, device="cuda")
    flags = dict(use_qk_l2norm_in_kernel=case["gate"], use_gate_in_kernel=case["gate"],
                 use_beta_sigmoid_in_kernel=case["sigmoid"])
    q_hat, k_hat, g_cum, beta_f = kda_prepare(q, k, g, beta, **gate, **flags, cu_seqlens=cu)
    want = chunk_kda_fwd_intra(q_hat, k_hat, v, g_cum, beta_f, K**-0.5, cu_seqlens=cu, output_qg=True,
                               variant="lean-unrolled")
    poison_allocator(8 * B * T * HV * K * 4)
    got = chunk_kda_fwd_intra_from_raw(q, k, v, g, beta, K**-0.5, **gate, **flags, cu_seqlens=cu, variant=variant)
    for name, a, b in zip(NAMES[:5], got[:5], want[:5], strict=True):
        assert torch.equal(a, b), name
    g_last = got[5]
    if cu is None:
        ends = [min(c * C + C, T) - 1 for c in range(-(-T // C))]
        expect = g_cum[:, ends]
    else:
        rows = prepare_chunk_indices(cu, C).tolist()
        ends = [case["cu"][n] + min(c * C + C, case["cu"][n + 1] - case["cu"][n]) - 1 for n, c in rows]
        expect = g_cum[:, ends]
    assert g_last.shape == expect.shape and torch.equal(g_last, expect)
