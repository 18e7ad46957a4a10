"""KDA kernels written in CuTeDSL.

Importing this package needs neither CuTeDSL nor a GPU; the names below import their kernel module (and so
CuTeDSL) on first use, raising an ``ImportError`` that names the fix when CuTeDSL or TVM-FFI is missing.

* :func:`kda_prepare`, :class:`KdaPrepare`, :class:`KdaPrepareConfig` (``prepare.py``): l2norm of q/k, beta
  activation and the chunk-local cumsum of the activated gate, in one launch.
* :func:`chunk_kda_fwd_intra`, :class:`KdaIntra`, :class:`KdaIntraConfig` (``intra.py``): Aqk and Akk on warp MMA,
  the fp32 inverse of (I + Akk), and w/u/kg/qg, in FLA's intermediate layouts, in one launch; and the same as three
  launches (the modular path): :func:`chunk_kda_fwd_scores`, :func:`chunk_kda_solve_tril`,
  :func:`chunk_kda_recompute_w_u`; and :func:`chunk_kda_fwd_intra_from_raw`, the one-launch kernel doing
  kda_prepare's work too (:class:`InKernelGate`), with per-chunk decay rows for the recurrence.
* :func:`chunk_kda_fwd_recurrence`, :class:`KdaRecurrence`, :class:`KdaRecurrenceConfig` (``recurrence.py``): the
  fused delta-h + output, with the fp32 state in registers across chunks; :func:`chunk_kda_fwd_h`, the same
  kernel as the delta-h primitive (per-chunk states h and v_new, no output).
* :func:`chunk_kda_fwd_o`, :class:`KdaOutput`, :class:`KdaOutputConfig` (``output.py``): the chunk output from
  per-chunk states, chunk-parallel (the modular counterpart of the recurrence's output, same bits).

``tiles.py`` holds the tile machinery the recurrence and output kernels share.
"""

from __future__ import annotations

from ..._lazy import lazy_exports

_LAZY_EXPORTS = {
    "kda_prepare": "cula_runtime.cute.kda.prepare",
    "KdaPrepare": "cula_runtime.cute.kda.prepare",
    "KdaPrepareConfig": "cula_runtime.cute.kda.prepare",
    "chunk_kda_fwd_intra": "cula_runtime.cute.kda.intra",
    "chunk_kda_fwd_intra_from_raw": "cula_runtime.cute.kda.intra",
    "InKernelGate": "cula_runtime.cute.kda.intra",
    "chunk_kda_fwd_scores": "cula_runtime.cute.kda.intra",
    "chunk_kda_solve_tril": "cula_runtime.cute.kda.intra",
    "chunk_kda_recompute_w_u": "cula_runtime.cute.kda.intra",
    "KdaIntra": "cula_runtime.cute.kda.intra",
    "KdaIntraConfig": "cula_runtime.cute.kda.intra",
    "chunk_kda_fwd_recurrence": "cula_runtime.cute.kda.recurrence",
    "chunk_kda_fwd_h": "cula_runtime.cute.kda.recurrence",
    "chunk_kda_fwd_o": "cula_runtime.cute.kda.output",
    "KdaOutput": "cula_runtime.cute.kda.output",
    "KdaOutputConfig": "cula_runtime.cute.kda.output",
    "KdaRecurrence": "cula_runtime.cute.kda.recurrence",
    "KdaRecurrenceConfig": "cula_runtime.cute.kda.recurrence",
}

__all__ = list(_LAZY_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _LAZY_EXPORTS)
