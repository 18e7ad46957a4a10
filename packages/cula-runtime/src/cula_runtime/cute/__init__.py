"""cuLA's CuTeDSL kernels and the machinery to compile them.

Importing this package imports neither CuTeDSL (``cutlass``) nor TVM-FFI nor torch, and needs no GPU: every name
below is resolved on first use. Kernel modules (``cula_runtime.cute.kda.prepare``, ...) import CuTeDSL and TVM-FFI
when they are imported and raise an ``ImportError`` that names the fix (``pip install "cula-runtime[cute]"``)
when either is missing.

* :mod:`.arch`: the two knobs, ``CULA_ARCH`` (dispatch) and ``CUTE_DSL_ARCH`` (compile target).
* :mod:`.compile_cache`: the one compile cache of the monorepo; the only caller of ``cute.compile``.
* :mod:`.machine_code`: SASS of a compiled kernel (nvdisasm) and the SM its cubin targets.
"""

from __future__ import annotations

import importlib
import importlib.util

from .._lazy import lazy_exports

_LAZY_EXPORTS = {
    "compile_target": "cula_runtime.cute.arch",
    "launch_target": "cula_runtime.cute.arch",
    "dispatch_target": "cula_runtime.cute.arch",
    "supported_targets": "cula_runtime.cute.arch",
    "compile_kernel": "cula_runtime.cute.compile_cache",
    "compile_records": "cula_runtime.cute.compile_cache",
    "cache_info": "cula_runtime.cute.compile_cache",
    "require_cutedsl": "cula_runtime.cute.compile_cache",
    "INSTALL_HINT": "cula_runtime.cute.compile_cache",
    "disassemble": "cula_runtime.cute.machine_code",
    "MachineCode": "cula_runtime.cute.machine_code",
}

__all__ = ["is_available", *_LAZY_EXPORTS]


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


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder refusing the name counts as "not installed"
        return False


__getattr__, __dir__ = lazy_exports(globals(), _LAZY_EXPORTS)
