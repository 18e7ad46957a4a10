"""Chunked KDA forward (KDA_SPEC §3) in float32, vectorised over batch, sequences, chunks and heads.

Pipeline (C = chunk size, Γ = chunk-local inclusive cumulative log-gate, S = state entering a chunk)::

    Akk[i, j] = β_i Σ_k k_i k_j exp(Γ_i - Γ_j)            j <  i   (strictly lower)
    Aqk[i, j] = scale Σ_k q_i k_j exp(Γ_i - Γ_j)          j <= i   (lower incl. diagonal)
    Tinv = (I + Akk)^-1
    w = Tinv (β ⊙ k ⊙ exp(Γ));  u = Tinv (β ⊙ v);  kg = k ⊙ exp(Γ_last - Γ);  qg = q ⊙ exp(Γ)
    h[c] = S;  v_new = u - w S;  S <- diag(exp(Γ_last)) S + kgᵀ v_new
    o = scale qg S + tril(Aqk) v_new

Two layouts are used:

* token layout ``[B, T, HV, D]`` (FLA's layout for every intermediate; varlen has ``B = 1``);
* chunk layout ``[NC, HV, C, D]``: every chunk of every sequence (ordered sequence by sequence, as
  ``prepare_chunk_indices`` orders them), zero-filled past each sequence end. :class:`ChunkLayout` converts.

All intra-chunk work is batched over chunks; only the state recurrence loops, over the chunk position within a
sequence (batched over sequences). Pairwise factors ``exp(Γ_i - Γ_j)`` are formed directly for ``j <= i`` (never
through an anchor), so log-gates as low as -1000 underflow to 0 instead of overflowing. :func:`kda_chunked` forms
the exponents ``Γ_i - Γ_j`` and ``Γ_last - Γ_i`` as segment sums of the per-token gates rather than as differences
of the fp32 cumsum: with |Γ| ~ 1000 the difference of two fp32 cumsums carries ~1e-4 absolute error (FLA has it;
it would cost ~2e-4 rel-L2 against the fp64 recurrence), the segment sum does not. The token-layout primitives
(``kda_fwd_*``), which receive only the stored cumulative gate like FLA's kernels, use the differences.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .kda_naive import check_kda_shapes
from .preprocess import expand_qk_heads, prepare_kda_inputs, validate_cu_seqlens

__all__ = [
    "RCP_LN2",
    "ChunkLayout",
    "KdaChunkIntermediates",
    "chunk_gate_terms",
    "chunk_local_cumsum",
    "kda_chunk_output",
    "kda_chunk_scores",
    "kda_chunk_states",
    "kda_chunk_wu",
    "kda_chunked",
    "kda_fwd_h",
    "kda_fwd_intra",
    "kda_fwd_o",
    "unit_lower_inverse",
]

#: 1 / ln 2; FLA stores the cumulative gate as Γ · RCP_LN2 (log2 units) and uses exp2.
RCP_LN2: float = 1.0 / math.log(2.0)

# Largest number of fp32 elements in one pairwise-exponent temporary (32 MiB).
_PAIRWISE_BUDGET = 1 << 23


# --------------------------------------------------------------------------------------------------------------
# Token layout <-> chunk layout


@dataclass(frozen=True)
class ChunkLayout:
    """Where each chunk of each sequence lives in a token-layout tensor ``[B, T, ...]``.

    Fixed-length inputs are treated as ``B`` sequences of ``T`` tokens packed back to back, so chunk ``b * NT + c``
    is chunk ``c`` of batch row ``b``; varlen inputs (``B == 1``) follow ``cu_seqlens``. Either way, chunks are
    ordered sequence by sequence and aligned to each sequence start.

    Attributes:
        B, T: token-layout batch and length.
        chunk_size: C.
        varlen: whether the layout came from ``cu_seqlens``.
        chunks_per_seq: ``ceil(len_n / C)`` for each of the N sequences (0 for empty sequences).
        chunk_offsets: ``[N + 1]`` global index of each sequence's first chunk (Python ints).
        token_index: int64 ``[NC, C]`` flat token index ``b * T + t`` of each chunk slot (clamped inside the chunk
            for slots past the sequence end).
        valid: bool ``[NC, C]``: slot holds a real token.
        chunk_len: int64 ``[NC]``: number of real tokens L of each chunk (1..C).
    """

    B: int
    T: int
    chunk_size: int
    varlen: bool
    chunks_per_seq: tuple[int, ...]
    chunk_offsets: tuple[int, ...]
    token_index: torch.Tensor
    valid: torch.Tensor
    chunk_len: torch.Tensor

    @classmethod
    def build(
        cls, B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int, device: torch.device | str
    ) -> ChunkLayout:
        """Build the layout for ``[B, T, ...]`` inputs; ``cu_seqlens`` (``[N + 1]``, needs B == 1) or None."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if cu_seqlens is None:
            bounds = [b * T for b in range(B + 1)]
        else:
            bounds = validate_cu_seqlens(cu_seqlens, B, T)
        C = chunk_size
        starts, lens, per_seq, offsets = [], [], [], [0]
        for bos, eos in itertools.pairwise(bounds):
            n_chunks = -(-(eos - bos) // C)
            per_seq.append(n_chunks)
            offsets.append(offsets[-1] + n_chunks)
            for c in range(n_chunks):
                starts.append(bos + c * C)
                lens.append(min(C, eos - bos - c * C))
        start = torch.tensor(starts, dtype=torch.int64, device=device).reshape(-1, 1)
        chunk_len = torch.tensor(lens, dtype=torch.int64, device=device)
        local = torch.arange(C, dtype=torch.int64, device=device).reshape(1, C)
        valid = local < chunk_len.reshape(-1, 1)
        token_index = torch.where(valid, start + local, start)
        return cls(B, T, C, cu_seqlens is not None, tuple(per_seq), tuple(offsets), token_index, valid, chunk_len)

    @property
    def num_chunks(self) -> int:
        """Total number of chunks NC over all sequences."""
        return self.chunk_offsets[-1]

    @property
    def num_seqs(self) -> int:
        """Number of sequences N."""
        return len(self.chunks_per_seq)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """Token layout ``[B, T, HV, *D]`` -> chunk layout ``[NC, HV, C, *D]``, zeros past each sequence end."""
        flat = x.reshape((self.B * self.T,) + tuple(x.shape[2:]))
        xc = flat[self.token_index]  # [NC, C, HV, *D]
        mask = self.valid.reshape(self.valid.shape + (1,) * (xc.dim() - 2))
        xc = torch.where(mask, xc, torch.zeros((), dtype=xc.dtype, device=xc.device))
        return xc.movedim(1, 2)

    def to_tokens(self, xc: torch.Tensor) -> torch.Tensor:
        """Chunk layout ``[NC, HV, C, *D]`` -> token layout ``[B, T, HV, *D]`` (slots past the end are dropped)."""
        xt = xc.movedim(2, 1)  # [NC, C, HV, *D]
        out = xt.new_zeros((self.B * self.T,) + tuple(xt.shape[2:]))
        out[self.token_index[self.valid]] = xt[self.valid]
        return out.reshape((self.B, self.T) + tuple(xt.shape[2:]))

    def last_rows(self, xc: torch.Tensor) -> torch.Tensor:
        """Row ``L - 1`` (last real token) of each chunk: ``[NC, HV, C, D] -> [NC, HV, D]``."""
        idx = (self.chunk_len - 1).reshape(-1, 1, 1, 1).expand(-1, xc.shape[1], 1, xc.shape[3])
        return torch.gather(xc, 2, idx).squeeze(2)

    def states_to_fla(self, hc: torch.Tensor, state_v_first: bool) -> torch.Tensor:
        """Chunk states ``[NC, HV, K, V]`` -> FLA's ``h``: ``[B, NT, HV, K, V]`` (``[1, NC, ...]`` for varlen).

        With ``state_v_first`` the last two dims are swapped (``[..., V, K]``).
        """
        h = hc.transpose(-1, -2) if state_v_first else hc
        if self.varlen:
            return h.unsqueeze(0).contiguous()
        return h.reshape((self.B, self.num_chunks // max(self.B, 1)) + tuple(h.shape[1:])).contiguous()

    def states_from_fla(self, h: torch.Tensor, state_v_first: bool) -> torch.Tensor:
        """Inverse of :meth:`states_to_fla`: ``[B, NT, HV, K, V]`` (or V, K) -> ``[NC, HV, K, V]``."""
        hc = h.reshape((self.num_chunks,) + tuple(h.shape[2:]))
        return hc.transpose(-1, -2) if state_v_first else hc


# --------------------------------------------------------------------------------------------------------------
# Chunk-layout building blocks (fp32; q/k already broadcast to the HV value heads)


def _reverse_exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``out[p] = sum(x[p + 1:])`` along ``dim``, accumulated from the far end (no subtraction, no cancellation)."""
    n = x.shape[dim]
    tail = x.narrow(dim, 1, n - 1) if n > 1 else x.narrow(dim, 0, 0)
    acc = torch.flip(torch.cumsum(torch.flip(tail, [dim]), dim), [dim])
    pad_shape = list(x.shape)
    pad_shape[dim] = 1
    return torch.cat([acc, x.new_zeros(pad_shape)], dim=dim)


def chunk_gate_terms(g_step: torch.Tensor, layout: ChunkLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate exponents of every chunk from the per-token log-gates (KDA_SPEC §3.1, §3.4).

    Args:
        g_step: ``[NC, HV, C, K]`` float32 activated per-token log-gates, zero past each chunk end.
        layout: the chunk layout.

    Returns:
        ``(gamma, g_last, kg_exp)``: gamma ``[NC, HV, C, K]`` inclusive chunk-local cumsum Γ (constant past the
        end); g_last ``[NC, HV, K]`` = Γ at the last real token; kg_exp ``[NC, HV, C, K]`` = Γ_last - Γ_i, formed
        as the suffix sum ``sum(g[i+1 : L])`` (accurate even when |Γ| is large).
    """
    gamma = torch.cumsum(g_step, dim=2)
    return gamma, layout.last_rows(gamma), _reverse_exclusive_cumsum(g_step, dim=2)


def kda_chunk_scores(
    qc: torch.Tensor,
    kc: torch.Tensor,
    betac: torch.Tensor,
    scale: float,
    *,
    gamma: torch.Tensor | None = None,
    g_step: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Intra-chunk matrices Akk and Aqk (KDA_SPEC §3.2), pair by pair, overflow-free.

    The pairwise exponent ``Γ_i - Γ_j`` (j <= i) comes from exactly one of:

    * ``g_step`` (preferred): the per-token log-gates; the exponent is the segment sum ``g_{j+1} + ... + g_i``
      accumulated from ``i`` downwards, so its rounding error scales with the segment, not with |Γ|
      (matters for huge gates such as -1000);
    * ``gamma``: the cumulative gate Γ, as FLA stores it; the exponent is the fp32 difference ``Γ_i - Γ_j``.

    Entries with ``j > i`` get exponent -inf (factor exactly 0) before ``exp``, so nothing overflows.

    Args:
        qc, kc: ``[NC, HV, C, K]`` float32 queries/keys (zero rows past the chunk end).
        betac: ``[NC, HV, C]`` float32.
        scale: folded into Aqk.
        gamma / g_step: ``[NC, HV, C, K]`` float32 (natural-log units), one of them.

    Returns:
        ``(Akk, Aqk)``, float32 ``[NC, HV, C, C]``: Akk strictly lower, rows scaled by β_i;
        Aqk lower including the diagonal, times ``scale``; both exactly zero above the diagonal.
    """
    if (gamma is None) == (g_step is None):
        raise ValueError("pass exactly one of gamma= or g_step=")
    NC, HV, C, K = kc.shape
    nb = NC * HV
    q = qc.reshape(nb, C, K)
    k = kc.reshape(nb, C, K)
    g = (gamma if g_step is None else g_step).reshape(nb, C, K)
    akk = torch.zeros(nb, C, C, dtype=kc.dtype, device=kc.device)
    aqk = torch.zeros(nb, C, C, dtype=kc.dtype, device=kc.device)
    row_elems = C * K
    slab = max(1, min(nb, _PAIRWISE_BUDGET // row_elems))
    rows = max(1, min(C, _PAIRWISE_BUDGET // (slab * row_elems)))
    ar = torch.arange(C, device=kc.device)
    for b0 in range(0, nb, slab):
        b1 = min(nb, b0 + slab)
        for r0 in range(0, C, rows):
            r1 = min(C, r0 + rows)
            # e[b, i - r0, j, :] = Γ_i - Γ_j for rows i in [r0, r1) and columns j < r1 (j > i is masked below).
            if g_step is None:
                e = g[b0:b1, r0:r1, None, :] - g[b0:b1, None, :r1, :]
            else:
                within = ar[None, :r1] <= ar[r0:r1, None]  # token m contributes to row i iff m <= i
                seg = torch.where(within[None, :, :, None], g[b0:b1, None, :r1, :], 0.0)
                e = _reverse_exclusive_cumsum(seg, dim=2)  # sum over m in (j, i]
                del seg
            above = ar[None, :r1] > ar[r0:r1, None]
            if e.requires_grad:  # (autograd keeps exp's output for its backward: no in-place op after it)
                e = e.masked_fill(above[None, :, :, None], float("-inf")).exp() * k[b0:b1, None, :r1, :]
            else:  # in place: the slab is the largest temporary of the call
                e.masked_fill_(above[None, :, :, None], float("-inf"))
                e.exp_()
                e.mul_(k[b0:b1, None, :r1, :])  # exp(Γ_i - Γ_j) ⊙ k_j
            akk[b0:b1, r0:r1, :r1] = torch.matmul(e, k[b0:b1, r0:r1, :, None]).squeeze(-1)
            aqk[b0:b1, r0:r1, :r1] = torch.matmul(e, q[b0:b1, r0:r1, :, None]).squeeze(-1)
            del e
    akk = akk.reshape(NC, HV, C, C)
    aqk = aqk.reshape(NC, HV, C, C)
    akk = torch.tril(akk, diagonal=-1) * betac.unsqueeze(-1)
    aqk = torch.tril(aqk) * scale
    return akk, aqk


def unit_lower_inverse(akk: torch.Tensor) -> torch.Tensor:
    """``Tinv = (I + Akk)^-1`` for strictly lower ``Akk`` ``[..., C, C]`` (KDA_SPEC §3.3).

    Solved by triangular substitution in the dtype of ``akk`` (float32 here). Returns ``[..., C, C]``, unit lower
    triangular, exactly zero above the diagonal.
    """
    C = akk.shape[-1]
    eye = torch.eye(C, dtype=akk.dtype, device=akk.device).expand_as(akk)
    if akk.numel() == 0:
        return eye.clone()
    a = eye + torch.tril(akk, diagonal=-1)
    tinv = torch.linalg.solve_triangular(a, eye, upper=False, unitriangular=True)
    return torch.tril(tinv, diagonal=-1) + eye


def kda_chunk_wu(
    tinv: torch.Tensor,
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    betac: torch.Tensor,
    gamma: torch.Tensor,
    kg_exp: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute W/U (KDA_SPEC §3.4) in chunk layout.

    Args:
        tinv: ``[NC, HV, C, C]``; qc, kc: ``[NC, HV, C, K]``; vc: ``[NC, HV, C, V]``; betac: ``[NC, HV, C]``;
        gamma: ``[NC, HV, C, K]`` Γ; kg_exp: ``[NC, HV, C, K]`` Γ_last - Γ (see :func:`chunk_gate_terms`).
        All float32.

    Returns:
        ``(w, u, kg, qg)``: w ``[NC, HV, C, K]`` = Tinv (β ⊙ k ⊙ exp(Γ)), u ``[NC, HV, C, V]`` = Tinv (β ⊙ v),
        kg = k ⊙ exp(Γ_last - Γ), qg = q ⊙ exp(Γ) (no scale). Rows past the chunk end are zero.
    """
    b = betac.unsqueeze(-1)
    decay = torch.exp(gamma)
    w = torch.matmul(tinv, b * kc * decay)
    u = torch.matmul(tinv, b * vc)
    kg = kc * torch.exp(kg_exp)
    qg = qc * decay
    return w, u, kg, qg


def kda_chunk_states(
    kgc: torch.Tensor,
    wc: torch.Tensor,
    uc: torch.Tensor,
    g_last: torch.Tensor,
    initial_state: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inter-chunk state recurrence (KDA_SPEC §3.5), looping over chunk positions, batched over sequences.

    Args:
        kgc, wc: ``[NC, HV, C, K]``; uc: ``[NC, HV, C, V]``; g_last: ``[NC, HV, K]``. All float32.
        initial_state: ``[N, HV, K, V]`` float32 (K-first; not modified).
        layout: the chunk layout the chunk-layout tensors follow.

    Returns:
        ``(h, v_new, ht)``: h ``[NC, HV, K, V]`` state entering each chunk; v_new ``[NC, HV, C, V]`` = u - w S;
        ht ``[N, HV, K, V]`` state after each sequence's last chunk (= initial_state for empty sequences).
    """
    NC, HV, C, K = wc.shape
    V = uc.shape[-1]
    S = initial_state.clone()
    h = torch.zeros(NC, HV, K, V, dtype=S.dtype, device=S.device)
    v_new = torch.zeros(NC, HV, C, V, dtype=S.dtype, device=S.device)
    decay = torch.exp(g_last).unsqueeze(-1)  # [NC, HV, K, 1]
    for c in range(max(layout.chunks_per_seq, default=0)):
        seqs = [n for n, count in enumerate(layout.chunks_per_seq) if count > c]
        seq_idx = torch.tensor(seqs, dtype=torch.int64, device=S.device)
        gid = torch.tensor([layout.chunk_offsets[n] + c for n in seqs], dtype=torch.int64, device=S.device)
        s_in = S[seq_idx]  # [n, HV, K, V]
        h[gid] = s_in
        vn = uc[gid] - torch.matmul(wc[gid], s_in)
        v_new[gid] = vn
        S[seq_idx] = decay[gid] * s_in + torch.matmul(kgc[gid].transpose(-1, -2), vn)
    return h, v_new, S


def kda_chunk_output(
    qgc: torch.Tensor, v_newc: torch.Tensor, aqk: torch.Tensor, h: torch.Tensor, scale: float
) -> torch.Tensor:
    """Chunk output (KDA_SPEC §3.6): ``o = scale · qg · h + tril(Aqk) · v_new``.

    Args:
        qgc: ``[NC, HV, C, K]`` q ⊙ exp(Γ) without scale; v_newc: ``[NC, HV, C, V]``;
        aqk: ``[NC, HV, C, C]`` (scale included; anything above the diagonal is ignored);
        h: ``[NC, HV, K, V]`` state entering each chunk. All float32.

    Returns:
        o ``[NC, HV, C, V]`` float32.
    """
    return scale * torch.matmul(qgc, h) + torch.matmul(torch.tril(aqk), v_newc)


# --------------------------------------------------------------------------------------------------------------
# Token-layout primitives mirroring FLA's modular forward (KDA_SPEC §3.8)


def _gamma_from(g_cum: torch.Tensor, g_cum_log2: bool) -> torch.Tensor:
    g = g_cum.to(torch.float32)
    return g * math.log(2.0) if g_cum_log2 else g


def chunk_local_cumsum(
    g: torch.Tensor, chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None, log2: bool = False
) -> torch.Tensor:
    """Chunk-local inclusive cumulative sum of the log-gate (KDA_SPEC §3.1), in float32.

    Args:
        g: ``[B, T, HV, K]`` log-gate (activated), any float dtype.
        chunk_size: C; the sum restarts at every chunk, chunks aligned to each sequence start.
        cu_seqlens: ``[N + 1]`` varlen boundaries (B == 1) or None.
        log2: return ``Γ · RCP_LN2`` (FLA's stored ``g_cum``) instead of natural-log Γ.

    Returns:
        ``[B, T, HV, K]`` float32.
    """
    layout = ChunkLayout.build(g.shape[0], g.shape[1], cu_seqlens, chunk_size, g.device)
    gamma = torch.cumsum(layout.to_chunks(g.to(torch.float32)), dim=2)
    out = layout.to_tokens(gamma)
    return out * RCP_LN2 if log2 else out


def kda_fwd_intra(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    g_cum_log2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Intra-chunk part (KDA_SPEC §3.2-3.4), like FLA's ``chunk_kda_fwd_intra``, in float32 token layout.

    Args:
        q, k: ``[B, T, H, K]`` (already preprocessed; broadcast to HV here); v: ``[B, T, HV, V]``;
        g_cum: ``[B, T, HV, K]`` chunk-local cumulative log-gate (natural log, or log2 units if ``g_cum_log2``);
        beta: ``[B, T, HV]`` (activated). Any float dtypes; computed in float32.

    Returns:
        ``(w, u, qg, kg, Aqk, Akk_inv)``: w, qg, kg ``[B, T, HV, K]``; u ``[B, T, HV, V]``; Aqk and Akk_inv
        ``[B, T, HV, C]`` (row = token, column = local index in its chunk). All float32.
    """
    HV = v.shape[2]
    f32 = torch.float32
    layout = ChunkLayout.build(q.shape[0], q.shape[1], cu_seqlens, chunk_size, q.device)
    qc = layout.to_chunks(expand_qk_heads(q.to(f32), HV))
    kc = layout.to_chunks(expand_qk_heads(k.to(f32), HV))
    vc = layout.to_chunks(v.to(f32))
    gc = layout.to_chunks(_gamma_from(g_cum, g_cum_log2))
    bc = layout.to_chunks(beta.to(f32))
    akk, aqk = kda_chunk_scores(qc, kc, bc, scale, gamma=gc)
    tinv = unit_lower_inverse(akk)
    kg_exp = layout.last_rows(gc).unsqueeze(2) - gc
    w, u, kg, qg = kda_chunk_wu(tinv, qc, kc, vc, bc, gc, kg_exp)
    tok = layout.to_tokens
    return tok(w), tok(u), tok(qg), tok(kg), tok(aqk), tok(tinv)


def kda_fwd_h(
    kg: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    g_cum_log2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inter-chunk state pass (KDA_SPEC §3.5), like FLA's ``chunk_gated_delta_rule_fwd_h``, float32.

    Args:
        kg, w: ``[B, T, HV, K]``; u: ``[B, T, HV, V]``; g_cum: ``[B, T, HV, K]`` (see :func:`kda_fwd_intra`);
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``) or None (zeros).

    Returns:
        ``(h, v_new, ht)``: h ``[B, NT, HV, K, V]`` (``[1, NC, ...]`` varlen; V, K if ``state_v_first``);
        v_new ``[B, T, HV, V]``; ht ``[N, HV, K, V]`` (or V, K) or None. All float32.
    """
    HV, K, V = w.shape[2], w.shape[3], u.shape[3]
    f32 = torch.float32
    layout = ChunkLayout.build(w.shape[0], w.shape[1], cu_seqlens, chunk_size, w.device)
    h0 = _initial_state(initial_state, layout.num_seqs, HV, K, V, state_v_first, w.device)
    gc = layout.to_chunks(_gamma_from(g_cum, g_cum_log2))
    h, vn, ht = kda_chunk_states(
        layout.to_chunks(kg.to(f32)), layout.to_chunks(w.to(f32)), layout.to_chunks(u.to(f32)),
        layout.last_rows(gc), h0, layout,
    )  # fmt: skip
    ht_out = (ht.transpose(-1, -2).contiguous() if state_v_first else ht) if output_final_state else None
    return layout.states_to_fla(h, state_v_first), layout.to_tokens(vn), ht_out


def kda_fwd_o(
    q: torch.Tensor,
    v_new: torch.Tensor,
    g_cum: torch.Tensor,
    Aqk: torch.Tensor,
    h: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    g_cum_log2: bool = False,
) -> torch.Tensor:
    """Output pass (KDA_SPEC §3.6), like FLA's ``chunk_gla_fwd_o_gk``, float32.

    Args:
        q: ``[B, T, H, K]`` (preprocessed, unscaled); v_new: ``[B, T, HV, V]``; g_cum: ``[B, T, HV, K]``;
        Aqk: ``[B, T, HV, C]`` (scale included; entries above the diagonal are ignored, so an uninitialised
        upper part is fine); h: ``[B, NT, HV, K, V]`` as returned by :func:`kda_fwd_h`.

    Returns:
        o ``[B, T, HV, V]`` float32.
    """
    HV = v_new.shape[2]
    f32 = torch.float32
    layout = ChunkLayout.build(q.shape[0], q.shape[1], cu_seqlens, chunk_size, q.device)
    qg = layout.to_chunks(expand_qk_heads(q.to(f32), HV)) * torch.exp(layout.to_chunks(_gamma_from(g_cum, g_cum_log2)))
    hc = layout.states_from_fla(h.to(f32), state_v_first)
    oc = kda_chunk_output(qg, layout.to_chunks(v_new.to(f32)), layout.to_chunks(Aqk.to(f32)), hc, scale)
    return layout.to_tokens(oc)


def _initial_state(
    initial_state: torch.Tensor | None,
    N: int,
    HV: int,
    K: int,
    V: int,
    state_v_first: bool,
    device: torch.device,
) -> torch.Tensor:
    """float32 K-first copy ``[N, HV, K, V]`` of the initial state (zeros if None)."""
    if initial_state is None:
        return torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
    expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state must be {expected}, got {tuple(initial_state.shape)}")
    s = initial_state.to(device=device, dtype=torch.float32)
    return (s.transpose(-1, -2) if state_v_first else s).clone()


# --------------------------------------------------------------------------------------------------------------
# Full forward


@dataclass(frozen=True)
class KdaChunkIntermediates:
    """Intermediate tensors of :func:`kda_chunked`, float32, in FLA's layouts (KDA_SPEC §3.8).

    For varlen inputs B = 1, T = total tokens and NT = total chunks, ordered sequence by sequence.

    Attributes:
        g_cum: ``[B, T, HV, K]`` chunk-local inclusive cumulative log-gate in log2 units (Γ · RCP_LN2).
        Aqk: ``[B, T, HV, C]`` scale · Σ q_i k_j exp(Γ_i - Γ_j); row = token i, column = local index j of i's
            chunk; zero above the diagonal (hence also past the chunk end).
        Akk_inv: ``[B, T, HV, C]`` rows of Tinv = (I + Akk)^-1, same indexing, unit diagonal, zero above it.
        w: ``[B, T, HV, K]``; u: ``[B, T, HV, V]``; kg: ``[B, T, HV, K]``; qg: ``[B, T, HV, K]`` (no scale).
        h: ``[B, NT, HV, K, V]`` (``[B, NT, HV, V, K]`` if state_v_first): state entering each chunk.
        v_new: ``[B, T, HV, V]`` = u - w · h, the per-token delta residual v'.
    """

    g_cum: torch.Tensor
    Aqk: torch.Tensor
    Akk_inv: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    kg: torch.Tensor
    qg: torch.Tensor
    h: torch.Tensor
    v_new: torch.Tensor


def kda_chunked(
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
    chunk_size: int = 64,
    return_intermediates: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, KdaChunkIntermediates]:
    """KDA forward by the chunked algorithm (KDA_SPEC §3), computed in float32.

    Args: as :func:`~cula_runtime.reference.kda_naive.kda_naive`:
        q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]`` (any float dtypes);
        initial_state ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``); cu_seqlens ``[N + 1]`` int32
        (B == 1); scale defaults to ``K ** -0.5``; preprocessing flags as in :func:`prepare_kda_inputs` (float32).
        chunk_size: C (64 in every kernel).
        return_intermediates: also return a :class:`KdaChunkIntermediates`.

    Returns:
        ``(o, ht)`` or ``(o, ht, intermediates)``: o ``[B, T, HV, V]`` in ``q.dtype``; ht float32
        ``[N, HV, K, V]`` (or V, K) when ``output_final_state``, else None.
    """
    check_kda_shapes(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first)
    B, T, _, K = q.shape
    HV = v.shape[2]
    V = v.shape[3]
    out_dtype = q.dtype
    f32 = torch.float32
    if scale is None:
        scale = K**-0.5

    q, k, g, beta = prepare_kda_inputs(
        q, k, g, beta, dtype=f32,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
    )  # fmt: skip
    layout = ChunkLayout.build(B, T, cu_seqlens, chunk_size, q.device)
    qc = layout.to_chunks(expand_qk_heads(q, HV))
    kc = layout.to_chunks(expand_qk_heads(k, HV))
    vc = layout.to_chunks(v.to(f32))
    bc = layout.to_chunks(beta)
    g_step = layout.to_chunks(g)
    gc, g_last, kg_exp = chunk_gate_terms(g_step, layout)  # Γ restarts at each chunk; constant past the end

    akk, aqk = kda_chunk_scores(qc, kc, bc, scale, g_step=g_step)
    tinv = unit_lower_inverse(akk)
    w, u, kg, qg = kda_chunk_wu(tinv, qc, kc, vc, bc, gc, kg_exp)
    h0 = _initial_state(initial_state, layout.num_seqs, HV, K, V, state_v_first, q.device)
    h, v_new, ht = kda_chunk_states(kg, w, u, g_last, h0, layout)
    oc = kda_chunk_output(qg, v_new, aqk, h, scale)

    o = layout.to_tokens(oc).to(out_dtype)
    ht_out = None
    if output_final_state:
        ht_out = ht.transpose(-1, -2).contiguous() if state_v_first else ht
    if not return_intermediates:
        return o, ht_out
    tok = layout.to_tokens
    inter = KdaChunkIntermediates(
        g_cum=tok(gc) * RCP_LN2, Aqk=tok(aqk), Akk_inv=tok(tinv), w=tok(w), u=tok(u), kg=tok(kg), qg=tok(qg),
        h=layout.states_to_fla(h, state_v_first), v_new=tok(v_new),
    )  # fmt: skip
    return o, ht_out, inter
