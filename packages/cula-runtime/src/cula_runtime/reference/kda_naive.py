"""Token-by-token KDA recurrence in float64: the oracle of every KDA test (KDA_SPEC §1.2).

For each sequence and value head ``hv`` (qk head ``hv // (HV // H)``), starting from ``S = h0`` (zeros if absent)::

    S  <- diag(exp(g_t)) S            # decay the K rows
    v' <- beta_t (v_t - k_t . S)      # delta-rule residual against the decayed state
    S  <- S + outer(k_t, v')          # rank-1 write
    o_t <- (scale q_t) . S            # read with the updated state
"""

from __future__ import annotations

import torch

from ..kda_args import validate_kda_prefill
from .preprocess import expand_qk_heads, merge_sequences, prepare_kda_inputs, split_sequences

__all__ = ["check_kda_shapes", "kda_naive", "recurrence_step"]


def recurrence_step(
    S: torch.Tensor, q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, g_t: torch.Tensor, b_t: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of the recurrence (KDA_SPEC §1.2) for a batch of K-first states, in their dtype.

    Args:
        S: ``[R, HV, K, V]`` states before the token. q_t, k_t: ``[R, HV, K]`` (heads expanded); v_t ``[R, HV, V]``;
            g_t ``[R, HV, K]`` log-gate; b_t ``[R, HV]`` step size (all preprocessed).

    Returns:
        ``(S_new, o_t, v')``: the states after the token ``[R, HV, K, V]``, its output ``[R, HV, V]`` and the delta
        residual ``[R, HV, V]``.
    """
    S_dec = torch.exp(g_t).unsqueeze(-1) * S  # 1. decay rows
    kS = torch.einsum("nhk,nhkv->nhv", k_t, S_dec)
    vp = b_t.unsqueeze(-1) * (v_t - kS)  # 2. residual against the decayed state
    S_upd = S_dec + k_t.unsqueeze(-1) * vp.unsqueeze(-2)  # 3. rank-1 write
    o_t = torch.einsum("nhk,nhkv->nhv", scale * q_t, S_upd)  # 4. read the updated state
    return S_upd, o_t, vp


def check_kda_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    state_v_first: bool,
) -> tuple[list[int] | None, int]:
    """Check KDA argument shapes (KDA_SPEC §1.1, §4) with the library's one validator.

    Expects q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]``, beta ``[B, T, HV]`` and initial_state
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``). Returns ``(cu, N)``: the varlen boundaries as a Python
    list (None for fixed length) and the number of sequences.
    """
    args = validate_kda_prefill(q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                state_v_first=state_v_first)
    cu = None if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    return cu, args.N


def kda_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    *,
    return_v_new: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """KDA forward by the per-token recurrence, entirely in float64.

    Args:
        q, k: ``[B, T, H, K]`` any float dtype.
        v: ``[B, T, HV, V]``.
        g: ``[B, T, HV, K]`` log-gate (or raw gate with ``use_gate_in_kernel``).
        beta: ``[B, T, HV]`` (or logits with ``use_beta_sigmoid_in_kernel``).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``), any float dtype; not modified.
        output_final_state: return ht instead of None.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
            A_log (``[HV]``), dt_bias (``[HV*K]``): preprocessing, see :func:`prepare_kda_inputs` (done in float64).
        cu_seqlens: ``[N + 1]`` int32 boundaries for packed varlen inputs (then ``B == 1``).
        state_v_first: state layout of initial_state / ht.
        return_v_new: also return the per-token delta residual v' (what the chunked algorithm calls ``v_new``).

    Returns:
        ``(o, ht)``: o float64 ``[B, T, HV, V]``; ht float64 ``[N, HV, K, V]`` (or ``[N, HV, V, K]``) or None.
        With ``return_v_new``: ``(o, ht, v_new)`` with v_new float64 ``[B, T, HV, V]``.
    """
    cu, N = check_kda_shapes(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    K = q.shape[-1]
    HV, V = v.shape[2], v.shape[3]
    f64 = torch.float64
    if scale is None:
        scale = K**-0.5

    q, k, g, beta = prepare_kda_inputs(
        q, k, g, beta, dtype=f64,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
    )  # fmt: skip
    q = expand_qk_heads(q, HV)
    k = expand_qk_heads(k, HV)
    v = v.to(f64)

    # Per-sequence padded layout [N, T_max, HV, ...]; padded steps are skipped through `active`.
    qs, lens = split_sequences(q, cu)
    ks, _ = split_sequences(k, cu)
    vs, _ = split_sequences(v, cu)
    gs, _ = split_sequences(g, cu)
    bs, _ = split_sequences(beta, cu)

    if initial_state is None:
        S = torch.zeros(N, HV, K, V, dtype=f64, device=q.device)
    else:
        S = initial_state.to(device=q.device, dtype=f64)
        S = S.transpose(-1, -2) if state_v_first else S
        S = S.clone()

    T_max = qs.shape[1]
    o = torch.zeros(N, T_max, HV, V, dtype=f64, device=q.device)
    v_new = torch.zeros(N, T_max, HV, V, dtype=f64, device=q.device)
    for t in range(T_max):
        q_t, k_t, v_t = qs[:, t], ks[:, t], vs[:, t]  # [N, HV, K], [N, HV, K], [N, HV, V]
        g_t, b_t = gs[:, t], bs[:, t]  # [N, HV, K], [N, HV]
        S_upd, o[:, t], v_new[:, t] = recurrence_step(S, q_t, k_t, v_t, g_t, b_t, scale)
        active = (lens > t).view(N, 1, 1, 1)
        S = torch.where(active, S_upd, S)

    o_out = merge_sequences(o, cu)
    ht = None
    if output_final_state:
        ht = S.transpose(-1, -2).contiguous() if state_v_first else S
    if return_v_new:
        return o_out, ht, merge_sequences(v_new, cu)
    return o_out, ht
