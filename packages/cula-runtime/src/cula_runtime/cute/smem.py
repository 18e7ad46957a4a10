"""Shared-memory helpers shared by the CuTeDSL kernels: buffers that reuse one region across kernel phases.

A kernel allocates a raw byte region once (``SmemAllocator.allocate(nbytes, 1024)``) and carves typed tensors out
of it at fixed byte offsets; two buffers whose lifetimes do not overlap (separated by a CTA barrier) may share
bytes. Offsets are multiples of 1024 so that a swizzled tile keeps the address bits its swizzle acts on.
"""

from __future__ import annotations

from .compile_cache import missing_cutedsl

try:
    import cutlass.cute as cute
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["REGION_ALIGN", "align_up", "carve"]

REGION_ALIGN = 1024  # bytes: a Swizzle<3,3,3> tile of 16-bit elements repeats every 1024 bytes


def align_up(nbytes: int, alignment: int = REGION_ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


def carve(region, byte_offset: int, dtype, layout):
    """A ``dtype`` tensor with ``layout`` at ``byte_offset`` of ``region`` (an Int8 shared-memory pointer)."""
    if byte_offset % REGION_ALIGN:
        raise ValueError(f"byte_offset={byte_offset} must be a multiple of {REGION_ALIGN}")
    return cute.make_tensor(cute.recast_ptr(region + byte_offset, dtype=dtype), layout)
