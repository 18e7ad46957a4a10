"""Launch-shape choices shared by the GPU KDA backends (cula-sm90 and CuTeDSL), and the device facts they need
(SM count, compute capability), each asked of the driver once per device. Imports nothing heavy."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK_V_CHOICES", "device_capability", "recurrence_block_v", "sm_count"]

BLOCK_V_CHOICES = (64, 128)  # value columns per recurrence CTA: whole warpgroups (4 or 8 warps)


def recurrence_block_v(num_pairs: int, num_sms: int) -> int:
    """Value columns per recurrence CTA (``block_v``, 64 or 128) for ``num_pairs`` = N·HV (sequence, value head)
    pairs, chosen per call.

    Both recurrence kernels (native and CuTeDSL) hold about 130 KB of shared memory, so one CTA per SM, and split a
    pair's 128 value columns over ``128 / block_v`` CTAs of ``block_v / 16`` warps. Every warp owns 16 state rows and
    walks the whole sequence, so a CTA's time per chunk depends little on ``block_v``; what matters is how many
    waves the grid of ``num_pairs * 128 / block_v`` CTAs takes. Hence: the narrowest ``block_v`` whose grid fits in
    one wave (more SMs, fewer warps on each), else 128 (the fewest waves, 8 warps per SM to hide latency).
    Every choice gives the same bits (tested on the H200).

    No narrower block: the CuTeDSL recurrence's 2-warp CTAs (``block_v`` = 32) were slower than 4-warp ones even
    with half the SMs idle (H200, B1 H16 T32768: 1229 vs 1121 us; ``kda_profile_h200.md``), and the native kernel's
    warpgroup MMAs need whole warpgroups: its mma.sync form, the only one at 32 (run at this choice with 32 allowed,
    the fastest mma.sync block there: 1026 vs 1320 us), was 1.03-1.16x slower end to end than the warpgroup-MMA one on
    29 of 30 configs and equal on the 30th (``kda_prefill_fixed_sm90_knobs_h200.md``,
    ``kda_prefill_rest_sm90_wgmma_h200.md``). The forms at 32 were retired in issue 25, with ``CULA_BLOCK_V``.
    """
    for block_v in BLOCK_V_CHOICES:
        if num_pairs * (128 // block_v) <= num_sms:
            return block_v
    return BLOCK_V_CHOICES[-1]


def _device_index(device: torch.device) -> int:
    """The ordinal of a CUDA ``torch.device``; no index: the current device's."""
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()


def sm_count(device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (a ``torch.device``; no index: the current device)."""
    return _sm_count(_device_index(device))


@functools.cache
def _sm_count(index: int) -> int:  # cached: a device query costs microseconds on every call
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def device_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of the CUDA ``device`` (a ``torch.device``; no index: the current
    device). A device's capability never changes, so it is asked of the driver once per device index."""
    return _capability(_device_index(device))


@functools.cache
def _capability(index: int) -> tuple[int, int]:  # torch.cuda.get_device_capability costs microseconds per call
    import torch

    return tuple(torch.cuda.get_device_capability(index))
