"""benchmarks/precision_unbounded_diag.py's score forms (CPU only): the proposed "levels" form of the diagonal blocks
computes Aqk and Akk to bf16-operand accuracy for any gate, and today's anchored form does not survive unbounded
gates (which is why the GPU backends refuse them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.precision_unbounded_diag import scores_of  # noqa: E402
from tests.helpers import rel_l2  # noqa: E402


def _chunk(L: int, gate: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k ``[2, L, 128]`` (unit rows, bf16 values) and Γ ``[2, L, 128]`` for a gate of the named kind."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(2, L, 128, generator=gen), dim=-1).bfloat16().float()
            for _ in range(2))
    g = -torch.rand(2, L, 128, generator=gen) * {"safe": 5.0, "kimi": 40.0}.get(gate, 1.0)
    if gate == "extreme":  # some channels -50, others -1e4 per token, and one token that decays every channel fully
        channels = torch.rand(2, 1, 128, generator=gen)
        g = torch.where(channels < 0.2, -50.0, torch.where(channels > 0.9, -1e4, g))
        g[:, L // 2] = -1e4
    return q, k, torch.cumsum(g, dim=1)


def _exact(q, k, gam):
    return scores_of("pairwise")(q.double(), k.double(), gam.double())


@pytest.mark.parametrize("L", [64, 37, 16, 1])
@pytest.mark.parametrize("gate", ["safe", "kimi", "extreme"])
def test_levels_match_the_exact_scores(L: int, gate: str) -> None:
    q, k, gam = _chunk(L, gate, seed=L)
    qk_ref, kk_ref = _exact(q, k, gam)
    qk, kk = scores_of("levels")(q, k, gam)
    assert torch.isfinite(qk).all() and torch.isfinite(kk).all()
    # Akk is used strictly below the diagonal (its diagonal is not formed); Aqk on and below it
    assert rel_l2(qk, qk_ref) < 1e-2
    assert L == 1 or rel_l2(torch.tril(kk, -1), torch.tril(kk_ref, -1)) < 1e-2
    # nothing above the diagonal; Aqk's diagonal is the fp32 dot product q·k
    assert not torch.triu(qk, diagonal=1).any()
    torch.testing.assert_close(torch.diagonal(qk, dim1=1, dim2=2), (q * k).sum(-1), rtol=1e-6, atol=1e-6)


def test_anchored_form_breaks_on_unbounded_gates() -> None:
    """Today's first-row anchor: right for the safe gate, not finite once a sub-chunk's gates sum below about -88."""
    q, k, gam = _chunk(64, "safe", seed=1)
    qk_ref, _ = _exact(q, k, gam)
    assert rel_l2(scores_of("anchored")(q, k, gam)[0], qk_ref) < 1e-2
    q, k, gam = _chunk(64, "extreme", seed=1)
    qk, kk = scores_of("anchored")(q, k, gam)
    assert not (torch.isfinite(qk).all() and torch.isfinite(kk).all())
