"""cuLA's CuTeDSL kernels and the machinery to compile them.

Importing this package imports neither CuTeDSL (``cutlass``) nor TVM-FFI nor torch, and needs no GPU: every name
below is resolved on first use. ``cula-runtime`` depends on both on Linux x86_64 and aarch64, the platforms NVIDIA
ships CuTeDSL for (:data:`DSL_REQUIREMENTS`); kernel modules (``cula_runtime.cute.kda.intra``, ...) import them
when they are imported and raise an ``ImportError`` that names the fix (:func:`unavailable_reason`) when either is
missing.

* :mod:`.arch`: the two knobs, ``CULA_ARCH`` (dispatch) and ``CUTE_DSL_ARCH`` (compile target).
* :mod:`.compile_cache`: the one compile cache of the monorepo; the only caller of ``cute.compile``.
* :mod:`.machine_code`: SASS of a compiled kernel (nvdisasm) and the SM its cubin targets.
* :mod:`.dsl_compat`: what differs between the CuTeDSL versions of :data:`DSL_REQUIREMENTS`.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys
from typing import Any

from .._lazy import lazy_exports
from ..kda_tuning import device_capability

_LAZY_EXPORTS = {
    "compile_target": "cula_runtime.cute.arch",
    "launch_target": "cula_runtime.cute.arch",
    "dispatch_target": "cula_runtime.cute.arch",
    "supported_targets": "cula_runtime.cute.arch",
    "compile_kernel": "cula_runtime.cute.compile_cache",
    "compile_records": "cula_runtime.cute.compile_cache",
    "cache_info": "cula_runtime.cute.compile_cache",
    "require_cutedsl": "cula_runtime.cute.compile_cache",
    "disassemble": "cula_runtime.cute.machine_code",
    "MachineCode": "cula_runtime.cute.machine_code",
}

__all__ = ["DSL_REQUIREMENTS", "CUTEDSL_PLATFORMS", "INSTALL_HINT", "KERNEL_CAPABILITIES", "device_rejection",
           "decode_pool_rejection", "is_available", "platform_note", "unavailable_reason", *_LAZY_EXPORTS]

# cula-runtime's requirements on CuTeDSL and TVM-FFI, as its pyproject.toml declares them (without their platform
# markers; tests/packaging/test_versions.py checks the two agree): the CuTeDSL range is exactly what CI compiles.
DSL_REQUIREMENTS = ("nvidia-cutlass-dsl>=4.6.2,<=4.8.1", "apache-tvm-ffi>=0.1.11,<0.2")
# What brings the two packages back where cula-runtime was installed without its dependencies.
INSTALL_HINT = "pip install " + " ".join(f'"{requirement}"' for requirement in DSL_REQUIREMENTS)
# (sys.platform, platform.machine()) pairs NVIDIA ships CuTeDSL wheels for: the pyproject's environment markers.
CUTEDSL_PLATFORMS = (("linux", "x86_64"), ("linux", "aarch64"))


# True once both packages were found: the cutedsl backend asks on every call, and an installed package stays
# installed for the process, so the two module lookups run until they succeed, then never again.
_found = False


def is_available() -> bool:
    """True when CuTeDSL (``cutlass``, from ``nvidia-cutlass-dsl``) and TVM-FFI (``tvm_ffi``, from ``apache-tvm-ffi``)
    are installed; imports neither."""
    global _found
    if not _found:
        _found = all(_installed(name) for name in ("cutlass", "tvm_ffi"))
    return _found


def platform_note() -> str | None:
    """None on a platform CuTeDSL ships for; elsewhere the sentence that says so, naming this platform."""
    here = (sys.platform, platform.machine().lower())
    if here in CUTEDSL_PLATFORMS:
        return None
    return (
        f"CuTeDSL has no build for {here[0]} {here[1]} (NVIDIA ships it for Linux x86_64 and aarch64), so "
        "cula-runtime installs without it here and only the reference backend runs"
    )


def unavailable_reason() -> str:
    """Why the CuTeDSL kernels cannot run in this environment, with the fix; ``""`` when :func:`is_available`."""
    if is_available():
        return ""
    note = platform_note()
    if note is not None:
        return note
    missing = [dist for name, dist in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi"))
               if not _installed(name)]
    return (f"{' and '.join(missing)} not installed (cula-runtime depends on both; installed without its "
            f"dependencies?): {INSTALL_HINT}")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder refusing the name counts as "not installed"
        return False


#: the compute capabilities the CuTeDSL kernels target: sm_90a, sm_100a, sm_103a
KERNEL_CAPABILITIES = frozenset({(9, 0), (10, 0), (10, 3)})


def device_rejection(device: Any) -> str | None:
    """Why no CuTeDSL kernel runs on ``device`` (a ``torch.device``), or None: CuTeDSL or TVM-FFI missing, tensors
    not on CUDA, or a GPU outside :data:`KERNEL_CAPABILITIES`. The first check of every ``cutedsl`` backend's
    ``verify``; imports neither package (the capability is asked once per device, :mod:`cula_runtime.kda_tuning`)."""
    if not is_available():
        return f"needs CuTeDSL and TVM-FFI: {unavailable_reason()}"
    if device.type != "cuda":
        return f"needs CUDA tensors, got {device.type}"
    capability = device_capability(device)
    if capability not in KERNEL_CAPABILITIES:
        return f"targets sm_90a/sm_100a/sm_103a; this GPU is sm_{capability[0]}{capability[1]}"
    return None


def decode_pool_rejection(state: Any, served: str, head_dim: int = 128) -> tuple[bool, str]:
    """The decode kernels' (KDA and Lightning) promises about the state pool ``state`` (a ``torch.Tensor``), as a
    ``verify`` answer: fp32 or bf16, each head a dense ``[head_dim, head_dim]`` block, the other strides whole
    16-byte vectors, the data 16-byte aligned. ``(True, served)`` when all hold."""
    import torch

    if state.dtype not in (torch.float32, torch.bfloat16):
        return False, f"needs an fp32 or bf16 state pool, got {state.dtype}"
    vec = 16 // state.element_size()
    strides = state.stride()
    if strides[-2:] != (head_dim, 1) or any(s % vec for s in strides[:-1]) or state.data_ptr() % 16:
        return False, (f"needs each pool head a dense [{head_dim}, {head_dim}] block, 16-byte aligned, got strides "
                       f"{list(strides)}")
    return True, served


__getattr__, __dir__ = lazy_exports(globals(), _LAZY_EXPORTS)
