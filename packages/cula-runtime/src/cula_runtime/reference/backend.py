"""The reference backend of ``kda_prefill`` and ``kda_decode``: validated arguments in, float32 torch code out.

Prefill runs ``kda_chunked``; with a state pool (``state=``) it starts each sequence from its slot and writes its
final state back in place. Decode runs :func:`cula_runtime.reference.kda_decode.kda_decode_reference`. It serves
every argument combination the validators accept, on any device torch runs on. On a GPU it is correct but slow
(plain torch ops, no fused kernel; the pool forms read the index values back): the dispatch uses it there only when
no GPU kernel can serve a call.
"""

from __future__ import annotations

import torch

from ..kda_args import KdaPrefillArgs, sequence_lengths
from ..kda_decode_args import KdaDecodeArgs
from ..state_pool import PoolSlots, pool_slots
from .kda_chunked import kda_chunked
from .kda_decode import kda_decode_reference, write_slots

__all__ = ["verify", "kda_prefill_reference", "verify_decode", "kda_decode_reference", "zero_padding_rows"]

NAME = "reference"


def verify(args: KdaPrefillArgs) -> tuple[bool, str]:
    """Whether this backend serves ``args`` (always: it covers every validated argument), and why."""
    return True, "the torch reference serves every validated argument combination"


def verify_decode(args: KdaDecodeArgs) -> tuple[bool, str]:
    """Whether this backend serves these ``kda_decode`` arguments (always), and why."""
    return True, "the torch reference serves every validated decode call"


def kda_prefill_reference(args: KdaPrefillArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run KDA prefill with the chunked float32 reference.

    Returns ``o`` ``[B, T, HV, V]`` in q's dtype and, if ``args.output_final_state``, the final state
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` when ``state_v_first``) in float32, else ``None``. With a pool
    (``args.state``): ``(o, None)``, the final states written to the pool (:func:`prefill_into_pool`).
    """
    if args.state is not None:
        return prefill_into_pool(args)
    return kda_chunked(**args.reference_kwargs())


def prefill_into_pool(args: KdaPrefillArgs) -> tuple[torch.Tensor, None]:
    """Prefill on a state pool: sequence ``n`` starts from slot ``state_indices[n]`` (from zeros where
    ``has_initial_state[n]`` is False) and its final state, rounded to the pool's dtype, is written back there in
    place; a padding row (negative slot; on a GPU also one past the pool) reads and writes nothing and its outputs
    are zero. All sequences run in one ``kda_chunked`` call. Returns ``(o, None)``."""
    state, N, device = args.state, args.N, args.device
    lens = sequence_lengths(N, args.T, args.cu_seqlens_host)
    slots = args.pool_slots
    if slots is None:  # (device indices: one copy to the host)
        slots = pool_slots(args.state_indices.tolist(), lens, state.shape[0], per_token=False, strict=False)
    has = [True] * N if args.has_initial_state is None else args.has_initial_state.tolist()
    active = slots.active
    h0 = torch.zeros((N, *state.shape[1:]), dtype=torch.float32, device=device)
    read = [n for n in active if has[n]]
    if read:
        h0[read] = state.index_select(0, torch.tensor([slots.start[n] for n in read], device=device)).float()
    kwargs = args.reference_kwargs()
    kwargs.update(initial_state=h0, output_final_state=True)
    o, ht = kda_chunked(**kwargs)
    # a sequence of no tokens that read its slot leaves it as it was (an fp64 pool's state went through fp32 here)
    written = [n for n in active if lens[n] > 0 or not has[n]]
    if written:
        write_slots(state, [slots.final[n] for n in written], ht[written])
    zero_padding_rows(o, slots, None if args.cu_seqlens_host is None else args.cu_seqlens_host.tolist())
    return o, None


def zero_padding_rows(o: torch.Tensor, slots: PoolSlots, bounds: list[int] | None) -> None:
    """Zero a pool call's outputs ``o`` ``[B, T, heads, V]`` on its padding rows (start slot -1; KDA_SPEC §10):
    ``o[n]`` of a fixed batch, or tokens ``bounds[n]:bounds[n + 1]`` of a packed one (``bounds``: cu_seqlens)."""
    for n, slot in enumerate(slots.start):
        if slot < 0:
            if bounds is None:
                o[n] = 0
            else:
                o[0, bounds[n]:bounds[n + 1]] = 0
