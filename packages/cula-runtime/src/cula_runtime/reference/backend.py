"""The reference backend of ``kda_prefill``: validated arguments in, ``kda_chunked`` (float32 torch code) out.

It serves every argument combination the validator accepts, on any device torch runs on. On a GPU it is correct
but slow (plain torch ops, no fused kernel): the dispatch uses it there only when no GPU kernel can serve a call.
"""

from __future__ import annotations

import torch

from ..kda_args import KdaPrefillArgs
from .kda_chunked import kda_chunked

__all__ = ["verify", "kda_prefill_reference"]

NAME = "reference"


def verify(args: KdaPrefillArgs) -> tuple[bool, str]:
    """Whether this backend serves ``args`` (always: it covers every validated argument), and why."""
    return True, "the torch reference serves every validated argument combination"


def kda_prefill_reference(args: KdaPrefillArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run KDA prefill with the chunked float32 reference.

    Returns ``o`` ``[B, T, HV, V]`` in q's dtype and, if ``args.output_final_state``, the final state
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` when ``state_v_first``) in float32, else ``None``.
    """
    return kda_chunked(**args.reference_kwargs())
