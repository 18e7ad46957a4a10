"""cula-runtime: cuLA's pure-Python runtime (CuTeDSL kernels, kernel registry, index helpers, torch reference).

Importing this package imports nothing heavy: no GPU, CuTeDSL, triton or native extension is needed. Each public
name below is resolved on first use from the module that defines it.
"""

from __future__ import annotations

from ._lazy import lazy_exports
from ._version import __version__

_LAZY_EXPORTS = {
    "prepare_lens": "cula_runtime.index",
    "prepare_chunk_indices": "cula_runtime.index",
    "prepare_chunk_offsets": "cula_runtime.index",
    "validate_kda_prefill": "cula_runtime.kda_args",
    "KdaPrefillArgs": "cula_runtime.kda_args",
    "validate_kda_decode": "cula_runtime.kda_decode_args",
    "KdaDecodeArgs": "cula_runtime.kda_decode_args",
    "list_kernels": "cula_runtime.registry",
    "get_kernel": "cula_runtime.registry",
    "KERNELS": "cula_runtime.registry",
    "kda_naive": "cula_runtime.reference.kda_naive",
    "kda_chunked": "cula_runtime.reference.kda_chunked",
    "lightning_naive": "cula_runtime.reference.lightning",
    "lightning_chunked": "cula_runtime.reference.lightning",
    "lightning_decode": "cula_runtime.reference.lightning",
}

__all__ = ["__version__", *_LAZY_EXPORTS]


__getattr__, __dir__ = lazy_exports(globals(), _LAZY_EXPORTS)
