"""KDA "chunk intra" from the raw inputs in one CuTeDSL launch: the gate's activation and chunk-local cumsum, β and
the q/k L2 norm, then the intra-chunk scores, the triangular inverse and W/U (KDA_SPEC.md §2, §3.1-3.4, §3.7, §3.8;
FLA's ``chunk_kda_fwd_intra``, its inputs' preprocessing folded in). Two compile-time forms: the safe-gate form
(FLA's ``safe_gate=True``: every log-gate step in [-5, 0]) and the unbounded form (:attr:`KdaIntraConfig.unbounded`,
any finite log-gate <= 0), which differ only in the diagonal 16x16 score blocks.

One CTA of 256 threads (8 warps, two CTAs per SM) per (chunk, value head, batch row); value head ``hv`` reads q/k head
``hv // (HV // H)``. With ``Γ`` the chunk-local cumulative gate in log2 units:

0. *Gate prologue*: β's load is issued first; ``Γ`` is computed from the raw gate (:func:`~.gate.activate_gate`,
   then the chunk cumsum in 4 runs of 16 tokens, each summed serially and offset by the earlier runs' totals in
   order, times 1/ln 2) in two column stages of 64 through a staging tile, each stage's raw values loaded one stage
   ahead; each thread keeps ``Γ`` of its fill elements in registers. The anchors' rows ``Γ[16 I]`` and ``Γ_last``
   go to shared memory, and each chunk's decay row ``g_last = Γ_last`` to global memory for the recurrence. β is
   activated (:func:`~.gate.activate_beta`).
1. *Fill*: the chunk's q and k rows are read once from global memory (16-byte loads, each row pass's loads issued
   one pass ahead; rows past the chunk's end are zero-filled, never read) and, with ``l2norm``, L2-normalised. Each
   row ``r`` of 16-row sub-chunk ``I`` is factored around the sub-chunk's first row ``n_I``: ``q̃_r = q_r
   2^(Γ_r - Γ_n)`` and ``k̃_r = k_r 2^(Γ_r - Γ_n)`` (row operands, ≤ 1), and ``k̂^(I')_r = k_r 2^(Γ_n' - Γ_r)`` for
   every sub-chunk ``I' ≥ I`` (column operands; ≤ 1 off the diagonal, ≤ 2^(15·5/ln 2) on it under the safe gate
   |g| ≤ 5 per step, inside bf16's range), stored bf16 in shared memory. ``kg = k 2^(Γ_last - Γ)`` and ``qg = q
   2^Γ`` go straight to global memory.

   *Unbounded form*: the diagonal k̂ (``I' = I``, which overflows once a sub-chunk's gates sum below about -88 in
   log2 units) is not made, nor q̃, k̃ of sub-chunk 0 (no score block reads them). A row pass is one sub-chunk, and
   at its end all 8 warps make the diagonal blocks ``(I, I)`` of Aqk and Akk by the levels split of
   :mod:`.diag_levels`: each strict pair ``i > j`` belongs to the level ``b`` of the highest bit where ``i`` and
   ``j`` differ, with the anchor ``m`` = ``i`` with its bits below ``b`` cleared (``j < m ≤ i``), so that ``q_i k_j
   2^(Γi - Γj) = [q_i 2^(Γi - Γm)] [k_j 2^(Γm - Γj)]`` with both factors ≤ 1. Levels 3+2 and 1+0 pack into two
   16x16xK products per block (every token has one role per level). The rows' Γ go to a staging tile; behind a
   barrier the 16 threads of each token write its role at each level (a runtime loop over the levels) into its slot
   of the products' operands (bf16 ``[16, K]`` tiles: q and k rows ``x_r 2^-|Γr - Γm|``, k columns
   ``k_r 2^-|Γr - Γm|``; the k columns, shared by Aqk and Akk, in the bytes of sub-chunk 0's q̃ and k̃), one exp2 per
   token, level and column; behind a second barrier each warp makes 8 column slots of one product of Aqk or Akk (16 x
   8 x K on warp MMA) and keeps the outputs whose row and column slots share their anchor. Aqk's diagonal entries are
   fp32 dot products ``q_r·k_r`` over each row's 16 threads. Nothing overflows for any g ≤ 0; a factor that flushes
   to zero drops a product below 2^-126.
2. *Scores*: the 10 lower 16x16 sub-blocks of ``Aqk`` and ``Akk`` on warp MMA (bf16 m16n8k16, fp32 accumulation,
   operands by ldmatrix), warps 0-3 making Aqk and warps 4-7 Akk (unbounded: the 6 below the diagonal, as 12 column
   halves of 16 x 8 per matrix, three per warp in one runtime loop); scale, β and the causal masks are applied to
   the fp32 results. Then the right-hand sides ``bf16(β k 2^Γ)`` and ``bf16(β v)`` are built over q̃/k̃ (k and v
   rows read from global memory).
3. *Inverse* ``Tinv = (I + Akk)^-1`` in fp32 on CUDA cores: forward substitution on the diagonal 16x16 blocks (one
   thread per column), then block substitution ``Tinv_IJ = -Tinv_II Σ_M A_IM Tinv_MJ`` block row by block row, with
   compile-time loop bounds (every thread runs all of a block row's terms and keeps those of its lower-triangular
   range by selection).
4. *W/U*: ``w = bf16(Tinv) · bf16(β k 2^Γ)`` and ``u = bf16(Tinv) · bf16(β v)`` on warp MMA (4 x 2 warps; the
   right-hand sides are read transposed by ldmatrix.trans), staged through shared memory and stored with 16-byte
   stores, with ``Aqk``.

Shared memory (about 99 KB; the unbounded form about 108 KB): buffers whose lifetimes do not overlap share bytes
(:meth:`KdaIntra.smem_buffers`).
Registers are capped at 128 per thread so that two CTAs fit on an SM (a few values spill to local memory).

Only warp-level MMA, ldmatrix and plain loads/stores: the same source runs on SM90, SM100 and SM103.
Varlen (``B = 1``): CTA ``x`` reads row ``x`` of the chunk indices ``[NT, 2]`` (sequence, chunk within it); a row with
a negative sequence id is padding and does nothing. Rows past a sequence's end are never read nor written.

:func:`chunk_kda_fwd_intra_from_raw` is the host wrapper. (The forms this kernel superseded, each measured slower or
only reproducing its bits on the H200 — the separate ``KdaPrepare`` kernel before an intra kernel reading a
precomputed ``g_cum``, the wide shared-memory plan, the looped inverse, 4-warp CTAs, loads not issued ahead, the
three-launch modular path, K = 64, and the unbounded form's diagonal blocks on warps 0-3 alone, each warp building
its operands slot by slot from a staging of q, k and Γ (one exp2 per operand element) — are in the repository's
history.)
"""

import dataclasses
import functools

from ..compile_cache import TensorSpec, bound_launch, fake_call_arguments, launch, missing_cutedsl
from ..dsl_compat import SmemAllocator
from ..smem import REGION_ALIGN, align_up, carve
from ..varlen import check_token_tensors, chunk_rows
from .diag_levels import LEVELS, diag_products, level_product, level_slots, pack_nibbles
from .gate import GATE_FORMS, RCP_LN2, activate_beta, activate_gate, gate_arguments, gate_scan_segments
from .tiles import chunk_grid_extent, chunk_span

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr
    from cutlass.cute.nvgpu import warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["InKernelGate", "KdaIntra", "KdaIntraConfig", "chunk_kda_fwd_intra_from_raw"]

SUB = 16  # rows of a sub-chunk: the M (and N) of one score block
NUM_SUB = 4  # sub-chunks per 64-row chunk
EXP2_CLAMP = 126.0  # exponents are clamped here: a factor of a zero (past-the-end) row stays finite
L2NORM_EPS = 1e-6


_RAW_DTYPES = {"bfloat16": BFloat16, "float32": Float32}


@dataclasses.dataclass(frozen=True)
class InKernelGate:
    """How the kernel prepares the raw gate and β (:mod:`.gate`): the gate activation, its chunk-local cumsum in
    log2 units, and the β activation.

    Attributes:
        form: ``"none"`` (g is already the log-gate), ``"softplus"`` or ``"safe"`` (lower-bound form; the bound is a
            launch argument), as :data:`~cula_runtime.cute.kda.gate.GATE_FORMS`.
        g_dtype, beta_dtype: ``"bfloat16"`` or ``"float32"``, the raw inputs' dtypes.
        has_A_log, has_dt_bias: ``A_log [HV]`` and ``dt_bias [HV, K]`` (fp32) are given.
        beta_sigmoid, allow_neg_eigval: β is ``sigmoid(b)`` (``2 sigmoid(b)``), else ``b`` itself.
    """

    form: str = "safe"
    g_dtype: str = "float32"
    beta_dtype: str = "float32"
    has_A_log: bool = True
    has_dt_bias: bool = True
    beta_sigmoid: bool = True
    allow_neg_eigval: bool = False


@dataclasses.dataclass(frozen=True)
class KdaIntraConfig:
    """Compile-time configuration of :class:`KdaIntra` (the compile-cache key; T, B and cu_seqlens are not in it).

    Attributes:
        num_heads: H, q/k heads.
        num_v_heads: HV, value heads (a multiple of H).
        gate: how the raw gate and β are prepared (:class:`InKernelGate`).
        head_dim: K = V; only 128.
        varlen: packed sequences (B = 1, cu_seqlens and chunk indices).
        chunk_size: C; only 64.
        l2norm: q and k arrive raw and each row is L2-normalised here (the row's 16 threads, 8 values each, one fp32
            sum of squares over 16 lanes, rsqrt, rounding to bf16).
        unbounded: the diagonal 16x16 blocks of Aqk and Akk by the binary "levels" split (:mod:`.diag_levels`),
            exact in exponent range for every log-gate g <= 0; False: anchored at the sub-chunk's first row, which
            needs the safe gate (every step in [-5, 0]).
    """

    num_heads: int
    num_v_heads: int
    gate: InKernelGate = InKernelGate()
    head_dim: int = 128
    varlen: bool = False
    chunk_size: int = 64
    l2norm: bool = False
    unbounded: bool = False


class KdaIntra:
    """The KDA chunk-intra kernel family (see the module docstring)."""

    vec = 8  # bf16 elements per 16-byte access
    num_threads = 256  # 8 warps, two CTAs per SM

    def __init__(self, config: KdaIntraConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise ValueError(f"KdaIntra cannot implement {config}: {reason}")
        self.config = config
        K = config.head_dim
        # row copies of [64, K] bf16 tiles: threads_per_row threads, 8 contiguous elements (16 B) each
        self.threads_per_row = K // self.vec
        self.rows_per_pass = self.num_threads // self.threads_per_row
        self.passes = config.chunk_size // self.rows_per_pass

    @staticmethod
    def can_implement(config: KdaIntraConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c = config
        if c.chunk_size != 64:
            return False, f"chunk_size={c.chunk_size}: only 64 is supported"
        if c.head_dim != 128:
            return False, f"K={c.head_dim}: only K = V = 128 is supported"
        if c.num_heads < 1 or c.num_v_heads < 1 or c.num_v_heads % c.num_heads:
            return False, f"HV={c.num_v_heads} must be a positive multiple of H={c.num_heads}"
        if c.num_v_heads > 65535:
            return False, f"HV={c.num_v_heads} exceeds the grid's y limit (65535)"
        if c.gate.form not in GATE_FORMS:
            return False, f"gate.form={c.gate.form!r}: expected one of {GATE_FORMS}"
        for name in ("g_dtype", "beta_dtype"):
            if getattr(c.gate, name) not in _RAW_DTYPES:
                return False, f"gate.{name}={getattr(c.gate, name)!r}: expected one of {tuple(_RAW_DTYPES)}"
        if c.gate.form == "softplus" and not c.gate.has_A_log:
            return False, "the softplus gate needs A_log"
        if c.gate.form == "none" and (c.gate.has_A_log or c.gate.has_dt_bias):
            return False, "A_log/dt_bias are only used by an activated gate (form 'softplus' or 'safe')"
        if c.gate.allow_neg_eigval and not c.gate.beta_sigmoid:
            return False, "allow_neg_eigval requires beta_sigmoid"
        return True, ""

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the fifteen tensor arguments of ``__call__``, in order (None: absent in this
        configuration)."""
        c = self.config
        gate = c.gate
        bf16 = TensorSpec(BFloat16, 4, self.vec)
        index = TensorSpec(Int32, 1), TensorSpec(Int32, 2)
        return (
            bf16,  # q [B, T, H, K], raw
            bf16,  # k [B, T, H, K], raw
            bf16,  # v [B, T, HV, V]
            TensorSpec(_RAW_DTYPES[gate.g_dtype], 4),  # g [B, T, HV, K]: the raw gate (or the log-gate, form "none")
            TensorSpec(_RAW_DTYPES[gate.beta_dtype], 3),  # beta [B, T, HV], raw
            bf16,  # w [B, T, HV, K]
            bf16,  # u [B, T, HV, V]
            bf16,  # qg [B, T, HV, K]
            bf16,  # kg [B, T, HV, K]
            bf16,  # Aqk [B, T, HV, 64]
            *(index if c.varlen else (None, None)),  # cu_seqlens [N + 1], chunk_indices [NT, 2]
            TensorSpec(Float32, 1) if gate.has_A_log else None,  # A_log [HV]
            TensorSpec(Float32, 2) if gate.has_dt_bias else None,  # dt_bias [HV, K]
            TensorSpec(Float32, 4, 4),  # g_last [B, NT, HV, K] (varlen [1, NC, HV, K]), log2 units
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic B, T, N and NT; nothing allocated."""
        return fake_call_arguments(self.argument_specs(), Float32(1.0), Float32(0.0))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mW: cute.Tensor,
        mU: cute.Tensor,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mAqk: cute.Tensor,
        mCuSeqlens: cute.Tensor | None,
        mChunkIndices: cute.Tensor | None,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mGLast: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        c = self.config
        num_chunks = chunk_grid_extent(mChunkIndices, mG.shape[1], c.chunk_size, c.varlen)
        # score blocks: one warp atom (16x8x16), tiled to 16x16x16 so that ldmatrix.x4 feeds B
        mma_op = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        block_mma = cute.make_tiled_mma(mma_op, (1, 1, 1), permutation_mnk=(SUB, 16, 16))
        # W/U: four warps stacked along M (64 rows of Tinv), two such columns of warps along N
        wu_mma = cute.make_tiled_mma(mma_op, (4, 2, 1), permutation_mnk=(c.chunk_size, 32, 16))
        kernel = self.kernel(
            mQ, mK, mV, mG, mBeta, mW, mU, mQg, mKg, mAqk, mCuSeqlens, mChunkIndices, mALog, mDtBias, mGLast, scale,
            lower_bound, block_mma, wu_mma,
        )
        # two CTAs of 8 warps per SM: at most 128 registers per thread
        kernel.launch(grid=[num_chunks, c.num_v_heads, mG.shape[0]], block=[self.num_threads, 1, 1], stream=stream,
                      min_blocks_per_mp=2, preferred_smem_carveout=100)

    def smem_layout(self, rows: int, cols: int):
        """A [rows, cols] bf16 tile, row-major, 128-byte rows swizzled (Swizzle<3,3,3>) so ldmatrix is conflict-free."""
        atom = cute.make_composed_layout(
            cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
        )
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mW: cute.Tensor,
        mU: cute.Tensor,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mAqk: cute.Tensor,
        mCuSeqlens: cute.Tensor | None,
        mChunkIndices: cute.Tensor | None,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mGLast: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
        block_mma: cute.TiledMma,
        wu_mma: cute.TiledMma,
    ):
        c = self.config
        C, K = c.chunk_size, c.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        chunk, hv, batch = cute.arch.block_idx()
        head = hv // (c.num_v_heads // c.num_heads)
        # This CTA's chunk: first token `start` in batch row `batch`, `valid` tokens (0 for a padding row).
        start, valid = chunk_span(mCuSeqlens, mChunkIndices, chunk, mG.shape[1], C, c.varlen)

        smem = SmemAllocator()
        sQt, sKt, sKh, sAqk, sTb, sA, sT, sS, sGa, sBeta, sW, sU, sDiag = self.smem_buffers(smem)

        if valid > 0:
            # β's load goes out first, ahead of the gate's loads; it is used only after them
            beta_raw = self.load_beta(mBeta, batch, hv, start, valid, tidx)
            # Γ of this thread's fill elements, kept in registers; the gate prologue's staging tile lies over Tinv's
            # fp32 buffers (sT and sS, free until the inverse)
            rGam = cute.make_rmem_tensor(cute.make_layout((self.passes, self.vec), stride=(self.vec, 1)), Float32)
            self.gate_prologue(mG, mDtBias, mALog, mGLast, sT, sGa, rGam, lower_bound, batch, hv, chunk, start,
                               valid, tidx)
            self.store_beta(sBeta, sAqk, beta_raw, valid, tidx)
            cute.arch.sync_threads()
            diag = None  # unbounded: the fill makes the diagonal score blocks too, sub-chunk by sub-chunk
            if const_expr(c.unbounded):
                sDiag[3][0, tidx] = self.diag_pairs(tidx)  # (each entry read back by its own thread only)
                sDiag[3][1, tidx] = self.diag_slots(tidx)
                diag = (sDiag, sAqk, sA, scale)
            self.fill(mQ, mK, mV, mQg, mKg, sGa, sBeta, sQt, sKt, sKh, rGam, batch, head, hv, start, valid, tidx,
                      operands=True, diag=diag)
            cute.arch.sync_threads()
            if const_expr(c.unbounded):
                self.scores_below(sQt, sKh, sBeta, sAqk, sA, scale, tidx)
            else:
                self.scores(block_mma, sQt, sKt, sKh, sBeta, sAqk, sA, scale, tidx)
            cute.arch.sync_threads()
            # the right-hand sides, over q̃/k̃ (free since the barrier)
            self.fill(mQ, mK, mV, mQg, mKg, sGa, sBeta, sQt, sKt, sKh, rGam, batch, head, hv, start, valid, tidx,
                      operands=False)
            self.inverse(sA, sT, sS, sTb, tidx)  # ends with a barrier
            self.wu(wu_mma, sTb, sQt, sKt, sW, sU, tidx)
            cute.arch.sync_threads()
            self.store_rows(sW, mW, batch, hv, start, valid, K, tidx)
            self.store_rows(sU, mU, batch, hv, start, valid, K, tidx)
            self.store_rows(sAqk, mAqk, batch, hv, start, valid, C, tidx)

    @staticmethod
    def fp32_layout(cols: int, rows: int | None = None):
        """Row-major fp32 [rows, cols] (rows defaults to cols)."""
        return cute.make_layout((cols if rows is None else rows, cols), stride=(cols, 1))

    def small_buffers(self, smem) -> tuple:
        """The anchors' gate rows Γ[16 I] and Γ_last (fp32 [5, K]) and β (fp32 [64])."""
        C, K = self.config.chunk_size, self.config.head_dim
        sGa = smem.allocate_tensor(Float32, cute.make_layout((NUM_SUB + 1, K), stride=(K, 1)), 16)
        sBeta = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        return sGa, sBeta

    def smem_plan(self) -> dict[str, int]:
        """Byte offsets of the two shared regions' buffers (see :meth:`smem_buffers`) and the regions' sizes."""
        C, K = self.config.chunk_size, self.config.head_dim
        tile = C * K * 2  # one bf16 [64, K] tile
        inverse = C * C * 4 + SUB * C * 4  # sT, sS (fp32)
        off_tb = align_up(max(inverse, 2 * tile))
        if self.config.unbounded:
            # k̂ of anchors 1-3 only (the rows before them: off the diagonal), then one sub-chunk's staging for the
            # diagonal blocks: Γ (fp32), then the four A operands (bf16 [16, K] each; the two B operands lie in the
            # rows region, over q̃ and k̃ of sub-chunk 0, which no score block reads)
            kh = [align_up(SUB * i * K * 2) for i in range(NUM_SUB)]
            diag = sum(kh)
            return {
                "rows": 2 * tile,
                "kh": [sum(kh[:i]) for i in range(NUM_SUB)],
                "diag": diag,
                "diag_a": diag + SUB * K * 4,
                "s": C * C * 4,
                "tb": off_tb,
                "reuse": max(diag + SUB * K * (4 + 4 * 2), off_tb + C * C * 2),
            }
        kh = [align_up(SUB * (i + 1) * K * 2) for i in range(NUM_SUB)]
        return {
            "rows": 2 * tile,
            "kh": [sum(kh[:i]) for i in range(NUM_SUB)],
            "s": C * C * 4,
            "tb": off_tb,
            "reuse": max(sum(kh), off_tb + C * C * 2),
        }

    def smem_buffers(self, smem) -> tuple:
        """Two regions whose buffers take turns (every hand-over is behind a CTA barrier), then Aqk, Akk fp32 and
        the small buffers.

        * rows (2 tiles): q̃, k̃ until the scores; then bf16(β k 2^Γ), bf16(β v) until W/U.
        * reuse: the gate prologue's staging tile (over Tinv's fp32 buffers) until the fill; the k̂ of the four
          anchors until the scores (unbounded: of anchors 1-3, then the diagonal blocks' staging ``sDiag``); then
          Tinv fp32 and its temporaries, and bf16(Tinv) at ``tb``; after the inverse, w and u are staged over the
          fp32 Tinv while bf16(Tinv) stays.

        Returns ``sQt, sKt`` (also the right-hand sides), ``sKh``, ``sAqk``, ``sTb``, ``sA``, ``sT``, ``sS``, ``sGa``,
        ``sBeta``, ``sW``, ``sU``, ``sDiag`` (unbounded: ``(sDG, sDA, sDB, sWords)``: for one sub-chunk, Γ fp32
        ``[16, K]`` row-major; the first of the four bf16 A operands ``[16, K]`` (q rows of products 0 and 1, then k
        rows of products 0 and 1, ``SUB * K`` elements apart); the first B operand ``[16, K]`` (product 0, rows 0-15
        of ``sQt``; product 1's is rows 0-15 of ``sKt``, ``C * K`` elements on); then each thread's
        :meth:`diag_pairs` and :meth:`diag_slots` words (Int32 ``[2, 256]``, after the small buffers); else None).
        ``sKh[0]`` is None in the unbounded form, and ``sKh[a]`` is a list of ``a`` tiles ``[16, K]``.
        """
        C, K = self.config.chunk_size, self.config.head_dim
        plan = self.smem_plan()
        tile = C * K * 2
        rows = smem.allocate(plan["rows"], REGION_ALIGN)
        reuse = smem.allocate(plan["reuse"], REGION_ALIGN)
        sAqk = smem.allocate_tensor(BFloat16, self.smem_layout(C, C), 1024)
        sA = smem.allocate_tensor(Float32, self.fp32_layout(C), 16)
        sGa, sBeta = self.small_buffers(smem)
        kc = self.smem_layout(C, K)
        sQt, sKt = carve(rows, 0, BFloat16, kc), carve(rows, tile, BFloat16, kc)
        sDiag = None
        if self.config.unbounded:
            # k̂ of anchor a: one [16, K] tile per sub-chunk j < a (block (a, j)'s B operand, tile a (a - 1) / 2 + j)
            sKh = [None] + [[carve(reuse, plan["kh"][a] + j * SUB * K * 2, BFloat16, self.smem_layout(SUB, K))
                             for j in range(a)] for a in range(1, NUM_SUB)]
            sDiag = (carve(reuse, plan["diag"], Float32, cute.make_layout((SUB, K), stride=(K, 1))),
                     carve(reuse, plan["diag_a"], BFloat16, self.smem_layout(SUB, K)),
                     cute.local_tile(sQt, (SUB, K), (0, 0)),
                     smem.allocate_tensor(Int32, cute.make_layout((2, self.num_threads), stride=(self.num_threads, 1)),
                                          16))
        else:
            sKh = [carve(reuse, plan["kh"][i], BFloat16, self.smem_layout(SUB * (i + 1), K)) for i in range(NUM_SUB)]
        sT = carve(reuse, 0, Float32, self.fp32_layout(C))
        sS = carve(reuse, plan["s"], Float32, self.fp32_layout(C, SUB))
        sTb = carve(reuse, plan["tb"], BFloat16, self.smem_layout(C, C))
        sW, sU = carve(reuse, 0, BFloat16, kc), carve(reuse, tile, BFloat16, kc)
        return sQt, sKt, sKh, sAqk, sTb, sA, sT, sS, sGa, sBeta, sW, sU, sDiag

    def smem_bytes(self) -> int:
        """Shared memory one CTA allocates (bytes; an upper bound that counts 1024-byte alignment of every tile):
        what decides how many CTAs fit on an SM."""
        C, K = self.config.chunk_size, self.config.head_dim
        small = (NUM_SUB + 1) * K * 4 + C * 4 + 2 * self.num_threads * 4 * self.config.unbounded  # sGa, sBeta, sWords
        plan = self.smem_plan()
        return align_up(plan["rows"]) + align_up(plan["reuse"]) + align_up(C * C * 2) + C * C * 4 + small

    @cute.jit
    def load_beta(self, mBeta: cute.Tensor, b: Int32, hv: Int32, start: Int32, valid: Int32,
                  tidx: Int32) -> Float32:
        """This thread's β input as loaded (fp32; 0 for ``tidx >= valid``), not yet activated: thread ``t < C``
        holds token ``t`` of the chunk. Issued before the chunk's other loads, so that its latency overlaps theirs
        (the thread that activated β right after loading it held up every warp at the next barrier)."""
        beta = Float32(0.0)
        if tidx < valid:
            beta = mBeta[b, start + tidx, hv].to(Float32)
        return beta

    @cute.jit
    def store_beta(self, sBeta: cute.Tensor, sAqk: cute.Tensor, beta_raw: Float32, valid: Int32, tidx: Int32):
        """``sBeta = β`` activated from :meth:`load_beta`'s ``beta_raw`` (0 past the end), and zeros in the blocks of
        ``sAqk`` above the diagonal."""
        C = self.config.chunk_size
        gate = self.config.gate
        if tidx < C:
            beta = beta_raw
            if tidx < valid:
                beta = activate_beta(beta_raw, gate.beta_sigmoid, gate.allow_neg_eigval)
            sBeta[tidx] = beta
        for i in cutlass.range_constexpr(C * C // self.num_threads):
            idx = tidx + i * self.num_threads
            row = idx // C
            col = idx % C
            if const_expr(self.config.unbounded):  # the diagonal blocks' upper triangles too
                if col > row:
                    sAqk[row, col] = BFloat16(0.0)
            else:
                if col // SUB > row // SUB:
                    sAqk[row, col] = BFloat16(0.0)

    @cute.jit
    def gate_prologue(self, mG: cute.Tensor, mDtBias: cute.Tensor | None, mALog: cute.Tensor | None,
                      mGLast: cute.Tensor, sStaging: cute.Tensor, sGa: cute.Tensor, rGam: cute.Tensor,
                      lower_bound: Float32, b: Int32, hv: Int32, chunk: Int32, start: Int32, valid: Int32,
                      tidx: Int32):
        """``Γ`` of the chunk from the raw gate: the runs of :func:`~.gate.gate_scan_segments` (consecutive tokens,
        each summed serially), offset by the earlier runs' totals in order, then times 1/ln 2.

        It works in column stages through a staging tile over ``sStaging`` (Tinv's fp32 buffers, free until the
        inverse: a stage is 64 columns wide, with room for the run totals): thread ``(run, column)`` scans its run,
        then the threads of :meth:`fill` copy their elements of the stage into ``rGam`` (``[passes, 8]``, zero for
        rows past the end). Each stage's raw values are loaded before the previous stage is scanned. It also writes
        ``sGa`` (``Γ[16 I]`` for each sub-chunk start, 0 past the end, and ``Γ_last``) and ``g_last[b, chunk, hv,
        :] = Γ[valid - 1]``. Ends with a barrier."""
        c = self.config
        gate = c.gate
        C, K = c.chunk_size, c.head_dim
        runs = gate_scan_segments(K, C)
        run_len = C // runs
        width = self.num_threads // runs  # columns per stage: one thread per (run, column)
        sStage = cute.make_tensor(sStaging.iterator, cute.make_layout((C, width), stride=(width, 1)))
        sTotal = cute.make_tensor(sStaging.iterator + C * width, cute.make_layout((runs, width), stride=(width, 1)))
        run = tidx // width
        column = tidx % width
        scale = Float32(1.0)
        if const_expr(gate.form != "none" and gate.has_A_log):
            scale = cute.math.exp(mALog[hv])
        tXcX = self.row_copy(K).get_slice(tidx).partition_S(cute.make_identity_tensor((C, K)))
        stages = K // width
        staged = [None] * stages
        for step in cutlass.range_constexpr(stages + 1):  # stage step's raw gate is loaded before step - 1 is scanned
            if const_expr(step < stages):  # unconditional loads (rows clamped into the chunk)
                rRaw = cute.make_rmem_tensor(cute.make_layout(run_len), mG.element_type)
                for i in cutlass.range_constexpr(run_len):
                    rRaw[i] = mG[b, start + cutlass.min(run * run_len + i, valid - 1), hv, step * width + column]
                staged[step] = rRaw
            if const_expr(step >= 1):
                self.gate_stage(mDtBias, mGLast, sGa, sStage, sTotal, rGam, staged[step - 1], tXcX, scale,
                                lower_bound, b, hv, chunk, valid, run, column, step - 1)

    @cute.jit
    def gate_stage(self, mDtBias: cute.Tensor | None, mGLast: cute.Tensor, sGa: cute.Tensor, sStage: cute.Tensor,
                   sTotal: cute.Tensor, rGam: cute.Tensor, rRaw: cute.Tensor, tXcX: cute.Tensor, scale: Float32,
                   lower_bound: Float32, b: Int32, hv: Int32, chunk: Int32, valid: Int32, run: Int32, column: Int32,
                   stage: cutlass.Constexpr):
        """One column stage of :meth:`gate_prologue`: the ``width`` columns of ``stage``, from ``rRaw`` (this
        thread's raw gate values, prefetched)."""
        c = self.config
        gate = c.gate
        C, K, VEC = c.chunk_size, c.head_dim, self.vec
        runs = gate_scan_segments(K, C)
        run_len = C // runs
        width = self.num_threads // runs
        col = stage * width + column
        bias = Float32(0.0)
        if const_expr(gate.has_dt_bias):
            bias = mDtBias[hv, col]
        running = Float32(0.0)
        for i in cutlass.range_constexpr(run_len):
            row = run * run_len + i
            # rows past the end add the activation of 0 (never stored)
            x = cutlass.select_(row < valid, rRaw[i].to(Float32), Float32(0.0))
            running = running + activate_gate(gate.form, x + bias, scale, lower_bound, mufu_softplus=True)
            sStage[row, column] = running
        sTotal[run, column] = running
        cute.arch.sync_threads()
        offset = Float32(0.0)
        for r in cutlass.range_constexpr(runs):
            if r < run:
                offset = offset + sTotal[r, column]
        for i in cutlass.range_constexpr(run_len):
            row = run * run_len + i
            gam = (sStage[row, column] + offset) * RCP_LN2
            sStage[row, column] = gam
            if row % SUB == 0:
                sGa[row // SUB, col] = cutlass.select_(row < valid, gam, Float32(0.0))
            if row == valid - 1:
                sGa[NUM_SUB, col] = gam
                mGLast[b, chunk, hv, col] = gam
        cute.arch.sync_threads()
        for p in cutlass.range_constexpr(self.passes):
            row, col0 = tXcX[(0, 0), p, 0]
            if col0 // width == stage:
                for j in cutlass.range_constexpr(VEC):
                    rGam[p, j] = cutlass.select_(row < valid, sStage[row, col0 % width + j], Float32(0.0))
        cute.arch.sync_threads()  # the stage is read before the next one is written

    def row_copy(self, cols: int):
        """Tiled copy of a [64, cols] bf16 tile: 16-byte accesses, rows spread over the CTA."""
        per_row = cols // self.vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(
            atom,
            cute.make_ordered_layout((self.num_threads // per_row, per_row), order=(1, 0)),
            cute.make_layout((1, self.vec)),
        )

    def chunk_rows(self, mX: cute.Tensor, b: Int32, head: Int32, start: Int32, cols: int) -> cute.Tensor:
        """The chunk's [64, cols] tile of ``mX[b, :, head, :]`` starting at token ``start`` (traced inline)."""
        C = self.config.chunk_size
        return cute.local_tile(cute.domain_offset((start, 0), mX[b, None, head, None]), (C, cols), (0, 0))

    @cute.jit
    def fill(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mQg: cute.Tensor, mKg: cute.Tensor,
             sGa: cute.Tensor, sBeta: cute.Tensor, sQt: cute.Tensor, sKt: cute.Tensor, sKh: list, rGam: cute.Tensor,
             b: Int32, h: Int32, hv: Int32, start: Int32, valid: Int32, tidx: Int32, operands: cutlass.Constexpr,
             diag=None):
        """Phase 1 (``operands``): the factored MMA operands q̃, k̃ (into ``sQt``, ``sKt``) and k̂ (``sKh``) into
        shared memory, and kg, qg to global memory. After the scores (not ``operands``): the right-hand sides
        bf16(β k 2^Γ), bf16(β v), over q̃ and k̃. ``rGam``: Γ of this thread's elements (:meth:`gate_prologue`).
        Each row pass's loads are issued one pass ahead: without that, a pass's loads would come after the previous
        pass's global stores (kg, qg), which the compiler may not move them above.

        ``diag`` (unbounded, with ``operands``): ``(sDiag, sAqk, sA, scale)``. A row pass is one sub-chunk:
        :meth:`diag_stage` makes its diagonal score blocks from the pass's registers. No diagonal k̂ is made, nor
        q̃, k̃ of sub-chunk 0."""
        c = self.config
        rhs = not operands
        C, K, VEC = c.chunk_size, c.head_dim, self.vec
        tiled_copy = self.row_copy(K)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        thr_copy = tiled_copy.get_slice(tidx)

        tXgQ = thr_copy.partition_S(self.chunk_rows(mQ, b, h, start, K)) if const_expr(operands) else None
        tXgK = thr_copy.partition_S(self.chunk_rows(mK, b, h, start, K))  # (CPY, passes, 1)
        tXgV = thr_copy.partition_S(self.chunk_rows(mV, b, hv, start, K)) if const_expr(rhs) else None
        tXgKg = thr_copy.partition_D(self.chunk_rows(mKg, b, hv, start, K)) if const_expr(operands) else None
        tXsQt = thr_copy.partition_D(sQt)  # q̃, later bf16(β k 2^Γ)
        tXsKt = thr_copy.partition_D(sKt)  # k̃, later bf16(β v)
        if const_expr(c.unbounded):  # (no k̂ for anchor 0: it would be a diagonal block's)
            tXsKh = [None] + [[thr_copy.partition_D(t) for t in s] for s in sKh[1:]]
        else:
            tXsKh = [thr_copy.partition_D(s) for s in sKh]
        tXcX = thr_copy.partition_S(cute.make_identity_tensor((C, K)))  # (row, column) of every element
        vec_layout = cute.make_layout(VEC)
        staged = [None] * self.passes
        for step in cutlass.range_constexpr(self.passes + 1):
            if const_expr(step < self.passes):  # load pass `step`
                row, col0 = tXcX[(0, 0), step, 0]  # this thread's row and first of its 8 columns in the pass
                rQ = cute.make_rmem_tensor(vec_layout, BFloat16)
                rK = cute.make_rmem_tensor(vec_layout, BFloat16)
                rV = cute.make_rmem_tensor(vec_layout, BFloat16)
                rG = cute.make_rmem_tensor(vec_layout, Float32)  # (set from rGam below: see there)
                if const_expr(operands):
                    rQ.fill(0.0)
                rK.fill(0.0)
                if const_expr(rhs):
                    rV.fill(0.0)
                rG.fill(0.0)
                if row < valid:
                    if const_expr(operands):
                        cute.copy(atom, tXgQ[None, step, 0], rQ)
                    cute.copy(atom, tXgK[None, step, 0], rK)
                    if const_expr(rhs):
                        cute.copy(atom, tXgV[None, step, 0], rV)
                staged[step] = (rQ, rK, rV, rG)
            if const_expr(step >= 1):  # the work of pass step - 1
                p = step - 1
                rQ, rK, rV, rG = staged[p]
                row, col0 = tXcX[(0, 0), p, 0]
                sub = p * self.rows_per_pass // SUB  # the row's sub-chunk (compile-time: rows_per_pass divides 16)
                # q̃, k̃ of this pass (unbounded: not for sub-chunk 0, which no score block reads; its bytes hold the
                # diagonal blocks' B operands)
                tilde = operands and not (c.unbounded and sub == 0)
                # Γ of the pass (zero past the end) copied into a zeroed register tile before the L2 norm: the same
                # values as rGam, but the order of the traced operations decides the SASS, and this is the order of
                # the kernel that ran on the H200 (when Γ could also be loaded from a precomputed g_cum here)
                for j in cutlass.range_constexpr(VEC):
                    rG[j] = rGam[p, j]
                if const_expr(c.l2norm):  # the row's 16 threads
                    if const_expr(operands):
                        self.l2norm_row(rQ)
                    self.l2norm_row(rK)
                beta = sBeta[row]
                rQt = cute.make_rmem_tensor(vec_layout, BFloat16)
                rKt = cute.make_rmem_tensor(vec_layout, BFloat16)
                rKb = cute.make_rmem_tensor(vec_layout, BFloat16)
                rVb = cute.make_rmem_tensor(vec_layout, BFloat16)
                rKg = cute.make_rmem_tensor(vec_layout, BFloat16)
                rQg = cute.make_rmem_tensor(vec_layout, BFloat16)
                rKh = [cute.make_rmem_tensor(vec_layout, BFloat16) for _ in range(NUM_SUB)]
                for j in cutlass.range_constexpr(VEC):
                    g = rG[j]
                    if const_expr(operands):
                        q = rQ[j].to(Float32)
                    k = rK[j].to(Float32)
                    if const_expr(tilde):
                        row_factor = cute.math.exp2(cutlass.min(g - sGa[sub, col0 + j], EXP2_CLAMP), fastmath=True)
                    decay = cute.math.exp2(g, fastmath=True)
                    if const_expr(tilde):
                        rQt[j] = (q * row_factor).to(BFloat16)
                        rKt[j] = (k * row_factor).to(BFloat16)
                    if const_expr(rhs):
                        rKb[j] = (beta * k * decay).to(BFloat16)
                        rVb[j] = (beta * rV[j].to(Float32)).to(BFloat16)
                    if const_expr(operands):
                        last = cute.math.exp2(cutlass.min(sGa[NUM_SUB, col0 + j] - g, EXP2_CLAMP), fastmath=True)
                        rKg[j] = (k * last).to(BFloat16)
                        rQg[j] = (q * decay).to(BFloat16)
                        for a in cutlass.range_constexpr(sub + int(c.unbounded), NUM_SUB):
                            col_factor = cute.math.exp2(cutlass.min(sGa[a, col0 + j] - g, EXP2_CLAMP), fastmath=True)
                            rKh[a][j] = (k * col_factor).to(BFloat16)
                if const_expr(tilde):
                    cute.copy(atom, rQt, tXsQt[None, p, 0])
                    cute.copy(atom, rKt, tXsKt[None, p, 0])
                if const_expr(rhs):
                    cute.copy(atom, rKb, tXsQt[None, p, 0])
                    cute.copy(atom, rVb, tXsKt[None, p, 0])
                if const_expr(operands):
                    for a in cutlass.range_constexpr(sub + int(c.unbounded), NUM_SUB):
                        if const_expr(c.unbounded):  # (sub-chunk p's own tile: its only pass)
                            cute.copy(atom, rKh[a], tXsKh[a][p][None, 0, 0])
                        else:
                            cute.copy(atom, rKh[a], tXsKh[a][None, p, 0])
                    if row < valid:
                        cute.copy(atom, rKg, tXgKg[None, p, 0])
                        tXgQg = thr_copy.partition_D(self.chunk_rows(mQg, b, hv, start, K))
                        cute.copy(atom, rQg, tXgQg[None, p, 0])
                if const_expr(diag is not None):
                    self.diag_stage(diag, sBeta, rQ, rK, rG, row, col0, p, tidx)

    @cute.jit
    def diag_stage(self, diag: tuple, sBeta: cute.Tensor, rQ: cute.Tensor, rK: cute.Tensor, rG: cute.Tensor,
                   row: Int32, col0: Int32, sub: cutlass.Constexpr, tidx: Int32):
        """Unbounded form, end of the fill's row pass ``sub`` (this thread: token ``r = row % 16`` of the sub-chunk,
        columns ``col0 + 0..7``; ``rQ``, ``rK`` bf16 as the kernel uses them, ``rG`` Γ). Aqk's diagonal entry
        ``bf16(scale q_r·k_r)`` (fp32 dot over the row's threads); Γ of the row into the staging ``sDG``; behind a
        barrier, the token's role at each level (:func:`~.diag_levels.level_slots`) into the products' operands:
        as a row of its anchor ``m``, ``bf16(q_r 2^(Γr - Γm))`` and ``bf16(k_r 2^(Γr - Γm))`` (A operands of Aqk and
        Akk), as a column ``bf16(k_r 2^(Γm - Γr))`` (the B operand both share), each factor made once as
        ``2^-|Γr - Γm|``, in a runtime loop over the 4 levels (its slots from :meth:`diag_slots`; unrolled, the
        levels' code was 4 times larger and, interleaved with the fill's, spilled); behind a second barrier,
        :meth:`diag_block`. The staging and the operands are written again only after the next sub-chunk's first
        barrier, which every thread reaches after its products: two barriers per sub-chunk."""
        (sDG, sDA, sDB, sWords), sAqk, sA, scale = diag
        VEC, K = self.vec, self.config.head_dim
        dot = Float32(0.0)
        for j in cutlass.range_constexpr(VEC):
            dot = dot + rQ[j].to(Float32) * rK[j].to(Float32)
        dot = cute.arch.warp_reduction_sum(dot, threads_in_group=self.threads_per_row)
        if tidx % self.threads_per_row == 0:
            sAqk[row, row] = Float32(dot * scale).to(BFloat16)
        r = row % SUB
        group = col0 // VEC
        vec_layout = cute.make_layout((1, VEC))
        cute.local_tile(sDG, (1, VEC), (r, group)).store(cute.make_tensor(rG.iterator, vec_layout).load())
        cute.arch.sync_threads()
        tile = SUB * K
        b_stride = self.config.chunk_size * K  # product 1's B operand: rows 0-15 of sKt, which follows sQt
        slots = sWords[1, tidx]
        for level in cutlass.range(LEVELS, unroll=1):
            product = cutlass.select_(level < 2, Int32(level_product(0)), Int32(level_product(LEVELS - 1)))
            slot = (slots >> (4 * level)) & 15
            is_row = (r >> level) & 1 == 1
            anchor = ((r >> level) | 1) << level
            rM = cute.local_tile(sDG, (1, VEC), (anchor, group)).load()
            rF = cute.make_rmem_tensor(vec_layout, Float32)
            for j in cutlass.range_constexpr(VEC):
                # a row's exponent Γr - Γm and a column's Γm - Γr are both -|Γr - Γm| for a non-increasing Γ;
                # past the end (Γ = 0) the factor multiplies a zero q and k, and it is <= 1 for any Γ
                rF[0, j] = cute.math.exp2(-abs(rG[j] - rM[0, j]), fastmath=True)
            # bf16(k_r f), k_r's row or column, and bf16(q_r f), as whole vectors (rounded in pairs)
            rKf = cute.make_rmem_tensor(vec_layout, BFloat16)
            rKf.store((cute.make_tensor(rK.iterator, vec_layout).load().to(Float32) * rF.load()).to(BFloat16))
            if is_row:
                rQf = cute.make_rmem_tensor(vec_layout, BFloat16)
                rQf.store((cute.make_tensor(rQ.iterator, vec_layout).load().to(Float32) * rF.load()).to(BFloat16))
                sAq = cute.make_tensor(sDA.iterator + cute.assume(product * tile, divby=tile), sDA.layout)
                sAk = cute.make_tensor(sDA.iterator + cute.assume((2 + product) * tile, divby=tile), sDA.layout)
                cute.local_tile(sAq, (1, VEC), (slot, group)).store(rQf.load())
                cute.local_tile(sAk, (1, VEC), (slot, group)).store(rKf.load())
            else:
                sB = cute.make_tensor(sDB.iterator + cute.assume(product * b_stride, divby=b_stride), sDB.layout)
                cute.local_tile(sB, (1, VEC), (slot, group)).store(rKf.load())
        cute.arch.sync_threads()
        self.diag_block(sDA, sDB, sBeta, sAqk, sA, scale, sWords[0, tidx], sub, tidx)

    @staticmethod
    def signed_words(values) -> tuple[int, int]:
        """:func:`~.diag_levels.pack_nibbles` of ``values`` as signed 32-bit words."""
        return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in pack_nibbles(values))

    @staticmethod
    def diag_words() -> list:
        """Per product of :func:`~.diag_levels.diag_products`: the packed (:func:`~.diag_levels.pack_nibbles`, as
        signed 32-bit words) row tokens, row anchors, column tokens and column anchors."""
        return [[KdaIntra.signed_words(slot[which] for slot in slots) for slots in (rows, cols) for which in (0, 1)]
                for rows, cols in diag_products()]

    @staticmethod
    def diag_mma() -> cute.TiledMma:
        """The diagonal blocks' product tile: one bf16 m16n8k16 atom (16 x 8 outputs per warp)."""
        return cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1))

    @cute.jit
    def diag_slots(self, tidx: Int32) -> Int32:
        """Unbounded form: the slot (:func:`~.diag_levels.level_slots`) of this thread's token of a sub-chunk
        (``tidx // 16``) at each level, 4 bits per level (level ``b`` in bits ``4 b``)."""
        r = (tidx // self.threads_per_row) % SUB
        slots = Int32(0)
        for level in cutlass.range_constexpr(LEVELS):
            table = level_slots()[level]
            slot = r
            if const_expr(table != tuple(range(SUB))):
                slot = self.diag_slot(tuple(Int32(w) for w in self.signed_words(table)), r)
            slots = slots | (slot << (4 * level))
        return slots

    @cute.jit
    def diag_pairs(self, tidx: Int32) -> Int32:
        """Unbounded form: which pair of a diagonal block each of this thread's four accumulator elements in
        :meth:`diag_block` is, packed (element ``e`` in bits ``8 e``: row token ``<< 4 |`` column token), 0 for an
        output that is no pair (a pair has row token > column token). The same for every sub-chunk: made once,
        before the fill, and kept in shared memory (``sWords``), each sub-chunk reading it back behind its barriers
        (a value kept in a register across the fill made the compiler keep, and spill, the addresses derived from
        it)."""
        warp_idx = tidx // 32
        product = (warp_idx // 2) % 2
        half = warp_idx % 2
        words = self.diag_words()
        # row tokens, row anchors, column tokens, column anchors of this warp's product
        rtok, ranc, ctok, canc = (tuple(cutlass.select_(product == 0, Int32(words[0][t][h]), Int32(words[1][t][h]))
                                        for h in range(2)) for t in range(4))
        tCcC = self.diag_mma().get_slice(tidx % 32).partition_C(cute.make_identity_tensor((SUB, SUB // 2)))
        packed = Int32(0)
        for e in cutlass.range_constexpr(cute.size(tCcC)):
            rs, cs = tCcC[e]
            cs = cs + half * (SUB // 2)
            pair = (self.diag_slot(rtok, rs) << 4) | self.diag_slot(ctok, cs)
            pair = cutlass.select_(self.diag_slot(ranc, rs) == self.diag_slot(canc, cs), pair, Int32(0))
            packed = packed | (pair << (8 * e))
        return packed

    @cute.jit
    def diag_block(self, sDA: cute.Tensor, sDB: cute.Tensor, sBeta: cute.Tensor, sAqk: cute.Tensor,
                   sA: cute.Tensor, scale: Float32, pairs: Int32, sub: cutlass.Constexpr, tidx: Int32):
        """Unbounded form: the strict lower part of the diagonal blocks ``(sub, sub)`` of Aqk (scaled, bf16) and Akk
        (β-scaled, fp32) from the operands :meth:`diag_stage` built, on all 8 warps, one code path: warp ``w`` makes
        the 8 column slots ``8 (w % 2) ..`` of product ``(w // 2) % 2`` of Aqk (``w < 4``) or Akk (16 x 8 x K, bf16
        m16n8k16 from ldmatrix, fp32 accumulation) and writes the outputs that are pairs of the block (``pairs``,
        from :meth:`diag_pairs`)."""
        C, K = self.config.chunk_size, self.config.head_dim
        warp_idx = tidx // 32
        lane = tidx % 32
        qk = warp_idx < 4
        product = (warp_idx // 2) % 2
        half = warp_idx % 2
        # the A operand: q rows (Aqk) or k rows (Akk) of the product; the B operand: 8 column slots of the product's
        # (rows 8 half.. of a swizzled tile: an offset of whole 8-row atoms, outside the swizzle's bits)
        offset_A = (cutlass.select_(qk, Int32(0), Int32(2)) + product) * (SUB * K)
        sX = cute.make_tensor(sDA.iterator + cute.assume(offset_A, divby=SUB * K), sDA.layout)
        half_layout = cute.local_tile(sDB, (SUB // 2, K), (0, 0)).layout
        offset_B = product * (C * K) + half * (SUB // 2 * 64)
        sY = cute.make_tensor(sDB.iterator + cute.assume(offset_B, divby=SUB // 2 * 64), half_layout)
        mma = self.diag_mma()
        thr_mma = mma.get_slice(lane)
        copy_A = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16), mma
        ).get_slice(lane)
        copy_B = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=2), BFloat16), mma
        ).get_slice(lane)
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sX))
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sY))
        tCsA, tCrA_view = copy_A.partition_S(sX), copy_A.retile(tCrA)
        tCsB, tCrB_view = copy_B.partition_S(sY), copy_B.retile(tCrB)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((SUB, SUB // 2)), Float32)
        acc.fill(0.0)
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            cute.copy(copy_A, tCsA[None, None, kb], tCrA_view[None, None, kb])
            cute.copy(copy_B, tCsB[None, None, kb], tCrB_view[None, None, kb])
            cute.gemm(mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
        for e in cutlass.range_constexpr(cute.size(acc)):
            pair = (pairs >> (8 * e)) & 255
            i = pair >> 4
            j = pair & 15
            if i > j:
                row = sub * SUB + i
                col = sub * SUB + j
                if qk:
                    sAqk[row, col] = Float32(acc[e] * scale).to(BFloat16)
                else:
                    sA[row, col] = Float32(acc[e] * sBeta[row])

    @staticmethod
    def diag_slot(words: tuple, slot: Int32) -> Int32:
        """Entry ``slot`` (0..15) of a table packed by :func:`~.diag_levels.pack_nibbles` (traced inline)."""
        shift = (slot % 8) * 4
        return cutlass.select_(slot < 8, (words[0] >> shift) & 15, (words[1] >> shift) & 15)

    @cute.jit
    def l2norm_row(self, rX: cute.Tensor):
        """``rX <- bf16(x * rsqrt(sum(x^2) + eps))`` over the row whose ``vec`` values this thread holds with
        ``K / vec`` neighbouring lanes (zeros stay zeros)."""
        x = rX.load().to(Float32)
        sum_sq = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        sum_sq = cute.arch.warp_reduction_sum(sum_sq, threads_in_group=self.threads_per_row)
        rX.store((x * cute.math.rsqrt(sum_sq + L2NORM_EPS)).to(BFloat16))

    @cute.jit
    def scores(self, block_mma: cute.TiledMma, sQt: cute.Tensor, sKt: cute.Tensor, sKh: list, sBeta: cute.Tensor,
               sAqk: cute.Tensor, sA: cute.Tensor, scale: Float32, tidx: Int32):
        """Phase 2: the 10 lower 16x16 blocks of Aqk (bf16, scaled, masked j <= i; warps 0-3) and Akk (fp32,
        β-scaled, masked j < i; warps 4-7) on warp MMA; block (I, J) uses q̃/k̃ rows of sub-chunk I and k̂ rows of
        sub-chunk J for anchor I."""
        K = self.config.head_dim
        warp_idx = tidx // 32
        lane = tidx % 32
        thr_mma = block_mma.get_slice(lane)
        ld_atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        copy_A = cute.make_tiled_copy_A(ld_atom, block_mma).get_slice(lane)
        copy_B = cute.make_tiled_copy_B(ld_atom, block_mma).get_slice(lane)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((SUB, SUB)))
        # (I, J) blocks of warps w and w + 4: 3, 3, 2, 2 blocks
        assignment = (((0, 0), (3, 0), (3, 1)), ((1, 0), (1, 1), (3, 2)), ((2, 0), (2, 1)), ((2, 2), (3, 3)))
        for w in cutlass.range_constexpr(self.num_threads // 32):
            qk = w < len(assignment)  # this warp's product: Aqk, else Akk
            if warp_idx == w:
                for bi, bj in assignment[w % len(assignment)]:
                    sXI = cute.local_tile(sQt if qk else sKt, (SUB, K), (bi, 0))
                    sKJ = cute.local_tile(sKh[bi], (SUB, K), (bj, 0))
                    tCrX = thr_mma.make_fragment_A(thr_mma.partition_A(sXI))
                    tCrKh = thr_mma.make_fragment_B(thr_mma.partition_B(sKJ))
                    cute.copy(copy_A, copy_A.partition_S(sXI), copy_A.retile(tCrX))
                    cute.copy(copy_B, copy_B.partition_S(sKJ), copy_B.retile(tCrKh))
                    acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((SUB, SUB)), Float32)
                    acc.fill(0.0)
                    cute.gemm(block_mma, acc, tCrX, tCrKh, acc)
                    for e in cutlass.range_constexpr(cute.size(acc)):
                        i, j = tCcC[e]
                        row = bi * SUB + i
                        col = bj * SUB + j
                        if const_expr(qk):
                            aqk = Float32(acc[e] * scale)
                            if const_expr(bi == bj):
                                aqk = Float32(cutlass.select_(j <= i, aqk, Float32(0.0)))
                            sAqk[row, col] = aqk.to(BFloat16)
                        else:
                            akk = Float32(acc[e] * sBeta[row])
                            if const_expr(bi == bj):
                                akk = Float32(cutlass.select_(j < i, akk, Float32(0.0)))
                            sA[row, col] = akk

    @cute.jit
    def scores_below(self, sQt: cute.Tensor, sKh: list, sBeta: cute.Tensor, sAqk: cute.Tensor, sA: cute.Tensor,
                     scale: Float32, tidx: Int32):
        """Unbounded form, phase 2: the 6 blocks below the diagonal (the fill made the diagonal ones) of Aqk (bf16,
        scaled; warps 0-3) and Akk (fp32, β-scaled; warps 4-7), each as 12 products of 16 x 8 x K (a block's two
        column halves, :meth:`diag_mma`), three per warp in a runtime loop, one code path for all warps. Block
        ``b`` = (I, J) (``I(I - 1)/2 + J = b``) takes q̃ or k̃ rows of sub-chunk I and k̂ tile ``b``
        (:meth:`smem_buffers`): every operand a runtime offset of one tile layout."""
        C, K = self.config.chunk_size, self.config.head_dim
        warp_idx = tidx // 32
        lane = tidx % 32
        qk = warp_idx < 4
        blocks = NUM_SUB * (NUM_SUB - 1) // 2
        # sub-chunk I's rows of q̃ (Aqk) or k̃ (Akk, in sKt, C x K elements on): 2 I row atoms of 8 x 64 on
        rows_layout = cute.local_tile(sQt, (SUB, K), (0, 0)).layout
        sKh0 = sKh[1][0]  # k̂ tile 0; tile b lies SUB x K elements after tile b - 1
        half_layout = cute.local_tile(sKh0, (SUB // 2, K), (0, 0)).layout
        mma = self.diag_mma()
        thr_mma = mma.get_slice(lane)
        copy_A = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16), mma
        ).get_slice(lane)
        copy_B = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=2), BFloat16), mma
        ).get_slice(lane)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((SUB, SUB // 2)))
        per_warp = 2 * blocks // (self.num_threads // 64)
        for t in cutlass.range(per_warp, unroll=1):
            item = (warp_idx % 4) * per_warp + t
            b = item // 2
            half = item % 2
            # b = I (I - 1) / 2 + J (arithmetic: offsets from a shifted table word lose their known alignment)
            bi = Int32(1)
            for i in cutlass.range_constexpr(2, NUM_SUB):
                bi = bi + cutlass.select_(b >= i * (i - 1) // 2, Int32(1), Int32(0))
            bj = b - bi * (bi - 1) // 2
            offset_A = cutlass.select_(qk, Int32(0), Int32(C * K)) + bi * (2 * 8 * 64)
            sX = cute.make_tensor(sQt.iterator + cute.assume(offset_A, divby=2 * 8 * 64), rows_layout)
            offset_B = b * (SUB * K) + half * (8 * 64)
            sY = cute.make_tensor(sKh0.iterator + cute.assume(offset_B, divby=8 * 64), half_layout)
            tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sX))
            tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sY))
            tCsA, tCrA_view = copy_A.partition_S(sX), copy_A.retile(tCrA)
            tCsB, tCrB_view = copy_B.partition_S(sY), copy_B.retile(tCrB)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((SUB, SUB // 2)), Float32)
            acc.fill(0.0)
            for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                cute.copy(copy_A, tCsA[None, None, kb], tCrA_view[None, None, kb])
                cute.copy(copy_B, tCsB[None, None, kb], tCrB_view[None, None, kb])
                cute.gemm(mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
            # the thread's outputs: two rows, two adjacent columns each (accumulator elements 2 h, 2 h + 1), stored
            # as one bf16 pair (Aqk) or one fp32 pair (Akk)
            row0, col0 = tCcC[0]
            row = bi * SUB + row0
            col = bj * SUB + half * (SUB // 2) + col0
            pair = cute.make_layout((1, 2))
            for h in cutlass.range_constexpr(cute.size(acc) // 2):
                r_h = row + h * (SUB // 2)
                if qk:
                    rP = cute.make_rmem_tensor(pair, BFloat16)
                    rP.store((cute.make_tensor(acc.iterator + 2 * h, pair).load() * scale).to(BFloat16))
                    cute.local_tile(sAqk, (1, 2), (r_h, col // 2)).store(rP.load())
                else:
                    rP = cute.make_rmem_tensor(pair, Float32)
                    rP.store(cute.make_tensor(acc.iterator + 2 * h, pair).load() * sBeta[r_h])
                    cute.local_tile(sA, (1, 2), (r_h, col // 2)).store(rP.load())

    @cute.jit
    def inverse(self, sA: cute.Tensor, sT: cute.Tensor, sS: cute.Tensor, sTb: cute.Tensor, tidx: Int32):
        """Phase 3: ``sT = (I + A)^-1`` (lower part) in fp32, then ``sTb = bf16(sT)`` with zeros above the diagonal.
        Starts and ends with all of the CTA's threads in step (it ends with a barrier). The off-diagonal
        substitution has compile-time loop bounds: every thread runs all of a block row's terms (unrolled, so its
        independent sums interleave) and keeps those of its lower-triangular range by selection."""
        C = self.config.chunk_size
        # diagonal blocks: thread (D, col) solves (I + A_DD) x = e_col by forward substitution, x in registers
        if tidx < NUM_SUB * SUB:
            base = (tidx // SUB) * SUB
            col = tidx % SUB
            xs = []
            for i in cutlass.range_constexpr(SUB):
                acc = cutlass.select_(col == i, Float32(1.0), Float32(0.0))
                for m in cutlass.range_constexpr(i):
                    acc = acc - sA[base + i, base + m] * xs[m]
                xs.append(acc)
                sT[base + i, base + col] = acc
        cute.arch.sync_threads()
        # off-diagonal blocks, block row I at a time: S = Σ_{M=J}^{I-1} A_IM Tinv_MJ, then Tinv_IJ = -Tinv_II S
        for bi in cutlass.range_constexpr(1, NUM_SUB):
            width = bi * SUB  # columns of block row I left of its diagonal block
            for e in cutlass.range_constexpr(SUB * width // self.num_threads):
                idx = tidx + e * self.num_threads
                r = idx // width
                x = idx % width
                acc = Float32(0.0)
                lo = (x // SUB) * SUB  # Tinv_MJ is zero above the diagonal: skip M < J
                for y in cutlass.range_constexpr(width):
                    acc = cutlass.select_(y >= lo, acc + sA[width + r, y] * sT[y, x], acc)
                sS[r, x] = acc
            cute.arch.sync_threads()
            for e in cutlass.range_constexpr(SUB * width // self.num_threads):
                idx = tidx + e * self.num_threads
                r = idx // width
                x = idx % width
                acc = sS[r, x]
                for y in cutlass.range_constexpr(SUB):
                    acc = cutlass.select_(y < r, acc + sT[width + r, width + y] * sS[y, x], acc)
                sT[width + r, x] = -acc
            cute.arch.sync_threads()
        for e in cutlass.range_constexpr(C * C // self.num_threads):
            idx = tidx + e * self.num_threads
            row = idx // C
            col = idx % C
            t = Float32(0.0)
            if col <= row:
                t = sT[row, col]
            sTb[row, col] = t.to(BFloat16)
        cute.arch.sync_threads()

    @cute.jit
    def wu(self, wu_mma: cute.TiledMma, sTb: cute.Tensor, sKb: cute.Tensor, sVb: cute.Tensor, sW: cute.Tensor,
           sU: cute.Tensor, tidx: Int32):
        """Phase 4: ``sW = Tinv · sKb`` and ``sU = Tinv · sVb`` (bf16 operands, fp32 accumulation), rounded to bf16.
        ``sW`` and ``sU`` lie over the fp32 Tinv, free since the inverse."""
        C, K = self.config.chunk_size, self.config.head_dim
        thr_mma = wu_mma.get_slice(tidx)
        ld_atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        ldt_atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        copy_A = cute.make_tiled_copy_A(ld_atom, wu_mma).get_slice(tidx)
        copy_B = cute.make_tiled_copy_B(ldt_atom, wu_mma).get_slice(tidx)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16)
        copy_C = cute.make_tiled_copy_C(st_atom, wu_mma).get_slice(tidx)
        tCrT = thr_mma.make_fragment_A(thr_mma.partition_A(sTb))
        cute.copy(copy_A, copy_A.partition_S(sTb), copy_A.retile(tCrT))
        transposed = cute.make_layout((K, C), stride=(C, 1))  # (feature, token) view of a [token, feature] tile
        for sRhs, sOut in ((sKb, sW), (sVb, sU)):
            sRhsT = cute.composition(sRhs, transposed)
            tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sRhsT))
            tCsB = copy_B.partition_S(sRhsT)
            tCrB_view = copy_B.retile(tCrB)
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((C, K)), Float32)
            acc.fill(0.0)
            for kb in cutlass.range_constexpr(cute.size(tCrB, mode=[2])):
                cute.copy(copy_B, tCsB[None, None, kb], tCrB_view[None, None, kb])
                cute.gemm(wu_mma, acc, tCrT[None, None, kb], tCrB[None, None, kb], acc)
            rOut = cute.make_fragment_like(acc, BFloat16)
            rOut.store(acc.load().to(BFloat16))
            cute.copy(copy_C, copy_C.retile(rOut), copy_C.partition_D(sOut))

    @cute.jit
    def store_rows(self, sX: cute.Tensor, mX: cute.Tensor, b: Int32, hv: Int32, start: Int32, valid: Int32,
                   cols: cutlass.Constexpr, tidx: Int32):
        """``mX[b, start + r, hv, :] = sX[r, :]`` for the chunk's rows ``r < valid`` of a bf16 ``[64, cols]`` shared
        tile, through registers, 16 bytes per access."""
        C = self.config.chunk_size
        per_row = cols // self.vec
        rows_per_pass = self.num_threads // per_row
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        thr_copy = self.row_copy(cols).get_slice(tidx)
        gX = self.chunk_rows(mX, b, hv, start, cols)
        tXsX = thr_copy.partition_S(sX)
        tXgX = thr_copy.partition_D(gX)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor((C, cols)))
        for p in cutlass.range_constexpr(C // rows_per_pass):
            if tXcX[(0, 0), p, 0][0] < valid:
                rX = cute.make_rmem_tensor(cute.make_layout(self.vec), BFloat16)
                cute.copy(atom, tXsX[None, p, 0], rX)
                cute.copy(atom, rX, tXgX[None, p, 0])


# positions of the outputs among the tensor arguments: w, u, qg, kg, Aqk, g_last
_OUTPUTS = frozenset((*range(5, 10), 14))


@functools.lru_cache(maxsize=256)
def _plan(H: int, HV: int, varlen: bool, l2norm: bool, gate: InKernelGate, unbounded: bool) -> tuple:
    """The config and argument specs of one call signature (cached: no work per call)."""
    config = KdaIntraConfig(num_heads=H, num_v_heads=HV, gate=gate, varlen=varlen, l2norm=l2norm,
                            unbounded=unbounded)
    ok, reason = KdaIntra.can_implement(config)
    if not ok:
        raise ValueError(f"KdaIntra: {reason}")
    return config, KdaIntra(config).argument_specs()


def chunk_kda_fwd_intra_from_raw(
    q,
    k,
    v,
    g,
    beta,
    scale: float,
    *,
    A_log=None,
    dt_bias=None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = True,
    cu_seqlens=None,
    chunk_indices=None,
):
    """KDA chunk intra on the GPU from the raw inputs, in one launch (KDA_SPEC §2, §3.1-3.4, §3.8): ``(w, u, qg,
    kg, Aqk, g_last)``. The cutedsl backend's intra step.

    Args:
        q, k: ``[B, T, H, 128]`` bf16, raw (L2-normalised here with ``use_qk_l2norm_in_kernel``); v:
            ``[B, T, HV, 128]`` bf16.
        g: ``[B, T, HV, 128]`` bf16 or fp32: the raw gate (``use_gate_in_kernel``) or the log-gate (any finite
            value <= 0); its chunk-local cumsum is taken here.
        beta: ``[B, T, HV]`` bf16 or fp32, logits with ``use_beta_sigmoid_in_kernel``.
        scale: folded into Aqk.
        A_log: ``[HV]``; dt_bias: ``[HV * K]`` or ``[HV, K]`` (cast to fp32). Used only with ``use_gate_in_kernel``.
        lower_bound: selects the safe (lower-bound) gate form ``lower_bound * sigmoid(exp(A_log) (g + dt_bias))``
            when ``use_gate_in_kernel``; None: softplus, ``-exp(A_log) softplus(g + dt_bias)``.
        allow_neg_eigval: β = ``2 sigmoid(beta)`` (needs ``use_beta_sigmoid_in_kernel``).
        safe_gate: a precomputed log-gate lies in [-5, 0] at every step. Which kernel form runs follows
            :func:`cula_runtime.kda_args.gate_is_bounded`: the safe-gate form (diagonal blocks anchored at each
            sub-chunk's first row) for the lower-bound form with ``lower_bound >= -5`` or a precomputed g with
            ``safe_gate``; the unbounded form (:attr:`KdaIntraConfig.unbounded`) for the softplus form,
            ``lower_bound < -5`` and a precomputed g without ``safe_gate``.
        cu_seqlens: int32 ``[N + 1]`` for packed sequences (B must be 1). Read on the device and clamped there
            into ``[0, T]`` (:func:`~.tiles.chunk_span`): values unlike those ``chunk_indices`` was built from give
            wrong outputs, never an access outside a tensor.
        chunk_indices: int32 ``[NT, 2]`` from :func:`cula_runtime.index.prepare_chunk_indices` (computed when None).

    Returns:
        w, qg, kg ``[B, T, HV, K]``; u ``[B, T, HV, V]``; Aqk ``[B, T, HV, 64]`` (scale folded in, zero above the
        diagonal): all bf16 in FLA's layouts (KDA_SPEC §3.8; ``qg = q 2^Γ`` without scale); and ``g_last`` fp32
        ``[B, NT, HV, K]`` (varlen ``[1, NC, HV, K]``, one row per row of ``chunk_indices``): the cumulative gate in
        log2 units at each chunk's last valid token, for
        :func:`~cula_runtime.cute.kda.recurrence.chunk_kda_fwd_recurrence`. Launched on the current stream; the
        first call per configuration compiles (:func:`cula_runtime.cute.compile_cache.compile_records`).
    """
    import torch

    if q.dim() != 4 or q.shape[3] != 128:
        raise ValueError(f"q must be [B, T, H, 128] (the kernel serves K = V = 128), got {tuple(q.shape)}")
    B, T, H, K = q.shape
    HV = v.shape[2]
    bf16 = torch.bfloat16
    named = {"q": (q, H, K, bf16), "k": (k, H, K, bf16), "v": (v, HV, K, bf16), "g": (g, HV, K, g.dtype),
             "beta": (beta, HV, None, beta.dtype)}
    check_token_tensors(named, B, T)
    dtypes = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be bfloat16 or float32, got {t.dtype}")
    device = q.device
    form, A_log, dt_bias = gate_arguments(use_gate_in_kernel, lower_bound, A_log, dt_bias, allow_neg_eigval,
                                          use_beta_sigmoid_in_kernel, HV, K, device)
    chunk_indices, num_chunks = chunk_rows(cu_seqlens, chunk_indices, B, T, device)
    from ...kda_args import SAFE_GATE_LOWER_BOUND_MIN

    if use_gate_in_kernel:
        bounded = lower_bound is not None and lower_bound >= SAFE_GATE_LOWER_BOUND_MIN
    else:
        bounded = bool(safe_gate)
    return _intra_from_raw(q, k, v, g, beta, scale, form, A_log, dt_bias, lower_bound,
                           bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval),
                           cu_seqlens, chunk_indices, num_chunks, unbounded=not bounded)


def _intra_from_raw(q, k, v, g, beta, scale: float, form: str, A_log, dt_bias, lower_bound: float | None,
                    l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool, cu_seqlens, chunk_indices,
                    num_chunks: int, out=None, unbounded: bool = False) -> tuple:
    """:func:`chunk_kda_fwd_intra_from_raw` after its argument checks (``form``, ``A_log``, ``dt_bias`` from
    :func:`~.gate.gate_arguments`; g and beta bf16 or fp32; ``chunk_indices`` and ``num_chunks`` from
    :func:`~cula_runtime.cute.varlen.chunk_rows`; ``unbounded``: the kernel form for gates outside [-5, 0]): plan,
    allocate the outputs unless ``out`` (the caller's own, unchecked: the cutedsl backend carves them from its
    workspace) and launch."""
    import torch

    B, T, H, K = q.shape
    HV = v.shape[2]
    device = q.device
    varlen = cu_seqlens is not None
    config, specs = _plan(H, HV, varlen, l2norm, _gate_config(form, g, beta, A_log, dt_bias, beta_sigmoid,
                                                                allow_neg_eigval), bool(unbounded))
    if out is not None:
        w, u, qg, kg, Aqk, g_last = out
    else:
        bf16 = torch.bfloat16
        w, u, qg, kg = (torch.empty(B, T, HV, K, dtype=bf16, device=device) for _ in range(4))
        Aqk = torch.empty(B, T, HV, 64, dtype=bf16, device=device)
        g_last = torch.empty(B, num_chunks if varlen else -(-T // 64), HV, K, dtype=torch.float32, device=device)
    if num_chunks:
        launch(KdaIntra, config, specs, _intra_tensors(q, k, v, g, beta, (w, u, qg, kg, Aqk, g_last), cu_seqlens,
                                                      chunk_indices, A_log, dt_bias),
               _OUTPUTS, device, *_intra_scalars(scale, form, lower_bound))
    return w, u, qg, kg, Aqk, g_last


def _gate_config(form: str, g, beta, A_log, dt_bias, beta_sigmoid: bool, allow_neg_eigval: bool) -> InKernelGate:
    """The gate part of the kernel's configuration for these arguments (their dtypes and presence)."""
    import torch

    names = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    return InKernelGate(form=form, g_dtype=names[g.dtype], beta_dtype=names[beta.dtype], has_A_log=A_log is not None,
                        has_dt_bias=dt_bias is not None, beta_sigmoid=beta_sigmoid, allow_neg_eigval=allow_neg_eigval)


def _intra_tensors(q, k, v, g, beta, out, cu_seqlens, chunk_indices, A_log, dt_bias) -> tuple:
    """The kernel's tensor arguments in their order (:meth:`KdaIntra.argument_specs`)."""
    w, u, qg, kg, Aqk, g_last = out
    return q, k, v, g, beta, w, u, qg, kg, Aqk, cu_seqlens, chunk_indices, A_log, dt_bias, g_last


def _intra_scalars(scale: float, form: str, lower_bound: float | None) -> tuple:
    """The kernel's scalar arguments: the scale, and the lower bound of the "safe" gate form (else 0)."""
    return float(scale), float(lower_bound) if form == "safe" else 0.0


def plan_intra_from_raw(q, k, v, g, beta, scale: float, form: str, A_log, dt_bias, lower_bound: float | None,
                        l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool, varlen: bool,
                        unbounded: bool = False):
    """:func:`_intra_from_raw` for every call with the signature of these arguments (the tensors are read for their
    shapes and dtypes only; none is kept): ``run(q, k, v, g, beta, out, cu_seqlens, chunk_indices, A_log,
    dt_bias)`` launches into ``out`` (``w, u, qg, kg, Aqk, g_last``) through a launch bound once
    (:func:`~cula_runtime.cute.compile_cache.bound_launch`: no per-tensor check; ``LaunchDeclined``, nothing
    launched, where TVM-FFI refuses a pointer). The same configuration, tensors and scalars as
    :func:`_intra_from_raw`: the same bits. The caller launches only calls with chunks."""
    config, specs = _plan(q.shape[2], v.shape[2], varlen, l2norm,
                          _gate_config(form, g, beta, A_log, dt_bias, beta_sigmoid, allow_neg_eigval), bool(unbounded))
    run = bound_launch(KdaIntra, config, specs, q.device)
    scalars = _intra_scalars(scale, form, lower_bound)

    def run_intra(q, k, v, g, beta, out, cu_seqlens, chunk_indices, A_log, dt_bias) -> None:
        run(_intra_tensors(q, k, v, g, beta, out, cu_seqlens, chunk_indices, A_log, dt_bias), scalars)

    return run_intra
