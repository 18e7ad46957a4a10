"""The planned decode path after its host-time cuts (issue 26 item 6): what still misses a plan (a tensor's dtype,
stride or device, a flag's type, a knob), the plan as one Python frame that allocates nothing with ``out``, and a
misaligned tensor (refused by TVM-FFI before any launch) sent through ``compile_cache.launch`` as the unplanned path
sends it. Driven on CPU tensors: the kernels' real configurations and argument specs (CuTeDSL imports, nothing
compiles), the compiled kernel a stand-in that refuses a misaligned pointer with a ``ValueError`` as TVM-FFI does,
and CPU index tensors let through the signature as a GPU call's are."""

from __future__ import annotations

import pytest
import torch

import cula.kda
import cula.lightning
from cula import call_plans, dispatch
from cula_runtime.env import env_value
from cula_runtime.kda_decode_args import validate_kda_decode
from cula_runtime.lightning_args import validate_lightning_decode
from tests.helpers import AllocationCounter

pytest.importorskip("cutlass", reason="CuTeDSL is not installed (the plans build the kernels' real argument specs)")

K = 128
KNOB = "CULA_TEST_HOST_PATH_KNOB"  # a knob read once here, so that the snapshot holds it


class Kernels:
    """The compiled-kernel stand-in: records each launch's arguments; refuses (``ValueError``, before recording) a
    tensor whose data pointer breaks its spec's alignment, as TVM-FFI's checks do."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def compile(self, kernel_cls, config, *, target=None):
        specs = kernel_cls(config).argument_specs()

        def kernel(*args):
            for i, (spec, arg) in enumerate(zip(specs, args, strict=False)):
                if spec is not None and arg.data_ptr() % spec.align:
                    raise ValueError(f"Misaligned Tensor data on argument #{i}")
            self.launches.append(args)

        return kernel


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch):
    """(kernels, validations): the decode calls of both ops planned by their CuTeDSL backends on the CPU."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda import decode_backend as kda_backend
    from cula_runtime.cute.lightning import decode_backend as lightning_backend

    stand_in, validations = Kernels(), []
    monkeypatch.setattr(compile_cache, "_launchable", {})
    monkeypatch.setattr(compile_cache, "launch_target", lambda index: "sm_90a")
    monkeypatch.setattr(compile_cache, "compile_kernel", stand_in.compile)
    monkeypatch.setattr(call_plans, "indices_checked_on_host", lambda idx: False)
    monkeypatch.setattr(lightning_backend, "device_rejection", lambda device: None)

    def counted(validate):
        def run(*a, **kw):
            validations.append(validate.__name__)
            return validate(*a, **kw)
        return run

    monkeypatch.setattr(cula.kda, "validate_kda_decode", counted(validate_kda_decode))
    monkeypatch.setattr(cula.lightning, "validate_lightning_decode", counted(validate_lightning_decode))
    monkeypatch.setattr(cula.kda, "select_decode_backend", lambda args: kda_backend.kda_decode_cutedsl_backend)
    monkeypatch.setattr(cula.lightning, "select_lightning_decode_backend",
                        lambda args: lightning_backend.lightning_decode_cutedsl_backend)
    monkeypatch.setattr(dispatch, "_planners", {
        kda_backend.kda_decode_cutedsl_backend: kda_backend.plan_kda_decode,
        lightning_backend.lightning_decode_cutedsl_backend: lightning_backend.plan_lightning_decode})
    monkeypatch.delenv("CULA_CALL_PLANS", raising=False)
    monkeypatch.delenv(KNOB, raising=False)
    env_value(KNOB, "")
    call_plans.clear_call_plans()
    yield stand_in, validations
    call_plans.clear_call_plans()


def _kda(seed: int = 0, **changes) -> dict:
    """A kda_decode call of three sequences (one padding row), the benchmark's form: fp32 log-gate, L2 norm, out."""
    gen = torch.Generator().manual_seed(seed)
    B, H, HV = 3, 2, 4
    kwargs = dict(q=torch.randn(B, 1, H, K, generator=gen).bfloat16(),
                  k=torch.randn(B, 1, H, K, generator=gen).bfloat16(),
                  v=torch.randn(B, 1, HV, K, generator=gen).bfloat16(), g=-torch.rand(B, 1, HV, K, generator=gen),
                  beta=torch.rand(B, 1, HV, generator=gen), state=torch.zeros(7, HV, K, K),
                  state_indices=torch.tensor([5, -1, 2], dtype=torch.int32), use_qk_l2norm_in_kernel=True,
                  out=torch.empty(B, 1, HV, K, dtype=torch.bfloat16))
    kwargs.update(changes)
    return kwargs


def _lightning(seed: int = 0, **changes) -> dict:
    """A lightning_decode call of three sequences, the benchmark's form: g_gamma (on the CPU: the layer form
    instead, since a CPU g_gamma's values are checked on every call), scale and out."""
    gen = torch.Generator().manual_seed(seed)
    B, H = 3, 2
    kwargs = dict(q=torch.randn(B, 1, H, K, generator=gen).bfloat16(),
                  k=torch.randn(B, 1, H, K, generator=gen).bfloat16(),
                  v=torch.randn(B, 1, H, K, generator=gen).bfloat16(), layer_idx=0, num_layers=2, scale=0.1,
                  state=torch.zeros(5, H, K, K), state_indices=torch.tensor([4, 0, -1], dtype=torch.int32),
                  out=torch.empty(B, 1, H, K, dtype=torch.bfloat16))
    kwargs.update(changes)
    return kwargs


OPS = {"kda": (cula.kda.kda_decode, _kda), "lightning": (cula.lightning.lightning_decode, _lightning)}


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous tensor of its shape and dtype whose data starts one element into a buffer."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t)


@pytest.mark.parametrize("op", list(OPS))
def test_the_plan_is_one_frame_and_allocates_nothing_with_out(op: str, kernels) -> None:
    stand_in, validations = kernels
    fn, make = OPS[op]
    fn(**make(0))
    call = make(1)
    with AllocationCounter() as counted:
        assert fn(**call) is call["out"]
    assert counted.count == 0 and len(validations) == 1 and len(stand_in.launches) == 2
    [plan] = call_plans._plans.values()
    assert plan.__name__ == "launch_planned", "the kernel module's launch is the plan itself: no wrapper frame"
    fn(**{**make(2), "out": None})  # (another signature: validated, planned)
    no_out = {**make(3), "out": None}
    with AllocationCounter() as counted:
        o = fn(**no_out)
    assert counted.count == 1 and len(validations) == 2, "without out: o, and nothing else"
    assert o.shape == call["out"].shape and o.dtype == torch.bfloat16
    assert stand_in.launches[-1][-3 if op == "kda" else -2] is o


@pytest.mark.parametrize("change", ["g-bf16", "state-slot-stride", "out-on-meta", "beta-strided"])
def test_a_changed_dtype_stride_or_device_misses_the_plan(change: str, kernels) -> None:
    stand_in, validations = kernels
    cula.kda.kda_decode(**_kda(0))
    call = _kda(1)
    if change == "g-bf16":  # another kernel configuration: validated, then a plan of its own
        call["g"] = call["g"].bfloat16()
    elif change == "state-slot-stride":  # the pool's free slot stride
        call["state"] = torch.zeros(7, 5, K, K)[:, :4]
    elif change == "out-on-meta":  # the validator's refusal, not the plan's launch
        call["out"] = torch.empty(call["out"].shape, dtype=torch.bfloat16, device="meta")
        with pytest.raises(ValueError, match="out"):
            cula.kda.kda_decode(**call)
        assert len(validations) == 2 and len(stand_in.launches) == 1
        return
    else:  # copied by the validator: never planned
        call["beta"] = torch.rand(3, 1, 8)[..., ::2]
    cula.kda.kda_decode(**call)
    assert len(validations) == 2 and len(stand_in.launches) == 2
    assert stand_in.launches[-1][3].dtype == call["g"].dtype and stand_in.launches[-1][7] is call["state"]


@pytest.mark.parametrize("op", list(OPS))
def test_a_flag_that_is_not_a_bool_is_validated_every_call(op: str, kernels) -> None:
    _, validations = kernels
    fn, make = OPS[op]
    fn(**make(0))
    flag = "use_qk_l2norm_in_kernel" if op == "kda" else "state_v_first"
    with pytest.raises(TypeError, match=flag):
        fn(**make(1, **{flag: 1}))  # (1 == True, and hashes alike: it must not find the plan made for True)
    assert len(validations) == 2


@pytest.mark.parametrize("op", list(OPS))
def test_a_knob_change_misses_and_the_first_plan_serves_again(op: str, kernels, monkeypatch) -> None:
    stand_in, validations = kernels
    fn, make = OPS[op]
    fn(**make(0))
    fn(**make(1))
    assert len(validations) == 1
    monkeypatch.setenv(KNOB, "x")
    fn(**make(2))
    fn(**make(3))
    assert len(validations) == 2, "a new knob value: validated once, then its own plan"
    monkeypatch.delenv(KNOB)
    fn(**make(4))
    assert len(validations) == 2 and len(stand_in.launches) == 5, "the knob as it was: the first plan again"


@pytest.mark.parametrize("op", list(OPS))
def test_plans_off_is_read_when_a_call_misses(op: str, kernels, monkeypatch) -> None:
    stand_in, validations = kernels
    fn, make = OPS[op]
    monkeypatch.setenv("CULA_CALL_PLANS", "0")
    fn(**make(0))
    fn(**make(1))
    assert len(validations) == 2 and call_plans._plans == {}
    monkeypatch.delenv("CULA_CALL_PLANS")
    fn(**make(2))
    fn(**make(3))
    assert len(validations) == 3 and len(stand_in.launches) == 4


@pytest.mark.parametrize("op", list(OPS))
def test_a_misaligned_input_is_copied_and_a_misaligned_out_refused(op: str, kernels) -> None:
    stand_in, validations = kernels
    fn, make = OPS[op]
    fn(**make(0))
    call = make(1)
    odd_q = _misaligned(call["q"])
    assert odd_q.is_contiguous() and odd_q.data_ptr() % 16
    assert fn(**{**call, "q": odd_q}) is call["out"]
    assert len(validations) == 1, "the signature holds no pointer: the plan serves the call"
    q_passed = stand_in.launches[-1][0]
    assert q_passed is not odd_q and q_passed.data_ptr() % 16 == 0 and torch.equal(q_passed, odd_q)
    with pytest.raises(ValueError, match="output tensor .* breaks the kernel's layout promise"):
        fn(**{**make(2), "out": _misaligned(call["out"])})
    assert len(stand_in.launches) == 2


def test_bound_launch_sends_a_misaligned_input_through_launch(monkeypatch) -> None:
    """bound_launch (the Lightning prefill's kernels) on the same rule: TVM-FFI's refusal, then launch's copy."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.lightning.decode import _OUTPUTS, LightningDecode, LightningDecodeConfig

    stand_in = Kernels()
    monkeypatch.setattr(compile_cache, "_launchable", {})
    monkeypatch.setattr(compile_cache, "launch_target", lambda index: "sm_90a")
    monkeypatch.setattr(compile_cache, "compile_kernel", stand_in.compile)
    config = LightningDecodeConfig(num_heads=2)
    specs = LightningDecode(config).argument_specs()
    run = compile_cache.bound_launch(LightningDecode, config, specs, _OUTPUTS, torch.device("cpu"))
    q = torch.randn(3, 1, 2, K).bfloat16()
    tensors = [q, q, q, torch.zeros(2), torch.zeros(4, 2, K, K), torch.zeros(3, dtype=torch.int32),
               torch.zeros(4, dtype=torch.int32), torch.empty_like(q)]
    run(tuple(tensors), (0.5,))
    assert stand_in.launches[-1][6] is None, "an argument its configuration has not is passed as None"
    tensors[1] = _misaligned(q)
    run(tuple(tensors), (0.5,))
    assert len(stand_in.launches) == 2 and stand_in.launches[-1][1] is not tensors[1]
    assert torch.equal(stand_in.launches[-1][1], q)


class _Compiled:
    """The shape of CuTeDSL 4.8's compiled object: its TVM-FFI function and its arguments' facts."""

    def __init__(self, function: object, pointers: bool) -> None:
        self.function = function
        self.execution_args = type("ExecutionArgs", (), {"has_pointer_address_arg_specs": pointers})()

    def __tvm_ffi_object__(self) -> object:
        return self.function

    def __call__(self, *args: object) -> None:
        raise AssertionError("the wrapper is not called when its function is")


def test_direct_callable_takes_the_tvm_ffi_function_only_where_the_wrapper_just_forwards() -> None:
    from cula_runtime.cute.compile_cache import direct_callable

    function = object()
    assert direct_callable(_Compiled(function, pointers=False)) is function
    with_pointers = _Compiled(function, pointers=True)
    assert direct_callable(with_pointers) is with_pointers, "Python pointers to convert: the wrapper converts them"
    uninitialised = _Compiled(None, pointers=False)
    assert direct_callable(uninitialised) is uninitialised, "its own call says why it cannot run"

    def stand_in(*args: object) -> None:
        return None

    assert direct_callable(stand_in) is stand_in


_WRAPPER_FACTS = """
import inspect, json
from cula_runtime.cute.compile_cache import compile_kernel, direct_callable
from cula_runtime.cute.lightning.decode import LightningDecode, LightningDecodeConfig

compiled = compile_kernel(LightningDecode, LightningDecodeConfig(num_heads=2), target="sm_90a")
function = direct_callable(compiled)
wrapper = getattr(compiled, "_kwargs_wrapper", None)
params = [] if wrapper is None else list(inspect.signature(wrapper).parameters.values())
print(json.dumps({
    "kind": type(compiled).__name__,
    "direct": function is not compiled,
    "positional": [p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in params],
    "forwards_to_it": wrapper is not None and any(v is function for v in wrapper.__globals__.values()),
}))
"""


@pytest.mark.compile
def test_cutedsls_wrapper_only_forwards_to_the_function_direct_callable_takes() -> None:
    """On the installed CuTeDSL: the compiled decode kernel's Python wrapper hands its nine positional arguments,
    none defaulted, to exactly the function ``direct_callable`` returns (so calling that function is the same
    call). In a fresh process with ``CUTE_DSL_ARCH`` set before CuTeDSL is imported: on a machine without a GPU,
    CuTeDSL makes the TVM-FFI function only then (a GPU launch always has it)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _WRAPPER_FACTS], env=env, capture_output=True, text=True,
                          check=True, timeout=600)
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    if facts["kind"] != "TVMFFIJitCompiledFunctionWithKwargs":
        pytest.skip(f"this CuTeDSL's compiled object is a {facts['kind']}: called as it is")
    assert facts["direct"] and facts["forwards_to_it"]
    assert facts["positional"] == [True] * 9


def _on_gpu(call: dict) -> dict:
    """``call`` with every tensor on the GPU (a Lightning call with its layer's ``g_gamma`` tensor instead of the
    layer form: the benchmark's form)."""
    moved = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in call.items()}
    if "layer_idx" in moved:
        H = moved["q"].shape[2]
        moved["g_gamma"] = cula.lightning.layer_g_gamma(H, moved.pop("layer_idx"), moved.pop("num_layers"), "cuda")
    return moved


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_on_the_gpu_a_planned_call_through_tvm_ffi_gives_the_unplanned_bits(op: str, monkeypatch) -> None:
    """The real kernels: the planned call (the TVM-FFI function called directly) writes the bits of the unplanned
    one; a misaligned input is refused by TVM-FFI and copied by launch (the same bits); a misaligned out is refused
    with launch's ValueError, and nothing is written (as before the plans called TVM-FFI directly; an unplanned
    Lightning call with such an out runs the reference instead: its backend declines it)."""
    from cula_runtime.cute import compile_cache

    monkeypatch.delenv("CULA_CALL_PLANS", raising=False)
    call_plans.clear_call_plans()
    fn, make = OPS[op]
    call = _on_gpu(make(0))
    pool = call["state"].clone()

    def run(**changes) -> tuple[torch.Tensor, torch.Tensor]:
        call["state"].copy_(pool)
        o = fn(**{**call, **changes})
        torch.cuda.synchronize()
        return o.clone(), call["state"].clone()

    monkeypatch.setenv("CULA_CALL_PLANS", "0")
    unplanned = run()
    monkeypatch.delenv("CULA_CALL_PLANS")
    run()  # (makes the plan)
    assert len(call_plans._plans) == 1
    planned = run()
    assert all(torch.equal(a, b) for a, b in zip(planned, unplanned, strict=True))
    import tvm_ffi

    assert any(isinstance(f, tvm_ffi.Function) for f in compile_cache._launchable.values()), "called directly"
    odd = run(q=_misaligned(call["q"]))
    assert all(torch.equal(a, b) for a, b in zip(odd, unplanned, strict=True))
    call["state"].copy_(pool)
    with pytest.raises(ValueError, match="output tensor .* breaks the kernel's layout promise"):
        fn(**{**call, "out": _misaligned(call["out"])})
    torch.cuda.synchronize()
    assert torch.equal(call["state"], pool), "a refused call writes nothing"
    assert len(call_plans._plans) == 1
    call_plans.clear_call_plans()
