"""cuLA: fast CUDA kernels for linear attention (Kimi Delta Attention first, Lightning Attention next).

Public modules: ``cula.kda`` (``kda_prefill``, ``kda_decode`` and the varlen index helpers), ``cula.lightning``
(``lightning_prefill``, ``lightning_decode``), ``cula.ops`` (the same calls as torch custom ops, ``torch.ops.cula.*``)
and ``cula.kernels`` (the kernel registry, imported on first use). ``import cula`` registers the custom ops
(importing ``cula.kda`` and ``cula.lightning``, which they call) and, where FLA is installed, cuLA's backend of
FLA's registry the moment FLA's KDA ops are imported (:mod:`cula.integrations`; FLA itself is not imported here).
``import cula`` needs no GPU, CuTeDSL, triton, FLA or native extension.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import ops as _ops  # noqa: F401  (registers torch.ops.cula.*)
from ._version import __version__
from .integrations import autoregister_fla

_SUBMODULES = ("kda", "lightning", "kernels", "dispatch", "info", "ops", "integrations")

__all__ = ["__version__", "kda", "lightning", "kernels"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"cula.{name}")
    raise AttributeError(f"module 'cula' has no attribute {name!r}")


autoregister_fla()
