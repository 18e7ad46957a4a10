"""Input preprocessing shared by the KDA reference implementations (KDA_SPEC §2, §4).

Everything here is plain PyTorch and works for any floating compute dtype: the naive oracle calls it
with ``torch.float64``, the chunked reference with ``torch.float32``.

Layout conventions (KDA_SPEC §1.1): token-major tensors ``[B, T, heads, dim]``; q/k carry ``H`` qk heads,
everything else (v, g, beta, A_log, dt_bias, states) carries ``HV`` value heads, ``HV % H == 0``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..index import check_cu_seqlens_values

__all__ = [
    "expand_qk_heads",
    "kda_beta",
    "kda_gate",
    "l2norm",
    "merge_sequences",
    "prepare_kda_inputs",
    "split_sequences",
    "validate_cu_seqlens",
]


def _wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in: ``dtype`` promoted to at least float32."""
    return torch.promote_types(dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise the last dimension: ``x / sqrt(sum(x**2, -1) + eps)`` (KDA_SPEC §2.1).

    The epsilon is added to the sum of squares *inside* the square root.

    Args:
        x: ``[..., D]`` floating tensor of any dtype.
        eps: added to the sum of squares.

    Returns:
        ``[..., D]`` tensor in ``x.dtype`` promoted to at least float32 (bf16/fp16 inputs come back fp32,
        fp64 stays fp64); the arithmetic is done in that dtype.
    """
    x = x.to(_wide_dtype(x.dtype))
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA gate activation: raw gate pre-activation -> per-channel log-decay (KDA_SPEC §2.2).

    With ``x = g_raw + dt_bias.view(HV, K)`` (no bias if ``dt_bias`` is None):

    * ``lower_bound is None`` ("softplus" form): ``g = -exp(A_log[hv]) * softplus(x)``, torch softplus with
      beta 1 and threshold 20 (``softplus(x) = x`` for ``x > 20``). ``A_log`` is required.
    * ``lower_bound`` set ("safe" form): ``g = lower_bound * sigmoid(exp(A_log[hv]) * x)``; when ``A_log`` is None
      the multiplier is exactly 1: ``g = lower_bound * sigmoid(x)``.

    Args:
        g_raw: ``[..., HV, K]`` raw gate (any float dtype; typically ``[B, T, HV, K]``).
        A_log: ``[HV]`` per value head, or None (only allowed with ``lower_bound``).
        dt_bias: ``[HV * K]`` or ``[HV, K]``, or None.
        lower_bound: negative float selecting the safe form, or None.

    Returns:
        ``[..., HV, K]`` log-gate in ``g_raw.dtype`` promoted to at least float32 (the compute dtype).
    """
    dtype = _wide_dtype(g_raw.dtype)
    HV, K = g_raw.shape[-2], g_raw.shape[-1]
    x = g_raw.to(dtype)
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias has {dt_bias.numel()} elements, expected HV*K = {HV * K}")
        x = x + dt_bias.to(device=x.device, dtype=dtype).reshape(HV, K)
    a = None
    if A_log is not None:
        if A_log.numel() != HV:
            raise ValueError(f"A_log has {A_log.numel()} elements, expected HV = {HV}")
        a = torch.exp(A_log.to(device=x.device, dtype=dtype).reshape(HV, 1))
    if lower_bound is None:
        if a is None:
            raise ValueError("the softplus gate form needs A_log (A_log may be None only when lower_bound is set)")
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    if a is not None:
        x = a * x
    return lower_bound * torch.sigmoid(x)


def kda_beta(b: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """Beta activation (KDA_SPEC §2.3): ``sigmoid(b)``, or ``2 * sigmoid(b)`` when ``allow_neg_eigval``.

    Args:
        b: ``[B, T, HV]`` (any shape) raw logits, any float dtype.
        allow_neg_eigval: doubles the range to (0, 2).

    Returns:
        Same shape, in ``b.dtype`` promoted to at least float32.
    """
    beta = torch.sigmoid(b.to(_wide_dtype(b.dtype)))
    return 2.0 * beta if allow_neg_eigval else beta


def prepare_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    dtype: torch.dtype,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast the KDA inputs to ``dtype`` and apply the optional in-kernel preprocessing.

    Order as in FLA's chunk path (KDA_SPEC §2): l2norm(q), l2norm(k), beta sigmoid, gate activation. Every step
    runs in ``dtype`` (inputs are cast first; no intermediate rounding to the input dtype is modelled).
    ``lower_bound`` only matters together with ``use_gate_in_kernel`` (without it, g is used as given).

    Args:
        q, k: ``[B, T, H, K]``.
        g: ``[B, T, HV, K]`` log-gate, or the raw gate when ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` step size, or its logit when ``use_beta_sigmoid_in_kernel``.
        dtype: compute dtype (float32 or float64).
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` or ``[HV, K]``; lower_bound: see :func:`kda_gate`.

    Returns:
        ``(q, k, g, beta)`` with the same shapes, all in ``dtype``.

    Raises:
        ValueError: ``allow_neg_eigval`` without ``use_beta_sigmoid_in_kernel``.
    """
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval requires use_beta_sigmoid_in_kernel=True")
    q = q.to(dtype)
    k = k.to(dtype)
    g = g.to(dtype)
    beta = beta.to(dtype)
    if use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = kda_beta(beta, allow_neg_eigval=allow_neg_eigval)
    if use_gate_in_kernel:
        A = None if A_log is None else A_log.to(dtype)
        bias = None if dt_bias is None else dt_bias.to(dtype)
        g = kda_gate(g, A_log=A, dt_bias=bias, lower_bound=lower_bound)
    return q, k, g, beta


def expand_qk_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """GVA broadcast of qk heads to value heads: ``[B, T, H, K] -> [B, T, HV, K]``.

    Value head ``hv`` reads qk head ``hv // (HV // H)`` (repeat_interleave order, not tiling; KDA_SPEC §1.1).
    Returns ``x`` itself when ``HV == H``. Dtype is unchanged.
    """
    H = x.shape[2]
    if HV % H != 0:
        raise ValueError(f"HV={HV} must be a multiple of the number of qk heads H={H}")
    if HV == H:
        return x
    return x.repeat_interleave(HV // H, dim=2)


# --------------------------------------------------------------------------------------------------------------
# Variable-length helpers (KDA_SPEC §4)


def validate_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> list[int]:
    """Check packed-varlen boundaries and return them as a Python list.

    Args:
        cu_seqlens: ``[N + 1]`` integer tensor (int32 in this library; any integer dtype is accepted here),
            non-decreasing, from 0 to T.
        B, T: batch size and token count of the packed inputs (B must be 1).

    Returns:
        The boundaries ``[cu_0 = 0, ..., cu_N = T]`` as Python ints.
    """
    if B != 1:
        raise ValueError(f"varlen inputs (cu_seqlens given) need batch size 1, got B={B}")
    return check_cu_seqlens_values(cu_seqlens, T)


def split_sequences(x: torch.Tensor, cu: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack ``[B, T, ...]`` into per-sequence padded ``[N, T_max, ...]`` (zero-filled past each end).

    Without ``cu`` (fixed length) this is ``x`` itself with ``N = B``. Returns ``(padded, lens)`` where ``lens`` is
    an int64 ``[N]`` tensor on ``x.device``.
    """
    B, T = x.shape[0], x.shape[1]
    if cu is None:
        return x, torch.full((B,), T, dtype=torch.int64, device=x.device)
    lens = [b - a for a, b in itertools.pairwise(cu)]
    t_max = max(lens)
    out = x.new_zeros((len(lens), t_max) + tuple(x.shape[2:]))
    for n, (bos, length) in enumerate(zip(cu[:-1], lens, strict=True)):
        out[n, :length] = x[0, bos : bos + length]
    return out, torch.tensor(lens, dtype=torch.int64, device=x.device)


def merge_sequences(x: torch.Tensor, cu: list[int] | None) -> torch.Tensor:
    """Inverse of :func:`split_sequences`: ``[N, T_max, ...] -> [B, T, ...]`` (``B = 1`` for varlen)."""
    if cu is None:
        return x
    parts = [x[n, : b - a] for n, (a, b) in enumerate(itertools.pairwise(cu))]
    return torch.cat(parts, dim=0).unsqueeze(0)
