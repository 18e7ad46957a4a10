"""Lightning prefill, kernel C: every segment's outputs from its start state, in one CuTeDSL launch (KDA_SPEC §5;
issue 28; the segment design in ``prefill_backend.py``).

Per (segment s, head h), one CTA of 8 warps (all 128 value columns: ``block_v`` = 128) starts from the segment's
start state ``S = seg_state[s, h]`` (fp32 ``[K, V]``; what the scan of ``chunk_states.py`` left there) and walks
the segment's chunks of <= 64 tokens in order. With λ = exp(g_gamma[h]) and local token indices i, j:

* ``P[i, j] = bf16(scale · λ^(i-j) · (q_i · k_j))`` for ``j <= i``, else 0 (the masked, decayed score tile, computed
  here from q and k: fp32 accumulators, rounded once);
* ``o_i = bf16(scale · λ^(i+1) · (q_i · S_bf) + Σ_j P[i, j] v_j)`` for the chunk's valid rows i < L, with
  ``S_bf = bf16(S)``;
* unless it is the segment's last chunk (the only one that may be partial):
  ``S = λ^64 S + Σ_j bf16(λ^(63-j) v_j)ᵀ k_j`` (fp32, in registers for the whole segment).

**The direct form** (``direct=True`` in the config; the prefill backend runs it where every sequence fits in one segment
or no sequence is much longer than the tokens per SM: ``prefill_backend.uses_direct_form``): the table has one row per
sequence (empty ones too), S starts from the sequence's initial state instead of ``seg_state`` (h0 in either layout, or
its pool slot widened from fp32/bf16, or zeros: padding slots, a False ``has_initial_state``, no h0), and with a final
state asked the last chunk updates S too, decayed by its true length L: ``S = λ^L S + Σ_{j<L} bf16(λ^(L-1-j) v_j)ᵀ k_j``
(factors made in registers, 0 past L: never the exponential of a positive number), then S goes to ``final_state[n]``
(fp32) or back to the pool slot (rounded to its dtype). One launch in place of three: q, k, v read once, no segment
states. **Over segments with final states** (the prefill backend's segments form: kernels A and B ``skip_last``) each
sequence's last segment (``segments[s, 3] != 0``) ends the same way, from its start state in ``seg_state``: its last
chunk's update decayed by its true length, then ``final_state[n]`` or the pool slot. The accumulator layout reads
and writes a state as 8-byte pairs where it is V-first (two adjacent k columns),
as 4-byte elements (32 bytes per 8 lanes) where it is K-first. In a pool call, every CTA of a padding row (its slot
outside ``[0, P)``) stores zeros for o, as KDA's pool form does (KDA_SPEC §10).

This is the KDA recurrence's chunk step (:mod:`cula_runtime.cute.kda.recurrence`) with w = 0, u = v, a scalar
decay and the intra scores made in the kernel. As there, everything is transposed so that the state is the A
operand and the products chain in registers: ``oᵀ = Sᵀ_bf · qᵀ`` (A = Sᵀ_bf straight from the fp32 state's
registers; B = q from shared memory), ``oᵀ += vᵀ · Pᵀ`` and ``Sᵀ = λ^64 Sᵀ + vᵀ_dec · k`` (A = vᵀ read once per
chunk with ``ldmatrix.trans`` in accumulator layout, two n8 tiles = one k16 A fragment; B = the score tile and kᵀ
from shared memory). Warp w owns value rows ``16 w .. 16 w + 15`` of Sᵀ (64 fp32 registers per thread): the
state needs no exchange between warps. The score tile is the only thing the warps share: its 10 lower 16 x 16
blocks are split over the warps (2, 2, 1, ..., 1; each warp's blocks are one run of adjacent key blocks of one
query block), written to shared memory in bf16
(rows padded to 72 elements: no swizzle, no bank conflict) and read back by every warp as the B operand of
``vᵀ · Pᵀ`` after a CTA barrier. One code path serves every warp: a loop over the warp's blocks, their offsets
runtime values from a word per warp (:func:`_score_word`), the diagonal blocks' masked elements cleared in the
packed bf16 pairs (bits, the same as the select they replace).

Decay powers are made once per CTA into shared memory, each the exp2 of an fp32 product ``d · g · log2(e)`` with
``d >= 0`` (never the exponent of a positive number): ``scale · λ^d`` (d = 0..63, the scores; at 16 + d, after 16
zeros that the diagonal blocks' masked elements read), ``scale · λ^(i+1)`` (the inter-chunk term's rows),
``λ^(63-j)`` (the state update's keys); λ^64 is a register.

Pipeline: each chunk's q, k (64 x 128) and the CTA's v columns (64 x block_v) are copied by ``cp.async`` into one
of two shared-memory stages while the previous chunk computes; rows past the segment's end are zero-filled by the
copies themselves (source size 0) and never read from global memory (they belong to the next segment or sequence).
Per chunk: one CTA barrier (tiles landed, the
other stage and the score tile free), the warp's score blocks, ``Sᵀ_bf · qᵀ``, a second barrier (the score tile
complete), ``vᵀ · Pᵀ``, the state update, and oᵀ staged with ``stmatrix.trans`` over the warp's own (already read)
v columns, then 16-byte row stores of the valid rows. Only warp-level MMA (``mma.sync`` m16n8k16 bf16, fp32
accumulate): one source for SM90, SM100 and SM103.

Grid: one linear index, V block fastest, then head, then segment (the two half-V CTAs of a sequence and head, which
read the same q and k, run side by side: the second read is an L2 hit).

**Half-V CTAs** (``block_v`` = 64, the direct form only): two CTAs of 4 warps per sequence and head, each owning 64
value columns of the state and o (its warps' value rows, as above), both making the whole score tile (4 warps: 3, 3,
2 and 2 of its 10 blocks, one warp's two in two runs). Every element's arithmetic is that of the 8-warp CTA: the same
bits. For batches whose sequences and heads leave SMs idle (B1 H64: 64 CTAs on 132 SMs): twice the CTAs, each with
188 MMAs per warp and chunk instead of 168 but half the warps; where each CTA has an SM to itself
(``prefill_backend.choose_direct_block_v``) a sequence is walked in 0.71x the 8-warp CTA's time (a lent H100, B1
T32768 H64: 1123 against 1585 us; one warp per SM sub-partition hides less of the MMA chains' latency), the form
0.87-0.93x the three launches' time at B1 H64 (``benchmarks/results/lightning_prefill_forms_ab_h100.md``). Over
segments (full grids) V block 64 lost to 128 on every shape timed (two CTAs per SM; below), so the segments form
keeps 128.

The V block, 128 (per chunk of 64 tokens and head, K = V = 128):

* Bytes: q, k, v 16 KB each in, o 16 KB out: 64 KB.
* MMA (m16n8k16, 4096 flops each): per warp ``Sᵀ_bf · qᵀ`` 64, ``vᵀ · Pᵀ`` 20, the state 64 (148), plus its
  score blocks at 16 each: 8 x 148 + 10 x 16 = 1344 MMAs = 5.5 MFLOP (at V block 64: 1504, the score tile made
  twice).
* H200 budget per SM and chunk-head (4.8 TB/s over 132 SMs = 36 B/ns; 1.83 GHz; 2 warps per SM sub-partition):
  the 64 KB take 1.8 us; the MMAs ~336 per sub-partition at ~6 cycles each (mma.sync at ~2/3 of the wgmma peak)
  ~1.1 us; instruction issue: see the next item. So the kernel can be bound by memory if the loads keep flowing;
  what decides is bytes in flight and the barrier bubbles.
* Instructions (SASS, CuTeDSL 4.8.1; NOP excluded): the chunk loop is 691 instructions on sm_90a (632 on sm_100a
  and sm_103a), and a warp issues all of it but the score blocks it does not own: on sm_90a, per warp and (not
  last) chunk, 691 (one score block) or 760 (two), 708 on average. Before issue 28's instruction cut (commit
  93a50a9, the same arithmetic) the loop was 1347 and a warp issued 822-937 (mean 855): every warp's score blocks
  had their own code, a warp issued its neighbour's too (predicated off), and the loads spent 3 filler
  instructions per copy next to the zero-fill stores. Whole kernel: 1176 / 1120 / 1120 SASS instructions on
  sm_90a / sm_100a / sm_103a (with NOPs; 1864 / 1792 / 1792 before).
* Shared memory: 2 stages x 48 KB + 9,200 B score tile (64 rows of 72) + 832 B tables = 108,336 B, one CTA per
  SM (two would fit the shared memory, 214 KB with the reserve, but not the registers).
* Registers (compiled on the CPU with CuTeDSL 4.8.1, since the FFMA state step): 254 per thread on sm_90a over
  segments, 255 in the direct form with h0 and ht, 252 / 246 on sm_100a; no spills (222 / 216 before the state
  step). Half-V CTAs: 244 (sm_90a) / 248 (sm_100a) with h0 and ht; without any state 255 on both, and on sm_100a /
  sm_103a that configuration spills 10 instructions (7 in the chunk loop; ptxas' choice; see the compile tests).
* Measured (over segments): kernel C at V block 128 took 0.86-0.91x the time of V block 64 on four shapes on the H200
  (``benchmarks/results/lightning_kernel_c_ab_h200.md``) and 0.91-0.99x on those and four T = 1024 shapes on an
  H100 (``lightning_block_v_ab_h100.md``): 11% fewer MMAs (the score tile made once per chunk-head, not twice)
  outweigh the second CTA per SM that V block 64 overlaps (its barrier waits, 80 KB of loads in flight per SM
  instead of 48 KB, twice the CTAs), on the smallest grids too.

:func:`lightning_chunk_output` is the host wrapper.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable

from ..compile_cache import TensorSpec, bound_launch, fake_call_arguments, flag_bytes, launch, missing_cutedsl
from ..dsl_compat import SmemAllocator
from ..kda.tiles import ChunkTiles
from .chunk_states import _STATE_DTYPES, StateIO, load_pool_slot, pool_slot, scan_flags

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Uint8, const_expr
    from cutlass._mlir.dialects import nvvm
    from cutlass.cute.nvgpu import warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["BLOCK_V", "HALF_BLOCK_V", "LightningChunkOutput", "LightningChunkOutputConfig", "direct_output_run",
           "lightning_chunk_output", "plan_chunk_output", "plan_direct_output", "segments_output_run"]

BLOCK_V = 128  # value columns per CTA: all of them, one 8-warp CTA per segment and head (module docstring)
HALF_BLOCK_V = 64  # the direct form's other V block: two 4-warp CTAs per sequence and head (module docstring)
_LOG2E = 1.4426950408889634
_MAX_GRID_X = 2**31 - 1

# The 10 lower 16 x 16 blocks (query block I, key block J <= I) of the score tile, per warp, by the CTA's warps: each
# warp's blocks are runs of adjacent key blocks of one query block (its q rows read once per run); one run per warp
# with 8 warps, two for one of the 4 warps (V block 64)
_SCORE_BLOCKS = {
    8: (((3, 0), (3, 1)), ((3, 2), (3, 3)), ((2, 0),), ((2, 1),), ((2, 2),), ((1, 0),), ((1, 1),), ((0, 0),)),
    4: (((3, 0), (3, 1), (3, 2)), ((2, 0), (2, 1), (2, 2)), ((1, 0), (1, 1)), ((3, 3), (0, 0))),
}
_SCORE_PAD = 8  # bf16 padding per score-tile row: 144-byte rows, conflict-free ldmatrix rows and 4-byte stores
_ROW_BLOCK = 16 * 64  # elements between 16-row blocks of a swizzled (64, 128) tile: above the swizzle's bits


def _rows_of(blocks: tuple) -> tuple:
    """A warp's score blocks grouped by query block, in first-seen order: ``((I, (J, ...)), ...)``."""
    rows: dict[int, list[int]] = {}
    for bi, bj in blocks:
        rows.setdefault(bi, []).append(bj)
    return tuple((bi, tuple(bjs)) for bi, bjs in rows.items())


def _score_word(blocks: tuple) -> int:
    """One warp's score blocks packed into an int32 for the kernel: bits 0-3 the number of runs (query blocks),
    then 8 bits per run: I (bits 0-1), its first key block J0 (bits 2-3), the number of key blocks (bits 4-7)."""
    runs = _rows_of(blocks)
    word = len(runs)
    for r, (bi, bjs) in enumerate(runs):
        if list(bjs) != list(range(bjs[0], bjs[0] + len(bjs))):
            raise ValueError(f"the key blocks of query block {bi} are not adjacent: {bjs}")
        word |= (bi | bjs[0] << 2 | len(bjs) << 4) << (4 + 8 * r)
    return word


@dataclasses.dataclass(frozen=True, kw_only=True)
class LightningChunkOutputConfig(StateIO):
    """Compile-time configuration of :class:`LightningChunkOutput` (the compile-cache key; the token count, the
    number of segments and their lengths are not in it).

    Attributes:
        num_heads: H.
        head_dim: K = V (only 128).
        block_v: value columns per CTA (the tiles' contract, :class:`~cula_runtime.cute.kda.tiles.ChunkTiles`):
            :data:`BLOCK_V` (8 warps), or in the direct form :data:`HALF_BLOCK_V` (4 warps, two CTAs per sequence and
            head: twice the CTAs where the sequences and heads leave SMs idle; the same bits).
        chunk_size: C; only 64.
        direct: the direct form (module docstring): every segment is a whole sequence (one row per sequence, empty
            ones too), started from the sequence's initial state and ending in its final state; no ``seg_state``.
            Its start and final states: the :class:`~cula_runtime.cute.lightning.chunk_states.StateIO` fields. Over
            segments only the final-state fields (``output_final_state`` or ``state_pool``, ``state_dtype``,
            ``state_v_first``) may be set: each sequence's last segment (``segments[s, 3] != 0``) then ends in the
            sequence's final state and writes it (kernels A and B with ``skip_last``).
    """

    num_heads: int
    head_dim: int = 128
    block_v: int = BLOCK_V
    chunk_size: int = 64
    direct: bool = False

    @property
    def writes_final_state(self) -> bool:
        """A sequence's last CTA (the direct form's every CTA) ends by writing its final state (``final_state`` or
        the pool)."""
        return self.output_final_state or self.state_pool


class LightningChunkOutput(ChunkTiles):
    """Kernel C of the Lightning prefill (see the module docstring)."""

    mma_k = 16  # k extent of one m16n8k16 MMA

    @staticmethod
    def can_implement(config: LightningChunkOutputConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c = config
        if c.chunk_size != 64:
            return False, f"chunk_size={c.chunk_size}: only 64 is supported"
        if c.head_dim != 128:
            return False, f"head_dim={c.head_dim}: only K = V = 128 is supported"
        if c.block_v not in (BLOCK_V, HALF_BLOCK_V):
            return False, f"block_v={c.block_v}: expected {BLOCK_V} or (the direct form) {HALF_BLOCK_V}"
        if c.block_v == HALF_BLOCK_V and not c.direct:
            return False, (f"block_v={HALF_BLOCK_V} serves only the direct form (over segments it lost to {BLOCK_V} on "
                           "every shape timed)")
        if c.num_heads < 1:
            return False, f"num_heads={c.num_heads}: must be >= 1"
        if not c.direct and (c.has_initial_state or c.initial_state_flags):
            return False, ("over segments the start states are seg_state's: has_initial_state and "
                           "initial_state_flags belong to the direct form (direct=True)")
        reason = c.state_io_rejection()
        return (False, reason) if reason else (True, "")

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the twelve tensor arguments of ``__call__``, in order (None: argument absent)."""
        c = self.config
        bf16 = TensorSpec(BFloat16, 4, 8)  # 16-byte row segments for cp.async and the o store
        state = TensorSpec(Float32, 4, 2)  # (8-byte pairs of the accumulator layout, V-first)
        return (
            bf16,  # q [1, B·T, H, K]
            bf16,  # k [1, B·T, H, K]
            bf16,  # v [1, B·T, H, V]
            TensorSpec(Float32, 1),  # g_gamma [H], natural log
            None if c.direct else TensorSpec(Float32, 4),  # seg_state [NSEG, H, K, V]: each segment's start state
            TensorSpec(Int32, 2, 4),  # segments [NSEG, 4]: (sequence, first row, length, 0)
            bf16,  # o [1, B·T, H, V]
            state if c.has_initial_state else None,  # (direct) h0 [N, H, K, V] / [N, H, V, K]
            state if c.output_final_state else None,  # ht
            TensorSpec(_STATE_DTYPES[c.state_dtype], 4, 2) if c.state_pool else None,  # the pool
            TensorSpec(Int32, 1) if c.state_pool else None,  # state_indices [N]
            TensorSpec(Uint8, 1) if c.initial_state_flags else None,  # (direct) has_initial_state [N], bytes
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic token and segment counts; nothing allocated."""
        return fake_call_arguments(self.argument_specs(), Float32(1.0))

    # ------------------------------------------------------------------------------------------------------------
    # Host side: layouts, atoms, launch

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mS0: cute.Tensor | None,
        mSeg: cute.Tensor,
        mO: cute.Tensor,
        mH0: cute.Tensor | None,
        mHt: cute.Tensor | None,
        mPool: cute.Tensor | None,
        mStateIdx: cute.Tensor | None,
        mHasInit: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        sK_layout = self._smem_layout(C, K, 2)
        sV_layout = self._smem_layout(C, BV, 2)
        sP_layout = cute.make_layout((C, C, 1), stride=(C + _SCORE_PAD, 1, C * (C + _SCORE_PAD)))  # padded rows

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_layout)], 1024]
            sPdec: cute.struct.Align[cute.struct.MemRange[Float32, C + 16], 16]  # scale · λ^d at 16 + d, d >= -15
            sOdec: cute.struct.Align[cute.struct.MemRange[Float32, C], 16]  # scale · λ^(i+1)
            sVdec: cute.struct.Align[cute.struct.MemRange[Float32, C], 16]  # λ^(63-j)

        tiled_mma = self.make_tiled_mma()
        score_mma = self.make_score_mma()
        grid = [mSeg.shape[0] * c.num_heads * (K // BV), 1, 1]
        self.kernel(
            mQ, mK, mV, mG, mS0, mSeg, mO, mH0, mHt, mPool, mStateIdx, mHasInit, scale, sK_layout, sV_layout,
            sP_layout, tiled_mma, score_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mS0: cute.Tensor | None,
        mSeg: cute.Tensor,
        mO: cute.Tensor,
        mH0: cute.Tensor | None,
        mHt: cute.Tensor | None,
        mPool: cute.Tensor | None,
        mStateIdx: cute.Tensor | None,
        mHasInit: cute.Tensor | None,
        scale: Float32,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sP_layout: cute.Layout,
        tiled_mma: cute.TiledMma,
        score_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        vb = bidx % (K // BV)  # one linear index: V block fastest, then head, then segment
        seg_head = bidx // (K // BV)
        h = seg_head % c.num_heads
        seg = seg_head // c.num_heads
        warp_idx = tidx // 32
        lane = tidx % 32

        # The segment: rows start .. start + length - 1 of the flattened token axis, clamped to the tensor.
        rows = mQ.shape[1]
        start = cutlass.max(mSeg[seg, 1], Int32(0))
        length = cutlass.max(cutlass.min(mSeg[seg, 2], rows - start), Int32(0))
        num_chunks = (length + (C - 1)) // C
        n = mSeg[seg, 0]
        slot = Int32(-1)  # the sequence's pool slot; -1 outside [0, P) or without a pool
        if const_expr(c.state_pool):  # a padding row (slot -1): no chunk runs, o gets zeros (after the loop)
            slot = pool_slot(mPool, mStateIdx, n)
            num_chunks = cutlass.select_(slot < 0, Int32(0), num_chunks)

        # ---- shared memory
        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sK_layout)  # (C tokens, K, stage)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)  # (C tokens, BV, stage)
        sP = storage.sP.get_tensor(sP_layout)  # (C query, C key, 1)
        sPdec = storage.sPdec.get_tensor(cute.make_layout(C + 16))
        sOdec = storage.sOdec.get_tensor(cute.make_layout(C))
        sVdec = storage.sVdec.get_tensor(cute.make_layout(C))
        # Transposed views (the composition maps (col, row, stage) onto the token-major tiles).
        sKT = cute.composition(sK, cute.make_layout((K, C, 2), stride=(C, 1, C * K)))  # (K, C tokens, stage)
        sVT = cute.composition(sV, cute.make_layout((BV, C, 2), stride=(C, 1, C * BV)))  # (BV, C tokens, stage)
        # Per-token factors broadcast over the BV value rows, for the accumulator partition (columns = tokens).
        sOdecB = cute.make_tensor(sOdec.iterator, cute.make_layout((BV, C), stride=(0, 1)))
        sVdecB = cute.make_tensor(sVdec.iterator, cute.make_layout((BV, C), stride=(0, 1)))

        # ---- global -> shared copies; chunk 0 first, so that its loads overlap the state's
        loader = self.make_loader(mQ, mK, mV, h, vb, start, tidx)
        if num_chunks > 0:
            self.load_chunk(loader, (sQ, sK, sV), Int32(0), cutlass.min(length, C), Int32(0))
            cute.arch.cp_async_commit_group()

        # ---- decay powers, once per CTA: exp2 of d · g · log2(e) with d >= 0 (visible after the loop's barrier)
        lg = mG[h] * Float32(_LOG2E)
        if tidx < C:
            d = Float32(tidx)
            sPdec[16 + tidx] = scale * cute.math.exp2(d * lg, fastmath=True)
            sOdec[tidx] = scale * cute.math.exp2((d + Float32(1.0)) * lg, fastmath=True)
            sVdec[tidx] = cute.math.exp2(Float32(C - 1 - tidx) * lg, fastmath=True)
        if tidx < 16:
            sPdec[tidx] = Float32(0.0)  # d < 0: read for the diagonal blocks' masked elements, never used
        lam_chunk = cute.math.exp2(Float32(C) * lg, fastmath=True)  # λ^64

        # ---- MMA partitions (M = BV value rows, warp w rows 16 w ..):
        #   oᵀ  = Sᵀ_bf (BV x K) · qᵀ     -> (BV x C);  B = q as (C tokens, K)
        #   oᵀ += vᵀ    (BV x C) · Pᵀ     -> (BV x C);  B = P as (C query, C key)
        #   Sᵀ += vᵀdec (BV x C) · k      -> (BV x K);  B = kᵀ as (K, C tokens)
        thr_mma = tiled_mma.get_slice(tidx)
        tSrS = cute.make_rmem_tensor(thr_mma.partition_shape_C((BV, K)), Float32)  # ((2,2), 1, K/8)
        accO = cute.make_rmem_tensor(thr_mma.partition_shape_C((BV, C)), Float32)  # ((2,2), 1, C/8)
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
        tCsP = s2r_B.partition_S(sP)  # (CPY, C/16, C/16, 1)
        tCsK = s2r_Bt.partition_S(sKT)  # (CPY, K/16, C/16, stage)
        tCrQ_v = s2r_B.retile(tCrQ)
        tCrP_v = s2r_B.retile(tCrP)
        tCrK_v = s2r_Bt.retile(tCrK)
        rV = cute.make_rmem_tensor(accO.layout, BFloat16)
        rO = cute.make_rmem_tensor(accO.layout, BFloat16)
        tCsV = s2r_C.partition_S(sVT)  # vᵀ read in accumulator layout
        tCrV_v = s2r_C.retile(rV)
        tCsO = r2s_C.partition_D(sVT)  # oᵀ staged over the warp's own (consumed) v columns
        tCrO_v = r2s_C.retile(rO)
        tOsOdec = thr_mma.partition_C(sOdecB)
        tVsVdec = thr_mma.partition_C(sVdecB)

        # ---- this warp's score blocks (a register for the whole segment)
        score_word = Int32(0)
        for w in cutlass.range_constexpr(self.num_warps):
            score_word = cutlass.select_(warp_idx == w, Int32(_score_word(_SCORE_BLOCKS[self.num_warps][w])),
                                         score_word)

        # ---- the segment's start state (fp32) into the accumulator layout of Sᵀ
        ends = Int32(1)  # the CTA ends its sequence (and writes the final state where there is one)
        if const_expr(c.direct):  # the sequence's initial state (or zeros)
            self.load_initial_state(thr_mma, tSrS, mH0, mPool, slot, mHasInit, n, h, vb)
        else:
            tSgS0 = thr_mma.partition_C(self._state_tile(mS0[seg, h, None, None], vb))
            if num_chunks > 0:
                tSrS.store(tSgS0.load())
            if const_expr(c.writes_final_state):  # the sequence's last segment (its pool slot only written)
                ends = cutlass.select_(mSeg[seg, 3] != 0, Int32(1), Int32(0))

        for chunk in cutlass.range(num_chunks, unroll=1):
            stage = chunk % 2
            chunk_len = cutlass.min(length - chunk * C, C)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # chunk's tiles visible; everyone is done with the other stage and with sP
            if chunk + 1 < num_chunks:
                self.load_chunk(loader, (sQ, sK, sV), (chunk + 1) * C, cutlass.min(length - (chunk + 1) * C, C),
                                1 - stage)
                cute.arch.cp_async_commit_group()

            # ---- this warp's blocks of the masked, decayed, scaled score tile (gates the second barrier: first)
            self.scores(score_mma, sQ[None, None, stage], sK[None, None, stage], sP[None, None, 0], sPdec,
                        score_word, lane)

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
            cute.arch.sync_threads()  # the score tile is complete

            # ---- oᵀ += vᵀ · Pᵀ: query tile nt (8 tokens) needs key blocks kb <= nt / 2
            for kb in cutlass.range_constexpr(C // self.mma_k):
                cute.copy(s2r_B, tCsP[None, None, kb, 0], tCrP_v[None, None, kb])
                for nt in cutlass.range_constexpr(2 * kb, C // 8):
                    acc = self._rank3(accO[None, None, nt])
                    cute.gemm(tiled_mma, acc, self._rank3(tCrV_A[None, None, kb]), self._rank3(tCrP[None, nt, kb]),
                              acc)

            # ---- Sᵀ = λ^64 Sᵀ + bf16(vᵀ ⊙ λ^(63-j)) · k, for the next chunk (none after the segment's last)
            k_copy = (s2r_Bt, tCsK, tCrK_v, tCrK, stage)
            if chunk + 1 < num_chunks:
                self.state_step(tiled_mma, tSrS, rV, tVsVdec, lam_chunk, k_copy)
            if const_expr(c.writes_final_state):  # a sequence's last chunk: decayed by its true length
                if chunk + 1 == num_chunks and ends != 0:
                    self.state_step(tiled_mma, tSrS, rV, self.tail_factors(thr_mma, lg, chunk_len),
                                    cute.math.exp2(Float32(chunk_len) * lg, fastmath=True), k_copy)

            # ---- o: stage oᵀ over this warp's own v columns (already read), then 16-byte stores of rows < chunk_len
            rO.store(accO.load().to(BFloat16))
            cute.arch.sync_warp()
            cute.copy(r2s_C, tCrO_v, tCsO[None, None, None, stage])
            cute.arch.sync_warp()
            self.store_rows(mO, sV[None, None, stage], Int32(0), h, vb, start + chunk * C, chunk_len, tidx)

        if const_expr(c.writes_final_state):
            if ends != 0:
                self.store_final_state(thr_mma, tSrS, mHt, mPool, n, h, vb, slot)
        if const_expr(c.state_pool):
            if slot < 0:  # a padding row: zeros for o
                self.store_zero_rows(mO, Int32(0), h, vb, start, length, tidx)

    @cute.jit
    def _bf16_pairs_to_f32(self, x: cute.Tensor) -> cute.Tensor:
        """``x`` (bf16, compact, even size) widened to fp32 by moving bits, one integer op per element: the low
        element of a 32-bit pair shifted up, the high one masked (exactly what the conversion does; 2 ops per pair
        where the compiler's conversion takes 3)."""
        pairs = cute.recast_tensor(x, Int32)
        y = cute.make_rmem_tensor(x.layout, Float32)
        y_bits = cute.recast_tensor(y, Int32)
        for k in cutlass.range_constexpr(cute.size(pairs)):
            y_bits[2 * k] = pairs[k] << 16
            y_bits[2 * k + 1] = pairs[k] & Int32(-65536)
        return y

    @cute.jit
    def scores(self, score_mma: cute.TiledMma, sQs: cute.Tensor, sKs: cute.Tensor, sP: cute.Tensor,
               sPdec: cute.Tensor, word: Int32, lane: Int32):
        """This warp's lower 16 x 16 blocks (query block I, key block J) of ``P = scale · λ^(i-j) · q kᵀ``
        (j <= i, else 0), rounded to bf16 into ``sP`` (C query, C key; padded rows). ``sQs``, ``sKs``: the chunk's
        (C, K) swizzled tiles; ``word``: the warp's blocks (:func:`_score_word`), runs of adjacent key blocks, so
        that one code path serves every warp (the blocks' offsets are runtime values: a 16-row block of q or k is
        ``_ROW_BLOCK`` elements on, outside the swizzle's bits; the padded score tile has no swizzle).

        Elements: ``p = acc · sPdec[16 + d]`` with ``d = 16 (I - J) + i - j`` (local i, j; d >= -15), then bf16; the
        masked ones (j > i, only in a diagonal block) are cleared in the packed bf16 pairs with an AND: bf16 +0,
        the bits that ``select(j <= i, p, 0)`` rounds to."""
        K = self.config.head_dim
        SUB = 16
        thr_mma = score_mma.get_slice(lane)
        ld_atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        copy_A = cute.make_tiled_copy_A(ld_atom, score_mma).get_slice(lane)
        copy_B = cute.make_tiled_copy_B(ld_atom, score_mma).get_slice(lane)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((SUB, SUB)))  # ((2,2), 1, 2): (row, key) of block
        tCsP = thr_mma.partition_C(sP)  # ((2,2), C/16, C/8): block (I, J) is modes (I, 2J) and (I, 2J + 1)
        sQ0 = cute.local_tile(sQs, (SUB, K), (0, 0))
        sK0 = cute.local_tile(sKs, (SUB, K), (0, 0))
        tXsQ0 = copy_A.partition_S(sQ0)
        tYsK0 = copy_B.partition_S(sK0)
        tCrX = thr_mma.make_fragment_A(thr_mma.partition_A(sQ0))
        tCrY = thr_mma.make_fragment_B(thr_mma.partition_B(sK0))
        # The diagonal block's mask of the pairs (rows r, r + 8 with keys 2c, 2c + 1 and 8 + 2c, 9 + 2c): rows r
        # with keys 2c.. and rows r + 8 with keys 8 + 2c.. keep the elements with key <= row (``keep``), rows r
        # with keys 8 + .. keep none, rows r + 8 with keys 2c.. keep all (test_score_fragment_coordinates).
        (i0, j0), (i1, j1) = tCcC[0], tCcC[1]
        keep = cutlass.select_(j0 <= i0, Int32(0xFFFF), Int32(0)) | cutlass.select_(j1 <= i1, Int32(-65536), Int32(0))
        ops = (score_mma, thr_mma, copy_A, copy_B, tCcC, tCsP, tXsQ0, tYsK0, tCrX, tCrY, sPdec, keep)
        if const_expr(self._one_run_per_warp()):  # a static run: its offsets are the same every chunk
            self._score_run(ops, (word >> 4) & 255)
        else:
            for r in cutlass.range(word & 15, unroll=1):  # the warp's runs (query blocks)
                self._score_run(ops, (word >> (4 + 8 * r)) & 255)

    def _one_run_per_warp(self) -> bool:
        """Whether every warp's score blocks are one run (one query block): 8 warps."""
        return all(len(_rows_of(blocks)) == 1 for blocks in _SCORE_BLOCKS[self.num_warps])

    @cute.jit
    def _score_run(self, ops: tuple, run: Int32):
        """One run of :meth:`scores`: query block I, then its key blocks J0, J0 + 1, .. (``run``: I | J0 << 2 |
        count << 4)."""
        score_mma, thr_mma, copy_A, copy_B, tCcC, tCsP, tXsQ0, tYsK0, tCrX, tCrY, sPdec, keep = ops
        SUB = 16
        bi = Int32(run & 3)
        bj0 = Int32((run >> 2) & 3)
        tXsQ = cute.make_tensor(tXsQ0.iterator + cute.assume(bi * _ROW_BLOCK, divby=_ROW_BLOCK), tXsQ0.layout)
        cute.copy(copy_A, tXsQ, copy_A.retile(tCrX))  # once per query block
        for t in cutlass.range(run >> 4, unroll=1):
            bj = bj0 + t
            tYsK = cute.make_tensor(tYsK0.iterator + cute.assume(bj * _ROW_BLOCK, divby=_ROW_BLOCK), tYsK0.layout)
            cute.copy(copy_B, tYsK, copy_B.retile(tCrY))
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((SUB, SUB)), Float32)
            acc.fill(0.0)
            cute.gemm(score_mma, acc, tCrX, tCrY, acc)
            rP = cute.make_rmem_tensor(acc.layout, BFloat16)
            d0 = SUB * (bi - bj) + 16
            for e in cutlass.range_constexpr(cute.size(acc)):
                i, j = tCcC[e]
                rP[e] = Float32(acc[e] * sPdec[d0 + i - j]).to(BFloat16)
            off = cutlass.select_(bi != bj, Int32(-1), Int32(0))  # all ones off the diagonal
            rPw = cute.recast_tensor(rP, Int32)  # pairs: (row r, keys 2c..), (r + 8, 2c..), (r, 8 + 2c..), (r + 8, ..)
            rPw[0] = rPw[0] & (keep | off)
            rPw[3] = rPw[3] & (keep | off)
            rPw[2] = rPw[2] & off
            for half in cutlass.range_constexpr(2):  # the block's two n8 tiles: key pairs, 4 bytes
                tCsP[None, bi, 2 * bj + half].store(rP[None, 0, half].load())

    @staticmethod
    def make_score_mma():
        """The score blocks' MMA: one warp, a 16 x 16 block (two n8 tiles of m16n8k16 bf16, fp32 accumulators)."""
        return cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), (1, 1, 1),
                                   permutation_mnk=(16, 16, 16))

    @cute.jit
    def _state_tile(self, head: cute.Tensor, vb: Int32) -> cute.Tensor:
        """This CTA's ``(BV, K)`` block of ``Sᵀ`` in one head's state ``[K, V]`` (V contiguous), viewed as
        ``(V, K)``."""
        c = self.config
        head = cute.make_tensor(head.iterator, cute.make_layout(
            (head.shape[1], head.shape[0]), stride=(head.stride[1], head.stride[0])
        ))
        return cute.local_tile(head, (c.block_v, c.head_dim), (vb, 0))

    @cute.jit
    def _head_tile(self, head: cute.Tensor, vb: Int32) -> cute.Tensor:
        """This CTA's ``(BV, K)`` block of ``Sᵀ`` in one head's compact ``[128, 128]`` state (the direct form's h0, ht
        or pool slot: ``[K, V]``, or ``[V, K]`` with ``state_v_first``), viewed as ``(V, K)`` with static strides."""
        c = self.config
        K = c.head_dim
        stride = (K, 1) if const_expr(c.state_v_first) else (1, K)
        view = cute.make_tensor(head.iterator, cute.make_layout((K, K), stride=stride))
        return cute.local_tile(view, (c.block_v, K), (vb, 0))

    @cute.jit
    def load_initial_state(self, thr_mma, tSrS: cute.Tensor, mH0, mPool, slot: Int32, mHasInit, n: Int32, h: Int32,
                           vb: Int32):
        """The direct form's start state of sequence ``n`` into ``tSrS`` (fp32, accumulator layout of Sᵀ): h0, or
        its pool slot ``slot`` (:func:`pool_slot`'s; widened from bf16) when it is one (not -1: padding, never read
        or written) and ``has_initial_state[n]`` is not 0, else zeros."""
        c = self.config
        tSrS.fill(0.0)
        if const_expr(c.state_pool):
            load_pool_slot(slot, mHasInit, n, c.initial_state_flags, lambda s: tSrS.store(
                thr_mma.partition_C(self._head_tile(mPool[s, h, None, None], vb)).load().to(Float32)))
        elif const_expr(c.has_initial_state):
            tSrS.store(thr_mma.partition_C(self._head_tile(mH0[n, h, None, None], vb)).load())

    @cute.jit
    def store_final_state(self, thr_mma, tSrS: cute.Tensor, mHt, mPool, n: Int32, h: Int32, vb: Int32, slot: Int32):
        """Sequence ``n``'s final state: ``tSrS`` into ``final_state[n]``, or rounded to the pool's dtype into slot
        ``slot`` unless it is -1."""
        c = self.config
        if const_expr(c.output_final_state):
            thr_mma.partition_C(self._head_tile(mHt[n, h, None, None], vb)).store(tSrS.load())
        if const_expr(c.state_pool):
            if slot >= 0:
                dst = thr_mma.partition_C(self._head_tile(mPool[slot, h, None, None], vb))
                dst.store(tSrS.load().to(dst.element_type))

    @cute.jit
    def state_step(self, tiled_mma: cute.TiledMma, tSrS: cute.Tensor, rV: cute.Tensor, factors: cute.Tensor,
                   lam: Float32, k_copy: tuple):
        """``Sᵀ = lam · Sᵀ + bf16(vᵀ ⊙ factors) · k`` (``factors``: a tensor of the chunk's per-token factors in vᵀ's
        accumulator layout; ``k_copy``: the kᵀ tiles' ldmatrix copy, partitions and stage).

        The chunk's product is made 16 key columns at a time (two n8 tiles, one ``ldmatrix.x4`` per 16 tokens) in
        fresh fp32 accumulators, then added to the scaled state with one FFMA per element: the long-lived state takes
        one round-to-nearest addition per chunk, never the tensor core's own accumulation, whose rounding (biased
        towards zero) compounds over a sequence's chunks; it made the direct form's final-state errors grow linearly
        with the length (``benchmarks/results/lightning_prefill_forms_ab_h100.md``)."""
        s2r_Bt, tCsK, tCrK_v, tCrK, stage = k_copy
        rVdec = cute.make_rmem_tensor(rV.layout, BFloat16)
        rVdec.store((self._bf16_pairs_to_f32(rV).load() * factors.load()).to(BFloat16))
        tCrVdec_A = self._acc_as_operand_a(rVdec)
        acc = cute.make_rmem_tensor(cute.make_layout(((2, 2), 1, 2)), Float32)
        for ng in cutlass.range_constexpr(self.config.head_dim // 16):
            acc.fill(0.0)
            for kb in cutlass.range_constexpr(self.config.chunk_size // self.mma_k):
                cute.copy(s2r_Bt, tCsK[None, ng, kb, stage], tCrK_v[None, ng, kb])
                for t in cutlass.range_constexpr(2):
                    part = self._rank3(acc[None, None, t])
                    cute.gemm(tiled_mma, part, self._rank3(tCrVdec_A[None, None, kb]),
                              self._rank3(tCrK[None, 2 * ng + t, kb]), part)
            for t in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(4):
                    tSrS[e, 0, 2 * ng + t] = tSrS[e, 0, 2 * ng + t] * lam + acc[e, 0, t]

    @cute.jit
    def tail_factors(self, thr_mma, lg: Float32, length: Int32):
        """The last chunk's key factors ``λ^(L-1-j)`` for its tokens ``j < L`` (``L = length``), 0 past them (never
        the exponential of a positive number), in vᵀ's accumulator layout (registers)."""
        c = self.config
        coords = thr_mma.partition_C(cute.make_identity_tensor((c.block_v, c.chunk_size)))  # (value row, token)
        factors = cute.make_rmem_tensor(coords.shape, Float32)
        for e in cutlass.range_constexpr(cute.size(factors)):
            j = coords[e][1]
            d = cutlass.max(length - 1 - j, Int32(0))  # (>= 0: past L the exponent is clamped, the factor then 0)
            factors[e] = cutlass.select_(j < length, cute.math.exp2(Float32(d) * lg, fastmath=True), Float32(0.0))
        return factors

    @cute.jit
    def make_loader(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, h: Int32, vb: Int32, start: Int32,
                    tidx: Int32):
        """Per tensor (q, k, v): this thread's cp.async slice, its source segments ``(CPY, passes, 1)`` in the
        segment's first chunk (a later chunk's are the same plus a row offset: :meth:`load_chunk`), their (row,
        column) coordinates within a chunk, and the token stride (elements)."""
        C, K, BV = self.config.chunk_size, self.config.head_dim, self.config.block_v
        loader = []
        for mX, cols, block in ((mQ, K, 0), (mK, K, 0), (mV, BV, vb)):
            thr = self._g2s_copy(cols).get_slice(tidx)
            gX = cute.local_tile(cute.domain_offset((start, 0), mX[0, None, h, None]), (C, cols), (0, block))
            loader.append((thr, thr.partition_S(gX), thr.partition_S(cute.make_identity_tensor((C, cols))),
                           mX.stride[1]))
        return loader

    @cute.jit
    def load_chunk(self, loader, tiles, row0: Int32, length: Int32, stage: Int32):
        """Issue the cp.async copies of the chunk at row ``row0`` of the segment (``length`` valid rows) into
        ``stage`` of ``tiles`` (sQ, sK, sV). A row past ``length`` is zero-filled by the copy itself (source size
        0: nothing is read from global memory, no separate store)."""
        for (thr, tXgX, tXcX, row_stride), sX in zip(loader, tiles, strict=True):
            tXsX = thr.partition_D(sX[None, None, stage])
            for p in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                src = tXgX[None, p, None].iterator + cutlass.Int64(row0) * row_stride
                size = cutlass.select_(tXcX[(0, 0), p, 0][0] < length, Int32(16), Int32(0))
                nvvm.cp_async_shared_global(tXsX[None, p, None].iterator.llvm_ptr, src.llvm_ptr, 16,
                                            nvvm.LoadCacheModifierKind.CG, cp_size=size.ir_value())


@functools.lru_cache(maxsize=64)
def _plan(H: int, flags: tuple | None = None) -> tuple:
    """The config and argument specs of one call signature (cached: no work per call); ``flags``: kernel B's
    (:func:`~cula_runtime.cute.lightning.chunk_states.scan_flags`) where the last segments write the final states
    (with neither ht nor a pool, nothing to write), None where nothing does."""
    if flags is None or not (flags[1] or flags[3] is not None):
        config = LightningChunkOutputConfig(num_heads=H)
    else:  # the final-state fields only: the start states are seg_state's
        _, want_ht, v_first, pool_dtype, _ = flags
        config = LightningChunkOutputConfig.from_flags((False, want_ht, v_first, pool_dtype, False), num_heads=H)
    ok, reason = LightningChunkOutput.can_implement(config)
    if not ok:
        raise ValueError(f"LightningChunkOutput: {reason}")
    return config, LightningChunkOutput(config).argument_specs()


_OUTPUTS = frozenset({6})  # o among the tensor arguments


def lightning_chunk_output(q, k, v, g_gamma, seg_state, segments, o, scale: float, seg_len: int) -> None:
    """Kernel C of the Lightning prefill: every segment's outputs from its start state, written into ``o``.

    Args:
        q, k: bf16 ``[B·T, H, 128]`` (the flattened token axis), on one CUDA device.
        v: bf16 ``[B·T, H, 128]``.
        g_gamma: fp32 ``[H]`` contiguous: each head's log-decay (<= 0; λ = exp(g_gamma[h])).
        seg_state: fp32 ``[NSEG, H, 128, 128]`` contiguous (K-first): each segment's START state.
        segments: int32 ``[NSEG, 4]`` contiguous, row s = (sequence, first row, length, 0): the segment covers rows
            ``first .. first + length - 1`` of the token axis, ``1 <= length <= seg_len``. Read on the device only
            (lengths and rows clamped to the token axis there).
        o: bf16 ``[B·T, H, 128]``, preallocated: every row of every segment is written, no other row.
        scale: the output's factor.
        seg_len: the segment length the table was built with (a positive multiple of 64).

    Launched on the current stream; the first call per configuration compiles
    (:func:`cula_runtime.cute.compile_cache.compile_records`).

    Raises:
        TypeError: an argument is not a tensor / number of the expected kind.
        ValueError: a shape, dtype, device or layout other than the above.
    """
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
    if not o.is_contiguous():
        raise ValueError("o must be contiguous (it is written in place)")
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
    if nseg * H > _MAX_GRID_X:
        raise ValueError(f"{nseg} segments x {H} heads exceed the grid ({_MAX_GRID_X} CTAs)")
    if device.type != "cuda":
        raise ValueError(f"q, k, v, g_gamma, seg_state, segments and o must be on one CUDA device, got {device}")
    if nseg == 0 or rows == 0:
        return
    config, specs = _plan(H)
    launch(LightningChunkOutput, config, specs, _tensors(q, k, v, g_gamma, seg_state, segments, o), _OUTPUTS, device,
           float(scale))


def _tensors(q, k, v, g_gamma, seg_state, segments, o, h0=None, ht=None, pool=None, state_indices=None,
             flag_bytes=None) -> tuple:
    """The kernel's tensor arguments in their order (:meth:`LightningChunkOutput.argument_specs`): the token tensors
    with the leading batch axis of 1 the kernel indexes; the direct form's states last (None where absent)."""
    return (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g_gamma, seg_state, segments, o.unsqueeze(0), h0, ht,
            pool, state_indices, flag_bytes)


def segments_output_run(q, k, v, g_gamma, seg_state, segments, o, scale: float, ht, state_v_first: bool, pool,
                        state_indices) -> None:
    """Kernel C over segments whose last ones end their sequences, nothing checked (the prefill backend's validated
    arguments; kernels A and B ran with ``skip_last``): :func:`lightning_chunk_output`'s work, and each sequence's
    last segment writes its final state into ``ht`` (fp32, ``state_v_first``'s layout) or its pool slot
    ``state_indices[n]`` (a slot outside ``[0, P)``: not written), where either is given."""
    config, specs = _plan(q.shape[1], scan_flags(None, ht is not None, state_v_first, pool, None))
    launch(LightningChunkOutput, config, specs, _tensors(q, k, v, g_gamma, seg_state, segments, o, None, ht, pool,
                                                         state_indices), _FINAL_OUTPUTS, q.device, float(scale))


def plan_chunk_output(H: int, device, flags: tuple) -> Callable:
    """Kernel C bound to one call signature (:func:`~cula_runtime.cute.compile_cache.bound_launch`, for the prefill's
    call plans): ``run(q, k, v, g_gamma, seg_state, segments, o, scale, ht=None, pool=None, state_indices=None)``
    with :func:`segments_output_run`'s tensors and nothing checked; ``flags``: kernel B's, as :func:`_plan`'s;
    ``LaunchDeclined`` where TVM-FFI refuses a pointer (nothing launched). The caller launches only with
    segments and rows."""
    config, specs = _plan(H, flags)
    run = bound_launch(LightningChunkOutput, config, specs, device)

    def run_output(q, k, v, g_gamma, seg_state, segments, o, scale: float, ht=None, pool=None,
                   state_indices=None) -> None:
        run(_tensors(q, k, v, g_gamma, seg_state, segments, o, None, ht, pool, state_indices), (float(scale),))

    return run_output


# ---- the direct form: one launch, each sequence one segment (module docstring)


@functools.lru_cache(maxsize=256)
def _direct_plan(H: int, flags: tuple, block_v: int) -> tuple:
    """The config and argument specs of one direct-form signature; ``flags``: kernel B's
    (:func:`~cula_runtime.cute.lightning.chunk_states.scan_flags`); ``block_v``: :data:`BLOCK_V` or
    :data:`HALF_BLOCK_V`."""
    config = LightningChunkOutputConfig.from_flags(flags, num_heads=H, direct=True, block_v=block_v)
    ok, reason = LightningChunkOutput.can_implement(config)
    if not ok:
        raise ValueError(f"LightningChunkOutput: {reason}")
    return config, LightningChunkOutput(config).argument_specs()


_FINAL_OUTPUTS = frozenset({6, 8, 9})  # o, ht, the pool (in place): the direct form and the last segments


def _direct_tensors(q, k, v, g_gamma, segments, o, initial_state, ht, pool, state_indices, has_initial_state) -> tuple:
    return _tensors(q, k, v, g_gamma, None, segments, o, initial_state, ht, pool, state_indices,
                    flag_bytes(has_initial_state))


def direct_output_run(q, k, v, g_gamma, segments, o, scale: float, initial_state, ht, state_v_first: bool, pool,
                      state_indices, has_initial_state, block_v: int = BLOCK_V) -> None:
    """The direct form of kernel C, nothing checked (the prefill backend's validated arguments): every sequence's
    outputs from its initial state and its final state, in one launch.

    Args:
        q, k, v, o: bf16 ``[B·T, H, 128]`` (the flattened token axis); o preallocated.
        g_gamma: fp32 ``[H]``.
        segments: int32 ``[N, 4]``: row n = (n, sequence n's first row, its length (may be 0), 0), one per sequence.
        scale: the output's factor.
        initial_state: fp32 ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``) or None (zeros).
        ht: fp32, ``initial_state``'s layout, to write the final states into, or None.
        pool, state_indices, has_initial_state: a state pool (fp32 or bf16, ``pool_layout_rejection``'s layout),
            int32 ``[N]`` slots (outside ``[0, P)``: padding, never read or written, its rows of o zeros) and an
            optional bool ``[N]`` (False: start from zeros), instead of ``initial_state`` / ``ht``.
        block_v: value columns per CTA, :data:`BLOCK_V` or :data:`HALF_BLOCK_V` (twice the CTAs; the same bits).

    Launched on the current stream; the first call per configuration compiles.
    """
    config, specs = _direct_plan(q.shape[1], scan_flags(initial_state, ht is not None, state_v_first, pool,
                                                        has_initial_state), block_v)
    launch(LightningChunkOutput, config, specs,
           _direct_tensors(q, k, v, g_gamma, segments, o, initial_state, ht, pool, state_indices, has_initial_state),
           _FINAL_OUTPUTS, q.device, float(scale))


def plan_direct_output(H: int, flags: tuple, device, block_v: int = BLOCK_V) -> Callable:
    """The direct form bound to one call signature (``flags``: :func:`~.chunk_states.scan_flags`; ``block_v``: as
    :func:`direct_output_run`'s): ``run(q, k, v,
    g_gamma, segments, o, scale, initial_state, ht, pool, state_indices, has_initial_state)`` with
    :func:`direct_output_run`'s tensors and nothing checked; ``LaunchDeclined`` where TVM-FFI refuses a pointer
    (nothing launched)."""
    config, specs = _direct_plan(H, flags, block_v)
    run = bound_launch(LightningChunkOutput, config, specs, device)

    def run_direct(q, k, v, g_gamma, segments, o, scale: float, initial_state, ht, pool, state_indices,
                   has_initial_state) -> None:
        run(_direct_tensors(q, k, v, g_gamma, segments, o, initial_state, ht, pool, state_indices, has_initial_state),
            (float(scale),))

    return run_direct
