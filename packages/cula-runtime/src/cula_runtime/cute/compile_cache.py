"""The one compile cache of cuLA's CuTeDSL kernels, and the only place that calls ``cute.compile``.

A kernel family is a class in the CUTLASS shape (see ``STYLE.md``): ``__init__(config)`` with a frozen dataclass,
a static ``can_implement(config) -> (ok, reason)``, a ``@cute.jit __call__`` and ``compile_arguments()``, which
returns the *fake* arguments to compile against (:func:`fake_call_arguments`: :meth:`TensorSpec.fake` for every
tensor, so token and batch extents are symbolic, the scalars, and :func:`fake_stream`). :func:`compile_kernel`
builds one binary per ``(kernel class, config, target)``; a new T, batch size or ``cu_seqlens`` reuses it, and
:func:`launch` is how every host wrapper calls it.

Launch convention (TVM-FFI, ``--enable-tvm-ffi``): the compiled callable takes the torch tensors themselves (None
for an absent optional tensor) and the scalars, in ``__call__``'s order without the stream; it launches on the
caller's current torch stream and device. On the H200 host a call of a 12-tensor kernel (the since retired
KdaPrepare) cost about 7 us; converting the same tensors through DLPack (``from_dlpack``) cost about 230 us.
TVM-FFI checks every tensor against its :class:`TensorSpec` (dtype, rank, device, alignment) and raises
``ValueError`` naming the argument.

The cache is in memory only (per process); :func:`compile_records` has the measured compile times.
"""

from __future__ import annotations

import dataclasses
import importlib
import tempfile
import threading
import time
from collections.abc import Hashable
from typing import Any, NamedTuple, Protocol

from ..env import env_value
from . import INSTALL_HINT, unavailable_reason
from .arch import CUTE_DSL_ARCH_ENV, compile_target, launch_target, normalize_target

__all__ = [
    "LaunchDeclined",
    "bound_launch",
    "direct_callable",
    "planned_launch",
    "INSTALL_HINT",
    "CacheInfo",
    "CompileRecord",
    "CuteKernelFamily",
    "TensorSpec",
    "cache_info",
    "clear_cache",
    "compile_kernel",
    "compile_records",
    "compile_seconds",
    "fake_call_arguments",
    "fake_stream",
    "launch",
    "fake_tensor",
    "missing_cutedsl",
    "require_cutedsl",
]


class LaunchDeclined(Exception):
    """A planned launch refused before anything ran (TVM-FFI's checks of the pointers): the call must take the
    unplanned path instead (validation, dispatch, :func:`launch`), which decides it exactly as if no plan existed
    (a misaligned input copied, a misaligned output refused, a pool the backend does not serve sent to the
    reference with its reason)."""


def missing_cutedsl(exc: ImportError) -> ImportError:
    """The ImportError to raise when importing CuTeDSL or TVM-FFI failed with ``exc``: it names the fix (or, on a
    platform CuTeDSL does not ship for, says so)."""
    return ImportError(
        "cuLA's CuTeDSL kernels need CuTeDSL and TVM-FFI (the nvidia-cutlass-dsl and apache-tvm-ffi packages): "
        f"{unavailable_reason() or INSTALL_HINT} (the import failed: {exc})"
    )


def require_cutedsl() -> Any:
    """Import CuTeDSL (``nvidia-cutlass-dsl``) and TVM-FFI (``apache-tvm-ffi``, the launch path of every compiled
    kernel); return ``cutlass.cute``.

    Raises:
        ImportError: either is missing (or does not import); the message names the fix.
    """
    try:
        import cutlass.cute as cute

        importlib.import_module("tvm_ffi")
    except ImportError as exc:
        raise missing_cutedsl(exc) from exc
    return cute


class CuteKernelFamily(Protocol):
    """What :func:`compile_kernel` needs from a kernel class."""

    def __init__(self, config: Any) -> None: ...

    @staticmethod
    def can_implement(config: Any) -> tuple[bool, str]: ...

    def compile_arguments(self) -> tuple[Any, ...]: ...


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """One compilation: which kernel and config, for which target, and how long ``cute.compile`` took."""

    kernel: str
    config: Hashable
    target: str
    seconds: float


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int


_lock = threading.Lock()
_compiled: dict[tuple[type, Hashable, str], Any] = {}
_records: dict[tuple[type, Hashable, str], CompileRecord] = {}
# launch's own table: (kernel class, config, device index, raw CUTE_DSL_ARCH or None) -> the compiled callable
# that compile_kernel returned for launch_target(device index); a per-launch lookup instead of launch_target and
# compile_kernel's bookkeeping. Emptied with the compile cache (clear_cache).
_launchable: dict[tuple[type, Hashable, int | None, str | None], Any] = {}
_hits = 0
_misses = 0


def _check_config(config: object) -> None:
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"a kernel config must be a frozen dataclass instance, got {type(config).__name__}")
    if not type(config).__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"kernel config {type(config).__name__} must be a frozen dataclass (it is a cache key)")


def compile_kernel(kernel_cls: type[CuteKernelFamily], config: Hashable, *, target: str | None = None) -> Any:
    """Compile ``kernel_cls(config)`` for ``target`` once per process and return the compiled callable.

    Args:
        kernel_cls: a kernel family (see :class:`CuteKernelFamily`).
        config: its frozen config dataclass: the cache key, with the class and the target.
        target: ``"sm_90a"``, ``"sm_100a"`` or ``"sm_103a"``; default :func:`~cula_runtime.cute.arch.compile_target`
            (``CUTE_DSL_ARCH``, else the current GPU). Compiling needs no GPU; calling needs a GPU of this target.

    The compiled object keeps its cubin in memory (``compiled.__cubin__``) for
    :func:`cula_runtime.cute.machine_code.disassemble`; nothing is left on disk.

    Raises:
        ValueError: ``kernel_cls.can_implement(config)`` refuses (the message has its reason), or the target is
            not supported.
        ImportError: CuTeDSL or TVM-FFI is not installed (the message names the fix).
    """
    global _hits, _misses
    _check_config(config)
    target = normalize_target(target) if target is not None else compile_target()
    key = (kernel_cls, config, target)
    compiled = _compiled.get(key)
    if compiled is not None:
        with _lock:
            _hits += 1
        return compiled
    with _lock:
        compiled = _compiled.get(key)
        if compiled is not None:
            _hits += 1
            return compiled
        ok, reason = kernel_cls.can_implement(config)
        if not ok:
            raise ValueError(f"{kernel_cls.__name__} cannot implement {config}: {reason}")
        cute = require_cutedsl()
        kernel = kernel_cls(config)
        args = kernel.compile_arguments()
        # --keep-cubin makes CuTeDSL read the cubin back into compiled.__cubin__; the dump folder is then dropped.
        with tempfile.TemporaryDirectory(prefix="cula-cute-") as dump_dir:
            options = f"--gpu-arch {target} --enable-tvm-ffi --keep-cubin --dump-dir {dump_dir}"
            start = time.perf_counter()
            compiled = cute.compile(kernel, *args, options=options)
            seconds = time.perf_counter() - start
        _misses += 1
        _compiled[key] = compiled
        _records[key] = CompileRecord(kernel_cls.__name__, config, target, seconds)
        return compiled


def compile_records() -> list[CompileRecord]:
    """Every compilation this process did, in order (benchmarks report first-call compile time from these)."""
    with _lock:
        return list(_records.values())


def compile_seconds(kernel_cls: type, config: Hashable, target: str | None = None) -> float | None:
    """Seconds ``cute.compile`` took for this key, or None if it was not compiled in this process."""
    target = normalize_target(target) if target is not None else compile_target()
    record = _records.get((kernel_cls, config, target))
    return None if record is None else record.seconds


def cache_info() -> CacheInfo:
    """Hits, misses and entries of the compile cache."""
    with _lock:
        return CacheInfo(_hits, _misses, len(_compiled))


def clear_cache() -> None:
    """Forget every compiled kernel and record (tests use this to count compilations)."""
    global _hits, _misses
    with _lock:
        _compiled.clear()
        _records.clear()
        _launchable.clear()
        _hits = _misses = 0


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a kernel promises itself about one tensor argument, at compile time and at launch.

    Every extent is symbolic and every stride symbolic except a unit stride in the last mode; the other strides
    are multiples of ``vec`` elements and the data pointer is aligned to ``vec`` elements, so the kernel may use
    ``vec``-wide accesses along the last mode.

    Attributes:
        dtype: the CuTeDSL numeric type (``cutlass.BFloat16``...).
        ndim: rank.
        vec: the divisibility / alignment promise, in elements.
        align: promised byte alignment of the data pointer, ``max(vec * dtype width / 8, 1)`` (derived, computed
            once: :meth:`conforms` runs for every tensor of every launch).
    """

    dtype: Any
    ndim: int
    vec: int = 1
    align: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "align", max(self.vec * self.dtype.width // 8, 1))

    def fake(self) -> Any:
        """The compile-time stand-in (see :func:`fake_tensor`)."""
        return fake_tensor(self.dtype, self.ndim, divisibility=self.vec, assumed_align=self.align)

    def conforms(self, tensor: Any) -> bool:
        """Whether a torch tensor keeps the layout promises (rank, unit last stride, divisible strides, alignment).

        Its dtype and device are left to TVM-FFI, which checks them at the call.
        """
        if tensor.dim() != self.ndim or tensor.data_ptr() % self.align:
            return False
        vec = self.vec
        if tensor.is_contiguous():  # every stride is a multiple of the last extent
            return vec == 1 or tensor.shape[-1] % vec == 0
        if tensor.stride(-1) != 1:
            return False
        return all(s % vec == 0 for s, n in zip(tensor.stride()[:-1], tensor.shape[:-1], strict=True) if n > 1)

    def launch_arg(self, tensor: Any, *, output: bool = False) -> Any:
        """``tensor`` itself if it keeps the promises; else an input is copied into a fresh compact tensor and an
        output is refused.

        Raises:
            ValueError: ``output`` and the tensor breaks a promise.
        """
        if self.conforms(tensor):
            return tensor
        if output:
            raise ValueError(
                f"output tensor {tuple(tensor.shape)} with strides {tensor.stride()} breaks the kernel's layout "
                f"promise (rank {self.ndim}, unit last stride, other strides multiples of {self.vec}, "
                f"{self.align}-byte aligned)"
            )
        fresh = tensor.new_empty(tensor.shape)
        fresh.copy_(tensor)
        return fresh


def fake_tensor(dtype: Any, ndim: int, *, divisibility: int = 1, assumed_align: int | None = None) -> Any:
    """A compile-time stand-in for a tensor argument: every extent symbolic, every stride symbolic except a unit
    stride in the last mode.

    Args:
        dtype: a CuTeDSL numeric type (``cutlass.BFloat16``...).
        ndim: rank.
        divisibility: what every non-unit stride is promised to be divisible by (in elements).
        assumed_align: promised byte alignment of the data pointer (default: one element).
    """
    cute = require_cutedsl()
    shape = tuple(cute.sym_int() for _ in range(ndim))
    stride = tuple(cute.sym_int64(divisibility=divisibility) for _ in range(ndim - 1)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=assumed_align)


def fake_stream() -> Any:
    """The compile-time stream argument: at the call, TVM-FFI passes the caller's current torch stream."""
    return require_cutedsl().runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def flag_bytes(flags: Any) -> Any:
    """A bool tensor as the uint8 tensor the kernels read (``cutlass.Uint8``: one byte per flag), a view (no copy);
    None stays None."""
    import torch

    return None if flags is None else flags.view(torch.uint8)


def fake_call_arguments(specs: tuple, *scalars: Any) -> tuple:
    """``compile_arguments()`` of a kernel family whose ``__call__`` takes the tensors of ``specs`` (a
    :class:`TensorSpec`, or None for an absent optional tensor), then ``scalars``, then the stream."""
    return (*(None if spec is None else spec.fake() for spec in specs), *scalars, fake_stream())


def direct_callable(compiled: Any) -> Any:
    """What to call for ``compiled`` (a ``cute.compile`` result): the TVM-FFI function under CuTeDSL's Python
    wrapper where that wrapper only forwards positional arguments to it, else ``compiled`` itself.

    Every cuLA launch passes every argument by position (the launch convention above), and CuTeDSL 4.8's compiled
    object (``TVMFFIJitCompiledFunctionWithKwargs``) then hands them unchanged to its ``tvm_ffi.Function``
    (``__tvm_ffi_object__()``) through two Python frames: calling that function skips them (about 0.5 us per launch
    here). Kept as it is: an object without that function (another CuTeDSL, a stand-in), one whose function is not
    initialised (its own call raises the reason), or one whose arguments carry Python pointers to convert."""
    function_of = getattr(compiled, "__tvm_ffi_object__", None)
    execution_args = getattr(compiled, "execution_args", None)
    if function_of is None or getattr(execution_args, "has_pointer_address_arg_specs", True):
        return compiled
    function = function_of()
    return compiled if function is None else function


def _launchable_for(kernel_cls: type[CuteKernelFamily], config: Hashable, index: int | None, *,
                    count_hit: bool = False) -> Any:
    """The callable of ``(kernel_cls, config)`` for device ``index`` under the current ``CUTE_DSL_ARCH``
    (:func:`direct_callable` of the compiled kernel): looked up in the launch table, or compiled for the device
    (:func:`compile_kernel`) and kept there. ``count_hit``: count a lookup that found it as a compile-cache hit (as
    :func:`compile_kernel` would)."""
    global _hits
    key = (kernel_cls, config, index, env_value(CUTE_DSL_ARCH_ENV, "") or None)
    compiled = _launchable.get(key)
    if compiled is None:
        compiled = direct_callable(compile_kernel(kernel_cls, config, target=launch_target(index)))
        _launchable[key] = compiled
    elif count_hit:
        with _lock:
            _hits += 1
    return compiled


def planned_launch(kernel_cls: type[CuteKernelFamily], config: Hashable, device: Any) -> Any:
    """The compiled ``kernel_cls(config)`` on ``device`` for call plans (looked up, or compiled, here, once):
    ``kernel(*tensors, *scalars)`` (:func:`direct_callable`), every tensor of the configuration's argument specs in
    order (None where a spec is None), then the scalars. The caller promises that every call passes tensors of the
    shapes, strides and dtypes of the call the plan was made from (a call plan's signature), so of the layout
    promises only the data pointers' alignment can differ; TVM-FFI checks it (with each tensor's dtype, rank, device
    and strides) and raises ``ValueError`` before anything is launched. On that ``ValueError`` the plan raises
    :class:`LaunchDeclined`, and the call takes the unplanned path, which decides it as if there were no plan (a
    misaligned input copied, a misaligned output refused, a pool the backend does not serve sent to the reference).
    A plan thus checks nothing in Python on the common path and answers every other call as the unplanned path
    does."""
    return _launchable_for(kernel_cls, config, device.index)


def bound_launch(kernel_cls: type[CuteKernelFamily], config: Hashable, specs: tuple, device: Any) -> Any:
    """:func:`planned_launch` bound to one call signature: ``run(tensors, scalars)`` calls the compiled kernel on
    ``tensors`` and ``scalars``, and raises :class:`LaunchDeclined` where TVM-FFI refuses a pointer (nothing
    launched). A tensor at a position whose spec (of ``specs``, the configuration's) is None is not passed (the
    kernel's configuration has no such argument)."""
    kernel = planned_launch(kernel_cls, config, device)
    present = tuple(spec is not None for spec in specs)
    absent = tuple(i for i, p in enumerate(present) if not p)

    def run(tensors: tuple, scalars: tuple) -> None:
        args = tensors  # (the common case: the caller passes None where the configuration has no tensor)
        for i in absent:
            if tensors[i] is not None:
                args = [t if p else None for t, p in zip(tensors, present, strict=True)]
                break
        try:
            kernel(*args, *scalars)
        except ValueError:  # (TVM-FFI's refusal, before any launch: the unplanned path decides the call)
            raise LaunchDeclined from None

    return run


def launch(kernel_cls: type[CuteKernelFamily], config: Hashable, specs: tuple, tensors: tuple,
           outputs: frozenset[int], device: Any, *scalars: Any) -> None:
    """Compile (once, cached) and call ``kernel_cls(config)`` on ``tensors`` and ``scalars``, on ``device``'s
    current torch stream. Each tensor goes through its spec's :meth:`TensorSpec.launch_arg` (the positions in
    ``outputs`` are outputs: refused, not copied, when they break a layout promise).

    The host cost of every CuTeDSL launch is here, so the common case is a short path: a contiguous tensor of the
    spec's rank, aligned, whose last extent is a multiple of ``vec``, is passed as it is without calling
    :meth:`TensorSpec.conforms` (the same answer); any other goes through :meth:`TensorSpec.launch_arg`. The
    compiled callable is looked up once per launch by (kernel class, config, device index, ``CUTE_DSL_ARCH``):
    :func:`~cula_runtime.cute.arch.launch_target` and :func:`compile_kernel` run on the first launch of each key
    only, and a launch with ``CUTE_DSL_ARCH`` set to another target than the device's raises as before (an error
    is never remembered). A CUDA tensor's device always has an index; None (a CPU tensor, in tests) is taken as it
    is.

    Raises:
        TypeError: a wrapper passed None where this configuration declares a tensor (a wrapper bug, named here
            rather than failing inside TVM-FFI).
    """
    if len(specs) != len(tensors):
        list(zip(specs, tensors, strict=True))  # raises zip's ValueError (a wrapper bug)
    args = list(tensors)
    for i, spec in enumerate(specs):
        if spec is None:
            args[i] = None
            continue
        tensor = args[i]
        if (tensor is not None and tensor.dim() == spec.ndim and not tensor.data_ptr() % spec.align
                and tensor.is_contiguous() and (spec.vec == 1 or not tensor.shape[-1] % spec.vec)):
            continue  # keeps every promise (the contiguous case of TensorSpec.conforms)
        if tensor is None:
            raise TypeError(f"{kernel_cls.__name__}: tensor argument {i} is required by {config}, got None")
        args[i] = spec.launch_arg(tensor, output=i in outputs)
    compiled = _launchable_for(kernel_cls, config, device.index, count_hit=True)
    compiled(*args, *scalars)  # TVM-FFI: the tensors' device, current stream
