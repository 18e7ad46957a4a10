"""KDA kernels written in CuTeDSL.

Importing this package needs neither CuTeDSL nor a GPU; the names below import their kernel module (and so
CuTeDSL) on first use, raising an ``ImportError`` that names the fix when CuTeDSL or TVM-FFI is missing.

* :func:`chunk_kda_fwd_intra_from_raw`, :class:`KdaIntra`, :class:`KdaIntraConfig`, :class:`InKernelGate`
  (``intra.py``): from the raw inputs, the gate's activation and chunk-local cumsum, β and the q/k L2 norm, then
  Aqk and Akk on warp MMA, the fp32 inverse of (I + Akk), and w/u/kg/qg in FLA's intermediate layouts, with each
  chunk's decay row for the recurrence, in one launch. ``gate.py`` holds the gate and β arithmetic it uses.
* :func:`chunk_kda_fwd_recurrence`, :class:`KdaRecurrence`, :class:`KdaRecurrenceConfig` (``recurrence.py``): the
  fused delta-h + output, with the fp32 state in registers across chunks.

``tiles.py`` holds the device-side machinery the kernels share; ``backend.py`` chains the two kernels as the
``cutedsl`` backend of ``kda_prefill``.
"""

from __future__ import annotations

from ..._lazy import lazy_exports

_LAZY_EXPORTS = {
    "chunk_kda_fwd_intra_from_raw": "cula_runtime.cute.kda.intra",
    "InKernelGate": "cula_runtime.cute.kda.intra",
    "KdaIntra": "cula_runtime.cute.kda.intra",
    "KdaIntraConfig": "cula_runtime.cute.kda.intra",
    "chunk_kda_fwd_recurrence": "cula_runtime.cute.kda.recurrence",
    "KdaRecurrence": "cula_runtime.cute.kda.recurrence",
    "KdaRecurrenceConfig": "cula_runtime.cute.kda.recurrence",
}

__all__ = list(_LAZY_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _LAZY_EXPORTS)
