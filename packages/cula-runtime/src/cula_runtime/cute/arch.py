"""Two architecture knobs, kept apart.

* ``CULA_ARCH`` picks which kernel *variant* dispatch uses (tests set it to exercise, say, the SM90 variant on
  a Blackwell GPU). :func:`dispatch_target` reads it.
* ``CUTE_DSL_ARCH`` says what CuTeDSL *compiles for*. CuTeDSL reads the same variable itself; we read it in
  :func:`compile_target` so that our compile cache keys on it. Setting it on a machine without a GPU is how CI
  compiles ``sm_100a`` code on a CPU box.

Both accept ``sm_90a``, ``sm_100a``, ``sm_103a`` (also written ``sm90a``, ``90a``, ``sm_90``, ``9.0``: the
"a" is implied, every cuLA target is arch-specific) and answer with the canonical ``sm_XXa`` spelling.
Nothing here imports CuTeDSL; torch is imported only where a GPU is queried.
"""

from __future__ import annotations

import functools
import re

from ..env import env_value

__all__ = [
    "CULA_ARCH_ENV",
    "CUTE_DSL_ARCH_ENV",
    "compile_target",
    "device_target",
    "dispatch_target",
    "launch_target",
    "normalize_target",
    "supported_targets",
    "target_capability",
]

CULA_ARCH_ENV = "CULA_ARCH"
CUTE_DSL_ARCH_ENV = "CUTE_DSL_ARCH"

# capability -> target; the one table of what cuLA's CuTeDSL kernels are built for.
_TARGETS: dict[tuple[int, int], str] = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
_SPELLING = re.compile(r"^(?:sm_?)?(\d+)(?:\.(\d))?(a?)$")


def supported_targets() -> tuple[str, ...]:
    """The compile targets cuLA's CuTeDSL kernels support, oldest first: ``("sm_90a", "sm_100a", "sm_103a")``."""
    return tuple(_TARGETS[cap] for cap in sorted(_TARGETS))


def target_capability(target: str) -> tuple[int, int]:
    """``"sm_100a"`` -> ``(10, 0)``."""
    target = normalize_target(target)
    return next(cap for cap, name in _TARGETS.items() if name == target)


@functools.cache
def normalize_target(name: str) -> str:
    """Canonical spelling of a target: ``"sm90"``, ``"90a"``, ``"9.0"``, ``"sm_90a"`` -> ``"sm_90a"``.

    Raises:
        ValueError: the name is not one of :func:`supported_targets` (the message lists them).
    """
    match = _SPELLING.match(name.strip().lower())
    cap = None
    if match:
        digits, minor, _suffix = match.groups()
        if minor is not None:
            cap = (int(digits), int(minor))
        elif len(digits) >= 2:
            cap = (int(digits[:-1]), int(digits[-1]))
    if cap not in _TARGETS:
        raise ValueError(f"unsupported architecture {name!r}: cuLA's CuTeDSL kernels target {supported_targets()}")
    return _TARGETS[cap]


def device_target(device: int | None = None) -> str:
    """The target of a CUDA device (the current one by default), from its compute capability.

    Raises:
        RuntimeError: no CUDA device, or its capability is not one cuLA targets.
    """
    import torch

    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"no CUDA device to take the architecture from; set {CUTE_DSL_ARCH_ENV} to one of "
                f"{supported_targets()} to compile without a GPU"
            )
        device = torch.cuda.current_device()
    return _device_target(device)


@functools.cache
def _device_target(index: int) -> str:
    """Target of CUDA device ``index`` (a device's capability never changes: asked once per process)."""
    import torch

    cap = torch.cuda.get_device_capability(index)
    if cap not in _TARGETS:
        raise RuntimeError(
            f"GPU capability {cap[0]}.{cap[1]} is not a cuLA CuTeDSL target (supported: {supported_targets()})"
        )
    return _TARGETS[cap]


def compile_target() -> str:
    """What CuTeDSL compiles for: ``CUTE_DSL_ARCH`` when set, else the current GPU's target."""
    env = env_value(CUTE_DSL_ARCH_ENV, "").strip()
    return normalize_target(env) if env else device_target()


def launch_target(device: int | None = None) -> str:
    """The target to compile for when the kernel will run on ``device``: that device's own target.

    Raises:
        RuntimeError: ``CUTE_DSL_ARCH`` is set to another target (CuTeDSL would build no runnable binary for
            this device; unset it to run kernels).
    """
    target = device_target(device)
    env = env_value(CUTE_DSL_ARCH_ENV, "").strip()
    if env and normalize_target(env) != target:
        raise RuntimeError(
            f"{CUTE_DSL_ARCH_ENV}={env} but the GPU is {target}: kernels compiled for {env} cannot run here; "
            f"unset {CUTE_DSL_ARCH_ENV} (it is for compiling without a GPU)"
        )
    return target


def dispatch_target(device: int | None = None) -> str:
    """Which kernel variant dispatch picks: ``CULA_ARCH`` when set, else the device's target."""
    env = env_value(CULA_ARCH_ENV, "").strip()
    return normalize_target(env) if env else device_target(device)
