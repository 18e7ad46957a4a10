"""KDA input preprocessing in one CuTeDSL launch (KDA_SPEC.md §2, §3.1, §3.8, §4).

Per 64-token chunk (chunks restart at every sequence start), it computes

* ``q_hat = l2norm(q)``, ``k_hat = l2norm(k)``: ``x / sqrt(sum(x^2) + 1e-6)`` in fp32, stored in the input dtype;
* ``beta_out`` (fp32): ``sigmoid(b)``, ``2 * sigmoid(b)`` with ``allow_neg_eigval``, or ``b`` itself;
* ``g_cum`` (fp32, ``[B, T, HV, K]``): the chunk-local inclusive cumsum of the activated gate, times ``1/ln 2``
  (log2 units, as FLA stores it). Gate forms: ``"softplus"`` ``-exp(A_log[hv]) * softplus(g + dt_bias)``,
  ``"safe"`` ``lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias))`` (multiplier 1 without ``A_log``), or
  ``"none"`` (``g`` is already the log-gate).

Grid: ``(chunks, HV + H, B)`` with 128 threads. CTAs with ``y < HV`` handle value head ``y``: gate cumsum and beta;
the others L2-normalise q and k of qk head ``y - HV`` (absent when ``l2norm`` is off). Varlen (``B = 1``): CTA ``x``
reads row ``x`` of the chunk-index tensor ``[NT, 2]`` = (sequence, chunk within it) and the sequence bounds from
``cu_seqlens``; a row with a negative sequence id is padding and does nothing. Loads and stores past a sequence end
are predicated off. Only plain CUDA-core code and vector global loads: the same source runs on SM90, SM100, SM103.

:func:`kda_prepare` is the host wrapper: it checks the arguments, allocates the outputs, gets the compiled kernel
from :mod:`cula_runtime.cute.compile_cache` (one binary per configuration, whatever T, B or cu_seqlens) and calls it
through TVM-FFI on the current torch stream (about 7 us of host time per call on the H200 host).
"""

import dataclasses
import functools

from ..compile_cache import TensorSpec, fake_call_arguments, launch, missing_cutedsl
from ..varlen import chunk_rows
from .tiles import chunk_grid_extent, chunk_span

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["GATE_FORMS", "KdaPrepare", "KdaPrepareConfig", "activate_beta", "activate_gate", "gate_arguments",
           "gate_scan_segments", "kda_prepare"]

GATE_FORMS = ("none", "softplus", "safe")
RCP_LN2 = 1.4426950216  # fp32(1 / ln 2), the constant FLA multiplies the cumsum by
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0
_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


def activate_gate(form: str, x: Float32, scale: Float32, lower_bound: Float32) -> Float32:
    """The log-gate of one channel in ``form`` (:data:`GATE_FORMS`) from ``x = g + dt_bias`` (fp32), ``scale =
    exp(A_log)`` (1 without A_log): traced inline, so every kernel that calls it does the same arithmetic."""
    if form == "softplus":
        softplus = cutlass.select_(x > SOFTPLUS_THRESHOLD, x, cute.math.log1p(cute.math.exp(x)))
        return -scale * Float32(softplus)
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
    ``g_cum``; every kernel that computes the cumsum splits it the same way."""
    segments = 128 // (min(head_dim, 128) // 4)  # prepare's 128 threads, 4 channels each, over 128-column blocks
    if chunk_size % segments:
        raise ValueError(f"chunk_size={chunk_size} is not a multiple of {segments} runs")
    return segments


@dataclasses.dataclass(frozen=True)
class KdaPrepareConfig:
    """Compile-time configuration of :class:`KdaPrepare` (the compile-cache key; T, B and cu_seqlens are not in it).

    Attributes:
        num_heads: H, qk heads.
        num_v_heads: HV, value heads (a multiple of H; value head hv reads qk head ``hv // (HV // H)``).
        head_dim: K.
        qk_dtype, g_dtype, beta_dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``; q_hat/k_hat have qk_dtype.
        l2norm: L2-normalise q and k.
        gate: ``"none"``, ``"softplus"`` or ``"safe"`` (lower-bound form; the bound is a launch argument).
        has_A_log, has_dt_bias: the gate's per-head ``A_log [HV]`` and per-channel ``dt_bias [HV, K]`` are given.
        beta_sigmoid, allow_neg_eigval: beta activation (allow_neg_eigval needs beta_sigmoid).
        varlen: packed sequences (B = 1, cu_seqlens and chunk indices).
        chunk_size: C; only 64.
    """

    num_heads: int
    num_v_heads: int
    head_dim: int
    qk_dtype: str = "bfloat16"
    g_dtype: str = "float32"
    beta_dtype: str = "float32"
    l2norm: bool = True
    gate: str = "safe"
    has_A_log: bool = True
    has_dt_bias: bool = True
    beta_sigmoid: bool = True
    allow_neg_eigval: bool = False
    varlen: bool = False
    chunk_size: int = 64


class KdaPrepare:
    """The KDA preprocessing kernel family (see the module docstring)."""

    num_threads = 128
    gate_vec = 4  # gate columns per thread and load (16-byte fp32 loads and stores)

    def __init__(self, config: KdaPrepareConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise ValueError(f"KdaPrepare cannot implement {config}: {reason}")
        self.config = config
        self.qk_dtype = _DTYPES[config.qk_dtype]
        self.g_dtype = _DTYPES[config.g_dtype]
        self.beta_dtype = _DTYPES[config.beta_dtype]
        K = config.head_dim
        # l2norm: a row of K elements is read by qk_threads_per_row threads, qk_vec contiguous elements (16 B) each.
        self.qk_vec = min(128 // self.qk_dtype.width, K)
        self.qk_threads_per_row = K // self.qk_vec
        # gate: column blocks of gate_cols channels; in each, a thread owns gate_vec channels of one run of
        # gate_segment_len consecutive tokens (gate_segments runs per chunk), scanned in registers and then
        # offset by the totals of the earlier runs (through shared memory).
        self.gate_cols = min(K, 128)
        self.gate_threads_per_row = self.gate_cols // self.gate_vec
        self.gate_segments = gate_scan_segments(K, config.chunk_size)
        self.gate_segment_len = config.chunk_size // self.gate_segments

    @staticmethod
    def can_implement(config: KdaPrepareConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c = config
        K = c.head_dim
        if c.chunk_size != 64:
            return False, f"chunk_size={c.chunk_size}: only 64 is supported"
        if K < 16 or K > 256 or K & (K - 1):
            return False, f"K={K}: head_dim must be a power of two in [16, 256]"
        for name in ("qk_dtype", "g_dtype", "beta_dtype"):
            if getattr(c, name) not in _DTYPES:
                return False, f"{name}={getattr(c, name)!r}: expected one of {tuple(_DTYPES)}"
        if K // min(128 // _DTYPES[c.qk_dtype].width, K) > 32:
            return False, f"K={K} with qk_dtype={c.qk_dtype}: a row must fit in one warp's 16-byte loads"
        if c.num_heads < 1 or c.num_v_heads < 1 or c.num_v_heads % c.num_heads:
            return False, f"HV={c.num_v_heads} must be a positive multiple of H={c.num_heads}"
        if c.num_v_heads + c.num_heads > 65535:
            return False, f"H + HV = {c.num_heads + c.num_v_heads} exceeds the grid's y limit (65535)"
        if c.gate not in GATE_FORMS:
            return False, f"gate={c.gate!r}: expected one of {GATE_FORMS}"
        if c.gate == "softplus" and not c.has_A_log:
            return False, "the softplus gate needs A_log (A_log may be absent only with the safe/lower-bound gate)"
        if c.gate == "none" and (c.has_A_log or c.has_dt_bias):
            return False, "A_log/dt_bias are only used by an in-kernel gate (gate='softplus' or 'safe')"
        if c.allow_neg_eigval and not c.beta_sigmoid:
            return False, "allow_neg_eigval requires beta_sigmoid"
        return True, ""

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the twelve tensor arguments of ``__call__``, in order (None: argument absent)."""
        c = self.config
        qk = TensorSpec(self.qk_dtype, 4, self.qk_vec) if c.l2norm else None
        index = TensorSpec(Int32, 1), TensorSpec(Int32, 2)
        return (
            qk,  # q [B, T, H, K]
            qk,  # k
            TensorSpec(self.g_dtype, 4, self.gate_vec),  # g [B, T, HV, K]
            TensorSpec(self.beta_dtype, 3),  # beta [B, T, HV]
            TensorSpec(Float32, 1) if c.has_A_log else None,  # A_log [HV]
            TensorSpec(Float32, 2, self.gate_vec) if c.has_dt_bias else None,  # dt_bias [HV, K]
            qk,  # q_hat
            qk,  # k_hat
            TensorSpec(Float32, 4, self.gate_vec),  # g_cum [B, T, HV, K]
            TensorSpec(Float32, 3),  # beta_out [B, T, HV]
            *(index if c.varlen else (None, None)),  # cu_seqlens [N + 1], chunk_indices [NT, 2]
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic B, T, N and NT; nothing allocated."""
        return fake_call_arguments(self.argument_specs(), Float32(0.0))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor | None,
        mK: cute.Tensor | None,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mQo: cute.Tensor | None,
        mKo: cute.Tensor | None,
        mGo: cute.Tensor,
        mBetaO: cute.Tensor,
        mCuSeqlens: cute.Tensor | None,
        mChunkIndices: cute.Tensor | None,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        c = self.config
        num_chunks = chunk_grid_extent(mChunkIndices, mG.shape[1], c.chunk_size, c.varlen)
        roles = c.num_v_heads + (c.num_heads if c.l2norm else 0)
        self.kernel(
            mQ, mK, mG, mBeta, mALog, mDtBias, mQo, mKo, mGo, mBetaO, mCuSeqlens, mChunkIndices, lower_bound
        ).launch(grid=[num_chunks, roles, mG.shape[0]], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor | None,
        mK: cute.Tensor | None,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mQo: cute.Tensor | None,
        mKo: cute.Tensor | None,
        mGo: cute.Tensor,
        mBetaO: cute.Tensor,
        mCuSeqlens: cute.Tensor | None,
        mChunkIndices: cute.Tensor | None,
        lower_bound: Float32,
    ):
        c = self.config
        C = c.chunk_size
        tidx, _, _ = cute.arch.thread_idx()
        chunk, role, batch = cute.arch.block_idx()
        # This CTA's chunk: first token `start` in batch row `batch`, `valid` tokens (0 for a padding row).
        start, valid = chunk_span(mCuSeqlens, mChunkIndices, chunk, mG.shape[1], C, c.varlen)
        if role < c.num_v_heads:
            self.gate_and_beta(mG, mBeta, mALog, mDtBias, mGo, mBetaO, lower_bound, batch, role, start, valid, tidx)
        if const_expr(c.l2norm):
            if role >= c.num_v_heads:
                head = role - c.num_v_heads
                self.l2norm_rows(mQ, mQo, batch, head, start, valid, tidx)
                self.l2norm_rows(mK, mKo, batch, head, start, valid, tidx)

    @cute.jit
    def l2norm_rows(self, mX: cute.Tensor, mXo: cute.Tensor, b: Int32, h: Int32, start: Int32, valid: Int32,
                    tidx: Int32):
        """``mXo[b, start + r, h] = l2norm(mX[b, start + r, h])`` for the chunk's rows ``r < valid``."""
        C, K = self.config.chunk_size, self.config.head_dim
        rows_per_pass = self.num_threads // self.qk_threads_per_row
        atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), self.qk_dtype, num_bits_per_copy=self.qk_vec * self.qk_dtype.width
        )
        tiled_copy = cute.make_tiled_copy_tv(
            atom,
            cute.make_ordered_layout((rows_per_pass, self.qk_threads_per_row), order=(1, 0)),
            cute.make_layout((1, self.qk_vec)),
        )
        thr_copy = tiled_copy.get_slice(tidx)
        gX = cute.local_tile(cute.domain_offset((start, 0), mX[b, None, h, None]), (C, K), (0, 0))
        gXo = cute.local_tile(cute.domain_offset((start, 0), mXo[b, None, h, None]), (C, K), (0, 0))
        tXgX = thr_copy.partition_S(gX)  # (CPY, passes, 1)
        tXgXo = thr_copy.partition_D(gXo)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor((C, K)))
        tXrX = cute.make_fragment_like(tXgX)
        tXrXo = cute.make_fragment_like(tXgXo)
        tXrX.fill(0)
        num_passes = cute.size(tXgX, mode=[1])
        for p in cutlass.range_constexpr(num_passes):
            if tXcX[(0, 0), p, 0][0] < valid:
                cute.copy(atom, tXgX[None, p, None], tXrX[None, p, None])
        for p in cutlass.range_constexpr(num_passes):
            x = tXrX[None, p, None].load().to(Float32)
            sum_sq = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            sum_sq = cute.arch.warp_reduction_sum(sum_sq, threads_in_group=self.qk_threads_per_row)
            tXrXo[None, p, None].store((x * cute.math.rsqrt(sum_sq + L2NORM_EPS)).to(self.qk_dtype))
        for p in cutlass.range_constexpr(num_passes):
            if tXcX[(0, 0), p, 0][0] < valid:
                cute.copy(atom, tXrXo[None, p, None], tXgXo[None, p, None])

    @cute.jit
    def gate_and_beta(self, mG: cute.Tensor, mBeta: cute.Tensor, mALog: cute.Tensor | None,
                      mDtBias: cute.Tensor | None, mGo: cute.Tensor, mBetaO: cute.Tensor, lower_bound: Float32,
                      b: Int32, hv: Int32, start: Int32, valid: Int32, tidx: Int32):
        """Gate cumsum (``mGo``) and beta (``mBetaO``) of value head ``hv`` for the chunk's ``valid`` tokens."""
        c = self.config
        C, K, V = c.chunk_size, c.head_dim, self.gate_vec
        seg_len, per_row = self.gate_segment_len, self.gate_threads_per_row
        seg = tidx // per_row  # this thread's run of seg_len consecutive tokens
        first = seg * seg_len
        smem = cutlass.utils.SmemAllocator()
        sTotal = smem.allocate_tensor(
            Float32, cute.make_layout((self.gate_segments, self.gate_cols), stride=(self.gate_cols, 1)), 16
        )
        copy_op = cute.nvgpu.CopyUniversalOp()
        g_atom = cute.make_copy_atom(copy_op, self.g_dtype, num_bits_per_copy=V * self.g_dtype.width)
        o_atom = cute.make_copy_atom(copy_op, Float32, num_bits_per_copy=V * 32)
        gG = cute.local_tile(cute.domain_offset((start, 0), mG[b, None, hv, None]), (C, K), (0, 0))
        gGo = cute.local_tile(cute.domain_offset((start, 0), mGo[b, None, hv, None]), (C, K), (0, 0))
        scale = Float32(1.0)
        if const_expr(c.gate != "none" and c.has_A_log):
            scale = cute.math.exp(mALog[hv])
        row_major = cute.make_layout((seg_len, V), stride=(V, 1))
        for blk in cutlass.range_constexpr(K // self.gate_cols):
            col_blk = blk * per_row + tidx % per_row  # in units of V channels
            col = (tidx % per_row) * V  # within this column block (sTotal)
            tGgG = cute.local_tile(gG, (seg_len, V), (seg, col_blk))
            tGgGo = cute.local_tile(gGo, (seg_len, V), (seg, col_blk))
            tGrG = cute.make_rmem_tensor(row_major, self.g_dtype)
            tGrG.fill(0)
            for i in cutlass.range_constexpr(seg_len):
                if first + i < valid:
                    cute.copy(g_atom, tGgG[i, None], tGrG[i, None])
            bias = [Float32(0.0)] * V
            if const_expr(c.has_dt_bias):
                rBias = cute.make_rmem_tensor(cute.make_layout(V), Float32)
                cute.copy(o_atom, cute.local_tile(mDtBias[hv, None], (V,), (col_blk,)), rBias)
                bias = [rBias[j] for j in range(V)]
            # inclusive scan of the activated gate over this thread's run, in fp32
            tGrCum = cute.make_rmem_tensor(row_major, Float32)
            running = [Float32(0.0)] * V
            for i in cutlass.range_constexpr(seg_len):
                for j in cutlass.range_constexpr(V):
                    running[j] = running[j] + self.activate(tGrG[i, j].to(Float32) + bias[j], scale, lower_bound)
                    tGrCum[i, j] = running[j]
            for j in cutlass.range_constexpr(V):
                sTotal[seg, col + j] = running[j]
            cute.arch.sync_threads()
            # add the totals of the earlier runs of this chunk, then convert to log2 units
            rOffset = cute.make_rmem_tensor(cute.make_layout(V), Float32)
            rOffset.fill(0.0)
            for s in cutlass.range_constexpr(self.gate_segments):
                if s < seg:
                    for j in cutlass.range_constexpr(V):
                        rOffset[j] = rOffset[j] + sTotal[s, col + j]
            for i in cutlass.range_constexpr(seg_len):
                for j in cutlass.range_constexpr(V):
                    tGrCum[i, j] = (tGrCum[i, j] + rOffset[j]) * RCP_LN2
                if first + i < valid:
                    cute.copy(o_atom, tGrCum[i, None], tGgGo[i, None])
            cute.arch.sync_threads()  # sTotal is rewritten by the next column block
        if tidx < valid:
            mBetaO[b, start + tidx, hv] = activate_beta(mBeta[b, start + tidx, hv].to(Float32), c.beta_sigmoid,
                                                        c.allow_neg_eigval)

    def activate(self, x: Float32, scale: Float32, lower_bound: Float32) -> Float32:
        """The gate activation of one channel (``x`` already includes dt_bias); traced inline."""
        return activate_gate(self.config.gate, x, scale, lower_bound)


# positions of q_hat, k_hat, g_cum and beta_out among the tensor arguments
_OUTPUTS = frozenset({6, 7, 8, 9})


@functools.lru_cache(maxsize=256)
def _plan(H: int, HV: int, K: int, qk_dtype, g_dtype, beta_dtype, flags: tuple) -> tuple:
    """The config and argument specs of one call signature (torch dtypes in, cached: no work per call)."""
    names = []
    for what, dtype in (("q", qk_dtype), ("g", g_dtype), ("beta", beta_dtype)):
        name = str(dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"{what} must be bfloat16, float16 or float32, got {dtype}")
        names.append(name)
    l2norm, gate, has_A_log, has_dt_bias, beta_sigmoid, allow_neg_eigval, varlen = flags
    config = KdaPrepareConfig(
        num_heads=H, num_v_heads=HV, head_dim=K, qk_dtype=names[0], g_dtype=names[1], beta_dtype=names[2],
        l2norm=l2norm, gate=gate, has_A_log=has_A_log, has_dt_bias=has_dt_bias, beta_sigmoid=beta_sigmoid,
        allow_neg_eigval=allow_neg_eigval, varlen=varlen,
    )
    ok, reason = KdaPrepare.can_implement(config)
    if not ok:
        raise ValueError(f"kda_prepare: {reason}")
    return config, KdaPrepare(config).argument_specs()


def gate_arguments(use_gate_in_kernel: bool, lower_bound: float | None, A_log, dt_bias, allow_neg_eigval: bool,
                   use_beta_sigmoid_in_kernel: bool, HV: int, K: int, device) -> tuple:
    """The gate form (:data:`GATE_FORMS`) and the checked fp32 ``A_log [HV]`` and ``dt_bias [HV, K]`` (None when
    absent or unused) of a call that prepares the gate in a kernel; ``ValueError`` for inconsistent flags or sizes."""
    import torch

    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval requires use_beta_sigmoid_in_kernel=True")
    if use_gate_in_kernel:
        gate = "safe" if lower_bound is not None else "softplus"
        if gate == "softplus" and A_log is None:
            raise ValueError("the softplus gate (lower_bound=None) needs A_log")
    else:
        gate, A_log, dt_bias = "none", None, None
    if A_log is not None:
        if A_log.numel() != HV:
            raise ValueError(f"A_log must have HV = {HV} elements, got {A_log.numel()}")
        if A_log.dim() != 1 or A_log.dtype != torch.float32 or A_log.device != device:
            A_log = A_log.to(device=device, dtype=torch.float32).reshape(HV)
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV*K = {HV * K} elements, got {dt_bias.numel()}")
        if dt_bias.dtype != torch.float32 or dt_bias.device != device:
            dt_bias = dt_bias.to(device=device, dtype=torch.float32)
        dt_bias = dt_bias.view(HV, K) if dt_bias.is_contiguous() else dt_bias.reshape(HV, K)
    return gate, A_log, dt_bias


def kda_prepare(
    q,
    k,
    g,
    beta,
    *,
    A_log=None,
    dt_bias=None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens=None,
    chunk_indices=None,
    out=None,
):
    """KDA preprocessing on the GPU: ``(q_hat, k_hat, g_cum, beta_f32)``.

    Args:
        q, k: ``[B, T, H, K]`` CUDA tensors (bf16/fp16/fp32, same dtype).
        g: ``[B, T, HV, K]`` log-gate, or the raw gate with ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` step size, or its logit with ``use_beta_sigmoid_in_kernel``.
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` or ``[HV, K]`` (cast to fp32). Used only with ``use_gate_in_kernel``.
        lower_bound: selects the safe (lower-bound) gate form when ``use_gate_in_kernel``; else softplus.
        cu_seqlens: int32 ``[N + 1]`` for packed sequences (B must be 1).
        chunk_indices: int32 ``[NT, 2]`` from :func:`cula_runtime.index.prepare_chunk_indices` (computed when None).
        out: optional preallocated ``(q_hat, k_hat, g_cum, beta_out)`` (q_hat/k_hat may be None without l2norm).

    Returns:
        ``q_hat, k_hat`` (q and k themselves without ``use_qk_l2norm_in_kernel``), ``g_cum`` fp32 ``[B, T, HV, K]``
        in log2 units, ``beta`` fp32 ``[B, T, HV]``. Launched on the current stream; the first call per
        configuration compiles (see :func:`cula_runtime.cute.compile_cache.compile_records`).
    """
    if q.shape != k.shape or q.dim() != 4 or q.dtype != k.dtype:
        raise ValueError(f"q and k must both be [B, T, H, K] of one dtype, got {tuple(q.shape)} {q.dtype} and "
                         f"{tuple(k.shape)} {k.dtype}")
    B, T, H, K = q.shape
    if g.dim() != 4 or g.shape[:2] != (B, T) or g.shape[3] != K:
        raise ValueError(f"g must be [B, T, HV, K] = [{B}, {T}, HV, {K}], got {tuple(g.shape)}")
    HV = g.shape[2]
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = [{B}, {T}, {HV}], got {tuple(beta.shape)}")
    device = q.device
    if device.type != "cuda" or any(t.device != device for t in (k, g, beta)):
        raise ValueError("q, k, g and beta must be CUDA tensors on one device")
    gate, A_log, dt_bias = gate_arguments(use_gate_in_kernel, lower_bound, A_log, dt_bias, allow_neg_eigval,
                                          use_beta_sigmoid_in_kernel, HV, K, device)

    chunk_indices, num_chunks = chunk_rows(cu_seqlens, chunk_indices, B, T, device)
    return _prepare(q, k, g, beta, gate, A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel,
                    use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens, chunk_indices, num_chunks, out)


def _prepare(q, k, g, beta, gate: str, A_log, dt_bias, lower_bound: float | None, use_qk_l2norm_in_kernel: bool,
             use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, cu_seqlens, chunk_indices, num_chunks: int,
             out, *, check_out: bool = True) -> tuple:
    """:func:`kda_prepare` after its argument checks (``gate``, ``A_log``, ``dt_bias`` from :func:`gate_arguments`,
    ``chunk_indices`` and ``num_chunks`` from :func:`~cula_runtime.cute.varlen.chunk_rows`): plan, allocate the
    outputs (or take ``out``: checked unless ``check_out`` is False, for a caller that carved them itself) and
    launch. The cutedsl backend calls it directly: :func:`~cula_runtime.kda_args.validate_kda_prefill` has checked
    what kda_prepare would."""
    import torch

    B, T, H, K = q.shape
    HV = g.shape[2]
    device = q.device
    flags = (use_qk_l2norm_in_kernel, gate, A_log is not None, dt_bias is not None, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, cu_seqlens is not None)
    config, specs = _plan(H, HV, K, q.dtype, g.dtype, beta.dtype, flags)

    if out is not None:
        q_hat, k_hat, g_cum, beta_out = out
        if check_out:
            expected = (("g_cum", g_cum, (B, T, HV, K), torch.float32),
                        ("beta_out", beta_out, (B, T, HV), torch.float32))
            if use_qk_l2norm_in_kernel:
                expected += (("q_hat", q_hat, q.shape, q.dtype), ("k_hat", k_hat, q.shape, q.dtype))
            for name, t, shape, dtype in expected:
                if t is None or t.shape != shape or t.dtype != dtype or t.device != device:
                    got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
                    raise ValueError(f"out: {name} must be {dtype} {tuple(shape)} on {device}, got {got}")
    else:
        q_hat = torch.empty_like(q) if use_qk_l2norm_in_kernel else None
        k_hat = torch.empty_like(k) if use_qk_l2norm_in_kernel else None
        g_cum = torch.empty(B, T, HV, K, dtype=torch.float32, device=device)
        beta_out = torch.empty(B, T, HV, dtype=torch.float32, device=device)
    if not use_qk_l2norm_in_kernel:
        q_hat, k_hat = q, k
    outputs = q_hat, k_hat, g_cum, beta_out
    if num_chunks == 0:
        return outputs

    if not use_qk_l2norm_in_kernel:
        q = k = q_hat = k_hat = None  # not read by the kernel; returned as given below
    tensors = (q, k, g, beta, A_log, dt_bias, q_hat, k_hat, g_cum, beta_out, cu_seqlens, chunk_indices)
    launch(KdaPrepare, config, specs, tensors, _OUTPUTS, device, float(lower_bound) if gate == "safe" else 0.0)
    return outputs
