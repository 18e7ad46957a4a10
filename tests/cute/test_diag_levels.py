"""The slot tables of the unbounded gate's diagonal blocks (cula_runtime.cute.kda.diag_levels, KDA_SPEC §3.7): every
strict pair of a 16x16 block comes out of the two products exactly once, no factor grows, the two products emulated
in float64 equal the direct sum for gates down to -1e4 per step, and the kernel's token-side construction of the
operands (each token's role at each level written into its slot, every factor 2^-|Γr - Γm|) gives the slot tables'
operands bit for bit in the kernel's fp32/bf16 arithmetic. CPU only, no CuTeDSL."""

from __future__ import annotations

import pytest
import torch

from cula_runtime.cute.kda.diag_levels import (
    DIAG_SIZE,
    LEVELS,
    diag_products,
    level_anchor,
    level_product,
    level_slots,
    pack_nibbles,
    useful_outputs,
)

N = DIAG_SIZE


def test_every_strict_pair_comes_out_exactly_once() -> None:
    produced = [pair for p in range(2) for pair in useful_outputs(p).values()]
    assert sorted(produced) == [(i, j) for i in range(N) for j in range(i)]


def test_each_product_gives_every_token_its_two_levels_roles() -> None:
    """Level b's anchor of token l is ((l >> b) | 1) << b; product 0 holds levels 3 and 2, product 1 levels 1 and 0,
    with each (token, anchor) once; a row's token has the level's bit set, a column's not."""
    for p, levels in enumerate(((3, 2), (1, 0))):
        rows, cols = diag_products()[p]
        roles = sorted([*rows, *cols])
        expected = sorted((t, ((t >> b) | 1) << b) for t in range(N) for b in levels)
        assert roles == expected
        for token, anchor in rows:
            assert anchor <= token
        for token, anchor in cols:
            assert anchor > token


def test_factors_never_grow_for_a_non_increasing_gate() -> None:
    """Row exponents Γ_token - Γ_anchor and column exponents Γ_anchor - Γ_token are <= 0 for any non-increasing Γ:
    checked on the extreme Γ that drops only at one step, for every step."""
    for step in range(1, N):
        gam = torch.where(torch.arange(N) >= step, -1.0, 0.0)
        for rows, cols in diag_products():
            assert all(gam[t] - gam[a] <= 0 for t, a in rows)
            assert all(gam[a] - gam[t] <= 0 for t, a in cols)


def _emulate(q: torch.Tensor, k: torch.Tensor, gam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two products of each matrix from the slot tables, their useful outputs scattered into 16x16 blocks."""
    aqk, akk = q.new_zeros(N, N), q.new_zeros(N, N)
    for p, (rows, cols) in enumerate(diag_products()):
        rt, ra = (torch.tensor(x) for x in zip(*rows, strict=True))
        ct, ca = (torch.tensor(x) for x in zip(*cols, strict=True))
        row_f = torch.exp2(gam[rt] - gam[ra])  # [16 slots, K]
        col_f = torch.exp2(gam[ca] - gam[ct])
        assert torch.isfinite(row_f).all() and torch.isfinite(col_f).all()
        col = k[ct] * col_f
        pq, pk = (q[rt] * row_f) @ col.T, (k[rt] * row_f) @ col.T
        for (rs, cs), (i, j) in useful_outputs(p).items():
            aqk[i, j] += pq[rs, cs]
            akk[i, j] += pk[rs, cs]
    return aqk + torch.diag((q * k).sum(-1)), akk


@pytest.mark.parametrize("seed", range(4))
def test_products_equal_the_direct_sum(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    K = 32
    q = torch.randn(N, K, generator=gen, dtype=torch.float64)
    k = torch.randn(N, K, generator=gen, dtype=torch.float64)
    step = -torch.rand(N, K, generator=gen, dtype=torch.float64) * 3
    step[3, :4] = -1e4  # huge drops in a few channels
    step[9, 4:8] = -1e4
    step[:, 8] = -1e4  # a channel that decays completely at every step
    step[:, 9] = -50.0
    step[:, 10] = 0.0  # and one that never decays
    gam = torch.cumsum(step, dim=0)
    aqk, akk = _emulate(q, k, gam)
    diff = gam[:, None, :] - gam[None, :, :]  # Γi - Γj, [i, j, K]
    lower = torch.ones(N, N, dtype=torch.bool).tril()
    weight = torch.where(lower[..., None], torch.exp2(torch.where(lower[..., None], diff, 0.0)), 0.0)
    direct_qk = (q[:, None, :] * k[None, :, :] * weight).sum(-1)
    direct_kk = (k[:, None, :] * k[None, :, :] * weight).sum(-1).tril(-1)
    torch.testing.assert_close(aqk, direct_qk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(akk, direct_kk, rtol=1e-12, atol=1e-12)
    # the anchored safe-gate form (one anchor per sub-chunk) is not finite here: the test can tell the two apart
    assert not torch.isfinite(torch.exp2(gam[0] - gam)).all()


def test_pack_nibbles_round_trips() -> None:
    for rows, cols in diag_products():
        for slots in (rows, cols):
            for which in range(2):
                values = [s[which] for s in slots]
                lo, hi = pack_nibbles(values)
                assert [((hi if s >= 8 else lo) >> (4 * (s % 8))) & 15 for s in range(N)] == values
    with pytest.raises(ValueError, match="16 values"):
        pack_nibbles([16] * N)


def test_level_slots_invert_the_slot_tables() -> None:
    """Every (product, side, slot) is one token's role at one level: the token-side table fills each product's 16 row
    and 16 column slots exactly once, with the slot tables' (token, anchor)."""
    tables = diag_products()
    filled = {(p, side, s): [] for p in range(2) for side in range(2) for s in range(N)}
    for level, slots in enumerate(level_slots()):
        p = level_product(level)
        for token, slot in enumerate(slots):
            side = 0 if token >> level & 1 else 1
            assert tables[p][side][slot] == (token, level_anchor(token, level))
            filled[(p, side, slot)].append((token, level))
    assert all(len(v) == 1 for v in filled.values())


def _gate_cumsum(gen: torch.Generator, K: int, valid: int) -> torch.Tensor:
    """A non-increasing fp32 Γ [16, K] in log2 units as the kernel forms it (serial fp32 cumsum, then times 1/ln 2),
    with steps down to -1e4, and rows past ``valid`` zero (as the kernel's Γ registers hold them)."""
    step = -torch.rand(N, K, generator=gen, dtype=torch.float32) * 3
    step[3, :4] = -1e4
    step[9, 4:8] = -1e4
    step[:, 8] = -1e4
    step[:, 9] = -50.0
    step[:, 10] = 0.0
    step[:, 11] = -1e-30  # steps too small to move Γ at all
    gam = torch.cumsum(step, dim=0, dtype=torch.float32) * torch.tensor(1.4426950216, dtype=torch.float32)
    gam[valid:] = 0.0
    return gam


def _slot_side_operands(x: torch.Tensor, k: torch.Tensor, gam: torch.Tensor) -> list:
    """Per product: (A rows of x, B rows of k) as the retired kernel made them, slot by slot from the tables:
    bf16(x_t 2^min(Γt - Γm, 0)) and bf16(k_t 2^min(Γm - Γt, 0)), fp32 arithmetic."""
    out = []
    for rows, cols in diag_products():
        a = torch.stack([(x[t].float() * torch.exp2(torch.clamp(gam[t] - gam[m], max=0.0))).bfloat16()
                         for t, m in rows])
        b = torch.stack([(k[t].float() * torch.exp2(torch.clamp(gam[m] - gam[t], max=0.0))).bfloat16()
                         for t, m in cols])
        out.append((a, b))
    return out


def _token_side_operands(x: torch.Tensor, k: torch.Tensor, gam: torch.Tensor) -> list:
    """The same operands as the kernel makes them (KdaIntra.diag_stage): the threads of token r write, per level, its
    row (bf16(x_r f), into the level's row slot) or its column (bf16(k_r f), column slot), f = 2^-|Γr - Γm|."""
    a = [torch.full((N, x.shape[1]), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    b = [torch.full((N, x.shape[1]), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
    for level, slots in enumerate(level_slots()):
        p = level_product(level)
        for r in range(N):
            f = torch.exp2(-(gam[r] - gam[level_anchor(r, level)]).abs())
            assert (f <= 1).all()
            if r >> level & 1:
                a[p][slots[r]] = (x[r].float() * f).bfloat16()
            else:
                b[p][slots[r]] = (k[r].float() * f).bfloat16()
    return list(zip(a, b, strict=True))


@pytest.mark.parametrize("valid", [N, 11, 1])
@pytest.mark.parametrize("seed", range(3))
def test_token_side_operands_equal_the_slot_tables(seed: int, valid: int) -> None:
    """Bit-identical operands, so the kernel's diagonal blocks keep the values of the form the H200 runs checked: a
    row's Γt - Γm and a column's Γm - Γt are -|Γt - Γm| for a non-increasing Γ. Past the end (zero q, k and Γ) the
    only operands that differ are the columns of valid tokens anchored past the end, and every row slot sharing
    their anchor is zero, so each output they enter is an exact zero in both."""
    gen = torch.Generator().manual_seed(seed)
    K = 16
    q = torch.randn(N, K, generator=gen).bfloat16()
    k = torch.randn(N, K, generator=gen).bfloat16()
    q[valid:] = 0
    k[valid:] = 0
    gam = _gate_cumsum(gen, K, valid)
    assert (gam[1:valid] <= gam[:valid - 1]).all()
    for x in (q, k):
        pairs = zip(_slot_side_operands(x, k, gam), _token_side_operands(x, k, gam), diag_products(), strict=True)
        for (a0, b0), (a1, b1), (rows, cols) in pairs:
            assert torch.equal(a0.view(torch.int16), a1.view(torch.int16))
            for c, (_, anchor) in enumerate(cols):
                if anchor < valid:
                    assert torch.equal(b0[c].view(torch.int16), b1[c].view(torch.int16))
                else:
                    assert all(not a1[r].float().any() for r, (_, m) in enumerate(rows) if m == anchor)


def test_levels_cover_four_bits() -> None:
    assert LEVELS == 4 and 1 << LEVELS == N


def test_column_halves_cover_every_pair_once() -> None:
    """The kernel's products are 16 x 8 column halves (one m16n8k16 accumulator per warp: element e of lane l at row
    slot l // 4 + 8 (e // 2), column slot 2 (l % 4) + e % 2 of its half); each warp keeps the elements whose slots
    share their anchor, packed as row token << 4 | column token (0: none, as no pair has row token 0)."""
    produced = []
    for p in range(2):
        outputs = useful_outputs(p)
        for half in range(2):
            for lane in range(32):
                for e in range(4):
                    rs, cs = lane // 4 + 8 * (e // 2), 8 * half + 2 * (lane % 4) + e % 2
                    pair = outputs.get((rs, cs))
                    packed = 0 if pair is None else pair[0] << 4 | pair[1]
                    assert packed < 256 and (packed == 0) == (pair is None)
                    if packed:
                        produced.append((packed >> 4, packed & 15))
    assert sorted(produced) == [(i, j) for i in range(N) for j in range(i)]
