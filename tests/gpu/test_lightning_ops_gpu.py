"""``torch.ops.cula.lightning_prefill`` under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` on the GPU
(marked ``gpu``, the cutedsl backend): a first call inside inductor's CUDA-graph warm-up builds the fixed-length
segment table that later calls reuse, outside the graph's memory pool (``cula_runtime.graph_pools``; a cached table
made in the pool fails inductor's check), and every replay with new inputs matches eager."""

from __future__ import annotations

import warnings

import pytest
import torch

import cula  # noqa: F401  (the ops)
from cula import dispatch
from tests.gpu_backends import use_backend
from tests.helpers import rel_l2

pytestmark = pytest.mark.gpu

B, T, H, K = 2, 300, 4, 128


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    o, _ = torch.ops.cula.lightning_prefill(q, k, v, layer_idx=0, num_layers=2)
    return o.float().sum(-1)


def test_reduce_overhead_compile_of_lightning_prefill_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend("cutedsl", monkeypatch)
    from cula_runtime.cute.lightning import prefill_backend

    torch._dynamo.reset()
    prefill_backend.clear_segment_cache()  # (the first call below builds the table, inside the warm-up)
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    compiled = torch.compile(_attend, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.CulaFallbackWarning)
        for call in range(5):  # warm-up, recording, then replays with new inputs
            q, k, v = (torch.randn(B, T, H, K, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
            out = compiled(q, k, v).clone()
            ref = _attend(q, k, v)
            assert rel_l2(out, ref) <= 1e-6, f"call {call}"
    assert counters["inductor"]["cudagraph_skips"] == skips, "a CUDA graph was skipped"
