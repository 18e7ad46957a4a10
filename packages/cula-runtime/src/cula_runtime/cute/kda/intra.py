"""KDA "chunk intra" in one CuTeDSL launch: intra-chunk scores, the triangular inverse and W/U (KDA_SPEC.md §3.2-3.4,
§3.7, §3.8; FLA's ``chunk_kda_fwd_intra`` with ``safe_gate=True``).

One CTA of 128 threads (4 warps) per (chunk, value head, batch row); value head ``hv`` reads q/k head
``hv // (HV // H)``. With ``Γ`` the chunk-local cumulative gate in log2 units (``g_cum`` of :func:`kda_prepare`):

1. *Fill*: the chunk's rows are read once from global memory (16-byte loads; rows past the chunk's end are
   zero-filled, never read). Each row ``r`` of 16-row sub-chunk ``I`` is factored around the sub-chunk's first
   row ``n_I``: ``q̃_r = q_r 2^(Γ_r - Γ_n)`` and ``k̃_r = k_r 2^(Γ_r - Γ_n)`` (row operands, ≤ 1), and
   ``k̂^(I')_r = k_r 2^(Γ_n' - Γ_r)`` for every sub-chunk ``I' ≥ I`` (column operands; ≤ 1 off the diagonal,
   ≤ 2^(15·5/ln 2) on it under the safe gate |g| ≤ 5 per step, inside bf16's range). All are stored bf16 in shared
   memory, with the right-hand sides ``bf16(β k 2^Γ)`` and ``bf16(β v)``. ``kg = k 2^(Γ_last - Γ)`` and (optionally)
   ``qg = q 2^Γ`` go straight to global memory.
2. *Scores*: the 10 lower 16x16 sub-blocks of ``Aqk`` and ``Akk`` on warp MMA (bf16 m16n8k16, fp32 accumulation,
   operands by ldmatrix), spread over the 4 warps; scale, β and the causal masks are applied to the fp32 results.
3. *Inverse* ``Tinv = (I + Akk)^-1`` in fp32 on CUDA cores: forward substitution on the diagonal 16x16 blocks (one
   thread per column), then block substitution ``Tinv_IJ = -Tinv_II Σ_M A_IM Tinv_MJ`` block row by block row.
4. *W/U*: ``w = bf16(Tinv) · bf16(β k 2^Γ)`` and ``u = bf16(Tinv) · bf16(β v)`` on warp MMA (the right-hand sides
   are read transposed by ldmatrix.trans), staged through shared memory and stored with 16-byte stores.

With an in-kernel gate (``KdaIntraConfig.gate``, the ``fused-prepare`` path of the cutedsl backend) the kernel
first does kda_prepare's work for its chunk: Γ from the raw gate (activation, chunk cumsum with prepare's order of
fp32 additions, log2 units) in column stages through a staging tile, kept in registers for the fill; β activated;
q/k L2-normalised in the fill. It writes each chunk's decay row ``g_last`` for the recurrence.

Only warp-level MMA, ldmatrix and plain loads/stores: the same source runs on SM90, SM100 and SM103.
Varlen (``B = 1``): CTA ``x`` reads row ``x`` of the chunk indices ``[NT, 2]`` (sequence, chunk within it); a row with
a negative sequence id is padding and does nothing. Rows past a sequence's end are never read nor written.

:func:`chunk_kda_fwd_intra` is the host wrapper (FLA's layouts, KDA_SPEC §3.8).
"""

import dataclasses
import functools
import os

from ...env import env_value
from ..compile_cache import TensorSpec, fake_call_arguments, launch, missing_cutedsl
from ..smem import REGION_ALIGN, align_up, carve
from ..varlen import check_token_tensors, chunk_rows
from .prepare import GATE_FORMS, RCP_LN2, activate_beta, activate_gate, gate_arguments, gate_scan_segments
from .tiles import chunk_grid_extent, chunk_span

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr
    from cutlass.cute.nvgpu import warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["InKernelGate", "KdaIntra", "KdaIntraConfig", "chunk_kda_fwd_intra", "chunk_kda_fwd_intra_from_raw",
           "chunk_kda_fwd_scores", "chunk_kda_recompute_w_u", "chunk_kda_solve_tril"]

PHASES = ("all", "scores", "inverse", "wu")
SUB = 16  # rows of a sub-chunk: the M (and N) of one score block
NUM_SUB = 4  # sub-chunks per 64-row chunk
EXP2_CLAMP = 126.0  # exponents are clamped here: a factor of a zero (past-the-end) row stays finite
L2NORM_EPS = 1e-6  # as kda_prepare


_RAW_DTYPES = {"bfloat16": BFloat16, "float32": Float32}


@dataclasses.dataclass(frozen=True)
class InKernelGate:
    """What :func:`kda_prepare` would do to the gate and β, done by the intra kernel itself (same arithmetic, same
    bits): the gate activation, its chunk-local cumsum in log2 units, and the β activation.

    Attributes:
        form: ``"none"`` (g is already the log-gate), ``"softplus"`` or ``"safe"`` (lower-bound form; the bound is a
            launch argument), as :data:`~cula_runtime.cute.kda.prepare.GATE_FORMS`.
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
        head_dim: K = V (64 or 128).
        output_qg: also write ``qg = q 2^Γ``.
        varlen: packed sequences (B = 1, cu_seqlens and chunk indices).
        chunk_size: C; only 64.
        lean_smem: the shared-memory plan. False ("wide", this config's default): every buffer has its own
            bytes, about 159 KB at K = 128, one CTA per SM. True ("lean"): buffers whose lifetimes do not overlap
            share bytes and the right-hand sides β k 2^Γ, β v are built after the scores (their rows are read from
            global memory a second time), about 99 KB at K = 128, so two CTAs fit on an SM. Same arithmetic, same
            bits.
        unrolled_inverse: the off-diagonal block substitution of the inverse with compile-time loop bounds: every
            thread runs all of a block row's terms (unrolled, so its independent sums interleave) and keeps only
            those of its lower-triangular range by selection. False: runtime loops over exactly that range (the
            H200-verified default). The kept terms are added in the same order: same bits.
        phases: ``all`` (the one-launch primitive) or one step of the modular path, each its own launch:
            ``scores`` (Aqk bf16 and Akk fp32 out), ``inverse`` (Akk fp32 in, Akk_inv bf16 out) or ``wu`` (Akk_inv
            in; w, u, kg, qg out). The three steps in turn compute the one-launch outputs bit for bit.
        l2norm: q and k arrive raw and each row is L2-normalised here, exactly as :func:`kda_prepare` does it (the
            same thread owns the same 8 values, the same fp32 sum, 16-lane reduction, rsqrt and rounding), so the
            outputs equal those of prepare's q̂/k̂ bit for bit while the q̂/k̂ round trip through memory is gone.
        gate: None: the gate argument is ``g_cum`` (kda_prepare's chunk-local cumulative gate, log2 units) and β is
            activated. An :class:`InKernelGate`: the gate and β arrive raw and this kernel does prepare's gate and β
            work itself (:meth:`KdaIntra.gate_prologue`); it also writes each chunk's decay row ``g_last``
            (``Γ`` of its last valid token) for the recurrence. ``phases="all"`` only.
        output_akk_inv: write ``Akk_inv`` (``phases="all"``; the recurrence does not read it, so the cutedsl
            backend's fused-prepare path leaves it out: 128 bytes per token and value head less to write).
        prefetch: how many row passes ahead each pass's global loads are issued (:meth:`KdaIntra.fill`; with any
            prefetch the in-kernel gate also loads each column stage's raw values one stage ahead,
            :meth:`KdaIntra.gate_prologue`). Without it a pass's loads come after the previous pass's global stores
            (kg, qg), which the compiler may not move them above, so every pass waits a full memory latency (the
            SASS shows load, use, store, load...). 0 or 1 (two ahead spill registers). Same arithmetic, same
            bits.
        threads: the CTA's threads, 128 (4 warps) or 256 (8 warps; ``phases="all"``, K = 128, and the lean plan
            with an in-kernel gate). With 8 warps each scheduler has four warps of two CTAs instead of two to hide
            latency; the fill runs 4 row passes of 16 rows, the score blocks' two products go to two warps, W/U is
            split over 4 x 2 warps, the in-kernel gate scans 64 columns per stage, and registers are capped at 128
            so that two CTAs still fit on an SM (a few values spill to local memory). Same arithmetic in the same
            order: same bits.
    """

    num_heads: int
    num_v_heads: int
    head_dim: int = 128
    output_qg: bool = False
    varlen: bool = False
    chunk_size: int = 64
    lean_smem: bool = False
    unrolled_inverse: bool = False
    phases: str = "all"
    l2norm: bool = False
    gate: InKernelGate | None = None
    output_akk_inv: bool = True
    prefetch: int = 0
    threads: int = 128


class KdaIntra:
    """The KDA chunk-intra kernel family (see the module docstring)."""

    vec = 8  # bf16 elements per 16-byte access

    def __init__(self, config: KdaIntraConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise ValueError(f"KdaIntra cannot implement {config}: {reason}")
        self.config = config
        self.num_threads = config.threads
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
        if c.head_dim not in (64, 128):
            return False, f"K={c.head_dim}: head_dim (= V) must be 64 or 128"
        if c.num_heads < 1 or c.num_v_heads < 1 or c.num_v_heads % c.num_heads:
            return False, f"HV={c.num_v_heads} must be a positive multiple of H={c.num_heads}"
        if c.num_v_heads > 65535:
            return False, f"HV={c.num_v_heads} exceeds the grid's y limit (65535)"
        if c.phases not in PHASES:
            return False, f"phases={c.phases!r}: expected one of {PHASES}"
        if c.prefetch not in (0, 1):  # two passes ahead spill registers (23 values with the fused L2 norm)
            return False, f"prefetch={c.prefetch!r}: expected 0 or 1 row passes"
        if c.threads not in (128, 256):
            return False, f"threads={c.threads!r}: expected 128 or 256"
        if c.threads == 256 and (c.phases != "all" or c.head_dim != 128 or (c.gate is not None and not c.lean_smem)):
            return False, "threads=256 is implemented for phases='all' and K = 128 (with an in-kernel gate: lean_smem)"
        if c.lean_smem and c.phases != "all":
            return False, "lean_smem applies to phases='all' only"
        if not c.output_akk_inv and c.phases != "all":
            return False, "output_akk_inv=False applies to phases='all' only (the modular steps write what they own)"
        if c.gate is not None:
            if c.phases != "all":
                return False, "an in-kernel gate applies to phases='all' only"
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
        """Layout promises of the seventeen tensor arguments of ``__call__``, in order (None: absent in this
        phase)."""
        c = self.config
        gate = c.gate
        bf16 = TensorSpec(BFloat16, 4, self.vec)
        index = TensorSpec(Int32, 1), TensorSpec(Int32, 2)
        ph = c.phases
        need = {  # which arguments each phase reads or writes
            "q": ph in ("all", "scores") or (ph == "wu" and c.output_qg),
            "k": ph != "inverse", "v": ph in ("all", "wu"), "gk": ph != "inverse", "beta": ph != "inverse",
            "wu": ph in ("all", "wu"), "qg": ph in ("all", "wu") and c.output_qg, "kg": ph in ("all", "wu"),
            "Aqk": ph in ("all", "scores"), "Akk": ph in ("scores", "inverse"),
            "Akk_inv": ph in ("inverse", "wu") or (ph == "all" and c.output_akk_inv),
        }
        return (
            bf16 if need["q"] else None,  # q [B, T, H, K]
            bf16 if need["k"] else None,  # k [B, T, H, K]
            bf16 if need["v"] else None,  # v [B, T, HV, V]
            # gk [B, T, HV, K]: g_cum in log2 units, or the raw gate (in-kernel gate)
            (TensorSpec(_RAW_DTYPES[gate.g_dtype], 4) if gate else TensorSpec(Float32, 4, 4)) if need["gk"] else None,
            # beta [B, T, HV]: activated fp32, or raw (in-kernel gate)
            (TensorSpec(_RAW_DTYPES[gate.beta_dtype], 3) if gate else TensorSpec(Float32, 3)) if need["beta"] else None,
            bf16 if need["wu"] else None,  # w [B, T, HV, K]
            bf16 if need["wu"] else None,  # u [B, T, HV, V]
            bf16 if need["qg"] else None,  # qg [B, T, HV, K]
            bf16 if need["kg"] else None,  # kg [B, T, HV, K]
            bf16 if need["Aqk"] else None,  # Aqk [B, T, HV, 64]
            bf16 if need["Akk_inv"] else None,  # Akk_inv [B, T, HV, 64]
            TensorSpec(Float32, 4, 4) if need["Akk"] else None,  # Akk [B, T, HV, 64] fp32 (modular steps)
            *(index if c.varlen else (None, None)),  # cu_seqlens [N + 1], chunk_indices [NT, 2]
            TensorSpec(Float32, 1) if gate and gate.has_A_log else None,  # A_log [HV]
            TensorSpec(Float32, 2) if gate and gate.has_dt_bias else None,  # dt_bias [HV, K]
            TensorSpec(Float32, 4, 4) if gate else None,  # g_last [B, NT, HV, K] (varlen [1, NC, HV, K]), log2 units
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
        mQg: cute.Tensor | None,
        mKg: cute.Tensor,
        mAqk: cute.Tensor,
        mAkk: cute.Tensor,
        mAkkF32: cute.Tensor | None,
        mCuSeqlens: cute.Tensor | None,
        mChunkIndices: cute.Tensor | None,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mGLast: cute.Tensor | None,
        scale: Float32,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        c = self.config
        mRef = mAkkF32 if const_expr(c.phases == "inverse") else mG  # a [B, T, ...] tensor of every phase
        num_chunks = chunk_grid_extent(mChunkIndices, mRef.shape[1], c.chunk_size, c.varlen)
        # score blocks: one warp atom (16x8x16), tiled to 16x16x16 so that ldmatrix.x4 feeds B
        mma_op = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        block_mma = cute.make_tiled_mma(mma_op, (1, 1, 1), permutation_mnk=(SUB, 16, 16))
        # W/U: four warps stacked along M (64 rows of Tinv); with 8 warps, two such columns of warps along N
        warps_n = self.num_threads // 128
        wu_mma = cute.make_tiled_mma(mma_op, (4, warps_n, 1), permutation_mnk=(c.chunk_size, 16 * warps_n, 16))
        kernel = self.kernel(
            mQ, mK, mV, mG, mBeta, mW, mU, mQg, mKg, mAqk, mAkk, mAkkF32, mCuSeqlens, mChunkIndices, mALog, mDtBias,
            mGLast, scale, lower_bound, block_mma, wu_mma,
        )
        grid = [num_chunks, c.num_v_heads, mRef.shape[0]]
        if const_expr(self.num_threads == 128):
            kernel.launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)
        else:  # two CTAs of 8 warps per SM: at most 128 registers per thread
            kernel.launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=2,
                          preferred_smem_carveout=100)

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
        mQg: cute.Tensor | None,
        mKg: cute.Tensor,
        mAqk: cute.Tensor,
        mAkk: cute.Tensor,
        mAkkF32: cute.Tensor | None,
        mCuSeqlens: cute.Tensor | None,
        mChunkIndices: cute.Tensor | None,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mGLast: cute.Tensor | None,
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
        mRef = mAkkF32 if const_expr(c.phases == "inverse") else mG  # a [B, T, ...] tensor of every phase
        start, valid = chunk_span(mCuSeqlens, mChunkIndices, chunk, mRef.shape[1], C, c.varlen)

        smem = cutlass.utils.SmemAllocator()
        plan = self.lean_buffers if const_expr(c.lean_smem) else self.wide_buffers
        sQt, sKt, sKb, sVb, sKh, sAqk, sTb, sA, sT, sS, sGa, sBeta, sW, sU = plan(smem)

        if const_expr(c.phases != "all"):
            if valid > 0:
                self.modular_step(mQ, mK, mV, mG, mBeta, mW, mU, mQg, mKg, mAqk, mAkk, mAkkF32, scale, block_mma,
                                  wu_mma, sQt, sKt, sKb, sVb, sKh, sAqk, sTb, sA, sT, sS, sGa, sBeta, batch, head,
                                  hv, start, valid, tidx)
        elif valid > 0:
            # β's load goes out first, ahead of the gate's (or the anchors') loads; it is used only after them
            beta_raw = self.load_beta(mBeta, batch, hv, start, valid, tidx)
            rGam = None
            if const_expr(c.gate is not None):  # Γ of this thread's fill elements, kept in registers
                rGam = cute.make_rmem_tensor(cute.make_layout((self.passes, self.vec), stride=(self.vec, 1)), Float32)
                # the staging tile: over sA (16 KB) with 4 warps; over sT and sS (Tinv's, 20 KB) with 8 warps, whose
                # stage of 64 columns also needs room for the run totals
                sStaging = sA if const_expr(self.num_threads == 128) else sT
                self.gate_prologue(mG, mDtBias, mALog, mGLast, sStaging, sGa, rGam, lower_bound, batch, hv, chunk,
                                   start, valid, tidx)
            self.load_anchors(mG, mBeta, sGa, sBeta, sAqk, batch, hv, start, valid, tidx,
                              anchors=c.gate is None, beta_raw=beta_raw)
            cute.arch.sync_threads()
            self.fill(mQ, mK, mV, mG, mQg, mKg, sGa, sBeta, sQt, sKt, sKb, sVb, sKh, batch, head, hv, start, valid,
                      tidx, operands=True, rhs=not c.lean_smem, rGam=rGam)
            cute.arch.sync_threads()
            self.scores(block_mma, sQt, sKt, sKh, sBeta, sAqk, sA, scale, tidx)
            cute.arch.sync_threads()
            if const_expr(c.lean_smem):  # the right-hand sides, over q̃/k̃ (free since the barrier)
                self.fill(mQ, mK, mV, mG, mQg, mKg, sGa, sBeta, sQt, sKt, sKb, sVb, sKh, batch, head, hv, start,
                          valid, tidx, operands=False, rhs=True, rGam=rGam)
            self.inverse(sA, sT, sS, sTb, tidx)  # ends with a barrier
            self.wu(wu_mma, sTb, sKb, sVb, sW, sU, tidx)
            cute.arch.sync_threads()
            self.store_rows(sW, mW, batch, hv, start, valid, K, tidx)
            self.store_rows(sU, mU, batch, hv, start, valid, K, tidx)
            self.store_rows(sAqk, mAqk, batch, hv, start, valid, C, tidx)
            if const_expr(c.output_akk_inv):
                self.store_rows(sTb, mAkk, batch, hv, start, valid, C, tidx)

    @cute.jit
    def modular_step(self, mQ, mK, mV, mG, mBeta, mW, mU, mQg, mKg, mAqk, mAkk, mAkkF32, scale: Float32,
                     block_mma: cute.TiledMma, wu_mma: cute.TiledMma, sQt, sKt, sKb, sVb, sKh, sAqk, sTb, sA, sT,
                     sS, sGa, sBeta, batch: Int32, head: Int32, hv: Int32, start: Int32, valid: Int32,
                     tidx: Int32):
        """One step of the modular path, on the one-launch kernel's buffers and phase code (so the steps in turn
        give its bits): ``scores``, ``inverse`` or ``wu`` (see :class:`KdaIntraConfig`)."""
        c = self.config
        C, K = c.chunk_size, c.head_dim
        if const_expr(c.phases == "scores"):
            self.load_anchors(mG, mBeta, sGa, sBeta, sAqk, batch, hv, start, valid, tidx)
            for i in cutlass.range_constexpr(C * C // self.num_threads):  # Akk's blocks above the diagonal: zeros
                idx = tidx + i * self.num_threads
                if (idx % C) // SUB > (idx // C) // SUB:
                    sA[idx // C, idx % C] = Float32(0.0)
            cute.arch.sync_threads()
            self.fill(mQ, mK, mV, mG, mQg, mKg, sGa, sBeta, sQt, sKt, sKb, sVb, sKh, batch, head, hv, start, valid,
                      tidx, operands=True, rhs=False, gated=False)
            cute.arch.sync_threads()
            self.scores(block_mma, sQt, sKt, sKh, sBeta, sAqk, sA, scale, tidx)
            cute.arch.sync_threads()
            self.store_rows(sAqk, mAqk, batch, hv, start, valid, C, tidx)
            self.fp32_rows(sA, mAkkF32, batch, hv, start, valid, tidx, to_global=True)
        if const_expr(c.phases == "inverse"):
            self.fp32_rows(sA, mAkkF32, batch, hv, start, valid, tidx, to_global=False)
            cute.arch.sync_threads()
            self.inverse(sA, sT, sS, sTb, tidx)  # ends with a barrier
            self.store_rows(sTb, mAkk, batch, hv, start, valid, C, tidx)
        if const_expr(c.phases == "wu"):
            self.load_anchors(mG, mBeta, sGa, sBeta, sAqk, batch, hv, start, valid, tidx)
            self.load_rows(mAkk, sTb, batch, hv, start, valid, C, tidx)
            cute.arch.sync_threads()
            self.fill(mQ, mK, mV, mG, mQg, mKg, sGa, sBeta, sQt, sKt, sKb, sVb, sKh, batch, head, hv, start, valid,
                      tidx, operands=False, rhs=True, gated=True)
            cute.arch.sync_threads()
            self.wu(wu_mma, sTb, sKb, sVb, sQt, sKt, tidx)
            cute.arch.sync_threads()
            self.store_rows(sQt, mW, batch, hv, start, valid, K, tidx)
            self.store_rows(sKt, mU, batch, hv, start, valid, K, tidx)

    @cute.jit
    def fp32_rows(self, sX: cute.Tensor, mX: cute.Tensor, b: Int32, hv: Int32, start: Int32, valid: Int32,
                  tidx: Int32, to_global: cutlass.Constexpr):
        """Rows of the fp32 ``[64, 64]`` tile ``sX`` to ``mX[b, start + r, hv, :]`` (``to_global``) or back, 16 bytes
        per access; rows ``>= valid`` are not touched in global memory and are zero-filled in shared memory."""
        C = self.config.chunk_size
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        per_row = C // 4
        copy = cute.make_tiled_copy_tv(atom, cute.make_ordered_layout((self.num_threads // per_row, per_row),
                                                                      order=(1, 0)), cute.make_layout((1, 4)))
        thr = copy.get_slice(tidx)
        gX = self.chunk_rows(mX, b, hv, start, C)
        tXsX = thr.partition_S(sX)
        tXgX = thr.partition_D(gX)
        tXcX = thr.partition_S(cute.make_identity_tensor((C, C)))
        for p in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            row = tXcX[(0, 0), p, 0][0]
            if const_expr(to_global):
                if row < valid:
                    cute.copy(atom, tXsX[None, p, None], tXgX[None, p, None])
            else:
                if row < valid:
                    cute.copy(atom, tXgX[None, p, None], tXsX[None, p, None])
                else:
                    tXsX[None, p, None].fill(0.0)

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

    def wide_buffers(self, smem) -> tuple:
        """The wide plan: every buffer its own bytes. w and u are staged over q̃ and k̃ (free after the scores)."""
        C, K = self.config.chunk_size, self.config.head_dim
        sQt = smem.allocate_tensor(BFloat16, self.smem_layout(C, K), 1024)  # q̃; later w
        sKt = smem.allocate_tensor(BFloat16, self.smem_layout(C, K), 1024)  # k̃; later u
        sKb = smem.allocate_tensor(BFloat16, self.smem_layout(C, K), 1024)  # bf16(β k 2^Γ)
        sVb = smem.allocate_tensor(BFloat16, self.smem_layout(C, K), 1024)  # bf16(β v)
        # k̂ of anchor I: rows 0 .. 16(I+1)-1 (the key rows of block row I)
        sKh = [smem.allocate_tensor(BFloat16, self.smem_layout(SUB * (i + 1), K), 1024) for i in range(NUM_SUB)]
        sAqk = smem.allocate_tensor(BFloat16, self.smem_layout(C, C), 1024)
        sTb = smem.allocate_tensor(BFloat16, self.smem_layout(C, C), 1024)  # bf16(Tinv)
        sA = smem.allocate_tensor(Float32, self.fp32_layout(C), 16)  # Akk (strictly lower, β-scaled), fp32
        sT = smem.allocate_tensor(Float32, self.fp32_layout(C), 16)  # Tinv, fp32 (lower part only is written)
        sS = smem.allocate_tensor(Float32, self.fp32_layout(C, SUB), 16)
        sGa, sBeta = self.small_buffers(smem)
        return sQt, sKt, sKb, sVb, sKh, sAqk, sTb, sA, sT, sS, sGa, sBeta, sQt, sKt

    def lean_plan(self) -> dict[str, int]:
        """Byte offsets of the lean plan's two shared regions (see :meth:`lean_buffers`) and their sizes."""
        C, K = self.config.chunk_size, self.config.head_dim
        tile = C * K * 2  # one bf16 [64, K] tile
        kh = [align_up(SUB * (i + 1) * K * 2) for i in range(NUM_SUB)]
        inverse = C * C * 4 + SUB * C * 4  # sT, sS (fp32)
        off_tb = align_up(max(inverse, 2 * tile))
        return {
            "rows": 2 * tile,
            "kh": [sum(kh[:i]) for i in range(NUM_SUB)],
            "s": C * C * 4,
            "tb": off_tb,
            "reuse": max(sum(kh), off_tb + C * C * 2),
        }

    def lean_buffers(self, smem) -> tuple:
        """The lean plan: two regions whose buffers take turns (every hand-over is behind a CTA barrier).

        * rows (2 tiles): q̃, k̃ until the scores; then bf16(β k 2^Γ), bf16(β v) until W/U.
        * reuse: the k̂ of the four anchors until the scores; then Tinv fp32 and its temporaries, and bf16(Tinv) at
          ``tb``; after the inverse, w and u are staged over the fp32 Tinv while bf16(Tinv) stays.
        """
        C, K = self.config.chunk_size, self.config.head_dim
        plan = self.lean_plan()
        tile = C * K * 2
        rows = smem.allocate(plan["rows"], REGION_ALIGN)
        reuse = smem.allocate(plan["reuse"], REGION_ALIGN)
        sAqk = smem.allocate_tensor(BFloat16, self.smem_layout(C, C), 1024)
        sA = smem.allocate_tensor(Float32, self.fp32_layout(C), 16)
        sGa, sBeta = self.small_buffers(smem)
        kc = self.smem_layout(C, K)
        sQt, sKt = carve(rows, 0, BFloat16, kc), carve(rows, tile, BFloat16, kc)
        sKb, sVb = sQt, sKt
        sKh = [carve(reuse, plan["kh"][i], BFloat16, self.smem_layout(SUB * (i + 1), K)) for i in range(NUM_SUB)]
        sT = carve(reuse, 0, Float32, self.fp32_layout(C))
        sS = carve(reuse, plan["s"], Float32, self.fp32_layout(C, SUB))
        sTb = carve(reuse, plan["tb"], BFloat16, self.smem_layout(C, C))
        sW, sU = carve(reuse, 0, BFloat16, kc), carve(reuse, tile, BFloat16, kc)
        return sQt, sKt, sKb, sVb, sKh, sAqk, sTb, sA, sT, sS, sGa, sBeta, sW, sU

    def smem_bytes(self) -> int:
        """Shared memory one CTA allocates (bytes; an upper bound that counts 1024-byte alignment of every tile):
        what decides how many CTAs fit on an SM."""
        C, K = self.config.chunk_size, self.config.head_dim
        small = (NUM_SUB + 1) * K * 4 + C * 4  # sGa, sBeta
        fp32_tile = C * C * 4  # sA (and sT in the wide plan)
        if self.config.lean_smem:
            plan = self.lean_plan()
            return align_up(plan["rows"]) + align_up(plan["reuse"]) + align_up(C * C * 2) + fp32_tile + small
        tiles = 4 * C * K * 2 + sum(align_up(SUB * (i + 1) * K * 2) for i in range(NUM_SUB)) + 2 * align_up(C * C * 2)
        return tiles + 2 * fp32_tile + SUB * C * 4 + small

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
    def load_anchors(self, mG: cute.Tensor, mBeta: cute.Tensor, sGa: cute.Tensor, sBeta: cute.Tensor,
                     sAqk: cute.Tensor, b: Int32, hv: Int32, start: Int32, valid: Int32, tidx: Int32,
                     anchors: cutlass.Constexpr = True, beta_raw: Float32 | None = None):
        """``sGa[I] = Γ[16 I]`` (0 for a sub-chunk past the end), ``sGa[4] = Γ_last`` (``anchors``; else the gate
        prologue wrote them), ``sBeta = β`` (0 past the end; activated here with an in-kernel gate), and zeros in
        the blocks of ``sAqk`` above the diagonal. ``beta_raw``: :meth:`load_beta`'s value, loaded earlier by the
        caller; None loads it here."""
        C, K = self.config.chunk_size, self.config.head_dim
        gate = self.config.gate
        if const_expr(beta_raw is None):
            beta_raw = self.load_beta(mBeta, b, hv, start, valid, tidx)
        entries = (NUM_SUB + 1) * K
        for i in cutlass.range_constexpr((entries + self.num_threads - 1) // self.num_threads if anchors else 0):
            idx = tidx + i * self.num_threads
            if const_expr(entries % self.num_threads == 0) or idx < entries:
                a = idx // K
                col = idx % K
                row = cutlass.select_(a < NUM_SUB, a * SUB, valid - 1)
                val = Float32(0.0)
                if row < valid:
                    val = mG[b, start + row, hv, col]
                sGa[a, col] = val
        if tidx < C:
            beta = beta_raw
            if const_expr(gate is not None):
                if tidx < valid:
                    beta = activate_beta(beta_raw, gate.beta_sigmoid, gate.allow_neg_eigval)
            sBeta[tidx] = beta
        for i in cutlass.range_constexpr(C * C // self.num_threads):
            idx = tidx + i * self.num_threads
            row = idx // C
            col = idx % C
            if col // SUB > row // SUB:
                sAqk[row, col] = BFloat16(0.0)

    @cute.jit
    def gate_prologue(self, mG: cute.Tensor, mDtBias: cute.Tensor | None, mALog: cute.Tensor | None,
                      mGLast: cute.Tensor, sA: cute.Tensor, sGa: cute.Tensor, rGam: cute.Tensor,
                      lower_bound: Float32, b: Int32, hv: Int32, chunk: Int32, start: Int32, valid: Int32,
                      tidx: Int32):
        """The in-kernel gate: ``Γ`` of the chunk from the raw gate, with :meth:`KdaPrepare.gate_and_beta`'s
        arithmetic (the same runs of consecutive tokens, each summed serially, offset by the earlier runs' totals
        in order, then times 1/ln 2), so ``Γ`` has ``g_cum``'s bits.

        It works in column stages through a staging tile over ``sA`` (free until the scores; with 8 warps over
        Tinv's fp32 buffers, free until the inverse: the stage is 64 columns wide): thread ``(run, column)`` scans
        its run, then the threads of :meth:`fill` copy their elements of the stage into ``rGam``
        (``[passes, 8]``, zero for rows past the end). It also writes ``sGa`` (the anchors, as
        :meth:`load_anchors`) and ``g_last[b, chunk, hv, :] = Γ[valid - 1]``. Ends with a barrier."""
        c = self.config
        gate = c.gate
        C, K = c.chunk_size, c.head_dim
        runs = gate_scan_segments(K, C)
        run_len = C // runs
        width = self.num_threads // runs  # columns per stage: one thread per (run, column)
        sStage = cute.make_tensor(sA.iterator, cute.make_layout((C, width), stride=(width, 1)))
        sTotal = cute.make_tensor(sA.iterator + C * width, cute.make_layout((runs, width), stride=(width, 1)))
        run = tidx // width
        column = tidx % width
        scale = Float32(1.0)
        if const_expr(gate.form != "none" and gate.has_A_log):
            scale = cute.math.exp(mALog[hv])
        tXcX = self.row_copy(K).get_slice(tidx).partition_S(cute.make_identity_tensor((C, K)))
        stages = K // width
        ahead = 1 if const_expr(c.prefetch) else 0  # with prefetch: stage s + 1's raw gate is loaded before s
        staged = [None] * stages
        for step in cutlass.range_constexpr(stages + ahead):
            if const_expr(c.prefetch and step < stages):  # unconditional loads (rows clamped into the chunk)
                rRaw = cute.make_rmem_tensor(cute.make_layout(run_len), mG.element_type)
                for i in cutlass.range_constexpr(run_len):
                    rRaw[i] = mG[b, start + cutlass.min(run * run_len + i, valid - 1), hv, step * width + column]
                staged[step] = rRaw
            if const_expr(step >= ahead):
                self.gate_stage(mG, mDtBias, mGLast, sGa, sStage, sTotal, rGam, staged[step - ahead], tXcX, scale,
                                lower_bound, b, hv, chunk, start, valid, run, column, step - ahead)

    @cute.jit
    def gate_stage(self, mG: cute.Tensor, mDtBias: cute.Tensor | None, mGLast: cute.Tensor, sGa: cute.Tensor,
                   sStage: cute.Tensor, sTotal: cute.Tensor, rGam: cute.Tensor, rRaw: cute.Tensor | None,
                   tXcX: cute.Tensor, scale: Float32, lower_bound: Float32, b: Int32, hv: Int32, chunk: Int32,
                   start: Int32, valid: Int32, run: Int32, column: Int32, stage: cutlass.Constexpr):
        """One column stage of :meth:`gate_prologue`: the ``width`` columns of ``stage``, from ``rRaw`` (this
        thread's raw gate values, prefetched) or from ``mG``."""
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
            x = Float32(0.0)  # rows past the end add the activation of 0, as in prepare (never stored)
            if const_expr(rRaw is not None):
                x = cutlass.select_(row < valid, rRaw[i].to(Float32), Float32(0.0))
            else:
                if row < valid:
                    x = mG[b, start + row, hv, col].to(Float32)
            running = running + activate_gate(gate.form, x + bias, scale, lower_bound)
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
    def fill(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mQg: cute.Tensor | None,
             mKg: cute.Tensor, sGa: cute.Tensor, sBeta: cute.Tensor, sQt: cute.Tensor, sKt: cute.Tensor,
             sKb: cute.Tensor, sVb: cute.Tensor, sKh: list, b: Int32, h: Int32, hv: Int32, start: Int32,
             valid: Int32, tidx: Int32, operands: cutlass.Constexpr = True, rhs: cutlass.Constexpr = True,
             gated: cutlass.Constexpr = None, rGam: cute.Tensor | None = None):
        """Phase 1: the factored MMA operands (``operands``: q̃, k̃, k̂ into shared memory), the gated outputs
        (``gated``, default ``operands``: kg and qg to global memory) and the right-hand sides (``rhs``:
        bf16(β k 2^Γ), bf16(β v) into shared memory). The wide plan does all in one pass; the lean plan does the
        right-hand sides in a second pass, after the scores; the modular steps do what each needs. ``rGam``: Γ of
        this thread's elements from :meth:`gate_prologue` (in-kernel gate), else Γ is read from ``mG``."""
        c = self.config
        gated = operands if const_expr(gated is None) else gated
        need_q = operands or (gated and c.output_qg)
        C, K, VEC = c.chunk_size, c.head_dim, self.vec
        tiled_copy = self.row_copy(K)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        g_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        thr_copy = tiled_copy.get_slice(tidx)

        tXgQ = thr_copy.partition_S(self.chunk_rows(mQ, b, h, start, K)) if const_expr(need_q) else None
        tXgK = thr_copy.partition_S(self.chunk_rows(mK, b, h, start, K))  # (CPY, passes, 1)
        tXgV = thr_copy.partition_S(self.chunk_rows(mV, b, hv, start, K)) if const_expr(rhs) else None
        tXgKg = thr_copy.partition_D(self.chunk_rows(mKg, b, hv, start, K)) if const_expr(gated) else None
        tXsQt = thr_copy.partition_D(sQt)
        tXsKt = thr_copy.partition_D(sKt)
        tXsKb = thr_copy.partition_D(sKb)
        tXsVb = thr_copy.partition_D(sVb)
        tXsKh = [thr_copy.partition_D(s) for s in sKh]
        tXcX = thr_copy.partition_S(cute.make_identity_tensor((C, K)))  # (row, column) of every element
        gG = self.chunk_rows(mG, b, hv, start, K)
        vec_layout = cute.make_layout(VEC)
        ahead = c.prefetch  # passes whose loads are issued before this pass's work
        staged = [None] * self.passes
        for step in cutlass.range_constexpr(self.passes + ahead):
            if const_expr(step < self.passes):  # load pass `step`
                row, col0 = tXcX[(0, 0), step, 0]  # this thread's row and first of its 8 columns in the pass
                rQ = cute.make_rmem_tensor(vec_layout, BFloat16)
                rK = cute.make_rmem_tensor(vec_layout, BFloat16)
                rV = cute.make_rmem_tensor(vec_layout, BFloat16)
                rG = cute.make_rmem_tensor(vec_layout, Float32)
                if const_expr(need_q):
                    rQ.fill(0.0)
                rK.fill(0.0)
                if const_expr(rhs):
                    rV.fill(0.0)
                rG.fill(0.0)
                if row < valid:
                    if const_expr(need_q):
                        cute.copy(atom, tXgQ[None, step, 0], rQ)
                    cute.copy(atom, tXgK[None, step, 0], rK)
                    if const_expr(rhs):
                        cute.copy(atom, tXgV[None, step, 0], rV)
                    if const_expr(rGam is None):
                        gRow = cute.local_tile(gG[row, None], (VEC,), (col0 // VEC,))
                        for half in cutlass.range_constexpr(2):
                            cute.copy(g_atom, cute.local_tile(gRow, (4,), (half,)),
                                      cute.local_tile(rG, (4,), (half,)))
                staged[step] = (rQ, rK, rV, rG)
            if const_expr(step >= ahead):  # the work of pass step - ahead
                p = step - ahead
                rQ, rK, rV, rG = staged[p]
                row, col0 = tXcX[(0, 0), p, 0]
                sub = p * self.rows_per_pass // SUB  # the row's sub-chunk (compile-time: rows_per_pass divides 16)
                if const_expr(rGam is not None):  # zero past the end, as the load above leaves it
                    for j in cutlass.range_constexpr(VEC):
                        rG[j] = rGam[p, j]
                if const_expr(c.l2norm):  # the row's 16 (K = 128) or 8 threads: kda_prepare's arithmetic exactly
                    if const_expr(need_q):
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
                    if const_expr(need_q):
                        q = rQ[j].to(Float32)
                    k = rK[j].to(Float32)
                    if const_expr(operands):
                        row_factor = cute.math.exp2(cutlass.min(g - sGa[sub, col0 + j], EXP2_CLAMP), fastmath=True)
                    decay = cute.math.exp2(g, fastmath=True)
                    if const_expr(operands):
                        rQt[j] = (q * row_factor).to(BFloat16)
                        rKt[j] = (k * row_factor).to(BFloat16)
                    if const_expr(rhs):
                        rKb[j] = (beta * k * decay).to(BFloat16)
                        rVb[j] = (beta * rV[j].to(Float32)).to(BFloat16)
                    if const_expr(gated):
                        last = cute.math.exp2(cutlass.min(sGa[NUM_SUB, col0 + j] - g, EXP2_CLAMP), fastmath=True)
                        rKg[j] = (k * last).to(BFloat16)
                        if const_expr(c.output_qg):
                            rQg[j] = (q * decay).to(BFloat16)
                    if const_expr(operands):
                        for a in cutlass.range_constexpr(sub, NUM_SUB):
                            col_factor = cute.math.exp2(cutlass.min(sGa[a, col0 + j] - g, EXP2_CLAMP), fastmath=True)
                            rKh[a][j] = (k * col_factor).to(BFloat16)
                if const_expr(operands):
                    cute.copy(atom, rQt, tXsQt[None, p, 0])
                    cute.copy(atom, rKt, tXsKt[None, p, 0])
                if const_expr(rhs):
                    cute.copy(atom, rKb, tXsKb[None, p, 0])
                    cute.copy(atom, rVb, tXsVb[None, p, 0])
                if const_expr(operands):
                    for a in cutlass.range_constexpr(sub, NUM_SUB):
                        cute.copy(atom, rKh[a], tXsKh[a][None, p, 0])
                if const_expr(gated):
                    if row < valid:
                        cute.copy(atom, rKg, tXgKg[None, p, 0])
                        if const_expr(c.output_qg):
                            tXgQg = thr_copy.partition_D(self.chunk_rows(mQg, b, hv, start, K))
                            cute.copy(atom, rQg, tXgQg[None, p, 0])

    @cute.jit
    def l2norm_row(self, rX: cute.Tensor):
        """``rX <- bf16(x * rsqrt(sum(x^2) + eps))`` over the row whose ``vec`` values this thread holds with
        ``K / vec`` neighbouring lanes (zeros stay zeros): :meth:`KdaPrepare.l2norm_rows`'s arithmetic."""
        x = rX.load().to(Float32)
        sum_sq = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        sum_sq = cute.arch.warp_reduction_sum(sum_sq, threads_in_group=self.threads_per_row)
        rX.store((x * cute.math.rsqrt(sum_sq + L2NORM_EPS)).to(BFloat16))

    @cute.jit
    def scores(self, block_mma: cute.TiledMma, sQt: cute.Tensor, sKt: cute.Tensor, sKh: list, sBeta: cute.Tensor,
               sAqk: cute.Tensor, sA: cute.Tensor, scale: Float32, tidx: Int32):
        """Phase 2: the 10 lower 16x16 blocks of Aqk (bf16, scaled, masked j <= i) and Akk (fp32, β-scaled, masked
        j < i) on warp MMA; block (I, J) uses q̃/k̃ rows of sub-chunk I and k̂ rows of sub-chunk J for anchor I."""
        K = self.config.head_dim
        warp_idx = tidx // 32
        lane = tidx % 32
        thr_mma = block_mma.get_slice(lane)
        ld_atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        copy_A = cute.make_tiled_copy_A(ld_atom, block_mma).get_slice(lane)
        copy_B = cute.make_tiled_copy_B(ld_atom, block_mma).get_slice(lane)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((SUB, SUB)))
        # (I, J) blocks of each warp: 3, 3, 2, 2 blocks; with 8 warps, warps 0-3 make Aqk and warps 4-7 Akk
        assignment = (((0, 0), (3, 0), (3, 1)), ((1, 0), (1, 1), (3, 2)), ((2, 0), (2, 1)), ((2, 2), (3, 3)))
        split = self.num_threads // 128 == 2
        for w in cutlass.range_constexpr(self.num_threads // 32):
            qk = not split or w < len(assignment)  # this warp's products
            kk = not split or w >= len(assignment)
            if warp_idx == w:
                for bi, bj in assignment[w % len(assignment)]:
                    sQI = cute.local_tile(sQt, (SUB, K), (bi, 0))
                    sKI = cute.local_tile(sKt, (SUB, K), (bi, 0))
                    sKJ = cute.local_tile(sKh[bi], (SUB, K), (bj, 0))
                    tCrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQI))
                    tCrK = thr_mma.make_fragment_A(thr_mma.partition_A(sKI))
                    tCrKh = thr_mma.make_fragment_B(thr_mma.partition_B(sKJ))
                    if const_expr(qk):
                        cute.copy(copy_A, copy_A.partition_S(sQI), copy_A.retile(tCrQ))
                    if const_expr(kk):
                        cute.copy(copy_A, copy_A.partition_S(sKI), copy_A.retile(tCrK))
                    cute.copy(copy_B, copy_B.partition_S(sKJ), copy_B.retile(tCrKh))
                    acc_qk = cute.make_rmem_tensor(thr_mma.partition_shape_C((SUB, SUB)), Float32)
                    acc_kk = cute.make_rmem_tensor(thr_mma.partition_shape_C((SUB, SUB)), Float32)
                    if const_expr(qk):
                        acc_qk.fill(0.0)
                    if const_expr(kk):
                        acc_kk.fill(0.0)
                    if const_expr(qk):
                        cute.gemm(block_mma, acc_qk, tCrQ, tCrKh, acc_qk)
                    if const_expr(kk):
                        cute.gemm(block_mma, acc_kk, tCrK, tCrKh, acc_kk)
                    for e in cutlass.range_constexpr(cute.size(acc_qk)):
                        i, j = tCcC[e]
                        row = bi * SUB + i
                        col = bj * SUB + j
                        if const_expr(qk):
                            aqk = Float32(acc_qk[e] * scale)
                        if const_expr(kk):
                            akk = Float32(acc_kk[e] * sBeta[row])
                        if const_expr(bi == bj):
                            if const_expr(qk):
                                aqk = Float32(cutlass.select_(j <= i, aqk, Float32(0.0)))
                            if const_expr(kk):
                                akk = Float32(cutlass.select_(j < i, akk, Float32(0.0)))
                        if const_expr(qk):
                            sAqk[row, col] = aqk.to(BFloat16)
                        if const_expr(kk):
                            sA[row, col] = akk

    @cute.jit
    def inverse(self, sA: cute.Tensor, sT: cute.Tensor, sS: cute.Tensor, sTb: cute.Tensor, tidx: Int32):
        """Phase 3: ``sT = (I + A)^-1`` (lower part) in fp32, then ``sTb = bf16(sT)`` with zeros above the diagonal.
        Starts and ends with all of the CTA's threads in step (it ends with a barrier)."""
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
                if const_expr(self.config.unrolled_inverse):  # Tinv_MJ is zero above the diagonal: skip M < J
                    lo = (x // SUB) * SUB
                    for y in cutlass.range_constexpr(width):
                        acc = cutlass.select_(y >= lo, acc + sA[width + r, y] * sT[y, x], acc)
                else:
                    for y in cutlass.range((x // SUB) * SUB, width):
                        acc = acc + sA[width + r, y] * sT[y, x]
                sS[r, x] = acc
            cute.arch.sync_threads()
            for e in cutlass.range_constexpr(SUB * width // self.num_threads):
                idx = tidx + e * self.num_threads
                r = idx // width
                x = idx % width
                acc = sS[r, x]
                if const_expr(self.config.unrolled_inverse):
                    for y in cutlass.range_constexpr(SUB):
                        acc = cutlass.select_(y < r, acc + sT[width + r, width + y] * sS[y, x], acc)
                else:
                    for y in cutlass.range(0, r):
                        acc = acc + sT[width + r, width + y] * sS[y, x]
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
        ``sW`` and ``sU`` are the q̃/k̃ buffers, free since phase 2."""
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
        """``mX[b, start + r, hv, :] = sX[r, :]`` for the chunk's rows ``r < valid`` (16-byte accesses)."""
        self.bf16_rows(sX, mX, b, hv, start, valid, cols, tidx, to_global=True)

    @cute.jit
    def load_rows(self, mX: cute.Tensor, sX: cute.Tensor, b: Int32, hv: Int32, start: Int32, valid: Int32,
                  cols: cutlass.Constexpr, tidx: Int32):
        """``sX[r, :] = mX[b, start + r, hv, :]`` for rows ``r < valid``, zeros for the others (16-byte accesses)."""
        self.bf16_rows(sX, mX, b, hv, start, valid, cols, tidx, to_global=False)

    @cute.jit
    def bf16_rows(self, sX: cute.Tensor, mX: cute.Tensor, b: Int32, hv: Int32, start: Int32, valid: Int32,
                  cols: cutlass.Constexpr, tidx: Int32, to_global: cutlass.Constexpr):
        """Rows of a bf16 ``[64, cols]`` shared tile to ``mX[b, start + r, hv, :]`` (``to_global``, rows < valid)
        or back (rows >= valid zero-filled), through registers, 16 bytes per access."""
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
            if const_expr(to_global):
                if tXcX[(0, 0), p, 0][0] < valid:
                    rX = cute.make_rmem_tensor(cute.make_layout(self.vec), BFloat16)
                    cute.copy(atom, tXsX[None, p, 0], rX)
                    cute.copy(atom, rX, tXgX[None, p, 0])
            else:
                rX = cute.make_rmem_tensor(cute.make_layout(self.vec), BFloat16)
                rX.fill(0.0)
                if tXcX[(0, 0), p, 0][0] < valid:
                    cute.copy(atom, tXgX[None, p, 0], rX)
                cute.copy(atom, rX, tXsX[None, p, 0])


# positions of the outputs among the tensor arguments, per phase: w, u, qg, kg, Aqk, Akk_inv, Akk (fp32), g_last
_OUTPUTS = {"all": frozenset((*range(5, 11), 16)), "scores": frozenset({9, 11}), "inverse": frozenset({10}),
            "wu": frozenset({5, 6, 7, 8})}


ENV_VARIANT = "CULA_CUTE_INTRA"
# Named variants of the intra kernel: (lean_smem, unrolled_inverse, fuse_l2norm, fuse_gate, prefetch, threads).
# All compute the same bits (each checked against `wide`, or against the lean-unrolled pipeline, on the H200).
# fuse_* are for the cutedsl backend: fuse_l2norm moves the q/k L2 norm from kda_prepare into this kernel; fuse_gate
# also the gate activation, its cumsum and β (no kda_prepare launch at all). "-prefetch" issues each row pass's loads
# one pass ahead (KdaIntraConfig.prefetch), "-8warps" runs 256-thread CTAs (KdaIntraConfig.threads, K = 128 only).
# The default is `fused-prepare-prefetch-8warps`, the fastest on the H200 (2026-11-30,
# kda_prefill_fixed_variants_h200.md and kda_prefill_rest_variants_h200.md: 1.05-1.68x faster end to end than
# `lean-unrolled`, the previous default; without the loads issued ahead and the 8 warps, `fused-prepare` was
# 0.59-0.89x of `wide`).
DEFAULT_VARIANT = "fused-prepare-prefetch-8warps"
VARIANTS = {"wide": (False, False, False, False, 0, 128), "lean": (True, False, False, False, 0, 128),
            "lean-unrolled": (True, True, False, False, 0, 128), "fused": (True, True, True, False, 0, 128),
            "fused-prepare": (True, True, True, True, 0, 128),
            "lean-unrolled-prefetch": (True, True, False, False, 1, 128),
            "fused-prefetch": (True, True, True, False, 1, 128),
            "fused-prepare-prefetch": (True, True, True, True, 1, 128),
            "fused-prepare-prefetch-8warps": (True, True, True, True, 1, 256),
            "lean-unrolled-8warps": (True, True, False, False, 0, 256),
            "lean-unrolled-prefetch-8warps": (True, True, False, False, 1, 256),
            "fused-prefetch-8warps": (True, True, True, False, 1, 256)}


def variant_flags(variant: str | None) -> tuple[bool, bool, bool, bool, int, int]:
    """``(lean_smem, unrolled_inverse, fuse_l2norm, fuse_gate, prefetch, threads)`` of a named variant; None:
    ``CULA_CUTE_INTRA``, else :data:`DEFAULT_VARIANT`. Every variant ran on the H200 with the same bits as ``wide``
    (or as the lean-unrolled pipeline). Asked on every cutedsl call: a lookup, no work."""
    name = variant if variant is not None else env_value(ENV_VARIANT, DEFAULT_VARIANT)
    flags = VARIANTS.get(name)
    if flags is None:
        where = "variant" if variant is not None else ENV_VARIANT
        raise ValueError(f"{where}={name!r}: expected one of {sorted(VARIANTS)}")
    return flags


def _primitive_flags(variant: str | None, K: int) -> tuple[bool, bool, bool, bool, int, int]:
    """:func:`variant_flags` for the intra primitives, which also take K = 64: when nothing was named (no
    ``variant``, no ``CULA_CUTE_INTRA``) and the default runs 8 warps, K = 64 gets the same variant with 4 (8 warps
    are implemented for K = 128 only; the same bits either way). A named 8-warp variant at K = 64 stays an error."""
    flags = variant_flags(variant)
    if K != 128 and flags[5] != 128 and variant is None and ENV_VARIANT not in os.environ:
        flags = (*flags[:5], 128)
    return flags


def kernel_flags(flags: tuple[bool, bool, bool, bool, int, int]) -> tuple[bool, bool, int, int]:
    """The kernel-shape part of :func:`variant_flags`'s answer: ``(lean_smem, unrolled_inverse, prefetch,
    threads)``."""
    return flags[0], flags[1], flags[4], flags[5]


@functools.lru_cache(maxsize=256)
def _plan(H: int, HV: int, K: int, output_qg: bool, varlen: bool, flags: tuple[bool, ...],
          phases: str = "all", l2norm: bool = False, gate: InKernelGate | None = None,
          output_akk_inv: bool = True) -> tuple:
    """The config and argument specs of one call signature (cached: no work per call). ``flags``: ``(lean_smem,
    unrolled_inverse[, prefetch, threads])``."""
    prefetch, threads = flags[2:] if len(flags) > 2 else (0, 128)
    config = KdaIntraConfig(num_heads=H, num_v_heads=HV, head_dim=K, output_qg=output_qg, varlen=varlen,
                            lean_smem=flags[0], unrolled_inverse=flags[1], phases=phases, l2norm=l2norm, gate=gate,
                            output_akk_inv=output_akk_inv, prefetch=prefetch, threads=threads)
    ok, reason = KdaIntra.can_implement(config)
    if not ok:
        raise ValueError(f"KdaIntra: {reason}")
    return config, KdaIntra(config).argument_specs()


def _launch(config: KdaIntraConfig, specs: tuple, tensors: tuple, scale: float, device,
            gate_tensors: tuple = (None, None, None), lower_bound: float = 0.0) -> None:
    """Launch one compiled :class:`KdaIntra` configuration on ``tensors`` (the first fourteen ``__call__`` tensor
    arguments) and ``gate_tensors`` (A_log, dt_bias, g_last: the in-kernel gate's)."""
    launch(KdaIntra, config, specs, (*tensors, *gate_tensors), _OUTPUTS[config.phases], device, float(scale),
           float(lower_bound))


def chunk_kda_fwd_intra(
    q,
    k,
    v,
    gk,
    beta,
    scale: float,
    cu_seqlens=None,
    chunk_indices=None,
    use_tf32_inverse: bool = False,
    output_qg: bool = False,
    out=None,
    *,
    variant: str | None = None,
    use_qk_l2norm_in_kernel: bool = False,
):
    """KDA chunk intra on the GPU (KDA_SPEC §3.2-3.4, §3.8): ``(w, u, qg or None, kg, Aqk, Akk_inv)``.

    Args:
        q, k: ``[B, T, H, K]`` bf16 (already preprocessed); v: ``[B, T, HV, V]`` bf16 with V = K in {64, 128}.
        gk: ``[B, T, HV, K]`` fp32 chunk-local cumulative gate in log2 units (``g_cum`` of ``kda_prepare``); the
            safe gate is assumed (every step's log-gate in [-5, 0]).
        beta: ``[B, T, HV]`` fp32 (activated).
        scale: folded into Aqk.
        cu_seqlens: int32 ``[N + 1]`` for packed sequences (B must be 1).
        chunk_indices: int32 ``[NT, 2]`` from :func:`cula_runtime.index.prepare_chunk_indices` (computed when None).
        use_tf32_inverse: not implemented (the inverse is fp32 on CUDA cores).
        output_qg: also return ``qg = bf16(q 2^gk)``.
        out: optional preallocated ``(w, u, qg, kg, Aqk, Akk_inv)`` (qg None unless ``output_qg``).
        variant: a name in :data:`VARIANTS` (here only the shared-memory plan, inverse form, prefetch and thread
            count count: ``fused*`` run as the ``lean-unrolled`` variant with the same prefetch and threads; see
            :class:`KdaIntraConfig`); None: ``CULA_CUTE_INTRA``, else :data:`DEFAULT_VARIANT` (with 4 warps at
            K = 64).
        use_qk_l2norm_in_kernel: q and k are raw; each row is L2-normalised in the kernel exactly as
            :func:`kda_prepare` would (same bits).

    Returns:
        w, qg, kg ``[B, T, HV, K]``; u ``[B, T, HV, V]``; Aqk ``[B, T, HV, 64]`` (scale folded in, zero above the
        diagonal); Akk_inv ``[B, T, HV, 64]`` (``(I + Akk)^-1``, unit diagonal, zero above). All bf16.
    """
    import torch

    if use_tf32_inverse:
        raise ValueError("chunk_kda_fwd_intra: use_tf32_inverse=True is not implemented (the inverse is fp32)")
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[3] != K:
        raise ValueError(f"v must be [B, T, HV, V] = [{B}, {T}, HV, {K}] (V = K), got {tuple(v.shape)}")
    HV = v.shape[2]
    if tuple(gk.shape) != (B, T, HV, K):
        raise ValueError(f"gk must be [B, T, HV, K] = [{B}, {T}, {HV}, {K}], got {tuple(gk.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = [{B}, {T}, {HV}], got {tuple(beta.shape)}")
    for name, t, dtype in (("q", q, torch.bfloat16), ("k", k, torch.bfloat16), ("v", v, torch.bfloat16),
                           ("gk", gk, torch.float32), ("beta", beta, torch.float32)):
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    device = q.device
    if device.type != "cuda" or any(t.device != device for t in (k, v, gk, beta)):
        raise ValueError("q, k, v, gk and beta must be CUDA tensors on one device")
    chunk_indices, num_chunks = chunk_rows(cu_seqlens, chunk_indices, B, T, device)
    return _intra(q, k, v, gk, beta, scale, cu_seqlens, chunk_indices, num_chunks, bool(output_qg),
                  _primitive_flags(variant, K), bool(use_qk_l2norm_in_kernel), out)


def _intra(q, k, v, gk, beta, scale: float, cu_seqlens, chunk_indices, num_chunks: int, output_qg: bool,
           flags: tuple, l2norm: bool, out, *, check_out: bool = True) -> tuple:
    """:func:`chunk_kda_fwd_intra` after its argument checks (``chunk_indices`` and ``num_chunks`` from
    :func:`~cula_runtime.cute.varlen.chunk_rows`, ``flags`` from :func:`variant_flags`): plan, allocate the outputs
    (or take ``out``: checked unless ``check_out`` is False, for a caller that carved them itself) and launch."""
    import torch

    B, T, H, K = q.shape
    HV = v.shape[2]
    device = q.device
    config, specs = _plan(H, HV, K, output_qg, cu_seqlens is not None, kernel_flags(flags), l2norm=l2norm)

    names = ("w", "u", "qg", "kg", "Aqk", "Akk_inv")
    if out is not None:
        if len(out) != 6:
            raise ValueError("out must be (w, u, qg, kg, Aqk, Akk_inv)")
        if check_out:
            shapes = ((B, T, HV, K),) * 4 + ((B, T, HV, 64),) * 2
            for name, t, shape in zip(names, out, shapes, strict=True):
                if name == "qg" and not output_qg:
                    continue
                if t is None or tuple(t.shape) != shape or t.dtype != torch.bfloat16 or t.device != device:
                    got = "None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
                    raise ValueError(f"out: {name} must be bfloat16 {shape} on {device}, got {got}")
        w, u, qg, kg, Aqk, Akk_inv = out
        outputs = (w, u, qg if output_qg else None, kg, Aqk, Akk_inv)
    else:
        def empty(cols: int):
            return torch.empty(B, T, HV, cols, dtype=torch.bfloat16, device=device)

        outputs = (empty(K), empty(K), empty(K) if output_qg else None, empty(K), empty(64), empty(64))
    if num_chunks == 0:
        return outputs
    _launch(config, specs, (q, k, v, gk, beta, *outputs, None, cu_seqlens, chunk_indices), scale, device)
    return outputs


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
    cu_seqlens=None,
    chunk_indices=None,
    variant: str | None = None,
):
    """:func:`kda_prepare` and :func:`chunk_kda_fwd_intra` in one launch, from the raw inputs (the cutedsl backend's
    ``fused-prepare`` path): ``(w, u, qg, kg, Aqk, g_last)``.

    Args:
        q, k: ``[B, T, H, K]`` bf16, raw; v: ``[B, T, HV, K]`` bf16.
        g: ``[B, T, HV, K]`` bf16 or fp32: the raw gate (``use_gate_in_kernel``) or the log-gate; its chunk-local
            cumsum is taken here, as kda_prepare takes it.
        beta: ``[B, T, HV]`` bf16 or fp32, logits with ``use_beta_sigmoid_in_kernel``.
        A_log, dt_bias, lower_bound, use_*_in_kernel, allow_neg_eigval: as :func:`kda_prepare`.
        scale, cu_seqlens, chunk_indices: as :func:`chunk_kda_fwd_intra`.
        variant: the shared-memory plan, inverse loop form, prefetch and threads (:data:`VARIANTS`); None:
            ``CULA_CUTE_INTRA`` if it names a ``fused-prepare`` variant, ``fused-prepare`` if it names another, else
            :data:`DEFAULT_VARIANT` (with 4 warps at K = 64).

    Returns:
        ``w, u, qg, kg, Aqk`` as :func:`chunk_kda_fwd_intra` with ``output_qg=True`` (bf16), and ``g_last`` fp32
        ``[B, NT, HV, K]`` (varlen ``[1, NC, HV, K]``, one row per row of ``chunk_indices``): ``g_cum`` at each
        chunk's last valid token, for :func:`~cula_runtime.cute.kda.recurrence.chunk_kda_fwd_recurrence` with
        ``gate_per_chunk=True``. The same bits as kda_prepare followed by chunk_kda_fwd_intra.
    """
    import torch

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
    flags = _primitive_flags(variant, K)
    if variant is None and not flags[3]:  # CULA_CUTE_INTRA names a variant without the in-kernel gate
        flags = VARIANTS["fused-prepare"]
    return _intra_from_raw(q, k, v, g, beta, scale, form, A_log, dt_bias, lower_bound,
                           bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval),
                           cu_seqlens, chunk_indices, num_chunks, flags)


def _intra_from_raw(q, k, v, g, beta, scale: float, form: str, A_log, dt_bias, lower_bound: float | None,
                    l2norm: bool, beta_sigmoid: bool, allow_neg_eigval: bool, cu_seqlens, chunk_indices,
                    num_chunks: int, flags: tuple, out=None) -> tuple:
    """:func:`chunk_kda_fwd_intra_from_raw` after its argument checks (``form``, ``A_log``, ``dt_bias`` from
    :func:`gate_arguments`; g and beta bf16 or fp32): plan, allocate the outputs unless ``out`` (the caller's own,
    unchecked: the cutedsl backend carves them from its workspace) and launch."""
    import torch

    B, T, H, K = q.shape
    HV = v.shape[2]
    device = q.device
    varlen = cu_seqlens is not None
    names = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    gate = InKernelGate(form=form, g_dtype=names[g.dtype], beta_dtype=names[beta.dtype],
                        has_A_log=A_log is not None, has_dt_bias=dt_bias is not None, beta_sigmoid=beta_sigmoid,
                        allow_neg_eigval=allow_neg_eigval)
    config, specs = _plan(H, HV, K, True, varlen, kernel_flags(flags), l2norm=l2norm, gate=gate, output_akk_inv=False)
    if out is not None:
        w, u, qg, kg, Aqk, g_last = out
    else:
        bf16 = torch.bfloat16
        w, u, qg, kg = (torch.empty(B, T, HV, K, dtype=bf16, device=device) for _ in range(4))
        Aqk = torch.empty(B, T, HV, 64, dtype=bf16, device=device)
        g_last = torch.empty(B, num_chunks if varlen else -(-T // 64), HV, K, dtype=torch.float32, device=device)
    if num_chunks:
        _launch(config, specs, (q, k, v, g, beta, w, u, qg, kg, Aqk, None, None, cu_seqlens, chunk_indices), scale,
                device, gate_tensors=(A_log, dt_bias, g_last),
                lower_bound=lower_bound if form == "safe" else 0.0)
    return w, u, qg, kg, Aqk, g_last


# ---- the modular path: the same work in three launches (FLA's intra scores, solve_tril and recompute_w_u)


def chunk_kda_fwd_scores(q, k, gk, beta, scale: float, cu_seqlens=None, chunk_indices=None,
                         use_qk_l2norm_in_kernel: bool = False):
    """Modular step 1: ``(Aqk, Akk)`` of every chunk (KDA_SPEC §3.2, §3.7, safe gate).

    Args: as :func:`chunk_kda_fwd_intra` (``q``, ``k`` ``[B, T, H, K]`` bf16; ``gk`` fp32 log2 units; ``beta`` fp32;
        ``use_qk_l2norm_in_kernel``).

    Returns:
        ``Aqk`` bf16 ``[B, T, HV, 64]`` (scale folded in, zero above the diagonal, as the one-launch primitive) and
        ``Akk`` fp32 ``[B, T, HV, 64]`` (β-scaled, strictly lower; zero on and above the diagonal).
    """
    import torch

    B, T, H, K = q.shape
    HV = gk.shape[2]
    check_token_tensors({"q": (q, H, K, torch.bfloat16), "k": (k, H, K, torch.bfloat16),
                   "gk": (gk, HV, K, torch.float32), "beta": (beta, HV, None, torch.float32)}, B, T)
    chunk_indices, num_chunks = chunk_rows(cu_seqlens, chunk_indices, B, T, q.device)
    config, specs = _plan(H, HV, K, False, cu_seqlens is not None, (False, False), "scores",
                          bool(use_qk_l2norm_in_kernel))
    Aqk = torch.empty(B, T, HV, 64, dtype=torch.bfloat16, device=q.device)
    Akk = torch.empty(B, T, HV, 64, dtype=torch.float32, device=q.device)
    if num_chunks:
        _launch(config, specs, (q, k, None, gk, beta, None, None, None, None, Aqk, None, Akk, cu_seqlens,
                                chunk_indices), scale, q.device)
    return Aqk, Akk


def chunk_kda_solve_tril(Akk, cu_seqlens=None, chunk_indices=None, use_tf32_inverse: bool = False,
                         *, unrolled: bool = False):
    """Modular step 2: ``Akk_inv = (I + Akk)^-1`` per chunk, fp32 substitution (KDA_SPEC §3.3).

    Args:
        Akk: fp32 ``[B, T, HV, 64]`` as :func:`chunk_kda_fwd_scores` returns it (strictly lower).
        use_tf32_inverse: not implemented (``ValueError``).
        unrolled: the compile-time-bounded substitution (same bits; see :class:`KdaIntraConfig`).

    Returns:
        ``Akk_inv`` bf16 ``[B, T, HV, 64]``: unit diagonal, zero above it.
    """
    import torch

    if use_tf32_inverse:
        raise ValueError("chunk_kda_solve_tril: use_tf32_inverse=True is not implemented (the inverse is fp32)")
    B, T, HV = Akk.shape[:3]
    check_token_tensors({"Akk": (Akk, HV, 64, torch.float32)}, B, T)
    chunk_indices, num_chunks = chunk_rows(cu_seqlens, chunk_indices, B, T, Akk.device)
    config, specs = _plan(HV, HV, 128, False, cu_seqlens is not None, (False, bool(unrolled)), "inverse")
    Akk_inv = torch.empty(B, T, HV, 64, dtype=torch.bfloat16, device=Akk.device)
    if num_chunks:
        _launch(config, specs, (None,) * 10 + (Akk_inv, Akk, cu_seqlens, chunk_indices), 1.0, Akk.device)
    return Akk_inv


def chunk_kda_recompute_w_u(k, v, gk, beta, Akk_inv, q=None, cu_seqlens=None, chunk_indices=None,
                            use_qk_l2norm_in_kernel: bool = False):
    """Modular step 3: ``(w, u, qg or None, kg)`` from the inverse (KDA_SPEC §3.4).

    Args:
        k: ``[B, T, H, K]`` bf16; v: ``[B, T, HV, K]`` bf16; gk, beta: as :func:`chunk_kda_fwd_intra`.
        Akk_inv: bf16 ``[B, T, HV, 64]`` with exact zeros above the diagonal (as :func:`chunk_kda_solve_tril`
            writes it).
        q: ``[B, T, H, K]`` bf16, to also return ``qg = bf16(q 2^gk)``; None: no qg.
        use_qk_l2norm_in_kernel: k (and q) are raw and L2-normalised in the kernel, as :func:`kda_prepare` does.

    Returns:
        w, kg (and qg) ``[B, T, HV, K]``, u ``[B, T, HV, K]``, all bf16: the one-launch primitive's, bit for bit.
    """
    import torch

    B, T, H, K = k.shape
    HV = v.shape[2]
    named = {"k": (k, H, K, torch.bfloat16), "v": (v, HV, K, torch.bfloat16), "gk": (gk, HV, K, torch.float32),
             "beta": (beta, HV, None, torch.float32), "Akk_inv": (Akk_inv, HV, 64, torch.bfloat16)}
    if q is not None:
        named["q"] = (q, H, K, torch.bfloat16)
    check_token_tensors(named, B, T)
    chunk_indices, num_chunks = chunk_rows(cu_seqlens, chunk_indices, B, T, k.device)
    config, specs = _plan(H, HV, K, q is not None, cu_seqlens is not None, (False, False), "wu",
                          bool(use_qk_l2norm_in_kernel))
    w, u, kg = (torch.empty(B, T, HV, K, dtype=torch.bfloat16, device=k.device) for _ in range(3))
    qg = torch.empty(B, T, HV, K, dtype=torch.bfloat16, device=k.device) if q is not None else None
    if num_chunks:
        _launch(config, specs, (q, k, v, gk, beta, w, u, qg, kg, None, Akk_inv, None, cu_seqlens, chunk_indices),
                1.0, k.device)
    return w, u, qg, kg
