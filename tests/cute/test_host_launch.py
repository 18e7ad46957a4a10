"""The per-launch host path of the CuTeDSL kernels, on the CPU: :func:`compile_cache.launch`'s short path for
tensors that keep their layout promises (the same answer as :meth:`TensorSpec.conforms`), its table of compiled
callables (``launch_target`` and ``compile_kernel`` once per kernel, config, device and ``CUTE_DSL_ARCH``), and the
cutedsl backend's workspace (:func:`carve_workspace`). Nothing compiles: ``cute.compile`` is replaced by a stub.
"""

from __future__ import annotations

import dataclasses
import itertools
import types

import pytest
import torch

from cula_runtime import cute as cula_cute

pytestmark = pytest.mark.skipif(
    not cula_cute.is_available(),
    reason="CuTeDSL or TVM-FFI is not installed (cula-runtime brings them on Linux x86_64/aarch64)",
)


@dataclasses.dataclass(frozen=True)
class _Config:
    name: str = "probe"


class _Kernel:
    """A kernel family that compiles to a recorder of its calls."""

    def __init__(self, config: _Config) -> None:
        self.config = config

    @staticmethod
    def can_implement(config: _Config) -> tuple[bool, str]:
        return True, ""

    def compile_arguments(self) -> tuple:
        return ()


@pytest.fixture
def stub_compiler(monkeypatch: pytest.MonkeyPatch) -> dict:
    """compile_kernel and launch_target run for real on fresh tables; ``cute.compile`` returns a recorder and the
    device is an sm_90a GPU. Returns the counts: ``compiled`` (cute.compile calls) and ``calls`` (the arguments of
    every call of a compiled kernel)."""
    from cula_runtime.cute import arch, compile_cache

    seen: dict = {"compiled": 0, "calls": []}

    def compile(kernel, *args, options):
        seen["compiled"] += 1
        return lambda *call_args: seen["calls"].append(call_args)

    monkeypatch.setattr(compile_cache, "require_cutedsl", lambda: types.SimpleNamespace(compile=compile))
    monkeypatch.setattr(arch, "device_target", lambda device=None: "sm_90a")
    for table in ("_compiled", "_records", "_launchable"):
        monkeypatch.setattr(compile_cache, table, {})
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    compile_cache.clear_cache()
    yield seen
    compile_cache.clear_cache()


def test_tensor_spec_align_is_derived_once() -> None:
    import cutlass

    from cula_runtime.cute.compile_cache import TensorSpec

    assert TensorSpec(cutlass.BFloat16, 4, 8).align == 16
    assert TensorSpec(cutlass.Float32, 4, 4).align == 16
    assert TensorSpec(cutlass.Int32, 1).align == 4
    assert TensorSpec(cutlass.BFloat16, 3).align == 2
    spec = TensorSpec(cutlass.Float32, 2, 4)
    assert spec == TensorSpec(cutlass.Float32, 2, 4) and hash(spec) == hash(TensorSpec(cutlass.Float32, 2, 4))
    assert "align" not in repr(spec)
    with pytest.raises(TypeError):
        TensorSpec(cutlass.Float32, 2, 4, 16)  # derived: not an argument
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.align = 4


def _layouts() -> list[torch.Tensor]:
    """Tensors of every layout case the short path has to tell apart."""
    base = torch.arange(4 * 6 * 3 * 16, dtype=torch.float32).reshape(4, 6, 3, 16)
    flat = torch.arange(2000, dtype=torch.float32)
    return [
        base,  # contiguous
        base[1:3],  # contiguous, offset by whole rows
        base[..., :8],  # unit last stride, strides multiples of 4
        base[..., 1:9],  # misaligned data pointer (4 bytes)
        base[..., :6],  # last extent 6: fine when not contiguous (strides are multiples of 16)
        flat[:4 * 6 * 3 * 6].view(4, 6, 3, 6),  # contiguous with a last extent that breaks vec = 4
        base.transpose(1, 2),  # unit last stride, permuted
        base.transpose(2, 3),  # last stride 16
        base[:, :, :1, :],  # a size-1 mode
        flat[1:1 + 4 * 6 * 3 * 16].view(4, 6, 3, 16),  # contiguous but misaligned
        torch.zeros(1, 1, 1, 16).expand(4, 6, 3, 16),  # stride 0
        base.reshape(4, 6, 48),  # wrong rank
        torch.empty(0, 6, 3, 16),  # empty
        flat[3:3 + 6 * 16].view(1, 6, 1, 16),  # size-1 modes, misaligned
    ]


@pytest.mark.parametrize("output", [False, True], ids=["input", "output"])
def test_launch_passes_a_tensor_itself_exactly_when_it_conforms(output: bool, stub_compiler: dict) -> None:
    """launch's short path (contiguous, aligned, last extent a multiple of vec) gives conforms' answer: the tensor
    itself when it keeps the promises; else an input is copied (same values, compact) and an output refused."""
    import cutlass

    from cula_runtime.cute.compile_cache import TensorSpec, launch

    specs = (TensorSpec(cutlass.Float32, 4, 4), None, TensorSpec(cutlass.Float32, 4, 1))
    for tensor, spec_index in itertools.product(_layouts(), (0, 2)):
        spec = specs[spec_index]
        tensors = (tensor, None, tensor) if spec_index == 0 else (tensor.contiguous(), None, tensor)
        outputs = frozenset({spec_index}) if output else frozenset()
        conforms = spec.conforms(tensor)
        if output and not conforms:
            with pytest.raises(ValueError, match="layout promise"):
                launch(_Kernel, _Config(), specs, tensors, outputs, tensor.device)
            continue
        launch(_Kernel, _Config(), specs, tensors, outputs, tensor.device, 1.5)
        passed = stub_compiler["calls"][-1]
        assert passed[1] is None and passed[-1] == 1.5
        if conforms:
            assert passed[spec_index] is tensor
        else:  # a compact copy (which still breaks a promise when the last extent does: TVM-FFI refuses it)
            assert passed[spec_index] is not tensor and passed[spec_index].is_contiguous()
            assert torch.equal(passed[spec_index], tensor)


def test_launch_names_the_missing_tensor_and_counts_arguments(stub_compiler: dict) -> None:
    import cutlass

    from cula_runtime.cute.compile_cache import TensorSpec, launch

    spec = TensorSpec(cutlass.Float32, 1)
    x = torch.zeros(4)
    with pytest.raises(TypeError, match=r"_Kernel: tensor argument 1 is required by _Config\(name='probe'\), got None"):
        launch(_Kernel, _Config(), (spec, spec), (x, None), frozenset(), x.device)
    with pytest.raises(ValueError, match="zip\\(\\) argument 2 is shorter than argument 1"):
        launch(_Kernel, _Config(), (spec, spec), (x,), frozenset(), x.device)
    with pytest.raises(ValueError, match="zip\\(\\) argument 2 is longer than argument 1"):
        launch(_Kernel, _Config(), (spec,), (x, x), frozenset(), x.device)
    launch(_Kernel, _Config(), (None, spec), (x, x), frozenset(), x.device)  # an undeclared tensor is dropped
    assert stub_compiler["calls"][-1] == (None, x)


def test_launch_compiles_once_and_checks_the_arch_knob_every_launch(stub_compiler: dict,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """launch asks launch_target and compile_kernel once per (kernel, config, device, CUTE_DSL_ARCH) and counts
    the later launches as compile-cache hits; CUTE_DSL_ARCH naming another target raises on every launch (an
    error is not remembered); clear_cache forgets the table too."""
    import cutlass

    from cula_runtime.cute import compile_cache

    spec = (compile_cache.TensorSpec(cutlass.Float32, 1),)
    x = torch.zeros(4)
    for _ in range(3):
        compile_cache.launch(_Kernel, _Config(), spec, (x,), frozenset(), x.device)
    assert stub_compiler["compiled"] == 1 and len(stub_compiler["calls"]) == 3
    assert compile_cache.cache_info() == compile_cache.CacheInfo(hits=2, misses=1, size=1)
    compile_cache.launch(_Kernel, _Config("other"), spec, (x,), frozenset(), x.device)
    assert stub_compiler["compiled"] == 2
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="CUTE_DSL_ARCH=sm_100a but the GPU is sm_90a"):
            compile_cache.launch(_Kernel, _Config(), spec, (x,), frozenset(), x.device)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm90a")  # the device's own target, spelled another way: runs
    compile_cache.launch(_Kernel, _Config(), spec, (x,), frozenset(), x.device)
    assert stub_compiler["compiled"] == 2 and len(stub_compiler["calls"]) == 5
    compile_cache.clear_cache()
    compile_cache.launch(_Kernel, _Config(), spec, (x,), frozenset(), x.device)
    assert stub_compiler["compiled"] == 3
    assert compile_cache.cache_info() == compile_cache.CacheInfo(hits=0, misses=1, size=1)


@pytest.mark.parametrize(
    "groups",
    [
        ((4, (1, 5, 3, 128), torch.bfloat16), (2, (1, 5, 3, 64), torch.bfloat16), (1, (1, 5, 3, 128), torch.float32),
         (1, (1, 5, 3), torch.float32), (2, (1, 5, 2, 128), torch.bfloat16)),
        ((1, (3,), torch.float32), (3, (7,), torch.bfloat16), (2, (2, 33), torch.float32), (1, (1,), torch.int32)),
        ((2, (1, 1), torch.float32),),
    ],
    ids=["default-path-odd-beta", "odd-sizes", "tiny"],
)
def test_carve_workspace_gives_aligned_disjoint_contiguous_tensors(groups: tuple) -> None:
    from cula_runtime.cute.kda.backend import WORKSPACE_ALIGN, carve_workspace

    tensors = carve_workspace(torch.device("cpu"), groups)
    wanted = [(shape, dtype) for count, shape, dtype in groups for _ in range(count)]
    assert [(tuple(t.shape), t.dtype) for t in tensors] == wanted
    base = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in tensors)  # one allocation
    spans = sorted((t.data_ptr() - base, t.data_ptr() - base + t.numel() * t.element_size()) for t in tensors)
    assert all(start % WORKSPACE_ALIGN == 0 for start, _ in spans)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # disjoint
    assert all(t.is_contiguous() for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(tensors))


@pytest.mark.parametrize("module", ["intra", "recurrence"])
def test_each_wrapper_plans_once_per_call_signature(module: str) -> None:
    """Every kernel family's ``_plan`` (config, can_implement, argument specs) is cached: building them costs tens of
    microseconds, so a call must find them, not build them. (A decorator that slides onto the wrong function when
    code is inserted above it is how this goes wrong.)"""
    import importlib

    plan = importlib.import_module(f"cula_runtime.cute.kda.{module}")._plan
    assert callable(getattr(plan, "cache_info", None)), f"{module}._plan is not cached"
