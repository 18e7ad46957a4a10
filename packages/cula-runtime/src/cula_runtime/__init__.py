"""cula-runtime: cuLA's pure-Python runtime (CuTeDSL kernels, kernel registry, index helpers, torch reference).

Importing this package imports nothing heavy: no GPU, CuTeDSL, triton or native extension is needed. Each public
name below is resolved on first use from the module that defines it.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__

_LAZY_EXPORTS = {
    "prepare_lens": "cula_runtime.index",
    "prepare_chunk_indices": "cula_runtime.index",
    "prepare_chunk_offsets": "cula_runtime.index",
    "validate_kda_prefill": "cula_runtime.kda_args",
    "KdaPrefillArgs": "cula_runtime.kda_args",
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


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cula_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
