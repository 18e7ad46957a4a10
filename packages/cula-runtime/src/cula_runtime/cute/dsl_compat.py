"""What differs between the CuTeDSL versions cula-runtime admits (``DSL_REQUIREMENTS``: 4.6.2 through 4.8.1), in
one place: kernels import these names from here, so no kernel is written twice.

* ``SmemAllocator``: ``cutlass.memory.SmemAllocator`` from CuTeDSL 4.8 (where ``cutlass.utils.SmemAllocator``
  still works but warns that it is deprecated), ``cutlass.utils.SmemAllocator`` before it (no ``cutlass.memory``).

Names that 4.8 deprecates but that have a spelling valid in every admitted version are written that way in the
kernels and need nothing here: ``cute.nvgpu.LoadCacheMode`` (4.8 deprecates ``cute.nvgpu.cpasync.LoadCacheMode``;
4.6's ``cpasync.CopyG2SOp`` already takes the shared enum, the same IR value).
"""

from __future__ import annotations

from .compile_cache import missing_cutedsl

try:
    import cutlass  # noqa: F401  (the ImportError names the fix when CuTeDSL is missing)
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

try:
    from cutlass.memory import SmemAllocator  # CuTeDSL >= 4.8
except ImportError:
    from cutlass.utils import SmemAllocator  # CuTeDSL 4.6 and 4.7

__all__ = ["SmemAllocator"]
