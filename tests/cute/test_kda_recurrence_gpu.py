"""The CuTeDSL fused delta-h + output kernel (``chunk_kda_fwd_recurrence``) on a GPU (KDA_SPEC.md §3.5, §3.6, §3.8).

Inputs are the intermediates of the float32 chunked reference (``kda_chunked``) on fresh random q/k/v/g/beta,
rounded to the kernel's dtypes (qg, kg, w, u, Aqk bf16; the decay rows ``g_last``, the cumulative gate at each
chunk's last valid token, fp32 in log2 units, as the intra kernel writes them). The upper triangle
of Aqk (key after query, which FLA never writes) is filled with NaN: the kernel must mask it itself. Two
references, both float32 on the same rounded inputs: ``kda_fwd_h`` + ``kda_fwd_o`` (FLA's modular primitives) and
:func:`emulate_kernel`, which rounds where the kernel rounds (S and v_new to bf16). Bound: rel-L2 < 1e-2 for o and
the final state against both. Outputs are NaN-poisoned through the caching allocator; fixed length with tails and
T < 64, varlen with tails and a zero-length sequence (launched longest first), both state layouts, with and without
an initial state; both block_v (64, 128) and every launch order give the same bits; a sequence's outputs do not
depend on its neighbours; 100 replays are bit-identical.

``test_emulation_stays_within_the_bound`` runs on the CPU: it checks that the rounding model of the kernel leaves
headroom under the bound against the fp32 primitives, on the same cases.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch

from cula_runtime import cute as cula_cute
from cula_runtime.reference.kda_chunked import ChunkLayout, kda_chunked, kda_fwd_h, kda_fwd_o
from tests.helpers import rel_l2

needs_cutedsl = pytest.mark.skipif(
    not cula_cute.is_available(),
    reason="CuTeDSL or TVM-FFI is missing (cula-runtime brings them on Linux x86_64/aarch64)",
)

C = 64
K = 128
BOUND = 1e-2


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    T: int
    HV: int
    cu: tuple[int, ...] | None = None
    h0: bool = True
    final_state: bool = True
    state_v_first: bool = False
    gate_bias: float = -6.0  # added to the raw gate: -6 decays a chunk by e^-0.02 .. e^-1 (the state matters)


CASES = [
    Case("B2-T200-HV4-kv-h0", B=2, T=200, HV=4),
    Case("B1-T63-HV2-vk-noh0", B=1, T=63, HV=2, h0=False, state_v_first=True),
    Case("B1-T1-HV2-kv-h0", B=1, T=1, HV=2),
    Case("B3-T128-HV2-vk-h0", B=3, T=128, HV=2, state_v_first=True),
    Case("B1-T700-HV2-kv-h0-nofinal", B=1, T=700, HV=2, final_state=False),
    Case("B1-T300-HV2-kv-h0-strong-decay", B=1, T=300, HV=2, gate_bias=0.0),
    Case("varlen-0-100-100-228-HV4-kv-h0", B=1, T=228, HV=4, cu=(0, 100, 100, 228)),
    Case("varlen-0-1-64-65-300-HV2-vk-noh0", B=1, T=300, HV=2, cu=(0, 1, 64, 65, 300), h0=False,
         state_v_first=True),
    Case("varlen-0-0-70-HV2-vk-h0", B=1, T=70, HV=2, cu=(0, 0, 70), state_v_first=True),
    Case("varlen-0-15-100-300-1200-HV2-kv-noh0", B=1, T=1200, HV=2, cu=(0, 15, 100, 300, 1200), h0=False),
]


def make_inputs(case: Case, seed: int, device: str = "cpu") -> dict:
    """Kernel arguments for ``case``: reference intermediates of random inputs, rounded, Aqk's upper part NaN."""
    gen = torch.Generator().manual_seed(seed)
    B, T, HV = case.B, case.T, case.HV
    N = len(case.cu) - 1 if case.cu is not None else B
    q = torch.randn(B, T, HV, K, generator=gen).to(torch.bfloat16)
    k = torch.randn(B, T, HV, K, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, T, HV, K, generator=gen).to(torch.bfloat16)
    g = 2.0 * torch.randn(B, T, HV, K, generator=gen) + case.gate_bias
    beta = torch.randn(B, T, HV, generator=gen)
    cu = torch.tensor(case.cu, dtype=torch.int32) if case.cu is not None else None
    scale = K**-0.5
    _, _, inter = kda_chunked(
        q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV * K),
        cu_seqlens=cu, return_intermediates=True,
    )  # fmt: skip
    layout = ChunkLayout.build(B, T, cu, C, "cpu")
    # Aqk's entries above the diagonal (key > query within the chunk) are not part of the input: poison them.
    aqk = layout.to_chunks(inter.Aqk)  # [NC, HV, C(query), C(key)]
    upper = torch.ones(C, C, dtype=torch.bool).triu(1)
    aqk = torch.where(upper, torch.full_like(aqk, float("nan")), aqk)
    aqk_tokens = layout.to_tokens(aqk)
    h0 = None
    if case.h0:
        h0 = 0.5 * torch.randn(N, HV, K, K, generator=gen)
    gk = inter.g_cum.float().contiguous()
    # the kernel's gate argument: each chunk's row at its last valid token, [B, NT, HV, K] (varlen [1, NC, HV, K])
    g_last = layout.last_rows(layout.to_chunks(gk)).reshape(B, -1, HV, K).contiguous()
    args = dict(
        qg=inter.qg.to(torch.bfloat16), kg=inter.kg.to(torch.bfloat16), w=inter.w.to(torch.bfloat16),
        u=inter.u.to(torch.bfloat16), Aqk=aqk_tokens.to(torch.bfloat16), gk=gk, g_last=g_last,
        scale=scale, initial_state=h0, output_final_state=case.final_state, cu_seqlens=cu,
        chunk_offsets=None if cu is None else torch.tensor(layout.chunk_offsets, dtype=torch.int32),
        state_v_first=case.state_v_first,
    )  # fmt: skip
    return {name: (t.to(device) if isinstance(t, torch.Tensor) else t) for name, t in args.items()}


def reference(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's modular primitives in float32 on the kernel's (rounded) inputs: ``(o, ht)`` (ht always returned)."""
    f32 = {name: (t.cpu().float() if isinstance(t, torch.Tensor) else t) for name, t in args.items()}
    cu = args["cu_seqlens"].cpu() if args["cu_seqlens"] is not None else None
    aqk = torch.nan_to_num(f32["Aqk"], nan=0.0)  # kda_fwd_o applies tril; NaN * 0 would still be NaN
    h, v_new, ht = kda_fwd_h(
        f32["kg"], f32["w"], f32["u"], f32["gk"], f32["initial_state"], True, C, cu, args["state_v_first"],
        g_cum_log2=True,
    )  # fmt: skip
    zeros = torch.zeros_like(f32["gk"])  # qg is already gated: kda_fwd_o's exp(Γ) factor is 1
    o = kda_fwd_o(f32["qg"], v_new, zeros, aqk, h, args["scale"], C, cu, args["state_v_first"])
    return o, ht


def emulate_kernel(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in float32 with its bf16 rounding points: per chunk, ``S_bf = bf16(S)``,
    ``v_new = bf16(u - w S_bf)``, ``o = scale qg S_bf + tril(Aqk) v_new``, ``S = 2^g_last S + kgᵀ v_new``."""
    f32 = {name: (t.cpu().float() if isinstance(t, torch.Tensor) else t) for name, t in args.items()}
    B, T, HV, _ = f32["w"].shape
    cu = args["cu_seqlens"].cpu() if args["cu_seqlens"] is not None else None
    layout = ChunkLayout.build(B, T, cu, C, "cpu")
    qg, kg, w, u = (layout.to_chunks(f32[n]) for n in ("qg", "kg", "w", "u"))
    aqk = torch.tril(torch.nan_to_num(layout.to_chunks(f32["Aqk"]), nan=0.0))
    gamma = torch.exp2(layout.last_rows(layout.to_chunks(f32["gk"])))  # [NC, HV, K]
    N = layout.num_seqs
    if f32["initial_state"] is None:
        S = torch.zeros(N, HV, K, K)
    else:
        S = f32["initial_state"].transpose(-1, -2).clone() if args["state_v_first"] else f32["initial_state"].clone()
    oc = torch.zeros_like(u)

    def bf(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).float()

    for n in range(N):
        for c in range(layout.chunks_per_seq[n]):
            i = layout.chunk_offsets[n] + c
            s_bf = bf(S[n])
            v_new = bf(u[i] - w[i] @ s_bf)
            oc[i] = args["scale"] * (qg[i] @ s_bf) + aqk[i] @ v_new
            S[n] = gamma[i].unsqueeze(-1) * S[n] + kg[i].transpose(-1, -2) @ v_new
    ht = S.transpose(-1, -2).contiguous() if args["state_v_first"] else S
    return layout.to_tokens(oc), ht


@pytest.mark.parametrize("case", CASES[:6], ids=[c.name for c in CASES[:6]])
def test_emulation_stays_within_the_bound(case: Case) -> None:
    """CPU: the kernel's rounding model against the fp32 primitives leaves at least 2x headroom under BOUND."""
    args = make_inputs(case, seed=11)
    o_ref, ht_ref = reference(args)
    o_emu, ht_emu = emulate_kernel(args)
    assert torch.isfinite(o_ref).all() and torch.isfinite(o_emu).all()
    assert rel_l2(o_emu.to(torch.bfloat16), o_ref) < BOUND / 2
    assert rel_l2(ht_emu, ht_ref) < BOUND / 2


def _run(args: dict, block_v: int = 64, seq_order=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    from cula_runtime.cute.kda.recurrence import chunk_kda_fwd_recurrence

    return chunk_kda_fwd_recurrence(
        args["qg"], args["kg"], args["w"], args["u"], args["Aqk"], args["g_last"], args["scale"],
        initial_state=args["initial_state"], output_final_state=args["output_final_state"],
        cu_seqlens=args["cu_seqlens"], chunk_offsets=args["chunk_offsets"], state_v_first=args["state_v_first"],
        block_v=block_v, seq_order=seq_order,
    )  # fmt: skip


def _poison_allocator(nbytes: int) -> None:
    """Fill free blocks of the caching allocator with NaN so that unwritten outputs show up."""
    block = torch.full((max(nbytes, 1 << 20) // 4,), float("nan"), device="cuda")
    del block


@pytest.mark.gpu
@needs_cutedsl
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_recurrence_matches_references(case: Case) -> None:
    args = make_inputs(case, seed=0, device="cuda")
    _poison_allocator(4 * case.B * case.T * case.HV * K * 2)
    o, ht = _run(args)
    torch.cuda.synchronize()
    assert o.dtype == torch.bfloat16 and o.shape == (case.B, case.T, case.HV, K)
    assert torch.isfinite(o).all(), "o has unwritten or non-finite entries"
    o_ref, ht_ref = reference(args)
    o_emu, ht_emu = emulate_kernel(args)
    errors = {"o_ref": rel_l2(o.cpu(), o_ref), "o_emu": rel_l2(o.cpu(), o_emu)}
    if case.final_state:
        assert ht is not None and ht.dtype == torch.float32 and ht.shape == ht_ref.shape
        assert torch.isfinite(ht).all(), "final state has unwritten or non-finite entries"
        errors |= {"ht_ref": rel_l2(ht.cpu(), ht_ref), "ht_emu": rel_l2(ht.cpu(), ht_emu)}
    else:
        assert ht is None
    if os.environ.get("CULA_ERROR_LOG"):
        with open(os.environ["CULA_ERROR_LOG"], "a") as log:
            log.write(f"cute-recurrence {case.name} " + " ".join(f"{k} {v:.4e}" for k, v in errors.items()) + "\n")
    for name, err in errors.items():
        assert err < BOUND, f"{name}: rel-L2 {err:.3e}"


@pytest.mark.gpu
@needs_cutedsl
def test_zero_length_sequences_pass_the_initial_state_through() -> None:
    case = next(c for c in CASES if c.name == "varlen-0-100-100-228-HV4-kv-h0")
    args = make_inputs(case, seed=3, device="cuda")
    _, ht = _run(args)
    assert torch.equal(ht[1], args["initial_state"][1])  # sequence 1 is empty: bit-exact copy
    no_h0 = dict(args, initial_state=None)
    _, ht = _run(no_h0)
    assert torch.equal(ht[1], torch.zeros_like(ht[1]))


@pytest.mark.gpu
@needs_cutedsl
def test_every_block_v_gives_the_same_bits() -> None:
    """block_v 128 (8 warps, one CTA per head) gives the bits of 64 (4 warps, two CTAs); 32 (the retired 2-warp
    form) is refused with a ValueError naming the accepted blocks."""
    case = next(c for c in CASES if c.name == "varlen-0-1-64-65-300-HV2-vk-noh0")
    args = make_inputs(case, seed=5, device="cuda")
    o_ref, ht_ref = _run(args, block_v=64)
    o, ht = _run(args, block_v=128)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    with pytest.raises(ValueError, match=r"block_v=32: expected one of \(64, 128\)"):
        _run(args, block_v=32)


@pytest.mark.gpu
@needs_cutedsl
def test_100_replays_are_bit_identical() -> None:
    case = next(c for c in CASES if c.name == "B2-T200-HV4-kv-h0")
    args = make_inputs(case, seed=1, device="cuda")
    o0, ht0 = _run(args)
    for _ in range(100):
        o, ht = _run(args)
        assert torch.equal(o, o0) and torch.equal(ht, ht0)


@pytest.mark.gpu
@needs_cutedsl
def test_one_compilation_serves_every_length() -> None:
    from cula_runtime.cute import compile_cache

    a = make_inputs(CASES[0], seed=7, device="cuda")
    b = make_inputs(Case("B1-T1000-HV4-kv-h0", B=1, T=1000, HV=4), seed=8, device="cuda")
    _run(a)
    misses = compile_cache.cache_info().misses
    o, _ = _run(b)
    assert compile_cache.cache_info().misses == misses
    assert rel_l2(o.cpu(), reference(b)[0]) < BOUND


@pytest.mark.gpu
@needs_cutedsl
def test_any_launch_order_gives_the_same_bits() -> None:
    """Longest first (the default), batch order and its reverse: the same o and final state, bit for bit."""
    case = next(c for c in CASES if c.name == "varlen-0-15-100-300-1200-HV2-kv-noh0")
    args = make_inputs(case, seed=9, device="cuda")
    o0, ht0 = _run(args)
    N = len(case.cu) - 1
    for order in (list(range(N)), list(reversed(range(N)))):
        o, ht = _run(args, seq_order=torch.tensor(order, dtype=torch.int32, device="cuda"))
        assert torch.equal(o, o0) and torch.equal(ht, ht0), order


@pytest.mark.gpu
@needs_cutedsl
def test_sequences_are_isolated() -> None:
    """A packed sequence's o and final state are the same bits whatever sequences are packed around it and in
    which order: the batch reversed gives each sequence's rows and state unchanged."""
    case = next(c for c in CASES if c.name == "varlen-0-100-100-228-HV4-kv-h0")
    args = make_inputs(case, seed=10, device="cuda")
    o, ht = _run(args)
    bounds = list(zip(case.cu[:-1], case.cu[1:], strict=True))
    order = list(reversed(range(len(bounds))))
    lens = [bounds[n][1] - bounds[n][0] for n in order]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    chunks = [-(-length // C) for length in lens]
    offsets = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32, device="cuda")
    old_offsets = [0, *itertools.accumulate(-(-(e - s) // C) for s, e in bounds)]
    tokens = torch.cat([torch.arange(*bounds[n], device="cuda") for n in order])
    rows = torch.cat([torch.arange(old_offsets[n], old_offsets[n + 1], device="cuda") for n in order])
    swapped = dict(args, cu_seqlens=cu, chunk_offsets=offsets, g_last=args["g_last"][:, rows],
                   initial_state=args["initial_state"][order],
                   **{name: args[name][:, tokens] for name in ("qg", "kg", "w", "u", "Aqk")})
    o2, ht2 = _run(swapped)
    assert torch.equal(o2, o[:, tokens]) and torch.equal(ht2, ht[order])
