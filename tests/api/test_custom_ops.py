"""The torch custom ops ``torch.ops.cula.*`` (:mod:`cula.ops`) on the CPU: ``torch.library.opcheck`` of each op, the
fake implementations' shapes, dtypes and strides against the real results, the same results as the Python API (bit
for bit), errors naming the argument, no backward, ``torch.compile(fullgraph=True)`` of a small KDA layer (prefill,
and a decode step on a pool held by the layer) matching eager, and registration on ``import cula`` without any GPU
module."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import cula
from cula.kda import kda_decode, kda_prefill
from cula.ops import OPS
from tests.api.op_helpers import clone_kwargs, fake_outputs, i32, metadata
from tests.kda_layer import TinyKda

B, T, H, HV, K, V = 2, 9, 1, 2, 8, 4


def inputs(B: int = B, T: int = T, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(q=r(B, T, H, K).to(dtype), k=r(B, T, H, K).to(dtype), v=r(B, T, HV, V).to(dtype),
                g=-torch.rand(B, T, HV, K, generator=gen), beta=torch.rand(B, T, HV, generator=gen))


def gate_params(seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(use_gate_in_kernel=True, A_log=0.1 * torch.randn(HV, generator=gen),
                dt_bias=0.1 * torch.randn(HV * K, generator=gen), use_qk_l2norm_in_kernel=True,
                use_beta_sigmoid_in_kernel=True)


def packed(lens: list[int], **overrides) -> dict:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    kwargs = inputs(1, cu[-1])
    kwargs.update(cu_seqlens=i32(cu), **overrides)
    return kwargs


def pool(P: int, v_first: bool = False, seed: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(P, HV, V, K, generator=gen) if v_first else torch.randn(P, HV, K, V, generator=gen)


def _h0(N: int, v_first: bool) -> torch.Tensor:
    return pool(N, v_first, seed=5)


PREFILL = {
    "fixed-B2-T9": inputs(),
    "fixed-final-state": dict(inputs(), output_final_state=True),
    "fixed-h0-vfirst": dict(inputs(), initial_state=_h0(B, True), output_final_state=True, state_v_first=True),
    "gate-in-kernel-safe": dict(inputs(), output_final_state=True, safe_gate=True, lower_bound=-5.0, **gate_params()),
    "gate-softplus-scale": dict(inputs(), scale=0.5, **gate_params()),
    "bf16-q-fp32-g": dict(inputs(dtype=torch.bfloat16), output_final_state=True),
    "packed-3-0-6": packed([3, 0, 6], output_final_state=True),
    "packed-cpu-copy": packed([4, 5], output_final_state=True, initial_state=_h0(2, False)),
}
PREFILL["packed-cpu-copy"]["cu_seqlens_cpu"] = PREFILL["packed-cpu-copy"]["cu_seqlens"].clone()

PREFILL_POOL = {
    "fixed-slots-3-0": dict(inputs(), state=pool(5), state_indices=i32([3, 0])),
    "fixed-padding-row": dict(inputs(), state=pool(5), state_indices=i32([-1, 2])),
    "packed-has-initial": packed([3, 0, 6], state=pool(4, True), state_indices=i32([1, 3, 0]),
                                 has_initial_state=torch.tensor([True, False, True]), state_v_first=True),
}

DECODE = {
    "T1-B3": dict(inputs(3, 1), state=pool(6), state_indices=i32([4, -1, 1])),
    "T1-gate-vfirst": dict(inputs(3, 1), state=pool(6, True), state_indices=i32([0, 5, 2]), state_v_first=True,
                           lower_bound=-3.0, **gate_params()),
    "packed-1-0-3-int64-cu": dict(packed([1, 0, 3]), state=pool(5), state_indices=i32([2, 0, 4])),
    "speculative-W3": dict(inputs(2, 3), state=pool(8), state_indices=i32([[0, 1, 2], [5, 6, 7]]),
                           num_accepted_tokens=i32([2, 1])),
}
DECODE["packed-1-0-3-int64-cu"]["cu_seqlens"] = DECODE["packed-1-0-3-int64-cu"]["cu_seqlens"].long()


# opcheck (schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes) costs ~2 s a case: a
# subset covering each op's optional arguments; the fake-vs-real tests below take every case.
OPCHECK = [("kda_prefill", PREFILL, name) for name in ("fixed-B2-T9", "fixed-h0-vfirst", "gate-in-kernel-safe",
                                                      "bf16-q-fp32-g", "packed-cpu-copy")]
OPCHECK += [("kda_prefill_pool", PREFILL_POOL, name) for name in ("fixed-padding-row", "packed-has-initial")]
OPCHECK += [("kda_decode", DECODE, name) for name in ("T1-B3", "packed-1-0-3-int64-cu", "speculative-W3")]
OPCHECK += [("kda_decode_out", DECODE, name) for name in ("T1-gate-vfirst", "speculative-W3")]


@pytest.mark.parametrize(("op", "cases", "name"), OPCHECK, ids=[f"{op}-{name}" for op, _, name in OPCHECK])
def test_opcheck(op: str, cases: dict, name: str) -> None:
    kwargs = clone_kwargs(cases[name])
    if op == "kda_decode_out":
        kwargs["out"] = torch.empty_like(kwargs["v"])
    torch.library.opcheck(getattr(torch.ops.cula, op).default, (), kwargs)


@pytest.mark.parametrize("name", list(PREFILL))
def test_kda_prefill_fake_matches_the_real_result_and_the_python_api(name: str) -> None:
    kwargs = PREFILL[name]
    o, final_state = torch.ops.cula.kda_prefill(**clone_kwargs(kwargs))
    fake_o, fake_final = fake_outputs(torch.ops.cula.kda_prefill, kwargs)
    assert metadata(fake_o) == metadata(o)
    assert metadata(fake_final) == metadata(final_state)
    N = kwargs["q"].shape[0] if "cu_seqlens" not in kwargs else kwargs["cu_seqlens"].numel() - 1
    assert o.shape == (*kwargs["v"].shape[:2], HV, V) and o.dtype == kwargs["q"].dtype and o.is_contiguous()
    o_api, final_api = kda_prefill(**clone_kwargs(kwargs))
    assert torch.equal(o, o_api)
    if kwargs.get("output_final_state"):
        dims = (V, K) if kwargs.get("state_v_first") else (K, V)
        assert final_state.shape == (N, HV, *dims) and final_state.dtype == torch.float32
        assert torch.equal(final_state, final_api)
    else:  # the op's stand-in for the API's None
        assert final_api is None and final_state.shape == (0,) and final_state.dtype == torch.float32


@pytest.mark.parametrize("name", list(PREFILL_POOL))
def test_kda_prefill_pool_writes_the_pool_as_the_python_api(name: str) -> None:
    kwargs = PREFILL_POOL[name]
    op_kwargs, api_kwargs = clone_kwargs(kwargs), clone_kwargs(kwargs)
    o = torch.ops.cula.kda_prefill_pool(**op_kwargs)
    assert metadata(fake_outputs(torch.ops.cula.kda_prefill_pool, kwargs)) == metadata(o)
    o_api, none = kda_prefill(**api_kwargs)
    assert none is None and torch.equal(o, o_api)
    assert torch.equal(op_kwargs["state"], api_kwargs["state"])
    assert not torch.equal(op_kwargs["state"], kwargs["state"])  # (written in place)


@pytest.mark.parametrize("name", list(DECODE))
def test_kda_decode_and_its_out_form_write_the_pool_as_the_python_api(name: str) -> None:
    kwargs = DECODE[name]
    op_kwargs, out_kwargs, api_kwargs = clone_kwargs(kwargs), clone_kwargs(kwargs), clone_kwargs(kwargs)
    o = torch.ops.cula.kda_decode(**op_kwargs)
    assert metadata(fake_outputs(torch.ops.cula.kda_decode, kwargs)) == metadata(o)
    out = torch.full_like(kwargs["v"], float("nan"))
    assert torch.ops.cula.kda_decode_out(**out_kwargs, out=out) is None
    o_api = kda_decode(**api_kwargs)
    assert torch.equal(o, o_api) and torch.equal(out, o_api)
    assert torch.equal(op_kwargs["state"], api_kwargs["state"])
    assert torch.equal(out_kwargs["state"], api_kwargs["state"])
    assert not torch.equal(op_kwargs["state"], kwargs["state"])


def test_fake_outputs_follow_symbolic_sizes() -> None:
    """Traced with symbolic sizes, the outputs' sizes are the inputs' symbols (nothing specialised): ``o`` has v's
    shape, the final state ``len(cu_seqlens) - 1`` rows."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def prefill(q, k, v, g, beta, cu_seqlens):
        return torch.ops.cula.kda_prefill(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens,
                                          state_v_first=True)

    kwargs = packed([3, 6])
    graph = make_fx(prefill, tracing_mode="symbolic")(*(kwargs[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")))
    placeholders = {node.target: node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"}
    v, cu = placeholders["v_1"], placeholders["cu_seqlens_1"]
    output, = [node for node in graph.graph.nodes if node.op == "output"]
    o, final_state = (node.meta["val"] for node in output.args[0])
    assert not all(isinstance(size, int) for size in o.shape)  # (symbols, not the example's sizes)
    assert o.shape == v.shape
    assert final_state.shape[0] == cu.shape[0] - 1 and tuple(final_state.shape[1:]) == (v.shape[2], V, K)


def test_bad_arguments_raise_the_python_api_errors_through_the_ops() -> None:
    with pytest.raises(ValueError, match=r"beta must have shape"):
        torch.ops.cula.kda_prefill(**dict(inputs(), beta=torch.rand(B, T, HV + 1)))
    with pytest.raises(TypeError, match=r"state_indices must have dtype torch.int32"):
        torch.ops.cula.kda_decode(**dict(DECODE["T1-B3"], state_indices=torch.tensor([4, -1, 1])))
    with pytest.raises(ValueError, match=r"out must have shape"):
        torch.ops.cula.kda_decode_out(**clone_kwargs(DECODE["T1-B3"]), out=torch.empty(3, 1, HV, V + 1))


@pytest.mark.parametrize(("op", "kwargs", "name"), [
    ("kda_prefill", PREFILL["fixed-h0-vfirst"], "initial_state"), ("kda_prefill", PREFILL["packed-cpu-copy"], "k"),
    ("kda_prefill_pool", PREFILL_POOL["packed-has-initial"], "has_initial_state"),
    ("kda_decode", DECODE["speculative-W3"], "num_accepted_tokens"), ("kda_decode", DECODE["T1-B3"], "state"),
], ids=["prefill-h0", "prefill-k", "prefill-pool-has-initial", "decode-accepted", "decode-state"])
def test_one_meta_tensor_among_real_ones_is_refused_by_name(op: str, kwargs: dict, name: str) -> None:
    """A meta tensor among CPU ones sends the call to the fake implementation (the meta kernel), which refuses it
    as the Python API does instead of returning uninitialised outputs."""
    mixed = dict(clone_kwargs(kwargs), **{name: kwargs[name].to("meta")})
    with pytest.raises(ValueError, match=f"^{name} must be on q's device \\(cpu\\), got meta$"):
        getattr(torch.ops.cula, op)(**mixed)


def test_gradients_flow_through_an_op_only_where_the_python_api_has_them() -> None:
    """No op registers a backward: torch's autograd fallback lets the CPU reference's own torch ops record the
    graph (the gradient is the Python API's), and warns that the op has no autograd kernel."""
    api_kwargs, op_kwargs = clone_kwargs(inputs()), clone_kwargs(inputs())
    for kwargs in (api_kwargs, op_kwargs):
        kwargs["q"].requires_grad_()
    kda_prefill(**api_kwargs)[0].sum().backward()
    with pytest.warns(UserWarning, match="an autograd kernel was not registered"):
        torch.ops.cula.kda_prefill(**op_kwargs)[0].sum().backward()
    torch.testing.assert_close(op_kwargs["q"].grad, api_kwargs["q"].grad, rtol=0, atol=0)


def test_the_cpu_reference_has_gradients_for_every_input() -> None:
    """The Python API on the CPU (the reference, fp32 inside) differentiates through every float input, g included,
    and its gradients match the float64 recurrence's (autograd through ``kda_naive``)."""
    from cula_runtime.reference import kda_naive

    base = {name: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for name, x in inputs().items()}
    names = [name for name in ("q", "k", "v", "g", "beta") if isinstance(base.get(name), torch.Tensor)]
    grads = []
    for run in (kda_prefill, kda_naive):
        kwargs = clone_kwargs(base)
        for name in names:
            kwargs[name].requires_grad_()
        o = run(**kwargs)[0]
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum().backward()
        grads.append([kwargs[name].grad for name in names])
    for name, got, want in zip(names, *grads, strict=True):
        assert got is not None and torch.isfinite(got).all(), name
        error = float((got - want).norm() / want.norm())
        assert error < 1e-5, f"{name}: relative L2 error {error:.1e} against the float64 recurrence's gradient"


needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="torch.compile's CPU backend (inductor) needs a C++ compiler")


@needs_compiler
@pytest.mark.slow
def test_compile_fullgraph_of_a_kda_layer_matches_eager() -> None:
    """Inductor on the CPU (about 4 s cold here): fullgraph=True raises on any graph break; the projections are
    compiled, the op runs as one node (cuLA's torch reference on the CPU)."""
    torch.manual_seed(0)
    layer = TinyKda().eval()
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    with torch.no_grad():
        for T_ in (24, 40):  # (the second length recompiles with a dynamic T)
            x = torch.randn(2, T_, 32)
            torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_fullgraph_of_a_decode_step_mutates_the_pool_as_eager() -> None:
    """The decode step (the pool a buffer mutated in place by the op) under ``aot_eager``: the functionalised
    graph must write the pool back as eager does, for new slots each call. (``aot_eager``: the mutation and the
    op's fake are what is tested here; inductor's code for the projections is the test above's.)"""
    torch.manual_seed(0)
    eager, compiled_layer = TinyKda().eval(), TinyKda().eval()
    eager.pool.copy_(torch.randn_like(eager.pool))
    compiled_layer.load_state_dict(eager.state_dict())  # (the pool too: a buffer)
    compiled = torch.compile(compiled_layer.step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for slots in ([0, 3], [5, -1], [3, 0]):
            x = torch.randn(2, 1, 32)
            torch.testing.assert_close(compiled(x, i32(slots)), eager.step(x, i32(slots)), rtol=0, atol=0)
            assert torch.equal(compiled_layer.pool, eager.pool)


_HEAVY = ("cutlass", "triton", "fla", "cula_sm90")
_PROBE = textwrap.dedent(
    """
    import sys

    class Block:  # the heavy packages unimportable, as on a machine without them
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {heavy!r}:
                raise ImportError(f"blocked for this test: {{name}}")
            return None

    sys.meta_path.insert(0, Block())
    import cula
    import torch
    for name in {ops!r}:
        assert hasattr(torch.ops.cula, name), name
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
    assert not loaded, loaded
    assert not torch.cuda.is_initialized()
    print("ok")
    """
)


def test_import_cula_registers_the_ops_without_gpu_modules() -> None:
    code = _PROBE.format(heavy=set(_HEAVY), ops=OPS)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_every_op_is_registered_once_with_the_python_api_defaults() -> None:
    assert cula.ops.OPS == OPS == cula.ops.KDA_OPS + cula.ops.LIGHTNING_OPS
    for name in OPS:
        schema = getattr(torch.ops.cula, name).default._schema
        inputs = "Tensor q, Tensor k, Tensor v" + (", Tensor g, Tensor beta" if name.startswith("kda_") else "")
        assert str(schema).startswith(f"cula::{name}({inputs}")
    mutated = {name: [a.name for a in getattr(torch.ops.cula, name).default._schema.arguments
                      if a.alias_info is not None and a.alias_info.is_write] for name in OPS}
    assert mutated == {"kda_prefill": [], "kda_prefill_pool": ["state"], "kda_decode": ["state"],
                       "kda_decode_out": ["state", "out"], "lightning_prefill": [],
                       "lightning_prefill_pool": ["state"], "lightning_decode": ["state"],
                       "lightning_decode_out": ["state", "out"]}


def test_the_fake_takes_the_host_copy_of_cu_seqlens_on_the_cpu() -> None:
    """``cu_seqlens_cpu`` is the host copy of ``cu_seqlens`` (a CPU tensor, as the Python API requires): the fakes'
    device check takes it on the CPU beside a GPU call's tensors (fake CUDA tensors, as ``torch.compile`` traces a
    GPU call; no GPU needed) and refuses it on q's device, with the Python API's message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        def cuda(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device="cuda")

        call = dict(q=cuda(1, 9, 1, 8, dtype=torch.bfloat16), k=cuda(1, 9, 1, 8, dtype=torch.bfloat16),
                    v=cuda(1, 9, 2, 4, dtype=torch.bfloat16), g=cuda(1, 9, 2, 8), beta=cuda(1, 9, 2),
                    cu_seqlens=cuda(3, dtype=torch.int32), output_final_state=True)
        o, final_state = torch.ops.cula.kda_prefill(**call, cu_seqlens_cpu=torch.empty(3, dtype=torch.int32))
        assert o.shape == (1, 9, 2, 4) and o.device.type == "cuda" and final_state.shape == (2, 2, 8, 4)
        with pytest.raises(ValueError, match=r"^cu_seqlens_cpu must be a CPU tensor \(the host copy of cu_seqlens\)"):
            torch.ops.cula.kda_prefill(**call, cu_seqlens_cpu=cuda(3, dtype=torch.int32))


@pytest.mark.parametrize("case", ["kda_prefill-v-3d", "kda_decode-v-3d", "lightning_decode-v-3d", "cu_seqlens-empty"])
def test_a_bad_shape_is_the_api_error_while_tracing(case: str) -> None:
    """The fakes check their inputs' shapes as the validator does: under ``torch.compile`` a bad shape stops the
    trace with the Python API's message naming the argument (torch wraps it), not an index error."""
    H, K, V = 1, 8, 4
    q, k, g, beta = torch.randn(1, 5, H, K), torch.randn(1, 5, H, K), -torch.rand(1, 5, HV, K), torch.rand(1, 5, HV)
    calls = {
        "kda_prefill-v-3d": (lambda v: torch.ops.cula.kda_prefill(q, k, v.flatten(2), g, beta), "v must have shape"),
        "kda_decode-v-3d": (lambda v: torch.ops.cula.kda_decode(q, k, v.flatten(2), g, beta,
                                                                 torch.zeros(2, HV, K, V), i32([0])),
                            "v must have shape"),
        "lightning_decode-v-3d": (lambda v: torch.ops.cula.lightning_decode(q, k, v[:, :, 0], torch.zeros(2, H, K, V),
                                                                            i32([0]), layer_idx=0, num_layers=1),
                                  "v must have shape"),
        "cu_seqlens-empty": (lambda v: torch.ops.cula.kda_prefill(q, k, v, g, beta, output_final_state=True,
                                                                  cu_seqlens=i32([])),
                             r"cu_seqlens must be 1-D \[N\+1\] with N >= 1"),
    }
    fn, message = calls[case]
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(torch.randn(1, 5, HV, V))
