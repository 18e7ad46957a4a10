"""Lightning Attention: the public prefill and decode API (FLA's conventions; issue 28, KDA_SPEC §5).

Per head ``h`` with the log-decay ``g_gamma[h] <= 0`` (``λ = exp(g_gamma[h])``) and per token ``t``::

    S <- λ S + k_t^T v_t            (S is [K, V], fp32)
    o_t = scale · q_t S             (with the updated S)

A partial last chunk decays by its true length (the exact recurrence, as FLA; KDA_SPEC §9 item 1).
"""

from __future__ import annotations

import torch

from cula_runtime.kda_args import checked_boundaries
from cula_runtime.lightning_args import (
    LightningDecodeArgs,
    LightningPrefillArgs,
    layer_g_gamma,
    validate_lightning_decode,
    validate_lightning_prefill,
)

from . import call_plans
from .call_plans import (
    LaunchDeclined,
    first_call,
    has_guarded_plans,
    lightning_decode_call_signature,
    lightning_prefill_call_signature,
    lookup,
    lookup_guarded_lightning,
)
from .dispatch import select_lightning_decode_backend, select_lightning_prefill_backend

__all__ = ["lightning_prefill", "lightning_decode", "layer_g_gamma"]


def _decay(g_gamma: torch.Tensor | None, layer_idx: int | None, num_layers: int | None,
           q: torch.Tensor) -> torch.Tensor:
    """A planned call's decay tensor: ``g_gamma`` itself, or the kept tensor of its layer (no allocation)."""
    return g_gamma if g_gamma is not None else layer_g_gamma(q.shape[2], layer_idx, num_layers, q.device)


def lightning_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor | None = None,
    *,
    layer_idx: int | None = None,
    num_layers: int | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning Attention over whole sequences (prefill), on the best backend for the tensors' device.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (bf16, fp16 or fp32; one dtype for q, k, v).
        v: ``[B, T, H, V]`` values (q's heads: no GVA).
        g_gamma: ``[H]`` fp32 per-head log-decay (finite, ``<= 0``) on q's device. Exclusive with ``layer_idx``.
            A CPU ``g_gamma``'s values are checked; a GPU one's are trusted (reading them would synchronise).
        layer_idx, num_layers: FLA's decay of layer ``layer_idx`` (in ``[0, num_layers)``):
            ``g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h`` (head 0 has no decay); built once per
            ``(H, layer_idx, num_layers, device)``.
        scale: query scale; ``None`` means ``K ** -0.5`` (FLA's default).
        initial_state: fp32 ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``), one per sequence; ``None``
            means zeros.
        output_final_state: also return each sequence's final state (fp32, the layout of ``initial_state``).
        cu_seqlens: int32 or int64 ``[N + 1]`` cumulative lengths of a packed batch (then ``B`` must be 1); empty
            sequences allowed. Its values are checked (one copy to the host per tensor and version).
        state_v_first: states laid out ``[.., H, V, K]``.
        state: a state pool ``[P, H, K, V]`` (``[P, H, V, K]`` with ``state_v_first``), fp32 or bf16, read and
            written in place (never copied: each slot dense and its own memory, the slot stride free, no memory
            shared with another argument). Sequence ``n`` starts from slot
            ``state_indices[n]`` and its final state (rounded to the pool's dtype) is written back there; the other
            slots are untouched. Exclusive with ``initial_state`` and ``output_final_state=True`` (``ValueError``).
        state_indices: int32 ``[N]`` on q's device, with ``state``. A negative index is a padding row: nothing is
            read or written for it, and its outputs are zeros. An index ``>= P`` or a slot named
            twice is refused (``ValueError``) for CPU tensors; on a GPU the values are not read by the validator and
            an index ``>= P`` is padding.
        has_initial_state: optional bool ``[N]`` on q's device, with ``state``: where False, sequence ``n`` starts
            from zeros instead of its slot (its final state is still written there).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in q's dtype; ``final_state`` fp32 ``[N, H, K, V]``
        (``[N, H, V, K]``) or ``None``. With a pool: ``(o, None)``.

    Bad arguments raise ``TypeError`` or ``ValueError`` naming the argument; a call no backend serves raises
    ``NotImplementedError`` saying which backends were tried and why. ``CULA_BACKEND=reference|cutedsl`` forces a
    backend. A repeated GPU call of one signature (tensors' shapes, strides, dtypes, devices; the decay's form;
    flags; ``scale``; ``CULA_*`` knobs) runs the plan its backend left, without validation and dispatch
    (``cula.call_plans``); ``cu_seqlens``' values are still checked. Whether the pool shares memory with another
    argument is checked on the call that makes a plan, not on those it serves.
    """
    signature = lightning_prefill_call_signature(q, k, v, g_gamma, layer_idx, num_layers, scale, initial_state,
                                                 output_final_state, cu_seqlens, state_v_first, state, state_indices,
                                                 has_initial_state)
    plan = lookup(signature)
    if plan is not None:
        if cu_seqlens is not None:  # (its values, checked as the validator does: cached, no new synchronisation)
            checked_boundaries(cu_seqlens, None, q.shape[1])
        try:
            return plan(q, k, v, _decay(g_gamma, layer_idx, num_layers, q), initial_state, cu_seqlens, state,
                        state_indices, has_initial_state)
        except LaunchDeclined:  # (refused before launching: decided below, as if there were no plan)
            pass
    args = validate_lightning_prefill(q, k, v, g_gamma, layer_idx, num_layers, scale, initial_state,
                                      output_final_state, cu_seqlens, state_v_first, state, state_indices,
                                      has_initial_state)
    as_is = signature is not None and _prefill_passed_as_is(args, q, k, v, g_gamma, initial_state, cu_seqlens,
                                                            state_indices, has_initial_state)
    return first_call(signature, args, select_lightning_prefill_backend(args), as_is,
                      (q, k, v, args.g_gamma, initial_state, cu_seqlens, state, state_indices, has_initial_state))


def lightning_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor | None = None,
    *,
    layer_idx: int | None = None,
    num_layers: int | None = None,
    scale: float | None = None,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lightning Attention decode: the recurrence over ``T_n >= 0`` new tokens per sequence, from and into a state
    pool, in place.

    Args:
        q, k: ``[B, T, H, K]`` (bf16, fp16 or fp32; one dtype for q, k, v); v: ``[B, T, H, V]``. Without
            ``cu_seqlens``: ``B`` sequences of ``T`` tokens each (``T = 1``: one decode step).
        g_gamma, layer_idx, num_layers, scale: the decay and the query scale, as in :func:`lightning_prefill`.
        state: the pool ``[P, H, K, V]`` (``[P, H, V, K]`` with ``state_v_first``), fp32 or bf16, read and written in
            place, never copied (each slot dense and its own memory; the slot stride free; no memory shared with
            another argument, out included). The running state is fp32; a bf16 pool is
            rounded when a state is written.
        state_indices: int32 ``[N]`` on q's device: sequence ``n`` starts from slot ``state_indices[n]`` and its
            state after its last token is written back there (a sequence of no tokens writes nothing). A negative
            index is a padding row: nothing is read or written and its output rows are zeros. An index ``>= P`` or a
            slot named twice is refused (``ValueError``) for CPU tensors; on a GPU no value is read on the host and
            an index ``>= P`` is padding. Slots no sequence names are untouched.
        state_v_first: the pool's layout.
        cu_seqlens: int32 or int64 ``[N + 1]`` on q's device: ``N`` packed sequences of any lengths, zero included
            (then ``B`` must be 1).
        out: the output, written in place when given: contiguous ``[B, T, H, V]`` in q's dtype on q's device (on a
            GPU served by the kernel, 16-byte aligned: a misaligned one is refused with a ``ValueError``).

    Returns:
        ``o`` ``[B, T, H, V]`` in q's dtype (``out`` when given), zeros on padding rows.

    On a GPU served by a kernel the call reads no device value on the host and allocates nothing but ``o`` (nothing
    with ``out``): it can be captured in a CUDA graph and replayed with new values in the same tensors. The torch
    reference (CPU tensors, or a GPU call no kernel serves, with a ``CulaFallbackWarning``) reads the indices back
    and is not capturable. Bad arguments raise ``TypeError`` or ``ValueError`` naming the argument. Repeated GPU
    calls of one signature run a call plan (``cula.call_plans``); whether the pool or ``out`` shares memory with
    another argument is checked on the call that makes a plan, not on those it serves.
    """
    signature = lightning_decode_call_signature(q, k, v, g_gamma, layer_idx, num_layers, scale, state, state_indices,
                                                state_v_first, cu_seqlens, out)
    # (the decay only where a plan exists: its layer_idx / num_layers passed the validator then)
    if signature is not None and has_guarded_plans(signature):
        decay = _decay(g_gamma, layer_idx, num_layers, q)
        plan = lookup_guarded_lightning(signature, q, k, v, decay, state, state_indices, cu_seqlens, out)
        if plan is not None:  # (nothing of a GPU call's values is checked on the host: the plan is the whole call)
            try:
                return plan(q, k, v, decay, state, state_indices, cu_seqlens, out)
            except LaunchDeclined:  # (refused before launching: decided below, as if there were no plan)
                pass
    args = validate_lightning_decode(q, k, v, g_gamma, layer_idx, num_layers, scale, state=state,
                                     state_indices=state_indices, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                     out=out)
    # (CPU indices: the validator checks their values on every call, so such a call is never planned)
    as_is = (signature is not None and not call_plans.indices_checked_on_host(state_indices)
             and _decode_passed_as_is(args, q, k, v, g_gamma, state_indices, cu_seqlens))
    return first_call(signature, args, select_lightning_decode_backend(args), as_is,
                      (q, k, v, args.g_gamma, state, state_indices, cu_seqlens, out), guarded=True)


def _prefill_passed_as_is(args: LightningPrefillArgs, q, k, v, g_gamma, initial_state, cu_seqlens, state_indices,
                          has_initial_state) -> bool:
    """Whether the validator kept every tensor as passed (contiguous: no copy), which a plan relies on."""
    return (args.q is q and args.k is k and args.v is v and (g_gamma is None or args.g_gamma is g_gamma)
            and args.initial_state is initial_state and args.cu_seqlens is cu_seqlens
            and args.state_indices is state_indices and args.has_initial_state is has_initial_state)


def _decode_passed_as_is(args: LightningDecodeArgs, q, k, v, g_gamma, state_indices, cu_seqlens) -> bool:
    return (args.q is q and args.k is k and args.v is v and (g_gamma is None or args.g_gamma is g_gamma)
            and args.state_indices is state_indices and args.cu_seqlens is cu_seqlens)
