"""KDA kernels written in CuTeDSL.

Importing this package needs neither CuTeDSL nor a GPU; the names below import their kernel module (and so
CuTeDSL) on first use, raising an ``ImportError`` that names the fix when CuTeDSL or TVM-FFI is missing.

* :func:`kda_prepare`, :class:`KdaPrepare`, :class:`KdaPrepareConfig` (``prepare.py``): l2norm of q/k, beta
  activation and the chunk-local cumsum of the activated gate, in one launch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_EXPORTS = {
    "kda_prepare": "cula_runtime.cute.kda.prepare",
    "KdaPrepare": "cula_runtime.cute.kda.prepare",
    "KdaPrepareConfig": "cula_runtime.cute.kda.prepare",
}

__all__ = list(_LAZY_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cula_runtime.cute.kda' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
