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
from tests.api.op_helpers import counted
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

    monkeypatch.setattr(cula.kda, "validate_kda_decode", counted(validate_kda_decode, validations))
    monkeypatch.setattr(cula.lightning, "validate_lightning_decode", counted(validate_lightning_decode, validations))
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


def _kept_plans() -> list:
    """Every plan kept, with or without guards."""
    return [*call_plans._plans.values(), *(plan for entries in call_plans._guarded_plans.values()
                                             for _, plan in entries)]


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous tensor of its shape and dtype whose data starts one element into a buffer."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t)


@pytest.mark.parametrize("op", list(OPS))
def test_the_plan_is_one_frame_and_allocates_nothing_with_out(op: str, kernels) -> None:
    stand_in, validations = kernels
    fn, make = OPS[op]
    # (the plans are made under a dispatch mode too, as the counted calls run: torch's native guards, which the
    # KDA decode's plans use, compare the thread's dispatch state, and a plan made outside a mode is not used in one)
    with AllocationCounter():
        fn(**make(0))
    call = make(1)
    with AllocationCounter() as counted:
        assert fn(**call) is call["out"]
    assert counted.count == 0 and len(validations) == 1 and len(stand_in.launches) == 2
    [plan] = _kept_plans()
    assert plan.__name__ == "launch_planned", "the kernel module's launch is the plan itself: no wrapper frame"
    with AllocationCounter():
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
    assert len(validations) == 2 and _kept_plans() == []
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
    # (the plan declines what TVM-FFI refuses: the unplanned path decides the call)
    assert len(validations) == 2 and len(stand_in.launches) == 2
    q_passed = stand_in.launches[-1][0]
    assert q_passed is not odd_q and q_passed.data_ptr() % 16 == 0 and torch.equal(q_passed, odd_q)
    with pytest.raises(ValueError, match="output tensor .* breaks the kernel's layout promise"):
        fn(**{**make(2), "out": _misaligned(call["out"])})
    assert len(stand_in.launches) == 2
    call_plans.clear_call_plans()  # (the unplanned path answers a misaligned out as the plan does: refused)
    odd_out = {**make(3), "out": _misaligned(call["out"])}
    with pytest.raises(ValueError, match="output tensor .* breaks the kernel's layout promise"):
        fn(**odd_out)
    assert len(stand_in.launches) == 2
    if op == "lightning":  # (dispatch keeps it on the kernel, which refuses it: never the reference's silent copy)
        from cula_runtime.cute.lightning.decode_backend import verify_lightning_decode

        odd_out.pop("scale")
        assert verify_lightning_decode(validate_lightning_decode(**odd_out, scale=0.1))[0]


def _sparse_g(call: dict) -> torch.Tensor:
    return call["g"].to_sparse()


class _Marked(torch.Tensor):
    """A tensor subclass: the validator sees every call with one."""


class _MarkedParameter(torch.nn.Parameter):
    """A Parameter subclass (as engines define for their weights): the validator sees every call with one."""


def _gate_params(parameter: type) -> dict:
    """The softplus gate in kernel with ``A_log`` / ``dt_bias`` held as ``parameter`` (``requires_grad`` on)."""
    return {"use_gate_in_kernel": True, "A_log": parameter(torch.zeros(4)), "dt_bias": parameter(torch.zeros(4 * K))}


# a change to the benchmark-form call that the first call's plan must not serve: (name, change) -> the call's kwargs
_MISSES = {
    "q-fp16": lambda c: {"q": c["q"].half()},  # (the validator accepts it; the reference serves it: another backend)
    "g-bf16": lambda c: {"g": c["g"].bfloat16()},
    "beta-bf16": lambda c: {"beta": c["beta"].bfloat16()},
    "pool-bf16": lambda c: {"state": c["state"].bfloat16()},
    "pool-slot-stride": lambda c: {"state": torch.zeros(7, 5, K, K)[:, :4]},
    "pool-slots": lambda c: {"state": torch.zeros(9, 4, K, K)},
    "k-shape": lambda c: {"k": torch.zeros(3, 1, 4, K).bfloat16()},
    "v-heads": lambda c: {"v": torch.zeros(3, 1, 8, K).bfloat16(), "g": -torch.rand(3, 1, 8, K),
                          "beta": torch.rand(3, 1, 8), "out": torch.empty(3, 1, 8, K, dtype=torch.bfloat16)},
    "q-size-1-stride": lambda c: {"q": c["q"].as_strided(c["q"].shape, (2 * K, 7 * K, K, 1))},  # (contiguous)
    "out-stride": lambda c: {"out": torch.empty(3, 1, 4, 2 * K, dtype=torch.bfloat16)[..., :K]},
    "out-on-meta": lambda c: {"out": torch.empty(c["out"].shape, dtype=torch.bfloat16, device="meta")},
    "idx-on-meta": lambda c: {"state_indices": c["state_indices"].to("meta")},
    "idx-int64": lambda c: {"state_indices": c["state_indices"].long()},
    "idx-per-token": lambda c: {"state_indices": c["state_indices"][:, None].contiguous()},
    "g-sparse": lambda c: {"g": _sparse_g(c)},
    "q-subclass": lambda c: {"q": c["q"].as_subclass(_Marked)},
    "state-subclass": lambda c: {"state": c["state"].as_subclass(_Marked)},
    "q-requires-grad": lambda c: {"q": c["q"].float().requires_grad_().bfloat16().detach().requires_grad_()},
    "flag-beta-sigmoid": lambda c: {"use_beta_sigmoid_in_kernel": True},
    "flag-state-v-first": lambda c: {"state_v_first": True},
    "flag-int": lambda c: {"use_qk_l2norm_in_kernel": 1},
    "scale": lambda c: {"scale": 0.5},
    "scale-bool": lambda c: {"scale": True},
    "cu-seqlens": lambda c: {"cu_seqlens": torch.tensor([0, 1, 2, 3], dtype=torch.int32)},
    "gate-in-kernel": lambda c: {"use_gate_in_kernel": True, "A_log": torch.zeros(4), "lower_bound": -1.0},
    "gate-parameter-subclass": lambda c: _gate_params(_MarkedParameter),
}


@pytest.fixture(params=["native", "python"])
def guard_kind(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each way the plans' guards are made: torch's native guards (skipped where this torch has none that pass
    the probe) and the Python form."""
    if request.param == "native":
        if call_plans._guard_maker() is not call_plans._native:
            pytest.skip("torch's native tensor guards are missing or failed the probe here")
    else:
        monkeypatch.setattr(call_plans, "_guard_maker", lambda: call_plans._PythonGuards)
    return request.param


@pytest.mark.parametrize("change", list(_MISSES))
def test_a_plan_never_serves_a_call_the_validator_must_see(change: str, kernels, guard_kind) -> None:
    """Every change of a tensor's dtype, shape, strides, device, layout or class, of a flag, ``scale`` or the
    optional tensors given: the call is validated (and then refused, or served by its own plan or backend), never
    run by the plan of the first call."""
    stand_in, validations = kernels
    cula.kda.kda_decode(**_kda(0))
    assert cula.kda.kda_decode(**_kda(1)) is not None and len(validations) == 1 and len(stand_in.launches) == 2
    call = _kda(2)
    call.update(_MISSES[change](call))
    launches = len(stand_in.launches)
    try:
        cula.kda.kda_decode(**call)
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        pass
    assert len(validations) == 2, f"{change}: the first call's plan served the call"
    if len(stand_in.launches) > launches:  # (planned or launched anew: with the call's own tensors)
        assert stand_in.launches[-1][7] is call["state"]


def test_a_model_s_gate_parameters_are_planned(kernels, guard_kind) -> None:
    """``A_log`` and ``dt_bias`` as ``nn.Parameter`` (how Kimi-Linear's layer holds them): planned like plain
    tensors, so the second call runs the first call's plan; a new parameter of the same metadata passes the guards."""
    stand_in, validations = kernels
    with torch.no_grad():
        cula.kda.kda_decode(**_kda(0, **_gate_params(torch.nn.Parameter)))
        cula.kda.kda_decode(**_kda(1, **_gate_params(torch.nn.Parameter)))
    assert len(validations) == 1 and len(stand_in.launches) == 2


def test_cpu_indices_are_never_planned(kernels, monkeypatch) -> None:
    """Through the real host check: CPU index tensors (whose values the validator checks) leave no plan."""
    stand_in, validations = kernels
    monkeypatch.setattr(call_plans, "indices_checked_on_host", lambda idx: idx.device.type == "cpu")
    for seed in range(3):
        cula.kda.kda_decode(**_kda(seed))
    assert len(validations) == 3 and len(stand_in.launches) == 3 and _kept_plans() == []


def test_a_misaligned_pool_goes_to_the_backend_the_dispatch_picks(kernels, monkeypatch) -> None:
    """A pool whose data is not 16-byte aligned keeps every key of the plan's signature, but the CuTeDSL backend
    declines it (``decode_pool_rejection``): the plan declines it too (TVM-FFI's refusal), so the call is validated
    and dispatched as if no plan existed, here to the reference stand-in with the backend's reason."""
    from cula_runtime.cute import decode_pool_rejection
    from cula_runtime.cute.kda import decode_backend as kda_backend

    stand_in, validations = kernels
    served = []

    def reference(args):
        served.append(decode_pool_rejection(args.state, "")[1])
        return args.out

    monkeypatch.setattr(cula.kda, "select_decode_backend", lambda args: (
        kda_backend.kda_decode_cutedsl_backend if decode_pool_rejection(args.state, "")[0] else reference))
    cula.kda.kda_decode(**_kda(0))
    call = _kda(1)
    cula.kda.kda_decode(**call)
    assert len(validations) == 1 and len(stand_in.launches) == 2
    odd_pool = _misaligned(call["state"])
    assert odd_pool.stride() == call["state"].stride() and odd_pool.data_ptr() % 16
    assert cula.kda.kda_decode(**{**call, "state": odd_pool}) is call["out"]
    assert len(validations) == 2 and len(stand_in.launches) == 2 and served == [
        "needs each pool head a dense [128, 128] block, 16-byte aligned, got strides [65536, 16384, 128, 1]"]
    cula.kda.kda_decode(**_kda(2))
    assert len(validations) == 2 and len(stand_in.launches) == 3, "the aligned pool: the plan again"


def test_the_native_and_python_guards_agree() -> None:
    """The two ways of making guards answer alike (the native ones also refuse one object at two places, which
    :func:`call_plans.tensor_guards` never plans), and a subclass or an aliased tensor is never guarded."""
    if call_plans._guard_maker() is not call_plans._native:
        pytest.skip("torch's native tensor guards are missing or failed the probe here")
    base = (torch.zeros(3, 1, 2, K).bfloat16(), torch.zeros(5, 2, K, K), None, torch.zeros(3, dtype=torch.int32))
    native, python = call_plans._native(tuple(_fill(base))), call_plans._PythonGuards(tuple(_fill(base)))
    others = [
        _fill(base),
        _fill((base[0].clone(), *base[1:])),
        _fill((base[0].half(), *base[1:])),
        _fill((base[0], torch.zeros(5, 3, K, K)[:, :2], *base[2:])),
        _fill((base[0], base[1], None, base[3].long())),
        _fill((base[0], base[1], None, base[3][None])),
        _fill((base[0].to("meta"), *base[1:])),
        _fill((base[0].as_subclass(_Marked), *base[1:])),
        _fill((base[0].clone().requires_grad_(), *base[1:])),
        _fill((base[0].to_sparse(), *base[1:])),
        _fill((_inference(base[0]), *base[1:])),  # (an inference tensor outside inference mode)
    ]
    for other in others:
        assert native.check(*other) == python.check(*other)
    assert [python.check(*o) for o in others] == [True, True] + [False] * 9
    twins = (torch.zeros(4), torch.zeros(4))  # (one tensor at two places: refused by both)
    native, python = call_plans._native(twins), call_plans._PythonGuards(twins)
    assert python.check(*twins) and not python.check(twins[0], twins[0]) and not native.check(twins[0], twins[0])
    assert call_plans.tensor_guards((base[0].as_subclass(_Marked), *base[1:])) is None
    assert call_plans.tensor_guards((base[0], base[0], *base[2:])) is None
    assert call_plans.tensor_guards(base) is not None


def _inference(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return x.clone()


def _fill(tensors: tuple) -> list:
    return [call_plans._ABSENT[i] if t is None else t for i, t in enumerate(tensors)]


def test_bound_launch_declines_a_misaligned_pointer(monkeypatch) -> None:
    """bound_launch (the Lightning prefill's kernels A and B) on the same rule: TVM-FFI's refusal is the plan's
    LaunchDeclined, nothing launched, for the unplanned path to decide the call."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.lightning.decode import LightningDecode, LightningDecodeConfig

    stand_in = Kernels()
    monkeypatch.setattr(compile_cache, "_launchable", {})
    monkeypatch.setattr(compile_cache, "launch_target", lambda index: "sm_90a")
    monkeypatch.setattr(compile_cache, "compile_kernel", stand_in.compile)
    config = LightningDecodeConfig(num_heads=2)
    specs = LightningDecode(config).argument_specs()
    run = compile_cache.bound_launch(LightningDecode, config, specs, torch.device("cpu"))
    q = torch.randn(3, 1, 2, K).bfloat16()
    tensors = [q, q, q, torch.zeros(2), torch.zeros(4, 2, K, K), torch.zeros(3, dtype=torch.int32),
               torch.zeros(4, dtype=torch.int32), torch.empty_like(q)]
    run(tuple(tensors), (0.5,))
    assert stand_in.launches[-1][6] is None, "an argument its configuration has not is passed as None"
    tensors[1] = _misaligned(q)
    with pytest.raises(compile_cache.LaunchDeclined):
        run(tuple(tensors), (0.5,))
    assert len(stand_in.launches) == 1


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
    assert len(_kept_plans()) == 1
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
    assert len(_kept_plans()) == 1
    call_plans.clear_call_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
def test_on_the_gpu_a_misaligned_pool_runs_the_reference_planned_or_not(op: str, monkeypatch) -> None:
    """The real dispatch: a pool whose data is not 16-byte aligned (the same shape and strides as the planned
    call's) is declined by the CuTeDSL backend, so the planned call runs the reference with the fallback warning
    and its reason, as an unplanned one does, with the same result; the aligned pool runs the plan again."""
    from cula.dispatch import CulaFallbackWarning

    fn, make = OPS[op]
    monkeypatch.delenv("CULA_CALL_PLANS", raising=False)
    call_plans.clear_call_plans()
    call = _on_gpu(make(0))
    fn(**call)
    fn(**call)
    assert len(_kept_plans()) == 1
    results = []
    for planned in (True, False):
        if not planned:
            call_plans.clear_call_plans()
        odd = _misaligned(call["state"])
        out = torch.empty_like(call["out"])
        with pytest.warns(CulaFallbackWarning, match="16-byte aligned"):
            fn(**{**call, "state": odd, "out": out})
        results.append((out, odd))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), "planned or not: the same answer"
    fn(**call)
    fn(**call)
    assert len(_kept_plans()) == 1, "the aligned pool: planned again"
    call_plans.clear_call_plans()


@pytest.mark.parametrize("op", ["kda_decode", "kda_decode_out"])
def test_the_decode_custom_ops_run_a_plan_from_their_second_call(op: str, kernels) -> None:
    """``torch.ops.cula.kda_decode`` / ``kda_decode_out`` pass their arguments on in order (no keywords bound,
    cula.kda.kda_decode_ordered): the first call is validated and planned, later ones run the plan (planned inside
    the op: the guards compare the dispatch state, which the op's autograd fallback changes)."""
    import cula.ops  # noqa: F401  (defines torch.ops.cula.*)

    stand_in, validations = kernels

    def call(seed: int) -> torch.Tensor:
        kw = _kda(seed)
        inputs = [kw.pop(name) for name in ("q", "k", "v", "g", "beta", "state", "state_indices")]
        out = kw.pop("out")
        if op == "kda_decode":
            return torch.ops.cula.kda_decode(*inputs, **kw)
        torch.ops.cula.kda_decode_out(*inputs, out, **kw)
        return out

    first = call(0)
    assert len(validations) == 1 and len(stand_in.launches) == 1
    for seed in (1, 2):
        o = call(seed)
        assert o.shape == first.shape and stand_in.launches[-1][-3] is o
    assert len(validations) == 1 and len(stand_in.launches) == 3
