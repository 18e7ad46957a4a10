"""KDA kernels written in CuTeDSL.

Importing this package needs neither CuTeDSL nor a GPU; the names below import their kernel module (and so
CuTeDSL) on first use, raising an ``ImportError`` that names the fix when CuTeDSL or TVM-FFI is missing.

* :func:`kda_prepare`, :class:`KdaPrepare`, :class:`KdaPrepareConfig` (``prepare.py``): l2norm of q/k, beta
  activation and the chunk-local cumsum of the activated gate, in one launch.
"""

from __future__ import annotations

from ..._lazy import lazy_exports

_LAZY_EXPORTS = {
    "kda_prepare": "cula_runtime.cute.kda.prepare",
    "KdaPrepare": "cula_runtime.cute.kda.prepare",
    "KdaPrepareConfig": "cula_runtime.cute.kda.prepare",
}

__all__ = list(_LAZY_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _LAZY_EXPORTS)
