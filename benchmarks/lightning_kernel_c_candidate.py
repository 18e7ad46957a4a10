"""A candidate for kernel C of the Lightning prefill (issue 28): the same outputs, bit for bit, as
:mod:`cula_runtime.cute.lightning.chunk_output` (the product kernel), from one 8-warp CTA per (segment, head) with
one CTA barrier per chunk. Not used by any backend: ``benchmarks/ab_lightning_kernel_c.py`` times it against the
product kernel on the H200 and checks the bits; only that A/B decides whether it replaces the product.

What it computes is what the product module's docstring states (the score tile ``P``, ``o``, the state update,
their rounding points). What differs is how the work is laid out:

* One CTA of 8 warps per (segment s, head h) covers all 128 value columns (grid ``NSEG · H``, head fastest): the
  score tile is made once per chunk, not once per V block (the product at V block 64 makes it twice). Warp w owns
  value rows ``16 w .. 16 w + 15`` of ``Sᵀ`` (64 fp32 registers per thread), so the state needs no exchange
  between warps; the score tile's 10 lower 16 x 16 blocks are split 2, 2, 1, ..., 1 over the warps (the product's
  own table for 8 warps, made by its own method; per SM sub-partition, warps w and w + 4, that is 3, 3, 2, 2
  blocks, the best split of 10 whole blocks).
* Four shared-memory stages of (q, k, v), 48 KB each, filled by ``cp.async`` two chunks ahead, and the score
  tile double-buffered. The chunk loop is skewed by one: step i (i = 0 .. n, for a segment of n chunks) makes the
  score tile of chunk i (if i < n) and then the outputs of chunk i - 1 (if i > 0). So each step needs one CTA
  barrier, at its start, and it guarantees everything at once:

  - chunk i's tiles have landed (each thread waits for its own copies, ``cp.async.wait_group 1``: all but the
    newest group, chunk i + 1's; the barrier then makes every thread's copies and zero fills visible), and so
    have the decay tables (written before the loop, for step 0);
  - the score tile of chunk i - 1 (buffer ``(i - 1) % 2``, made in step i - 1) is complete;
  - every warp is done with step i - 1, hence with chunk i - 2: its stage ``(i - 2) % 4`` (q, k read by its
    scores in step i - 2 and by its products in step i - 1; v read, then overwritten by the o staging) may be
    refilled with chunk i + 2, and its score buffer ``i % 2`` overwritten with the scores of chunk i.

  In step i the four stages hold chunk i (scores), chunk i - 1 (outputs), chunk i + 1 (in flight since step
  i - 1) and chunk i + 2 (issued now). Per step after the barrier: the copies of chunk i + 2 (one commit group per
  step, empty past the segment's end, so the wait count stays 1), this warp's score blocks of chunk i into buffer
  ``i % 2``, then for chunk c = i - 1: ``Sᵀ_bf · qᵀ``, ``vᵀ · Pᵀ`` from buffer ``c % 2``, the state update (not after
  the segment's last chunk), oᵀ staged with ``stmatrix.trans`` over this warp's own v columns of stage ``c % 4``
  (read by no other warp) and 16-byte row stores of the valid rows. Before the loop: the copies of chunks 0 and 1,
  the decay tables and the start state; no barrier (n + 1 barriers per CTA in all; the product has 2n).
* Addresses: the wrapper requires q, k, v and o contiguous, so the kernel views them with static strides
  (``H·128`` per row): every copy of a chunk is a constant offset from the chunk's first row, a 64-bit product of
  a row index and ``H·128`` (no 32-bit overflow for any token count).
* Shared memory: 4 x (16 + 16 + 16) KB + 2 x 8 KB score tiles + 768 B tables = 213,760 B (one CTA per SM, under
  the 227 KB a CTA may have on the H200). Registers: whatever ptxas takes for 256 threads (at most 255; compiled
  with CuTeDSL 4.8.1: 252 on sm_90a, 242 on sm_100a / sm_103a, no spill, no stack). SASS: 1824 instructions on
  sm_90a (the step loop 1358, every warp's score branch included), 1776 on sm_100a / sm_103a; per chunk 308 HMMA,
  186 + 36 LDSM, 4 STSM, 12 LDGSTS per thread, one BAR.SYNC (the product at V block 64: 2032 instructions, two
  barriers, 255 registers).

Why the bits are those of the product kernel (at either of its V blocks): every output and state element is made
by the same operations on the same operands in the same order, only by another warp or at another time.

* The decay tables are the same expressions (exp2 of ``d · g · log2(e)``, fastmath, times ``scale``).
* The score tile is made by the product's own method (:meth:`LightningChunkOutput.scores`: the same MMAs over K in
  the same order, the same table entry, the same mask and the same bf16 rounding), only into the other buffer.
* For a value row r and a chunk, ``oᵀ`` is zero, then 8 MMAs over K with ``bf16(S)`` and q (k-blocks in order),
  times ``scale · λ^(i+1)``, then ``vᵀ · Pᵀ`` with key block kb = 0, 1, ... up to the query tile's, in order,
  rounded to bf16: the product's sequence. An m16n8k16 MMA's result for one element depends only on that
  element's row of A, column of B and accumulator, so which warp holds row r (here warp r // 16 of all 128 rows,
  there warp (r mod 64) // 16 of a V block) does not matter, nor does the score tile's buffer.
* The state: ``λ^64 · Sᵀ``, then 4 MMAs with ``bf16(vᵀ · λ^(63-j))`` and kᵀ (token blocks in order), skipped after
  the segment's last chunk; the start state is the same fp32 load.
* The operands are the same bits: q, k, v are copied unchanged (rows past the segment's end zero-filled, the
  same in both), the score tile and o are rounded by the same conversions. Loads issued earlier, into other
  stages, change none of them.

Only warp-level MMA (``mma.sync`` m16n8k16 bf16, fp32 accumulate), as the product: one source for SM90, SM100 and
SM103. :func:`lightning_chunk_output` is the host wrapper, with the product's signature (``block_v``: None or 128).
"""

from __future__ import annotations

import functools
import math
import numbers

from cula_runtime.cute.compile_cache import launch, missing_cutedsl
from cula_runtime.cute.dsl_compat import SmemAllocator
from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput, LightningChunkOutputConfig

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64
    from cutlass.cute.nvgpu import warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["BLOCK_V", "STAGES", "LightningChunkOutputCandidate", "candidate_config", "lightning_chunk_output",
           "shared_memory_bytes"]

BLOCK_V = 128  # value columns per CTA: all of them (8 warps)
STAGES = 4  # shared-memory stages of (q, k, v): chunk c computes while chunks c + 1 .. c + 3 are held or in flight
SCORE_BUFFERS = 2  # the score tile of chunk c is read while that of chunk c + 1 is made
_LOG2E = 1.4426950408889634
_MAX_GRID_X = 2**31 - 1


def candidate_config(num_heads: int) -> LightningChunkOutputConfig:
    """The candidate's compile-time configuration for ``num_heads`` heads (the product's config class, V block 128:
    the compile cache keys it by kernel class too, so it never collides with the product's)."""
    return LightningChunkOutputConfig(num_heads=num_heads, block_v=BLOCK_V)


class LightningChunkOutputCandidate(LightningChunkOutput):
    """Kernel C, one 8-warp CTA per (segment, head), four stages, one barrier per chunk (the module docstring)."""

    @staticmethod
    def can_implement(config: LightningChunkOutputConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config`` (the product's rules, and V block 128 only), and why not."""
        ok, reason = LightningChunkOutput.can_implement(config)
        if not ok:
            return ok, reason
        if config.block_v != BLOCK_V:
            return False, f"block_v={config.block_v}: the candidate's CTA covers all {BLOCK_V} value columns"
        return True, ""

    # ------------------------------------------------------------------------------------------------------------
    # Host side: layouts, atoms, launch

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mS0: cute.Tensor,
        mSeg: cute.Tensor,
        mO: cute.Tensor,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        c = self.config
        C, K = c.chunk_size, c.head_dim
        sX_layout = self._smem_layout(C, K, STAGES)  # q, k and v alike: (C tokens, 128, stage)
        sP_layout = self._smem_layout(C, C, SCORE_BUFFERS)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sX_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sX_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sX_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]
            sPdec: cute.struct.Align[cute.struct.MemRange[Float32, C], 16]  # scale · λ^d
            sOdec: cute.struct.Align[cute.struct.MemRange[Float32, C], 16]  # scale · λ^(i+1)
            sVdec: cute.struct.Align[cute.struct.MemRange[Float32, C], 16]  # λ^(63-j)

        tiled_mma = self.make_tiled_mma()
        score_mma = self.make_score_mma()
        grid = [mSeg.shape[0] * c.num_heads, 1, 1]
        self.kernel(
            self._packed_rows(mQ), self._packed_rows(mK), self._packed_rows(mV), mG, mS0, mSeg,
            self._packed_rows(mO), scale, sX_layout, sP_layout, tiled_mma, score_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    def _packed_rows(self, mX: cute.Tensor) -> cute.Tensor:
        """``mX`` (``[1, B·T, H, 128]``, contiguous: the wrapper checks it) with its strides static: ``(0, H·128,
        128, 1)``. Only the token count stays symbolic, so every address within a chunk is a constant offset from the
        chunk's first row (a 64-bit row index times ``H·128``: the kernel passes 64-bit row indices)."""
        c = self.config
        row = c.num_heads * c.head_dim
        return cute.make_tensor(mX.iterator, cute.make_layout((1, mX.shape[1], c.num_heads, c.head_dim),
                                                              stride=(0, row, c.head_dim, 1)))

    # ------------------------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mS0: cute.Tensor,
        mSeg: cute.Tensor,
        mO: cute.Tensor,
        scale: Float32,
        sX_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        score_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        c = self.config
        C, K = c.chunk_size, c.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        h = bidx % c.num_heads  # one linear index: head fastest, then segment
        seg = bidx // c.num_heads
        warp_idx = tidx // 32
        lane = tidx % 32
        vb = Int32(0)  # the one V block

        # The segment: rows start .. start + length - 1 of the flattened token axis, clamped to the tensor.
        rows = mQ.shape[1]
        start = cutlass.max(mSeg[seg, 1], Int32(0))
        length = cutlass.max(cutlass.min(mSeg[seg, 2], rows - start), Int32(0))
        num_chunks = (length + (C - 1)) // C

        # ---- shared memory
        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sX_layout)  # (C tokens, K, stage)
        sK = storage.sK.get_tensor(sX_layout)
        sV = storage.sV.get_tensor(sX_layout)  # (C tokens, V, stage)
        sP = storage.sP.get_tensor(sP_layout)  # (C query, C key, buffer)
        sPdec = storage.sPdec.get_tensor(cute.make_layout(C))
        sOdec = storage.sOdec.get_tensor(cute.make_layout(C))
        sVdec = storage.sVdec.get_tensor(cute.make_layout(C))
        # Transposed views (the composition maps (col, row, stage) onto the token-major tiles).
        sKT = cute.composition(sK, cute.make_layout((K, C, STAGES), stride=(C, 1, C * K)))  # (K, C tokens, stage)
        sVT = cute.composition(sV, cute.make_layout((K, C, STAGES), stride=(C, 1, C * K)))  # (V, C tokens, stage)
        # Per-token factors broadcast over the value rows, for the accumulator partition (columns = tokens).
        sOdecB = cute.make_tensor(sOdec.iterator, cute.make_layout((K, C), stride=(0, 1)))
        sVdecB = cute.make_tensor(sVdec.iterator, cute.make_layout((K, C), stride=(0, 1)))

        # ---- global -> shared copies of chunks 0 and 1, one commit group each (empty past the segment)
        g2s = self._g2s_copy(K).get_slice(tidx)
        loader = (g2s, g2s)
        for ahead in cutlass.range(STAGES - 2, unroll=1):
            if ahead < num_chunks:
                self.load_chunk(loader, mQ, mK, mV, sQ, sK, sV, h, vb, Int64(start + ahead * C),
                                cutlass.min(length - ahead * C, C), ahead)
            cute.arch.cp_async_commit_group()

        # ---- decay powers, once per CTA: exp2 of d · g · log2(e) with d >= 0 (the product's expressions)
        lg = mG[h] * Float32(_LOG2E)
        if tidx < C:
            d = Float32(tidx)
            sPdec[tidx] = scale * cute.math.exp2(d * lg, fastmath=True)
            sOdec[tidx] = scale * cute.math.exp2((d + Float32(1.0)) * lg, fastmath=True)
            sVdec[tidx] = cute.math.exp2(Float32(C - 1 - tidx) * lg, fastmath=True)
        lam_chunk = cute.math.exp2(Float32(C) * lg, fastmath=True)  # λ^64

        # ---- MMA partitions (M = the 128 value rows, warp w rows 16 w ..), as the product's:
        #   oᵀ  = Sᵀ_bf (V x K) · qᵀ     -> (V x C);  B = q as (C tokens, K)
        #   oᵀ += vᵀ    (V x C) · Pᵀ     -> (V x C);  B = P as (C query, C key)
        #   Sᵀ += vᵀdec (V x C) · k      -> (V x K);  B = kᵀ as (K, C tokens)
        thr_mma = tiled_mma.get_slice(tidx)
        tSrS = cute.make_rmem_tensor(thr_mma.partition_shape_C((K, K)), Float32)  # ((2,2), 1, K/8)
        accO = cute.make_rmem_tensor(thr_mma.partition_shape_C((K, C)), Float32)  # ((2,2), 1, C/8)
        tCrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ[None, None, 0]))  # (V, C/8, K/16)
        tCrP = thr_mma.make_fragment_B(thr_mma.partition_B(sP[None, None, 0]))  # (V, C/8, C/16)
        tCrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKT[None, None, 0]))  # (V, K/8, C/16)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        stsm_t = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        s2r_B = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        s2r_Bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        s2r_C = cute.make_tiled_copy_C(ldsm_t, tiled_mma).get_slice(tidx)
        r2s_C = cute.make_tiled_copy_C(stsm_t, tiled_mma).get_slice(tidx)
        tCsQ = s2r_B.partition_S(sQ)  # (CPY, C/16, K/16, stage)
        tCsP = s2r_B.partition_S(sP)  # (CPY, C/16, C/16, buffer)
        tCsK = s2r_Bt.partition_S(sKT)  # (CPY, K/16, C/16, stage)
        tCrQ_v = s2r_B.retile(tCrQ)
        tCrP_v = s2r_B.retile(tCrP)
        tCrK_v = s2r_Bt.retile(tCrK)
        rV = cute.make_rmem_tensor(accO.layout, BFloat16)
        rO = cute.make_rmem_tensor(accO.layout, BFloat16)
        tCsV = s2r_C.partition_S(sVT)  # vᵀ read in accumulator layout: this warp's 16 v columns only
        tCrV_v = s2r_C.retile(rV)
        tCsO = r2s_C.partition_D(sVT)  # oᵀ staged over the warp's own (consumed) v columns
        tCrO_v = r2s_C.retile(rO)
        tOsOdec = thr_mma.partition_C(sOdecB)
        tVsVdec = thr_mma.partition_C(sVdecB)

        # ---- the segment's start state (fp32) into the accumulator layout of Sᵀ
        tSgS0 = thr_mma.partition_C(self._state_tile(mS0[seg, h, None, None], vb))
        if num_chunks > 0:
            tSrS.store(tSgS0.load())

        # ---- step i: the score tile of chunk i (if any), then the outputs of chunk i - 1 (if any)
        for step in cutlass.range(num_chunks + 1, unroll=1):
            cute.arch.cp_async_wait_group(STAGES - 3)  # this thread's copies of chunk i landed (not i + 1's)
            cute.arch.sync_threads()  # chunk i visible, P of chunk i - 1 complete, everyone done with step i - 1

            # ---- refill the stage of chunk i - 2 with chunk i + 2 (an empty group past the segment's end)
            ahead = step + (STAGES - 2)
            if ahead < num_chunks:
                self.load_chunk(loader, mQ, mK, mV, sQ, sK, sV, h, vb, Int64(start + ahead * C),
                                cutlass.min(length - ahead * C, C), ahead % STAGES)
            cute.arch.cp_async_commit_group()

            # ---- this warp's blocks of chunk i's score tile, into buffer i % 2
            if step < num_chunks:
                now = step % STAGES
                self.scores(score_mma, sQ[None, None, now], sK[None, None, now],
                            sP[None, None, step % SCORE_BUFFERS], sPdec, warp_idx, lane)

            if step > 0:
                self.outputs(step - 1, num_chunks, length, start, h, mO, tiled_mma, lam_chunk, tSrS, accO, tCrQ,
                             tCrP, tCrK, rV, rO, (s2r_B, s2r_Bt, s2r_C, r2s_C), (tCsQ, tCsP, tCsK, tCsV, tCsO),
                             (tCrQ_v, tCrP_v, tCrK_v, tCrV_v, tCrO_v), tOsOdec, tVsVdec, sV, tidx)

    @cute.jit
    def outputs(self, chunk: Int32, num_chunks: Int32, length: Int32, start: Int32, h: Int32, mO: cute.Tensor,
                tiled_mma: cute.TiledMma, lam_chunk: Float32, tSrS: cute.Tensor, accO: cute.Tensor,
                tCrQ: cute.Tensor, tCrP: cute.Tensor, tCrK: cute.Tensor, rV: cute.Tensor, rO: cute.Tensor,
                copies: tuple, smem_parts: tuple, reg_views: tuple, tOsOdec: cute.Tensor, tVsVdec: cute.Tensor,
                sV: cute.Tensor, tidx: Int32):
        """Chunk ``chunk``'s outputs from the state ``tSrS`` (this warp's 16 value rows), then the state's update
        (not after the segment's last chunk): the product kernel's products, in its order. Reads stage
        ``chunk % 4`` and score buffer ``chunk % 2``; stages oᵀ over this warp's own v columns of that stage."""
        C, K = self.config.chunk_size, self.config.head_dim
        s2r_B, s2r_Bt, s2r_C, r2s_C = copies
        tCsQ, tCsP, tCsK, tCsV, tCsO = smem_parts
        tCrQ_v, tCrP_v, tCrK_v, tCrV_v, tCrO_v = reg_views
        stage = chunk % STAGES
        buf = chunk % SCORE_BUFFERS
        chunk_len = cutlass.min(length - chunk * C, C)

        # ---- oᵀ = (Sᵀ_bf · qᵀ) ⊙ scale · λ^(i+1)
        rSbf = cute.make_rmem_tensor(tSrS.layout, BFloat16)
        rSbf.store(tSrS.load().to(BFloat16))
        tSrSbf_A = self._acc_as_operand_a(rSbf)  # (((2,2),2), 1, K/16)
        accO.fill(0.0)
        for kb in cutlass.range_constexpr(K // self.mma_k):
            cute.copy(s2r_B, tCsQ[None, None, kb, stage], tCrQ_v[None, None, kb])
            cute.gemm(tiled_mma, accO, tSrSbf_A[None, None, kb], tCrQ[None, None, kb], accO)
        accO.store(accO.load() * tOsOdec.load())

        # ---- vᵀ (this warp's value rows, all tokens) as the A operand of both remaining products
        cute.copy(s2r_C, tCsV[None, None, None, stage], tCrV_v)
        tCrV_A = self._acc_as_operand_a(rV)  # (((2,2),2), 1, C/16)

        # ---- oᵀ += vᵀ · Pᵀ: query tile nt (8 tokens) needs key blocks kb <= nt / 2
        for kb in cutlass.range_constexpr(C // self.mma_k):
            cute.copy(s2r_B, tCsP[None, None, kb, buf], tCrP_v[None, None, kb])
            for nt in cutlass.range_constexpr(2 * kb, C // 8):
                acc = self._rank3(accO[None, None, nt])
                cute.gemm(tiled_mma, acc, self._rank3(tCrV_A[None, None, kb]), self._rank3(tCrP[None, nt, kb]), acc)

        # ---- Sᵀ = λ^64 Sᵀ + bf16(vᵀ ⊙ λ^(63-j)) · k, for the next chunk (none after the segment's last)
        if chunk + 1 < num_chunks:
            rVdec = cute.make_rmem_tensor(accO.layout, BFloat16)
            rVdec.store((rV.load().to(Float32) * tVsVdec.load()).to(BFloat16))
            tCrVdec_A = self._acc_as_operand_a(rVdec)
            tSrS.store(tSrS.load() * lam_chunk)
            for kb in cutlass.range_constexpr(C // self.mma_k):
                cute.copy(s2r_Bt, tCsK[None, None, kb, stage], tCrK_v[None, None, kb])
                cute.gemm(tiled_mma, tSrS, tCrVdec_A[None, None, kb], tCrK[None, None, kb], tSrS)

        # ---- o: stage oᵀ over this warp's own v columns (already read), then 16-byte stores of rows < chunk_len
        rO.store(accO.load().to(BFloat16))
        cute.arch.sync_warp()
        cute.copy(r2s_C, tCrO_v, tCsO[None, None, None, stage])
        cute.arch.sync_warp()
        self.store_rows(mO, sV[None, None, stage], Int32(0), h, Int32(0), Int64(start + chunk * C), chunk_len,
                        tidx)


@functools.lru_cache(maxsize=64)
def _plan(H: int) -> tuple:
    """The config and argument specs of one head count (cached: no work per call)."""
    config = candidate_config(H)
    ok, reason = LightningChunkOutputCandidate.can_implement(config)
    if not ok:
        raise ValueError(f"LightningChunkOutputCandidate: {reason}")
    return config, LightningChunkOutputCandidate(config).argument_specs()


_OUTPUTS = frozenset({6})  # o among the tensor arguments


def _check_arguments(q, k, v, g_gamma, seg_state, segments, o, scale, seg_len, block_v) -> int:
    """Every check of :func:`lightning_chunk_output`, in the product wrapper's order; returns NSEG."""
    import torch

    named = {"q": q, "k": k, "v": v, "g_gamma": g_gamma, "seg_state": seg_state, "segments": segments, "o": o}
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if q.dim() != 3 or q.shape[2] != 128:
        raise ValueError(f"q must be [B·T, H, 128], got {tuple(q.shape)}")
    rows, H, K = q.shape
    device = q.device
    for name in ("q", "k", "v", "o"):
        tensor = named[name]
        if tuple(tensor.shape) != (rows, H, K) or tensor.dtype != torch.bfloat16 or tensor.device != device:
            raise ValueError(f"{name} must be bfloat16 [{rows}, {H}, {K}] on {device}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)} on {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (what the prefill backend passes), got strides "
                             f"{tensor.stride()}")
    if (tuple(g_gamma.shape) != (H,) or g_gamma.dtype != torch.float32 or g_gamma.device != device
            or not g_gamma.is_contiguous()):
        raise ValueError(f"g_gamma must be contiguous float32 [{H}] on {device}, got {g_gamma.dtype} "
                         f"{tuple(g_gamma.shape)} on {g_gamma.device}")
    if (segments.dim() != 2 or segments.shape[1] != 4 or segments.dtype != torch.int32 or segments.device != device
            or not segments.is_contiguous()):
        raise ValueError(f"segments must be contiguous int32 [NSEG, 4] on {device}, got {segments.dtype} "
                         f"{tuple(segments.shape)} on {segments.device}")
    nseg = segments.shape[0]
    if (tuple(seg_state.shape) != (nseg, H, K, K) or seg_state.dtype != torch.float32
            or seg_state.device != device or not seg_state.is_contiguous()):
        raise ValueError(f"seg_state must be contiguous float32 [{nseg}, {H}, {K}, {K}] on {device}, got "
                         f"{seg_state.dtype} {tuple(seg_state.shape)} on {seg_state.device}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite real number, got {scale!r}")
    if isinstance(seg_len, bool) or not isinstance(seg_len, numbers.Integral) or seg_len < 64 or seg_len % 64:
        raise ValueError(f"seg_len must be a positive multiple of 64, got {seg_len!r}")
    if block_v not in (None, BLOCK_V):
        raise ValueError(f"block_v must be None or {BLOCK_V} (the candidate's CTA covers every value column), "
                         f"got {block_v!r}")
    if nseg * H > _MAX_GRID_X:
        raise ValueError(f"{nseg} segments x {H} heads exceed the grid ({_MAX_GRID_X} CTAs)")
    if device.type != "cuda":
        raise ValueError(f"q, k, v, g_gamma, seg_state, segments and o must be on one CUDA device, got {device}")
    return nseg


def lightning_chunk_output(q, k, v, g_gamma, seg_state, segments, o, scale: float, seg_len: int, *,
                           block_v: int | None = None) -> None:
    """The candidate kernel C: every segment's outputs from its start state, written into ``o`` (the product's
    :func:`cula_runtime.cute.lightning.chunk_output.lightning_chunk_output`, the same bits).

    Args:
        q, k: bf16 ``[B·T, H, 128]`` contiguous (the flattened token axis), on one CUDA device.
        v: bf16 ``[B·T, H, 128]`` contiguous.
        g_gamma: fp32 ``[H]`` contiguous: each head's log-decay (<= 0; λ = exp(g_gamma[h])).
        seg_state: fp32 ``[NSEG, H, 128, 128]`` contiguous (K-first): each segment's START state.
        segments: int32 ``[NSEG, 4]`` contiguous, row s = (sequence, first row, length, 0), ``1 <= length <=
            seg_len``; read on the device only (lengths and rows clamped to the token axis there).
        o: bf16 ``[B·T, H, 128]`` contiguous, preallocated: every row of every segment is written, no other row.
        scale: the output's factor.
        seg_len: the segment length the table was built with (a positive multiple of 64).
        block_v: None or 128 (the product's keyword; the candidate has one V block).

    Launched on the current stream; the first call per head count compiles.

    Raises:
        TypeError: an argument is not a tensor / number of the expected kind.
        ValueError: a shape, dtype, device, layout or ``block_v`` other than the above.
    """
    nseg = _check_arguments(q, k, v, g_gamma, seg_state, segments, o, scale, seg_len, block_v)
    if nseg == 0 or q.shape[0] == 0:
        return
    config, specs = _plan(q.shape[1])
    tensors = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g_gamma, seg_state, segments, o.unsqueeze(0))
    launch(LightningChunkOutputCandidate, config, specs, tensors, _OUTPUTS, q.device, float(scale))


def shared_memory_bytes() -> int:
    """The candidate's shared memory per CTA as its struct lays it out (1024-byte aligned tiles, 16-byte tables)."""
    tile = 64 * 128 * 2 * STAGES
    score = 64 * 64 * 2 * SCORE_BUFFERS
    return 3 * tile + score + 3 * 64 * 4

