"""Validation of ``kda_decode`` arguments: the one validator of the decode op, shared by every backend.

``validate_kda_decode`` checks every argument before any backend sees it, with the checks it shares with
``validate_kda_prefill`` (:mod:`cula_runtime.kda_args`: inputs, flags, scale, gate parameters, the state pool), and
raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, size or value) naming the argument and the
value expected. It returns a frozen :class:`KdaDecodeArgs`.

Values: nothing here synchronises with a device. The values of ``cu_seqlens``, ``state_indices`` and
``num_accepted_tokens`` are checked (:mod:`cula_runtime.state_pool`'s rules) when they are CPU tensors; on a GPU they
are never read by the validator (a CUDA graph replays the call with new values in the same buffers), and what the
kernels meet there is treated as padding (:mod:`cula_runtime.state_pool`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kda_args import (
    KdaCallArgs,
    check_apart,
    check_decode_cu_seqlens,
    check_devices,
    check_flags,
    check_gate,
    check_input_types,
    check_kda_inputs,
    check_out,
    check_scale,
    check_state_pool,
    sequence_lengths,
)
from .state_pool import PoolSlots, pool_slots

__all__ = ["KdaDecodeArgs", "validate_kda_decode", "decode_slots"]

_FLAG_NAMES = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
               "state_v_first")


@dataclass(frozen=True)
class KdaDecodeArgs(KdaCallArgs):
    """Validated ``kda_decode`` arguments: the inputs (contiguous), the pool ``state`` ``[P, HV, K, V]``
    (``[P, HV, V, K]`` V-first) and ``out`` as passed (both are written in place), ``state_indices`` int32 ``[N]``
    or ``[N, W]`` (``W``: 0 for ``[N]``), ``num_accepted_tokens`` int32 ``[N]`` or None.

    ``cu_seqlens_host``: the checked CPU copy of a CPU ``cu_seqlens`` (None otherwise); ``slots``: the slots checked
    on the host (:func:`cula_runtime.state_pool.pool_slots`, strict) when the index tensors are on the CPU, else None.
    """

    state: torch.Tensor
    state_indices: torch.Tensor
    num_accepted_tokens: torch.Tensor | None
    out: torch.Tensor | None
    P: int
    W: int
    cu_seqlens_host: torch.Tensor | None = None
    slots: PoolSlots | None = None


def validate_kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> KdaDecodeArgs:
    """Check every ``kda_decode`` argument (see ``cula.kda.kda_decode`` for their meaning); the checks run in a
    fixed order and the first failing one raises ``TypeError`` or ``ValueError`` naming its argument."""
    check_input_types(q, k, v, g, beta)
    check_flags(_FLAG_NAMES, (use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                              allow_neg_eigval, state_v_first))
    B, T, H, K, HV, V = check_kda_inputs(q, k, v, g, beta)
    check_devices(q, k, v, g, beta, (("state", state), ("state_indices", state_indices), ("A_log", A_log),
                                     ("dt_bias", dt_bias), ("cu_seqlens", cu_seqlens),
                                     ("num_accepted_tokens", num_accepted_tokens), ("out", out)))
    scale = check_scale(scale, K)

    N, cu_host = check_decode_cu_seqlens(cu_seqlens, B, T)

    P, per_token = check_state_pool(state, state_indices, N, HV, K, V, state_v_first, per_token_allowed=True)
    W = state_indices.shape[1] if per_token else 0
    if per_token and cu_seqlens is None and W < T:
        raise ValueError(f"state_indices [N, W] names the slot of each token's state: W must be >= T={T}, got "
                         f"shape {list(state_indices.shape)}")
    if num_accepted_tokens is not None:
        if not per_token:
            raise ValueError("num_accepted_tokens needs state_indices of shape [N, W] (speculative verification: "
                             "sequence n starts from state_indices[n, num_accepted_tokens[n] - 1]); got "
                             f"state_indices of shape {list(state_indices.shape)}")
        if num_accepted_tokens.dtype != torch.int32:
            raise TypeError(f"num_accepted_tokens must have dtype torch.int32, got {num_accepted_tokens.dtype}")
        if num_accepted_tokens.shape != (N,):
            raise ValueError(f"num_accepted_tokens must have shape [N]=[{N}] (one count per sequence), got "
                             f"{list(num_accepted_tokens.shape)}")

    lower_bound, dt_bias = check_gate(use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, None,
                                      lower_bound, A_log, dt_bias, HV, K)

    check_out(out, q, (B, T, HV, V), "[B, T, HV, V]")
    check_apart((("state", state), ("out", out)),
                (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log), ("dt_bias", dt_bias),
                 ("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                 ("num_accepted_tokens", num_accepted_tokens)))

    slots = None
    if state_indices.device.type == "cpu":
        slots = decode_slots(state_indices, num_accepted_tokens, sequence_lengths(N, T, cu_host), P, strict=True)

    return KdaDecodeArgs(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(), scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, A_log=None if A_log is None else A_log.contiguous(),
        dt_bias=None if dt_bias is None else dt_bias.contiguous(),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.contiguous(), state_v_first=state_v_first,
        B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, state=state, state_indices=state_indices.contiguous(),
        num_accepted_tokens=None if num_accepted_tokens is None else num_accepted_tokens.contiguous(), out=out, P=P,
        W=W, cu_seqlens_host=cu_host, slots=slots,
    )


def decode_slots(state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor | None, lens: list[int],
                 pool_size: int, *, strict: bool) -> PoolSlots:
    """The slots a decode call uses (:func:`cula_runtime.state_pool.pool_slots`), read from its index tensors (one
    copy to the host each; a synchronisation for GPU tensors)."""
    accepted = None if num_accepted_tokens is None else num_accepted_tokens.tolist()
    return pool_slots(state_indices.tolist(), lens, pool_size, accepted, per_token=state_indices.ndim == 2,
                      strict=strict)
