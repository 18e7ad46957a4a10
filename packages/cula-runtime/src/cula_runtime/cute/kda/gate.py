"""The gate and β of KDA's inputs as the CuTeDSL intra kernel prepares them (KDA_SPEC.md §2.2, §2.3, §3.1): the
activation of one gate channel and of β (device code, traced inline into the kernel that calls them), the order of
the chunk-local cumsum's fp32 additions, and the host-side checks of the gate's parameters.

Gate forms (:data:`GATE_FORMS`), from ``x = g + dt_bias`` and ``scale = exp(A_log[hv])`` (1 without ``A_log``):
``"softplus"`` ``-scale * softplus(x)``, ``"safe"`` ``lower_bound * sigmoid(scale * x)``, ``"none"`` (``g`` is
already the log-gate). β: ``sigmoid(b)``, ``2 * sigmoid(b)`` with ``allow_neg_eigval``, or ``b`` itself.

These helpers were ``KdaPrepare``'s, the separate preprocessing kernel that the intra kernel's in-kernel gate
replaced (its history keeps it); the intra kernel does the same arithmetic in the same order, so ``g_cum`` has the
bits the H200 runs verified, except the intra kernel's softplus form: since issue 25 item 6 it is one MUFU exp2 and one
MUFU log2 per element (``max(x, 0) + log1p(e^-|x|)``) instead of the library's exp and log1p, which the decode kernel
keeps (CPU model: ``benchmarks/precision_unbounded_diag.py --softplus``; not yet run on a GPU).
"""

from ..compile_cache import missing_cutedsl

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["GATE_FORMS", "RCP_LN2", "activate_beta", "activate_gate", "gate_arguments", "gate_scan_segments"]

GATE_FORMS = ("none", "softplus", "safe")
RCP_LN2 = 1.4426950216  # fp32(1 / ln 2), the constant FLA multiplies the cumsum by
LOG2_E = 1.4426950408889634  # log2(e), for e^-|x| = 2^(-|x| log2 e)
LN2 = 0.6931471805599453
SERIES_BELOW = 2.0 ** -5  # the softplus's e^-|x| below which log1p is its series
SOFTPLUS_THRESHOLD = 20.0  # the library form: x itself above


def activate_gate(form: str, x: Float32, scale: Float32, lower_bound: Float32, mufu_softplus: bool = False) -> Float32:
    """The log-gate of one channel in ``form`` (:data:`GATE_FORMS`) from ``x = g + dt_bias`` (fp32), ``scale =
    exp(A_log)`` (1 without A_log): traced inline into the calling kernel. ``mufu_softplus``: the softplus form by one
    MUFU exp2 and one MUFU log2 per element (the intra kernel's, issue 25 item 6); otherwise by the library's exp and
    log1p (the decode kernel's: the MUFU form's temporaries took its softplus configurations from 8 to 47 spill
    instructions on sm_90a, 12 to 86 on sm_100a, CuTeDSL 4.8.1)."""
    if form == "softplus" and not mufu_softplus:
        softplus = cutlass.select_(x > SOFTPLUS_THRESHOLD, x, cute.math.log1p(cute.math.exp(x)))
        return -scale * Float32(softplus)
    if form == "softplus":
        # softplus(x) = max(x, 0) + ln 2 log2(1 + e), e = e^-|x| in (0, 1]: one exp2 and one log2 (MUFU) per
        # element, finite for every x; for e < 2^-5 log2(1 + e) is its series to e^4 (relative error < 2^-22),
        # which keeps tiny gates (x << 0) accurate where 1 + e rounds (benchmarks/precision_unbounded_diag.py
        # --softplus)
        e = cute.math.exp2(-cute.math.abs(x) * LOG2_E, fastmath=True)
        series = e * (LOG2_E + e * (-LOG2_E / 2 + e * (LOG2_E / 3 - e * (LOG2_E / 4))))
        log_term = cutlass.select_(e < SERIES_BELOW, series, cute.math.log2(Float32(1.0) + e, fastmath=True))
        return -scale * (cutlass.max(x, Float32(0.0)) + Float32(log_term) * LN2)
    if form == "safe":
        return lower_bound / (Float32(1.0) + cute.math.exp(-(scale * x)))
    return x


def activate_beta(x: Float32, sigmoid: bool, allow_neg_eigval: bool) -> Float32:
    """β from its input ``x`` (fp32): ``sigmoid(x)``, ``2 sigmoid(x)`` with ``allow_neg_eigval``, or ``x``."""
    if sigmoid:
        return Float32(2.0 if allow_neg_eigval else 1.0) / (Float32(1.0) + cute.math.exp(-x))
    return x


def gate_scan_segments(head_dim: int, chunk_size: int = 64) -> int:
    """Runs of consecutive tokens a chunk's gate cumsum is split into: each run is summed serially, then offset by
    the totals of the earlier runs (added in order). This fixes the order of the fp32 additions, hence the bits of
    ``g_cum``: 4 runs of 16 tokens at K = 128, the split of the retired ``KdaPrepare`` kernel (128 threads, 4
    channels each), which the H200 runs verified."""
    segments = 128 // (min(head_dim, 128) // 4)
    if chunk_size % segments:
        raise ValueError(f"chunk_size={chunk_size} is not a multiple of {segments} runs")
    return segments


def gate_arguments(use_gate_in_kernel: bool, lower_bound: float | None, A_log, dt_bias, allow_neg_eigval: bool,
                   use_beta_sigmoid_in_kernel: bool, HV: int, K: int, device) -> tuple:
    """The gate form (:data:`GATE_FORMS`) and the checked fp32 ``A_log [HV]`` and ``dt_bias [HV, K]`` (None when
    absent or unused) of a call that prepares the gate in a kernel; ``ValueError`` for inconsistent flags or sizes."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval requires use_beta_sigmoid_in_kernel=True")
    if use_gate_in_kernel:
        gate = "safe" if lower_bound is not None else "softplus"
        if gate == "softplus" and A_log is None:
            raise ValueError("the softplus gate (lower_bound=None) needs A_log")
    else:
        gate, A_log, dt_bias = "none", None, None
    if A_log is not None and A_log.numel() != HV:
        raise ValueError(f"A_log must have HV = {HV} elements, got {A_log.numel()}")
    if dt_bias is not None and dt_bias.numel() != HV * K:
        raise ValueError(f"dt_bias must have HV*K = {HV * K} elements, got {dt_bias.numel()}")
    return (gate, *gate_tensors(A_log, dt_bias, HV, K, device))


def gate_tensors(A_log, dt_bias, HV: int, K: int, device) -> tuple:
    """``A_log`` and ``dt_bias`` (each None or of the right size) as the kernels take them: fp32 ``[HV]`` and
    ``[HV, K]`` on ``device``, the tensors themselves (or views) where they already are."""
    import torch

    if A_log is not None and (A_log.dim() != 1 or A_log.dtype != torch.float32 or A_log.device != device):
        A_log = A_log.to(device=device, dtype=torch.float32).reshape(HV)
    if dt_bias is not None:
        if dt_bias.dtype != torch.float32 or dt_bias.device != device:
            dt_bias = dt_bias.to(device=device, dtype=torch.float32)
        dt_bias = dt_bias.view(HV, K) if dt_bias.is_contiguous() else dt_bias.reshape(HV, K)
    return A_log, dt_bias
