"""Small helpers shared by the tests."""

from __future__ import annotations

import torch


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64."""
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
