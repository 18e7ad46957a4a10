"""Small helpers shared by the tests."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64."""
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


class AllocationCounter(TorchDispatchMode):
    """Counts the tensor allocations (empty, empty_like, zeros, copies) of the torch ops run under it
    (``with AllocationCounter() as counted: ...; counted.count``)."""

    ALLOCATING = {"empty", "empty_strided", "empty_like", "zeros", "zeros_like", "new_empty", "new_empty_strided",
                  "clone", "_to_copy"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in self.ALLOCATING
        return func(*args, **(kwargs or {}))
