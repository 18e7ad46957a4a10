"""Which backend serves a ``kda_prefill`` or ``kda_decode`` call: one table by device capability.

Backends:

- ``reference``: the torch reference in cula-runtime (float32 chunked algorithm). Serves every call, on any device.
- ``cutedsl``: CuTeDSL kernels in cula-runtime (``nvidia-cutlass-dsl``, a dependency of cula-runtime on Linux
  x86_64/aarch64).
- ``sm90``: the native Hopper extension ``cula_sm90`` (``pip install "cula[sm90]"``).

Order: CPU tensors → reference. CUDA SM90 → sm90, then cutedsl. SM100/SM103 → cutedsl. Each backend answers
``verify(args) -> (ok, reason)`` without side effects; the first that accepts runs the call. While the GPU kernels
are being built, a call on SM90/SM100/SM103 that no GPU backend accepts runs the reference on the GPU (correct,
slow) and says so in a ``CulaFallbackWarning``. Other GPUs raise ``NotImplementedError``.
``CULA_BACKEND=reference|cutedsl|sm90`` forces one backend; if it rejects the call, ``NotImplementedError`` says why.
A backend may also make call plans (``register_planner``; sm90 and cutedsl do): ``cula.kda.kda_prefill`` keeps the
plan of an accepted call and runs it for later calls of the same signature without asking again (``cula.call_plans``).

``kda_decode`` is dispatched the same way over its own table (:func:`explain_decode`): on SM90/SM100/SM103 the
CuTeDSL decode kernel serves it (cula-sm90 has none: :data:`NO_DECODE_KERNEL`); a call outside that kernel runs the
reference on the GPU with the ``CulaFallbackWarning`` and the kernel's reason.

``cula.lightning``'s ``lightning_prefill`` and ``lightning_decode`` are dispatched by the same rules over tables of
their own (:func:`explain_lightning_prefill`, :func:`explain_lightning_decode`): CPU → reference; SM90/SM100/SM103 →
the CuTeDSL kernels (cula-sm90 has no Lightning kernel: :data:`NO_LIGHTNING_KERNEL`), else the reference on the GPU
with the ``CulaFallbackWarning``. While a CuTeDSL Lightning backend module is not in this cula-runtime, its import
error is that backend's answer (``Decision("cutedsl", False, ...)``), not a failure of the call.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

import torch

from cula_runtime.env import env_value
from cula_runtime.kda_args import KdaCallArgs, KdaPrefillArgs
from cula_runtime.kda_decode_args import KdaDecodeArgs
from cula_runtime.kda_tuning import device_capability
from cula_runtime.lightning_args import LightningDecodeArgs, LightningPrefillArgs

from ._version import __version__

__all__ = ["BACKEND_NAMES", "Choice", "Decision", "explain", "select_backend", "explain_decode",
           "select_decode_backend", "CulaFallbackWarning", "GPU_BACKENDS_BY_ARCH", "planner_for", "register_planner",
           "NO_DECODE_KERNEL", "NO_LIGHTNING_KERNEL", "explain_lightning_prefill", "explain_lightning_decode",
           "select_lightning_prefill_backend", "select_lightning_decode_backend", "LIGHTNING_PREFILL_MODULE",
           "LIGHTNING_DECODE_MODULE"]

BACKEND_NAMES = ("reference", "cutedsl", "sm90")
ENV_FORCE = "CULA_BACKEND"

#: compute capability -> GPU backends to try, in order (the one table of the arch split).
GPU_BACKENDS_BY_ARCH: dict[tuple[int, int], tuple[str, ...]] = {
    (9, 0): ("sm90", "cutedsl"),
    (10, 0): ("cutedsl",),
    (10, 3): ("cutedsl",),
}


class CulaFallbackWarning(UserWarning):
    """A GPU call ran on the slow torch reference because no GPU kernel could serve it."""


@dataclass(frozen=True)
class Decision:
    """One backend's answer for a call: whether it serves it, and why (or why not)."""

    backend: str
    ok: bool
    reason: str


Runner = Callable[[KdaPrefillArgs], tuple[torch.Tensor, torch.Tensor | None]]
DecodeRunner = Callable[[KdaDecodeArgs], torch.Tensor]


@dataclass(frozen=True)
class Choice:
    """The dispatch outcome: every backend's answer, the runner chosen (None: nothing serves the call), a summary,
    and whether the choice is the reference standing in for a GPU kernel."""

    decisions: list[Decision]
    runner: Runner | DecodeRunner | None
    summary: str
    gpu_fallback: bool = False


Planner = Callable[[KdaPrefillArgs], Callable | None]
# runner -> its backend's plan maker (cula.call_plans): plan(args) returns a callable that serves every later call
# with the signature of args (or None when it will not); runners without one are never planned.
_planners: dict[Runner, Planner] = {}


def register_planner(runner: Runner, planner: Planner) -> None:
    """Say that ``runner``'s backend makes call plans with ``planner`` (see ``cula.call_plans``)."""
    _planners[runner] = planner


def planner_for(runner: Runner) -> Planner | None:
    """The plan maker of ``runner``'s backend, or None."""
    return _planners.get(runner)


def _reference(args: KdaPrefillArgs) -> tuple[Decision, Runner | None]:
    from cula_runtime.reference import backend

    ok, reason = backend.verify(args)
    return Decision("reference", ok, reason), backend.kda_prefill_reference if ok else None


def _cutedsl(args: KdaPrefillArgs) -> tuple[Decision, Runner | None]:
    from cula_runtime.cute.kda import backend

    ok, reason = backend.verify(args)
    if ok and backend.kda_prefill_cutedsl not in _planners:
        register_planner(backend.kda_prefill_cutedsl, backend.plan_kda_prefill)
    return Decision("cutedsl", ok, reason), backend.kda_prefill_cutedsl if ok else None


# (verify, run) of cula-sm90 once it was found, matched and loaded: asked on every Hopper call, so the package
# lookup, version check and extension load run until they succeed, then never again in this process.
_sm90_found: tuple[Callable, Runner] | None = None


def _sm90(args: KdaPrefillArgs) -> tuple[Decision, Runner | None]:
    global _sm90_found
    if _sm90_found is None:
        if importlib.util.find_spec("cula_sm90") is None:
            return Decision("sm90", False, "cula-sm90 is not installed (pip install \"cula[sm90]\" on Hopper)"), None
        shim = importlib.import_module("cula_sm90")
        version = getattr(shim, "__version__", "unknown")
        if version != __version__:
            return Decision("sm90", False, f"cula-sm90 {version} does not match cula {__version__}: "
                                           f"pip install \"cula-sm90=={__version__}\""), None
        try:
            shim.load_extension()
        except ImportError as error:
            return Decision("sm90", False, str(error)), None
        backend = importlib.import_module("cula_sm90.kda")
        planner = getattr(backend, "plan_kda_prefill", None)
        if planner is not None:
            register_planner(backend.kda_prefill, planner)
        _sm90_found = backend.verify_kda_prefill, backend.kda_prefill
    verify, run = _sm90_found
    ok, reason = verify(args)
    return Decision("sm90", ok, reason), run if ok else None


_BACKENDS: dict[str, Callable[[KdaPrefillArgs], tuple[Decision, Runner | None]]] = {
    "reference": _reference,
    "cutedsl": _cutedsl,
    "sm90": _sm90,
}

#: what the sm90 backend answers a ``kda_decode`` call: the portable CuTeDSL decode serves Hopper (issue 26 item 4:
#: a native one only if that one misses the goals)
NO_DECODE_KERNEL = "cula-sm90 has no decode kernel: the CuTeDSL decode kernel serves SM90"


def _reference_decode(args: KdaDecodeArgs) -> tuple[Decision, DecodeRunner | None]:
    from cula_runtime.reference import backend

    ok, reason = backend.verify_decode(args)
    return Decision("reference", ok, reason), backend.kda_decode_reference if ok else None


def _cutedsl_decode(args: KdaDecodeArgs) -> tuple[Decision, DecodeRunner | None]:
    from cula_runtime.cute.kda import decode_backend

    ok, reason = decode_backend.verify_decode(args)
    if ok and decode_backend.kda_decode_cutedsl_backend not in _planners:
        register_planner(decode_backend.kda_decode_cutedsl_backend, decode_backend.plan_kda_decode)
    return Decision("cutedsl", ok, reason), decode_backend.kda_decode_cutedsl_backend if ok else None


def _sm90_decode(args: KdaDecodeArgs) -> tuple[Decision, DecodeRunner | None]:
    return Decision("sm90", False, NO_DECODE_KERNEL), None


_DECODE_BACKENDS: dict[str, Callable[[KdaDecodeArgs], tuple[Decision, DecodeRunner | None]]] = {
    "reference": _reference_decode,
    "cutedsl": _cutedsl_decode,
    "sm90": _sm90_decode,
}


#: what the sm90 backend answers a Lightning call: the portable CuTeDSL kernels serve Hopper (issue 28)
NO_LIGHTNING_KERNEL = "cula-sm90 has no Lightning Attention kernel: the CuTeDSL kernels serve SM90"

#: the CuTeDSL Lightning backends' modules, imported on a GPU call's first dispatch
LIGHTNING_PREFILL_MODULE = "cula_runtime.cute.lightning.prefill_backend"
LIGHTNING_DECODE_MODULE = "cula_runtime.cute.lightning.decode_backend"

LightningPrefillRunner = Callable[[LightningPrefillArgs], tuple[torch.Tensor, torch.Tensor | None]]
LightningDecodeRunner = Callable[[LightningDecodeArgs], torch.Tensor]


def _backend_module(name: str):
    """The module ``name``, or None when exactly that module is missing from this installation (an error inside it,
    or a missing module it imports, is raised: never swallowed)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name == name:
            return None
        raise


def _missing(name: str) -> str:
    return f"this cula-runtime has no CuTeDSL Lightning backend ({name} is missing)"


def _reference_lightning(op: str, args: LightningPrefillArgs | LightningDecodeArgs) -> tuple[Decision, Callable | None]:
    """The reference's answer for ``lightning_<op>`` (``op``: ``"prefill"`` or ``"decode"``)."""
    from cula_runtime.reference import lightning_backend

    ok, reason = getattr(lightning_backend, f"verify_lightning_{op}")(args)
    return Decision("reference", ok, reason), getattr(lightning_backend, f"lightning_{op}_reference") if ok else None


def _cutedsl_lightning(op: str, args: LightningPrefillArgs | LightningDecodeArgs) -> tuple[Decision, Callable | None]:
    """The CuTeDSL backend's answer for ``lightning_<op>``: its module (``LIGHTNING_PREFILL_MODULE`` /
    ``LIGHTNING_DECODE_MODULE``) imported on the first call, its planner registered with its runner."""
    name = LIGHTNING_PREFILL_MODULE if op == "prefill" else LIGHTNING_DECODE_MODULE
    backend = _backend_module(name)
    if backend is None:
        return Decision("cutedsl", False, _missing(name)), None
    ok, reason = getattr(backend, f"verify_lightning_{op}")(args)
    runner = getattr(backend, f"lightning_{op}_cutedsl_backend")
    if ok and runner not in _planners:
        register_planner(runner, getattr(backend, f"plan_lightning_{op}"))
    return Decision("cutedsl", ok, reason), runner if ok else None


def _sm90_lightning(args: object) -> tuple[Decision, None]:
    return Decision("sm90", False, NO_LIGHTNING_KERNEL), None


_LIGHTNING_PREFILL_BACKENDS: dict[str, Callable] = {
    "reference": partial(_reference_lightning, "prefill"),
    "cutedsl": partial(_cutedsl_lightning, "prefill"),
    "sm90": _sm90_lightning,
}
_LIGHTNING_DECODE_BACKENDS: dict[str, Callable] = {
    "reference": partial(_reference_lightning, "decode"),
    "cutedsl": partial(_cutedsl_lightning, "decode"),
    "sm90": _sm90_lightning,
}


@cache
def _accepted_summary(arch: str, name: str, chain: tuple[str, ...]) -> str:  # formatted once, not on every call
    return f"{arch}: {name} is the first backend in {chain} to accept this call"


def forced_backend() -> str | None:
    """The backend named by ``CULA_BACKEND``, or ``None``; ``ValueError`` for an unknown name."""
    name = env_value(ENV_FORCE, "").strip()
    if not name:
        return None
    if name not in BACKEND_NAMES:
        raise ValueError(f"{ENV_FORCE} must be one of {BACKEND_NAMES}, got {name!r}")
    return name


def explain(args: KdaPrefillArgs) -> Choice:
    """Ask the backends in dispatch order and return the :class:`Choice`."""
    return _explain(args, _BACKENDS)


def explain_decode(args: KdaDecodeArgs) -> Choice:
    """:func:`explain` for a ``kda_decode`` call (its own backend table)."""
    return _explain(args, _DECODE_BACKENDS)


def explain_lightning_prefill(args: LightningPrefillArgs) -> Choice:
    """:func:`explain` for a ``lightning_prefill`` call (its own backend table)."""
    return _explain(args, _LIGHTNING_PREFILL_BACKENDS)


def explain_lightning_decode(args: LightningDecodeArgs) -> Choice:
    """:func:`explain` for a ``lightning_decode`` call (its own backend table)."""
    return _explain(args, _LIGHTNING_DECODE_BACKENDS)


def _explain(args: KdaCallArgs | LightningPrefillArgs | LightningDecodeArgs, backends: dict[str, Callable]) -> Choice:
    forced = forced_backend()
    if forced is not None:
        decision, runner = backends[forced](args)
        return Choice([decision], runner, f"{ENV_FORCE}={forced} forces the {forced} backend")
    device = args.device
    reference = backends["reference"]
    if device.type == "cpu":
        decision, runner = reference(args)
        return Choice([decision], runner, "CPU tensors run on the torch reference backend")
    if device.type != "cuda":
        return Choice([], None, f"cuLA has no backend for {device.type} tensors (CPU and CUDA only)")
    major, minor = device_capability(device)
    chain = GPU_BACKENDS_BY_ARCH.get((major, minor))
    arch = f"sm_{major}{minor}"
    if chain is None:
        return Choice([], None, (f"no cuLA GPU kernel targets {arch} (compute capability {major}.{minor}); cuLA "
                                 f"targets SM90 (Hopper) and SM100/SM103 (Blackwell). Set {ENV_FORCE}=reference to "
                                 "run the slow torch reference on this GPU, or move the tensors to the CPU"))
    decisions: list[Decision] = []
    for name in chain:
        decision, runner = backends[name](args)
        decisions.append(decision)
        if runner is not None:
            return Choice(decisions, runner, _accepted_summary(arch, name, chain))
    decision, runner = reference(args)
    decisions.append(decision)
    rejected = "; ".join(f"{d.backend}: {d.reason}" for d in decisions if not d.ok)
    summary = f"{arch}: no GPU kernel accepted this call ({rejected}); running the torch reference on the GPU " \
              "(correct, slow)"
    return Choice(decisions, runner, summary, gpu_fallback=True)


def select_backend(args: KdaPrefillArgs) -> Runner:
    """The runner for ``args``; ``NotImplementedError`` naming every backend tried and why, if none serves it."""
    return _select(explain(args), "cula.kda.kda_prefill")


def select_decode_backend(args: KdaDecodeArgs) -> DecodeRunner:
    """:func:`select_backend` for a ``kda_decode`` call."""
    return _select(explain_decode(args), "cula.kda.kda_decode")


def select_lightning_prefill_backend(args: LightningPrefillArgs) -> LightningPrefillRunner:
    """:func:`select_backend` for a ``lightning_prefill`` call."""
    return _select(explain_lightning_prefill(args), "cula.lightning.lightning_prefill")


def select_lightning_decode_backend(args: LightningDecodeArgs) -> LightningDecodeRunner:
    """:func:`select_backend` for a ``lightning_decode`` call."""
    return _select(explain_lightning_decode(args), "cula.lightning.lightning_decode")


def _select(choice: Choice, op: str) -> Callable:
    """``op``: the public function's qualified name, for the messages."""
    if choice.runner is None:
        tried = "; ".join(f"{d.backend} rejected it: {d.reason}" for d in choice.decisions)
        raise NotImplementedError(f"{op}: {choice.summary}" + (f" ({tried})" if tried else ""))
    if choice.gpu_fallback:  # (stacklevel: the caller of the public function)
        warnings.warn(f"{op}: {choice.summary}", CulaFallbackWarning, stacklevel=4)
    return choice.runner
