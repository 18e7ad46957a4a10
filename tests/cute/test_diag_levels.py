"""The slot tables of the unbounded gate's diagonal blocks (cula_runtime.cute.kda.diag_levels, KDA_SPEC §3.7): every
strict pair of a 16x16 block comes out of the two products exactly once, no factor grows, and the two products
emulated in float64 equal the direct sum for gates down to -1e4 per step. CPU only, no CuTeDSL."""

from __future__ import annotations

import pytest
import torch

from cula_runtime.cute.kda.diag_levels import DIAG_SIZE, diag_products, pack_nibbles, useful_outputs

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
