"""Lightning Attention reference (KDA_SPEC §5), FLA conventions.

Per head h with scalar log-decay ``g_gamma[h] <= 0`` (λ_h = exp(g_gamma[h]))::

    S <- λ_h S + outer(k_t, v_t);      o_t = scale · q_t · S     (read with the updated state)

q, k: ``[B, T, H, K]``; v, o: ``[B, T, H, V]``; state ``[N, H, K, V]`` fp32 (``[N, H, V, K]`` with
``state_v_first``); scale defaults to ``K ** -0.5`` (FLA; cuLA's own default is 1.0); no GVA.
"""

from __future__ import annotations

import torch

from .kda_chunked import ChunkLayout
from .preprocess import merge_sequences, split_sequences, validate_cu_seqlens

__all__ = ["lightning_chunked", "lightning_decode", "lightning_naive"]


def _check_lightning_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    state_v_first: bool,
) -> tuple[list[int] | None, int]:
    """Validate shapes; return ``(cu, N)`` (varlen boundaries as a list or None, number of sequences)."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with {(B, T, H)} leading, got {tuple(v.shape)}")
    V = v.shape[3]
    if tuple(g_gamma.shape) != (H,):
        raise ValueError(f"g_gamma must be [H] = [{H}], got {tuple(g_gamma.shape)}")
    cu = None if cu_seqlens is None else validate_cu_seqlens(cu_seqlens, B, T)
    N = B if cu is None else len(cu) - 1
    if initial_state is not None:
        expected = (N, H, V, K) if state_v_first else (N, H, K, V)
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be {expected}, got {tuple(initial_state.shape)}")
    return cu, N


def _state_in(
    initial_state: torch.Tensor | None,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    state_v_first: bool,
) -> torch.Tensor:
    """K-first copy ``[N, H, K, V]`` of the initial state in ``dtype`` (zeros if None)."""
    if initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    s = initial_state.to(device=device, dtype=dtype)
    return (s.transpose(-1, -2) if state_v_first else s).clone()


def _state_out(S: torch.Tensor, state_v_first: bool) -> torch.Tensor:
    return S.transpose(-1, -2).contiguous() if state_v_first else S


def lightning_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning Attention by the token recurrence, entirely in float64.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (any float dtype).
        g_gamma: ``[H]`` per-head log-decay (<= 0).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (``[N, H, V, K]`` if ``state_v_first``) or None (zeros); not modified.
        output_final_state: return ht instead of None.
        cu_seqlens: ``[N + 1]`` int32 boundaries of packed sequences (B == 1) or None.

    Returns:
        ``(o, ht)``: o float64 ``[B, T, H, V]``; ht float64 ``[N, H, K, V]`` (or V, K) or None.
    """
    cu, N = _check_lightning_shapes(q, k, v, g_gamma, initial_state, cu_seqlens, state_v_first)
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    f64 = torch.float64
    if scale is None:
        scale = K**-0.5
    qs, lens = split_sequences(q.to(f64), cu)
    ks, _ = split_sequences(k.to(f64), cu)
    vs, _ = split_sequences(v.to(f64), cu)
    lam = torch.exp(g_gamma.to(device=q.device, dtype=f64)).view(1, H, 1, 1)
    S = _state_in(initial_state, (N, H, K, V), f64, q.device, state_v_first)
    T_max = qs.shape[1]
    o = torch.zeros(N, T_max, H, V, dtype=f64, device=q.device)
    for t in range(T_max):
        S_upd = lam * S + ks[:, t].unsqueeze(-1) * vs[:, t].unsqueeze(-2)
        o[:, t] = torch.einsum("nhk,nhkv->nhv", scale * qs[:, t], S_upd)
        S = torch.where((lens > t).view(N, 1, 1, 1), S_upd, S)
    return merge_sequences(o, cu), (_state_out(S, state_v_first) if output_final_state else None)


def lightning_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Lightning Attention by the chunked form (KDA_SPEC §5) in float32, batched over chunks and heads.

    For chunk-local indices i, j and the **true** chunk length L (a partial tail chunk decays the state by λ^L,
    not λ^C; see KDA_SPEC §9 item 1)::

        o_i = scale [ λ^(i+1) q_i · S + Σ_{j<=i} λ^(i-j) (q_i · k_j) v_j ]
        S  <- λ^L S + Σ_{j<L} λ^(L-1-j) outer(k_j, v_j)

    Args: as :func:`lightning_naive`, plus ``chunk_size`` (C, default 64).

    Returns:
        ``(o, ht)``: o ``[B, T, H, V]`` in ``q.dtype``; ht float32 ``[N, H, K, V]`` (or V, K) or None.
    """
    _check_lightning_shapes(q, k, v, g_gamma, initial_state, cu_seqlens, state_v_first)
    B, T, H, K = q.shape
    V = v.shape[3]
    f32 = torch.float32
    if scale is None:
        scale = K**-0.5
    layout = ChunkLayout.build(B, T, cu_seqlens, chunk_size, q.device)
    C = chunk_size
    qc = layout.to_chunks(q.to(f32))  # [NC, H, C, K]
    kc = layout.to_chunks(k.to(f32))
    vc = layout.to_chunks(v.to(f32))
    gam = g_gamma.to(device=q.device, dtype=f32).view(H, 1, 1)

    pos = torch.arange(C, device=q.device)
    # Intra-chunk decay λ^(i-j) for j <= i, exactly 0 above the diagonal (exponent -inf, never +large).
    dist = (pos.view(C, 1) - pos.view(1, C)).to(f32)
    causal = pos.view(1, C) <= pos.view(C, 1)
    intra_decay = torch.exp(torch.where(causal, gam * dist, float("-inf")))  # [H, C, C]
    q_decay = torch.exp(gam.view(H, 1) * (pos + 1).to(f32)).unsqueeze(-1)  # [H, C, 1]: λ^(i+1)
    # Key weights λ^(L-1-j) for j < L (0 past the end) and the state decay λ^L, per chunk.
    L = layout.chunk_len.to(f32).view(-1, 1, 1)  # [NC, 1, 1]
    key_exp = gam.view(1, H, 1) * (L - 1 - pos.to(f32).view(1, 1, C))
    k_decay = torch.exp(torch.where(layout.valid.view(-1, 1, C), key_exp, float("-inf"))).unsqueeze(-1)
    state_decay = torch.exp(gam.view(1, H, 1, 1) * L.view(-1, 1, 1, 1))  # [NC, H, 1, 1]

    scores = torch.matmul(qc, kc.transpose(-1, -2)) * intra_decay  # [NC, H, C, C]
    o_intra = torch.matmul(scores, vc)
    kv = torch.matmul((kc * k_decay).transpose(-1, -2), vc)  # [NC, H, K, V]

    S = _state_in(initial_state, (layout.num_seqs, H, K, V), f32, q.device, state_v_first)
    h = torch.zeros(layout.num_chunks, H, K, V, dtype=f32, device=q.device)
    for c in range(max(layout.chunks_per_seq, default=0)):
        seqs = [n for n, count in enumerate(layout.chunks_per_seq) if count > c]
        seq_idx = torch.tensor(seqs, dtype=torch.int64, device=q.device)
        gid = torch.tensor([layout.chunk_offsets[n] + c for n in seqs], dtype=torch.int64, device=q.device)
        s_in = S[seq_idx]
        h[gid] = s_in
        S[seq_idx] = state_decay[gid] * s_in + kv[gid]

    oc = scale * (torch.matmul(qc * q_decay, h) + o_intra)
    o = layout.to_tokens(oc).to(q.dtype)
    return o, (_state_out(S, state_v_first) if output_final_state else None)


def lightning_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Lightning Attention step per sequence, in float32: ``S' = λ S + outer(k, v)``, ``o = scale q · S'``.

    Args:
        q, k: ``[N, H, K]``; v: ``[N, H, V]`` (any float dtype).
        g_gamma: ``[H]`` log-decay.
        state: ``[N, H, K, V]`` (``[N, H, V, K]`` if ``state_v_first``), float32; **not** modified.
        scale: defaults to ``K ** -0.5``.

    Returns:
        ``(o, new_state)``: o ``[N, H, V]`` in ``q.dtype``; new_state float32, same layout as ``state``.
    """
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [N, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    N, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (N, H):
        raise ValueError(f"v must be [N, H, V] with N={N}, H={H}, got {tuple(v.shape)}")
    V = v.shape[2]
    expected = (N, H, V, K) if state_v_first else (N, H, K, V)
    if tuple(state.shape) != expected:
        raise ValueError(f"state must be {expected}, got {tuple(state.shape)}")
    if tuple(g_gamma.shape) != (H,):
        raise ValueError(f"g_gamma must be [H] = [{H}], got {tuple(g_gamma.shape)}")
    f32 = torch.float32
    if scale is None:
        scale = K**-0.5
    S = _state_in(state, (N, H, K, V), f32, q.device, state_v_first)
    lam = torch.exp(g_gamma.to(device=q.device, dtype=f32)).view(1, H, 1, 1)
    S = lam * S + k.to(f32).unsqueeze(-1) * v.to(f32).unsqueeze(-2)
    o = torch.einsum("nhk,nhkv->nhv", scale * q.to(f32), S)
    return o.to(q.dtype), _state_out(S, state_v_first).contiguous()
