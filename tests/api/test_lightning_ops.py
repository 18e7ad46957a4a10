"""The Lightning custom ops ``torch.ops.cula.lightning_prefill``, ``lightning_prefill_pool``, ``lightning_decode`` and
``lightning_decode_out`` on the CPU: ``torch.library.opcheck``, the fakes against the real results, the ops against
the Python API (the pool written in place the same way), errors through the ops, ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import pytest
import torch

from cula.lightning import lightning_decode, lightning_prefill
from tests.api.op_helpers import clone_kwargs, fake_outputs, i32, metadata

H, K, V = 2, 8, 4


def _qkv(B: int, T: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(B, T, H, K, generator=gen).to(dtype), k=torch.randn(B, T, H, K, generator=gen).to(dtype),
                v=torch.randn(B, T, H, V, generator=gen).to(dtype))


def _pool(P: int, v_first: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(P, H, *((V, K) if v_first else (K, V)), generator=gen).to(dtype)


GAMMA = torch.tensor([0.0, -0.7])

PREFILL = {
    "fixed-B2-T9": dict(**_qkv(2, 9), g_gamma=GAMMA),
    "layer-h0-final-vfirst": dict(**_qkv(2, 9, 1), layer_idx=1, num_layers=3, initial_state=torch.randn(2, H, V, K),
                                  output_final_state=True, state_v_first=True),
    "packed-0-3-6-bf16-scale": dict(**_qkv(1, 9, 2, torch.bfloat16), g_gamma=GAMMA, scale=0.5,
                                    cu_seqlens=i32([0, 0, 3, 9]), output_final_state=True),
}
PREFILL_POOL = {
    "fixed-padding-row": dict(**_qkv(3, 5, 3), state=_pool(4), state_indices=i32([2, -1, 0]), g_gamma=GAMMA),
    "packed-has-layer-bf16-pool": dict(**_qkv(1, 8, 4), state=_pool(5, True, torch.bfloat16),
                                       state_indices=i32([4, 1, 0]), has_initial_state=torch.tensor([True, False,
                                                                                                    True]),
                                       layer_idx=0, num_layers=2, cu_seqlens=i32([0, 2, 2, 8]), state_v_first=True),
}
DECODE = {
    "T1-B3": dict(**_qkv(3, 1, 6), state=_pool(4), state_indices=i32([3, -1, 1]), g_gamma=GAMMA),
    "packed-0-1-2-5-int64-cu": dict(**_qkv(1, 8, 7), state=_pool(6, True), state_indices=i32([5, 0, 2, 3]),
                                    layer_idx=2, num_layers=4, scale=1.5, state_v_first=True,
                                    cu_seqlens=torch.tensor([0, 0, 1, 3, 8])),
}


OPCHECK = [("lightning_prefill", PREFILL, n) for n in PREFILL]
OPCHECK += [("lightning_prefill_pool", PREFILL_POOL, n) for n in PREFILL_POOL]
OPCHECK += [("lightning_decode", DECODE, n) for n in DECODE]
OPCHECK += [("lightning_decode_out", DECODE, n) for n in DECODE]


@pytest.mark.parametrize(("op", "cases", "name"), OPCHECK, ids=[f"{op}-{name}" for op, _, name in OPCHECK])
def test_opcheck(op: str, cases: dict, name: str) -> None:
    kwargs = clone_kwargs(cases[name])
    if op == "lightning_decode_out":
        kwargs["out"] = torch.empty_like(kwargs["v"])
    torch.library.opcheck(getattr(torch.ops.cula, op).default, (), kwargs)


@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_fake_matches_the_real_result_and_the_python_api(name: str) -> None:
    kwargs = PREFILL[name]
    o, final_state = torch.ops.cula.lightning_prefill(**clone_kwargs(kwargs))
    fake_o, fake_final = fake_outputs(torch.ops.cula.lightning_prefill, kwargs)
    assert metadata(fake_o) == metadata(o) and metadata(fake_final) == metadata(final_state)
    assert o.shape == kwargs["v"].shape and o.dtype == kwargs["q"].dtype
    o_api, final_api = lightning_prefill(**clone_kwargs(kwargs))
    assert torch.equal(o, o_api)
    if kwargs.get("output_final_state"):
        assert torch.equal(final_state, final_api) and final_state.dtype == torch.float32
    else:
        assert final_api is None and final_state.shape == (0,) and final_state.dtype == torch.float32


@pytest.mark.parametrize("name", list(PREFILL_POOL))
def test_prefill_pool_writes_the_pool_as_the_python_api(name: str) -> None:
    kwargs = PREFILL_POOL[name]
    op_kwargs, api_kwargs = clone_kwargs(kwargs), clone_kwargs(kwargs)
    o = torch.ops.cula.lightning_prefill_pool(**op_kwargs)
    assert metadata(fake_outputs(torch.ops.cula.lightning_prefill_pool, kwargs)) == metadata(o)
    o_api, none = lightning_prefill(**api_kwargs)
    assert none is None and torch.equal(o, o_api)
    assert torch.equal(op_kwargs["state"], api_kwargs["state"]) and not torch.equal(op_kwargs["state"],
                                                                                     kwargs["state"])


@pytest.mark.parametrize("name", list(DECODE))
def test_decode_and_its_out_form_write_the_pool_as_the_python_api(name: str) -> None:
    kwargs = DECODE[name]
    op_kwargs, out_kwargs, api_kwargs = clone_kwargs(kwargs), clone_kwargs(kwargs), clone_kwargs(kwargs)
    o = torch.ops.cula.lightning_decode(**op_kwargs)
    assert metadata(fake_outputs(torch.ops.cula.lightning_decode, kwargs)) == metadata(o)
    out = torch.full_like(kwargs["v"], float("nan"))
    assert torch.ops.cula.lightning_decode_out(**out_kwargs, out=out) is None
    o_api = lightning_decode(**api_kwargs)
    assert torch.equal(o, o_api) and torch.equal(out, o_api)
    assert torch.equal(op_kwargs["state"], api_kwargs["state"]) and torch.equal(out_kwargs["state"],
                                                                                 api_kwargs["state"])
    assert not torch.equal(op_kwargs["state"], kwargs["state"])


def test_bad_arguments_raise_the_python_api_errors_through_the_ops() -> None:
    with pytest.raises(ValueError, match=r"not both"):
        torch.ops.cula.lightning_prefill(**PREFILL["fixed-B2-T9"], layer_idx=0, num_layers=1)
    with pytest.raises(ValueError, match=r"g_gamma must be finite and <= 0"):
        torch.ops.cula.lightning_decode(**{**clone_kwargs(DECODE["T1-B3"]), "g_gamma": torch.tensor([0.0, 0.5])})
    with pytest.raises(ValueError, match=r"out must have shape"):
        torch.ops.cula.lightning_decode_out(**clone_kwargs(DECODE["T1-B3"]), out=torch.empty(3, 1, H, V + 1))


def test_compile_fullgraph_of_a_prefill_and_a_decode_step_matches_eager() -> None:
    def step(q, k, v, pool, idx):
        o, _ = torch.ops.cula.lightning_prefill(q, k, v, layer_idx=1, num_layers=2)
        return o + torch.ops.cula.lightning_decode(q[:, -1:], k[:, -1:], v[:, -1:], pool, idx, layer_idx=1,
                                                   num_layers=2)[:, :1]

    kwargs = _qkv(2, 6, 8)
    pool, idx = _pool(3), i32([2, 0])
    eager_pool, compiled_pool = pool.clone(), pool.clone()
    expected = step(kwargs["q"], kwargs["k"], kwargs["v"], eager_pool, idx)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(kwargs["q"], kwargs["k"], kwargs["v"],
                                                                   compiled_pool, idx)
    assert torch.equal(got, expected) and torch.equal(compiled_pool, eager_pool)


def test_fake_outputs_follow_symbolic_sizes() -> None:
    """Traced with symbolic sizes, ``o`` has v's shape and the final state ``len(cu_seqlens) - 1`` rows."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def prefill(q, k, v, cu_seqlens):
        return torch.ops.cula.lightning_prefill(q, k, v, layer_idx=0, num_layers=2, output_final_state=True,
                                                cu_seqlens=cu_seqlens, state_v_first=True)

    kwargs = _qkv(1, 9, 9)
    graph = make_fx(prefill, tracing_mode="symbolic")(kwargs["q"], kwargs["k"], kwargs["v"], i32([0, 3, 9]))
    placeholders = {node.target: node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"}
    v, cu = placeholders["v_1"], placeholders["cu_seqlens_1"]
    output, = [node for node in graph.graph.nodes if node.op == "output"]
    o, final_state = (node.meta["val"] for node in output.args[0])
    assert not all(isinstance(size, int) for size in o.shape) and o.shape == v.shape
    assert final_state.shape[0] == cu.shape[0] - 1 and tuple(final_state.shape[1:]) == (v.shape[2], V, K)
