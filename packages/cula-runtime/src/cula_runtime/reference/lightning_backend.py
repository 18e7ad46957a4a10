"""The reference backend of ``lightning_prefill`` and ``lightning_decode``: validated arguments in, torch code out.

Prefill runs :func:`cula_runtime.reference.lightning.lightning_chunked` (fp32); with a state pool (``state=``) it
starts each sequence from its slot and writes its final state back in place. Decode runs the per-token recurrence
over ``T_n >= 0`` tokens per sequence from and into the pool (fp32, or fp64 for the tests' oracle path). Both serve
every argument combination the validators (:mod:`cula_runtime.lightning_args`) accept, on any device torch runs on.
On a GPU they are correct but slow and they read the index values back (a synchronisation: not capturable in a CUDA
graph); the dispatch uses them there only when no GPU kernel can serve a call.

The pool rules (KDA_SPEC §5, §10; :mod:`cula_runtime.state_pool`): sequence ``n`` reads slot ``state_indices[n]``
(zeros instead where ``has_initial_state[n]`` is False) and its final state, rounded to the pool's dtype, is
written back there; a negative slot, or on a GPU one ``>= P``, is a padding row: nothing is read or written for it.
A padding row's prefill outputs are computed from a zero start state; its decode outputs are zeros. Slots no
sequence names are untouched.
"""

from __future__ import annotations

import torch

from ..index import checked_cu_seqlens_host
from ..kda_args import sequence_lengths
from ..lightning_args import LightningDecodeArgs, LightningPrefillArgs, lightning_pool_slots
from .backend import zero_padding_rows
from .kda_decode import write_slots
from .lightning import lightning_chunked

__all__ = ["verify_lightning_prefill", "lightning_prefill_reference", "verify_lightning_decode",
           "lightning_decode_reference"]

NAME = "reference"


def verify_lightning_prefill(args: LightningPrefillArgs) -> tuple[bool, str]:
    """Whether this backend serves ``args`` (always: it covers every validated call), and why."""
    return True, "the torch reference serves every validated Lightning prefill call"


def verify_lightning_decode(args: LightningDecodeArgs) -> tuple[bool, str]:
    """Whether this backend serves these ``lightning_decode`` arguments (always), and why."""
    return True, "the torch reference serves every validated Lightning decode call"


def _host_bounds(cu_seqlens: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """The checked host copy of ``cu_seqlens`` (cached: the validator made it; a GPU tensor's copy of a decode call,
    whose validator reads nothing, costs one synchronisation)."""
    return None if cu_seqlens is None else checked_cu_seqlens_host(cu_seqlens, T)


def lightning_prefill_reference(args: LightningPrefillArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run Lightning prefill with the chunked fp32 reference.

    Returns ``o`` ``[B, T, H, V]`` in q's dtype and, with ``args.output_final_state``, the final state fp32
    ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``), else None. With a pool (``args.state``):
    ``(o, None)``, the final states written into the pool in place.
    """
    if args.state is not None:
        return _prefill_into_pool(args)
    return lightning_chunked(args.q, args.k, args.v, args.g_gamma, scale=args.scale, initial_state=args.initial_state,
                             output_final_state=args.output_final_state, cu_seqlens=args.cu_seqlens,
                             state_v_first=args.state_v_first)


def _prefill_into_pool(args: LightningPrefillArgs) -> tuple[torch.Tensor, None]:
    """All sequences in one :func:`lightning_chunked` call from the start states gathered from the pool (zeros for
    padding rows and where ``has_initial_state`` is False); the final states of the rows that are not padding
    scattered back, rounded to the pool's dtype; the padding rows' outputs zeros."""
    state, N, device = args.state, args.N, args.device
    cu_host = _host_bounds(args.cu_seqlens, args.T)
    lens = sequence_lengths(N, args.T, cu_host)
    slots = lightning_pool_slots(args.state_indices, lens, state.shape[0], strict=False)
    has = [True] * N if args.has_initial_state is None else args.has_initial_state.tolist()
    active = slots.active
    h0 = torch.zeros((N, *state.shape[1:]), dtype=torch.float32, device=device)
    read = [n for n in active if has[n]]
    if read:
        start = torch.tensor([slots.start[n] for n in read], dtype=torch.int64, device=device)
        h0[read] = state.index_select(0, start).float()
    o, ht = lightning_chunked(args.q, args.k, args.v, args.g_gamma, scale=args.scale, initial_state=h0,
                              output_final_state=True, cu_seqlens=args.cu_seqlens, state_v_first=args.state_v_first)
    if active:
        write_slots(state, [slots.final[n] for n in active], ht[active])
    zero_padding_rows(o, slots, None if cu_host is None else cu_host.tolist())
    return o, None


def lightning_decode_reference(args: LightningDecodeArgs, *, compute_dtype: torch.dtype = torch.float32
                               ) -> torch.Tensor:
    """Run ``lightning_decode`` on validated arguments: update ``args.state`` in place and return ``o``.

    Per sequence ``n`` that is not padding, from its slot's state ``S`` (fp32 while it runs; a bf16 pool is read and
    written in bf16) and each of its ``T_n >= 0`` tokens: ``S <- exp(g_gamma) S + k_t^T v_t``, ``o_t = scale q_t S``;
    the state after its last token is written back to the slot (a sequence of no tokens writes nothing).

    Args:
        args: from :func:`cula_runtime.lightning_args.validate_lightning_decode`.
        compute_dtype: float32 (the backend) or float64 (the oracle path).

    Returns:
        ``o`` ``[B, T, H, V]`` in q's dtype (``args.out`` when given), zero on padding rows.
    """
    B, T, H, V, N = args.B, args.T, args.H, args.V, args.N
    device = args.device
    cu_host = _host_bounds(args.cu_seqlens, T)
    lens = sequence_lengths(N, T, cu_host)
    slots = lightning_pool_slots(args.state_indices, lens, args.P, strict=False)
    firsts = [n * T for n in range(N)] if cu_host is None else cu_host.tolist()[:-1]

    o = torch.zeros(B * T, H, V, dtype=compute_dtype, device=device)
    rows = sorted((n for n in slots.active if lens[n] > 0), key=lambda n: -lens[n])  # longest first (stable)
    if rows:
        longest = lens[rows[0]]
        # token positions [R, longest]; past a row's end its last token stands in (never used: see `running`)
        positions = [[firsts[n] + min(t, lens[n] - 1) for t in range(longest)] for n in rows]
        index = torch.tensor(positions, dtype=torch.int64, device=device)
        qs, ks, vs = (x.reshape(B * T, H, -1).to(compute_dtype)[index] for x in (args.q, args.k, args.v))
        start = torch.tensor([slots.start[n] for n in rows], dtype=torch.int64, device=device)
        S = args.state.index_select(0, start).to(compute_dtype)
        S = S.transpose(-1, -2).contiguous() if args.state_v_first else S  # K-first [R, H, K, V]
        lam = torch.exp(args.g_gamma.to(device=device, dtype=compute_dtype)).view(1, H, 1, 1)
        outputs = torch.zeros(len(rows), longest, H, V, dtype=compute_dtype, device=device)
        for t in range(longest):
            running = sum(lens[n] > t for n in rows)  # the rows still running are a prefix (sorted by length)
            S_t = lam * S[:running] + ks[:running, t].unsqueeze(-1) * vs[:running, t].unsqueeze(-2)
            outputs[:running, t] = args.scale * torch.einsum("rhk,rhkv->rhv", qs[:running, t], S_t)
            S[:running] = S_t
        write_slots(args.state, [slots.final[n] for n in rows], S, args.state_v_first)
        done = [(r, t) for r, n in enumerate(rows) for t in range(lens[n])]
        o[[positions[r][t] for r, t in done]] = outputs[[r for r, _ in done], [t for _, t in done]]

    result = o.view(B, T, H, V).to(args.q.dtype)
    if args.out is None:
        return result
    return args.out.copy_(result)
