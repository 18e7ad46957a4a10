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


def assert_k_first_lines_same_bits(decode_module, run, fp32_pool: bool, monkeypatch) -> None:
    """Every count of lines per K-first CTA (``k_first_lines``: 1, 2, 4 with an fp32 pool, 1, 2 with bf16) gives the
    default's (0's) results bit for bit. ``decode_module`` is a decode kernel module whose launches take their
    configuration from its ``_plan`` (replaced here, through ``monkeypatch``, by one that sets ``k_first_lines``);
    ``run()`` makes one call from the same start and returns ``(o, pool)`` copies."""
    import dataclasses

    plan = decode_module._plan
    results = {}
    for lines in (0, 1, 2, 4) if fp32_pool else (0, 1, 2):
        monkeypatch.setattr(decode_module, "_plan", lambda *key, lines=lines: (
            dataclasses.replace(plan(*key)[0], k_first_lines=lines), plan(*key)[1]))
        results[lines] = run()
    for lines, (out, pool) in results.items():
        assert torch.equal(out.view(torch.int16), results[0][0].view(torch.int16)), f"o at {lines} lines"
        assert torch.equal(pool, results[0][1]), f"the pool at {lines} lines"
