"""cuLA: fast CUDA kernels for linear attention (Kimi Delta Attention first, Lightning Attention next).

Public modules, imported on first use: ``cula.kda`` (``kda_prefill``, ``kda_decode`` and the varlen index helpers)
and ``cula.kernels`` (the kernel registry). ``import cula`` needs no GPU, CuTeDSL, triton or native extension.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__

_SUBMODULES = ("kda", "kernels", "dispatch", "info")

__all__ = ["__version__", "kda", "kernels"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"cula.{name}")
    raise AttributeError(f"module 'cula' has no attribute {name!r}")
