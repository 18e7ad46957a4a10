"""cuLA's custom ops on the GPU (marked ``gpu``), for each GPU backend: ``torch.compile(mode="reduce-overhead")`` of a
KDA layer (``tests/kda_layer.py``, bf16 projections, K = V = 128) for prefill and for a decode step on the pool the
layer holds, captured in CUDA graphs (no graph skipped) and matching eager on every replay with new inputs; and a
manual CUDA-graph capture of ``torch.ops.cula.kda_decode_out`` replayed with new pool indices, against the eager
Python API on the same values.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import cula  # noqa: F401  (the ops)
from cula import dispatch
from cula.kda import kda_decode
from cula_runtime.kda_decode_args import validate_kda_decode
from tests.gpu_backends import BACKENDS, use_backend
from tests.helpers import rel_l2
from tests.kda_layer import TinyKda

pytestmark = pytest.mark.gpu

HIDDEN, H, HV, K, V, P = 256, 2, 4, 128, 128, 16


def _layer(seed: int = 0) -> TinyKda:
    torch.manual_seed(seed)
    return TinyKda(HIDDEN, H, HV, K, V, P).cuda().projections_to(torch.bfloat16).eval()


def _skips() -> int:
    """How many graphs inductor has run without a CUDA graph so far (each says why in torch's log)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def _decode_served(layer: TinyKda, x: torch.Tensor, slots: torch.Tensor) -> str | None:
    """Why no GPU kernel serves the layer's decode step here (None when one does)."""
    q, k, v, g, beta = layer._project(x)
    args = validate_kda_decode(q, k, v, g, beta, state=layer.pool, state_indices=slots, A_log=layer.A_log,
                               dt_bias=layer.dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True)
    choice = dispatch.explain_decode(args)
    return choice.summary if choice.gpu_fallback or choice.runner is None else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_overhead_compile_of_the_prefill_layer_matches_eager(backend: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(backend, monkeypatch)
    torch._dynamo.reset()
    layer = _layer()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    skips = _skips()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.CulaFallbackWarning)
        for seed in range(5):  # warm-up, recording, then replays with new inputs
            x = torch.randn(2, 256, HIDDEN, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
            out = compiled(x).clone()
            ref = layer(x)
            assert rel_l2(out.float(), ref.float()) <= 2e-3, f"call {seed}"
    assert _skips() == skips, "a CUDA graph was skipped"


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_overhead_compile_of_a_decode_step_writes_the_pool_as_eager(backend: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(backend, monkeypatch)
    torch._dynamo.reset()
    eager, layer = _layer(), _layer()
    eager.pool.copy_(torch.randn_like(eager.pool))
    layer.load_state_dict(eager.state_dict())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    reason = _decode_served(eager, x, torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda"))
    if reason is not None:
        pytest.skip(f"no GPU decode kernel serves this call here: {reason}")
    compiled = torch.compile(layer.step, mode="reduce-overhead", fullgraph=True)
    skips = _skips()
    with torch.no_grad():
        for step in range(5):
            x = torch.randn(3, 1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
            slots = torch.randperm(P, generator=gen)[:3].to(torch.int32).cuda()
            out = compiled(x, slots).clone()
            ref = eager.step(x, slots)
            assert rel_l2(out.float(), ref.float()) <= 2e-3, f"step {step}"
            assert rel_l2(layer.pool, eager.pool) <= 1e-5, f"step {step}: pools differ"
    assert _skips() == skips, "a CUDA graph was skipped"


def test_a_captured_decode_op_replays_with_new_pool_indices() -> None:
    """``torch.ops.cula.kda_decode_out`` captured once in a ``torch.cuda.CUDAGraph`` (static inputs, pool, slots and
    out), replayed after new values were copied into the inputs and the slot buffer: each replay writes the slots
    named then, as the eager Python API does on a copy of the pool."""
    layer = _layer()
    gen = torch.Generator().manual_seed(2)
    N = 4

    def fresh() -> tuple[dict, torch.Tensor]:
        x = torch.randn(N, 1, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
        q, k, v, g, beta = layer._project(x)
        slots = torch.randperm(P, generator=gen)[:N].to(torch.int32).cuda()
        return dict(q=q, k=k, v=v, g=g, beta=beta), slots

    flags = dict(A_log=layer.A_log.detach(), dt_bias=layer.dt_bias.detach(), use_qk_l2norm_in_kernel=True,
                 use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    with torch.no_grad():
        static, slots = fresh()
        reason = _decode_served(layer, torch.zeros(N, 1, HIDDEN, device="cuda", dtype=torch.bfloat16), slots)
        if reason is not None:
            pytest.skip(f"no GPU decode kernel serves this call here: {reason}")
        pool = torch.randn(P, HV, K, V, generator=gen).cuda()
        out = torch.empty_like(static["v"])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (compiles)
            torch.ops.cula.kda_decode_out(*static.values(), pool.clone(), slots, out, **flags)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.ops.cula.kda_decode_out(*static.values(), pool, slots, out, **flags)
        for _ in range(3):
            values, new_slots = fresh()
            for name, value in values.items():
                static[name].copy_(value)
            slots.copy_(new_slots)
            expected_pool = pool.clone()
            expected = kda_decode(**values, state=expected_pool, state_indices=new_slots.clone(), **flags)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected) and torch.equal(pool, expected_pool)
