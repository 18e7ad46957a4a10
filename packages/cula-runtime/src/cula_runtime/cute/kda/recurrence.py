"""KDA inter-chunk recurrence fused with the chunk output, in one CuTeDSL launch (KDA_SPEC.md §3.5, §3.6, §3.8).

Per (sequence n, value head hv, block of ``block_v`` value columns), one CTA walks the sequence's 64-token chunks
in order. With S the fp32 state ``[K, V]`` entering a chunk (only the CTA's value columns):

* ``S_bf = bf16(S)``;
* ``v_new = bf16(u - w · S_bf)``;
* ``o = bf16(scale · (qg · S_bf) + tril(Aqk) · v_new)`` (``tril`` is applied here: the upper part of Aqk is ignored);
* ``S = 2^g_last ⊙ S + kgᵀ · v_new`` (fp32, kept in registers for the whole sequence), with ``g_last`` the
  cumulative gate (log2 units) at the chunk's last valid token: the per-chunk decay row the intra kernel writes
  (:func:`~cula_runtime.cute.kda.intra.chunk_kda_fwd_intra_from_raw`).

Everything is computed transposed so that the state is the A operand of every product (M = value rows) and the
products chain in registers:

* ``v_newᵀ = uᵀ - Sᵀ_bf · wᵀ`` and ``oᵀ = scale · Sᵀ_bf · qgᵀ`` share the A fragments of ``Sᵀ_bf``;
* ``oᵀ += v_newᵀ · Aqkᵀ`` and ``Sᵀ = γ ⊙ Sᵀ + v_newᵀ · kg`` take ``v_newᵀ`` as A straight from the accumulator
  (two adjacent n8 accumulator tiles of m16n8k16 are one k16 A fragment once packed to bf16).

Warp w owns rows ``16 w .. 16 w + 15`` of ``Sᵀ`` (64 fp32 registers per thread), so the recurrence needs no
cross-warp exchange. B operands come from shared memory through ``ldmatrix`` (``.trans`` for kg, whose
token-major tile is K-contiguous); ``uᵀ`` is read and ``oᵀ`` staged with ``ldmatrix.trans``/``stmatrix.trans`` in
accumulator layout. Each chunk's operands (w, qg, kg, the CTA's u columns, Aqk, and its decay row) are copied by
``cp.async`` into one of two shared-memory stages while the previous chunk computes.
Rows past a sequence end are zero-filled in shared memory and never read from global memory (they may belong to
the next sequence). Only warp-level MMA (``mma.sync`` m16n8k16 bf16, fp32 accumulate): the same source runs on
SM90, SM100 and SM103.

Grid ``(N, HV, 128 / block_v)``, ``block_v / 16`` warps per CTA; about 131 KB of shared memory at ``block_v = 64``.
Varlen: one linear grid index instead, and the sequences launch longest first, so the longest chains start in the
first wave.

The state pool (``KdaRecurrenceConfig.state_pool``; KDA_SPEC §10, the rules of :mod:`cula_runtime.state_pool`): the
states live in a pool ``[P, HV, K, V]`` (``[P, HV, V, K]``) of fp32 or bf16, and sequence n's CTAs read the int32
``state_indices[n]`` on the device. A slot in ``[0, P)`` is read (zeros where the optional ``has_initial_state[n]`` is
False; bf16 widened exactly) and the final state is written back to it in place (bf16: rounded to nearest even). A
slot outside ``[0, P)`` (negative: padding; ``>= P``: what the host validator refuses for CPU indices) makes the
sequence a padding row: the pool is neither read nor written, no chunk is loaded or computed, and its o rows are
written with zeros. Race-free in place: a CTA's piece of the state (its head, its ``block_v`` value columns) belongs
to no other CTA, and each thread loads its elements of that piece into registers before the chunk loop and stores
the same elements after it. Two sequences naming one slot (refused on the host for CPU indices; not checked on the
device) race: the slot ends with a mix of their final states, and either may start from the other's.

:func:`chunk_kda_fwd_recurrence` is the host wrapper (FLA layouts in, ``(o, final_state)`` out). (The kernel's
retired modes, which only reproduced its bits, are in the repository's history: the delta-h primitive writing
per-chunk states ``h`` and ``v_new`` for a separate output kernel, the token-major gate ``g_cum`` read at each
chunk's last row, and varlen sequences launched in batch order.)
"""

import dataclasses
import functools

from ..compile_cache import TensorSpec, bound_launch, fake_call_arguments, flag_bytes, launch, missing_cutedsl
from ..dsl_compat import SmemAllocator
from ..varlen import check_cu_seqlens, check_token_tensors
from .tiles import ChunkTiles

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Uint8, const_expr
    from cutlass.cute.nvgpu import cpasync, warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["KdaRecurrence", "KdaRecurrenceConfig", "chunk_kda_fwd_recurrence"]


@dataclasses.dataclass(frozen=True)
class KdaRecurrenceConfig:
    """Compile-time configuration of :class:`KdaRecurrence` (the compile-cache key; T, B, N are not in it).

    Attributes:
        num_v_heads: HV.
        head_dim: K = V (only 128).
        block_v: value columns per CTA (64 or 128 = 4 or 8 warps).
        varlen: packed sequences (B = 1, ``cu_seqlens``).
        has_initial_state: an fp32 initial state is read (else the state starts at zero).
        output_final_state: the fp32 final state is written.
        state_v_first: the states are ``[N, HV, V, K]`` (else ``[N, HV, K, V]``); the pool ``[P, HV, V, K]`` (else
            ``[P, HV, K, V]``).
        state_pool: the states live in a pool read and written in place at each sequence's slot
            ``state_indices[n]`` (module docstring); excludes ``has_initial_state`` and ``output_final_state``.
        state_dtype: the pool's dtype, ``"float32"`` or ``"bfloat16"`` (the running state is fp32 either way);
            only ``"float32"`` without a pool.
        initial_state_flags: (pool only) a ``has_initial_state`` ``[N]`` byte per sequence is read: where 0, the
            sequence starts from zeros instead of its slot (the final state is still written there).
        chunk_size: C; only 64.

    The gate argument holds each chunk's decay row: ``[B, NT, HV, K]``, varlen ``[1, NC, HV, K]`` with sequence n's
    chunk c at row ``chunk_offsets[n] + c``. Varlen launches a 1-D grid numbered V block fastest, then value head,
    then sequence slot, and slot s runs sequence ``seq_order[s]`` (:func:`~cula_runtime.index.prepare_sequence_order`:
    longest first).
    """

    num_v_heads: int
    head_dim: int = 128
    block_v: int = 64
    varlen: bool = False
    has_initial_state: bool = False
    output_final_state: bool = False
    state_v_first: bool = False
    state_pool: bool = False
    state_dtype: str = "float32"
    initial_state_flags: bool = False
    chunk_size: int = 64


_STATE_DTYPES = {"float32": Float32, "bfloat16": BFloat16}


class KdaRecurrence(ChunkTiles):
    """The fused delta-h + output kernel family (see the module docstring)."""

    mma_k = 16  # k extent of one m16n8k16 MMA

    @staticmethod
    def can_implement(config: KdaRecurrenceConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c = config
        reason = ChunkTiles.common_rejection(c)
        if reason is not None:
            return False, reason
        if c.state_dtype not in _STATE_DTYPES:
            return False, f"state_dtype={c.state_dtype!r}: expected one of {tuple(_STATE_DTYPES)}"
        if not c.state_pool:
            if c.state_dtype != "float32":
                return False, f"state_dtype={c.state_dtype!r}: h0 and ht are fp32 (a bf16 state needs state_pool)"
            if c.initial_state_flags:
                return False, "initial_state_flags (has_initial_state per sequence) needs state_pool"
        elif c.has_initial_state or c.output_final_state:
            return False, "state_pool reads and writes the pool: has_initial_state and output_final_state must be False"
        return True, ""

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the fifteen tensor arguments of ``__call__``, in order (None: argument absent)."""
        c = self.config
        bf16 = TensorSpec(BFloat16, 4, 8)  # 16-byte rows segments for cp.async and the o store
        state = TensorSpec(Float32, 4, 2)
        index = TensorSpec(Int32, 1) if c.varlen else None
        pool = c.state_pool
        return (
            bf16,  # qg [B, T, HV, K]
            bf16,  # kg [B, T, HV, K]
            bf16,  # w [B, T, HV, K]
            bf16,  # u [B, T, HV, V]
            bf16,  # Aqk [B, T, HV, C]
            TensorSpec(Float32, 4, 4),  # g_last [B, NT, HV, K] (varlen [1, NC, HV, K]), log2 units
            state if c.has_initial_state else None,  # h0 [N, HV, K, V] or [N, HV, V, K]
            bf16,  # o [B, T, HV, V]
            state if c.output_final_state else None,  # ht
            index,  # cu_seqlens [N + 1]
            index,  # chunk_offsets [N + 1]
            index,  # seq_order [N]
            TensorSpec(_STATE_DTYPES[c.state_dtype], 4, 2) if pool else None,  # the pool [P, HV, K, V] / [P, HV, V, K]
            TensorSpec(Int32, 1) if pool else None,  # state_indices [N]
            TensorSpec(Uint8, 1) if c.initial_state_flags else None,  # has_initial_state [N] (a bool as a byte)
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic B, T and N; nothing allocated."""
        return fake_call_arguments(self.argument_specs(), Float32(1.0))

    # ------------------------------------------------------------------------------------------------------------
    # Host side: layouts, atoms, launch

    @cute.jit
    def __call__(
        self,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mW: cute.Tensor,
        mU: cute.Tensor,
        mAqk: cute.Tensor,
        mG: cute.Tensor,
        mH0: cute.Tensor | None,
        mO: cute.Tensor,
        mHt: cute.Tensor | None,
        mCuSeqlens: cute.Tensor | None,
        mChunkOffsets: cute.Tensor | None,
        mSeqOrder: cute.Tensor | None,
        mPool: cute.Tensor | None,
        mStateIdx: cute.Tensor | None,
        mHasInit: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        sK_layout = self._smem_layout(C, K, 2)
        sU_layout = self._smem_layout(C, BV, 2)
        sA_layout = self._smem_layout(C, C, 2)

        @cute.struct
        class SharedStorage:
            sW: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sKg: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sU_layout)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, 2 * K], 16]
            sGamma: cute.struct.Align[cute.struct.MemRange[Float32, self.num_warps * K], 16]

        tiled_mma = self.make_tiled_mma()
        if const_expr(c.varlen):  # one linear index (the sequences in seq_order)
            grid = [(mCuSeqlens.shape[0] - 1) * c.num_v_heads * (K // BV), 1, 1]
        else:
            grid = [mW.shape[0], c.num_v_heads, K // BV]
        self.kernel(
            mQg, mKg, mW, mU, mAqk, mG, mH0, mO, mHt, mCuSeqlens, mChunkOffsets, mSeqOrder, mPool, mStateIdx, mHasInit,
            scale, sK_layout, sU_layout, sA_layout, tiled_mma, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(
        self,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mW: cute.Tensor,
        mU: cute.Tensor,
        mAqk: cute.Tensor,
        mG: cute.Tensor,
        mH0: cute.Tensor | None,
        mO: cute.Tensor,
        mHt: cute.Tensor | None,
        mCuSeqlens: cute.Tensor | None,
        mChunkOffsets: cute.Tensor | None,
        mSeqOrder: cute.Tensor | None,
        mPool: cute.Tensor | None,
        mStateIdx: cute.Tensor | None,
        mHasInit: cute.Tensor | None,
        scale: Float32,
        sK_layout: cute.ComposedLayout,
        sU_layout: cute.ComposedLayout,
        sA_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        tidx, _, _ = cute.arch.thread_idx()
        n, hv, vb = cute.arch.block_idx()  # sequences on x (up to 2^31 - 1), value heads on y
        if const_expr(c.varlen):  # one linear index: V block fastest, then head, then sequence slot
            slot_head = n // (K // BV)
            vb = n % (K // BV)
            hv = slot_head % c.num_v_heads
            n = mSeqOrder[slot_head // c.num_v_heads]
        warp_idx = tidx // 32
        lane = tidx % 32

        # The sequence: batch row b, first token bos, seqlen tokens, its decay rows from gate_row0 on. Varlen: the
        # device cu_seqlens may differ from the host copy that was checked and that chunk_offsets and g_last's rows
        # were built from (a CUDA-graph replay, a write the version counter did not see). Whatever its values, the
        # tokens [bos, bos + seqlen) are clamped into [0, T), and seqlen to the sequence's rows of g_last
        # [gate_row0, gate_row1) (clamped into [0, NC)) times C: every load, o store and decay row lies in its
        # tensor and the chunk loop runs at most NC times (o is wrong for such values, nothing else is touched).
        gate_row0 = Int32(0)
        if const_expr(c.varlen):
            b = Int32(0)
            T, NC = mW.shape[1], mG.shape[1]
            bos = cutlass.min(cutlass.max(mCuSeqlens[n], 0), T)
            gate_row0 = cutlass.min(cutlass.max(mChunkOffsets[n], 0), NC)
            gate_row1 = cutlass.min(cutlass.max(mChunkOffsets[n + 1], gate_row0), NC)
            seqlen = cutlass.min(cutlass.min(cutlass.max(mCuSeqlens[n + 1], bos), T) - bos, (gate_row1 - gate_row0) * C)
        else:
            b = n
            bos = Int32(0)
            seqlen = mW.shape[1]
        num_chunks = (seqlen + (C - 1)) // C
        run_chunks = num_chunks  # the chunks computed (a padding row of the pool computes none)
        if const_expr(c.state_pool):  # the slot; -1 outside [0, P) (negative: padding; >= P: treated as padding)
            slot = mStateIdx[n]
            slot = cutlass.select_(cutlass.min(slot, mPool.shape[0] - 1 - slot) >= 0, slot, Int32(-1))
            run_chunks = cutlass.select_(slot >= 0, num_chunks, Int32(0))

        # ---- shared memory
        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sW = storage.sW.get_tensor(sK_layout)  # (C tokens, K, stage)
        sQ = storage.sQ.get_tensor(sK_layout)
        sKg = storage.sKg.get_tensor(sK_layout)
        sU = storage.sU.get_tensor(sU_layout)  # (C tokens, BV, stage)
        sA = storage.sA.get_tensor(sA_layout)  # (C query tokens, C key tokens, stage)
        sG = storage.sG.get_tensor(cute.make_layout((K, 2)))  # gate row of the chunk's last valid token
        # Transposed views (the composition maps (col, row, stage) onto the token-major tiles).
        sKgT = cute.composition(sKg, cute.make_layout((K, C, 2), stride=(C, 1, C * K)))  # (K, C tokens, stage)
        sUT = cute.composition(sU, cute.make_layout((BV, C, 2), stride=(C, 1, C * BV)))  # (BV, C tokens, stage)
        # This warp's exp2(gate) row, broadcast over the BV state rows for the accumulator partition.
        sGammaAll = storage.sGamma.get_tensor(cute.make_layout((K, self.num_warps)))
        sGamma = cute.make_tensor(
            sGammaAll[None, warp_idx].iterator, cute.make_layout((BV, K), stride=(0, 1))
        )

        # ---- MMA partitions. Every product is (M = BV value rows) x (N) x (K-mode):
        #   GEMM1 / output:  Sᵀ_bf (BV x K) · wᵀ, qgᵀ  -> (BV x C tokens);  B = w, qg as (C tokens, K)
        #   output:          v_newᵀ (BV x C) · Aqkᵀ    -> (BV x C);         B = Aqk as (C query, C key)
        #   GEMM2:           v_newᵀ (BV x C) · kg      -> (BV x K);         B = kgᵀ as (K, C tokens)
        thr_mma = tiled_mma.get_slice(tidx)
        tSrS = cute.make_rmem_tensor(thr_mma.partition_shape_C((BV, K)), Float32)  # ((2,2), 1, K/8)
        accV = cute.make_rmem_tensor(thr_mma.partition_shape_C((BV, C)), Float32)  # ((2,2), 1, C/8)
        accO = cute.make_rmem_tensor(thr_mma.partition_shape_C((BV, C)), Float32)
        tCrW = thr_mma.make_fragment_B(thr_mma.partition_B(sW[None, None, 0]))  # (V, C/8, K/16)
        tCrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ[None, None, 0]))
        tCrA = thr_mma.make_fragment_B(thr_mma.partition_B(sA[None, None, 0]))  # (V, C/8, C/16)
        tCrKg = thr_mma.make_fragment_B(thr_mma.partition_B(sKgT[None, None, 0]))  # (V, K/8, C/16)
        # (query, key) coordinates of this thread's Aqk fragment, for the causal mask
        tCcA = thr_mma.partition_B(cute.make_identity_tensor((C, C)))

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        stsm_t = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        s2r_B = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        s2r_Bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        s2r_C = cute.make_tiled_copy_C(ldsm_t, tiled_mma).get_slice(tidx)
        r2s_C = cute.make_tiled_copy_C(stsm_t, tiled_mma).get_slice(tidx)
        tCsW = s2r_B.partition_S(sW)  # (CPY, C/16, K/16, stage)
        tCsQ = s2r_B.partition_S(sQ)
        tCsA = s2r_B.partition_S(sA)
        tCsKg = s2r_Bt.partition_S(sKgT)
        tCrW_v = s2r_B.retile(tCrW)
        tCrQ_v = s2r_B.retile(tCrQ)
        tCrA_v = s2r_B.retile(tCrA)
        tCrKg_v = s2r_Bt.retile(tCrKg)
        rU = cute.make_rmem_tensor(accV.layout, BFloat16)
        rO = cute.make_rmem_tensor(accO.layout, BFloat16)
        tCsU = s2r_C.partition_S(sUT)  # uᵀ read in accumulator layout
        tCrU_v = s2r_C.retile(rU)
        tCsO = r2s_C.partition_D(sUT)  # oᵀ staged over the warp's own (consumed) u columns
        tCrO_v = r2s_C.retile(rO)
        tSsGamma = thr_mma.partition_C(sGamma)

        # ---- initial state (fp32) into the accumulator layout of Sᵀ
        if const_expr(c.state_pool):  # from the slot (widened to fp32), else zeros; this thread's elements only
            tSrS.fill(0.0)
            if slot >= 0:
                read = Int32(1)
                if const_expr(c.initial_state_flags):
                    read = Int32(mHasInit[n])
                if read != 0:
                    tSrS.store(self._pool_tile(thr_mma, mPool, slot, hv, vb).load().to(Float32))
        elif const_expr(c.has_initial_state):
            tSgH0 = thr_mma.partition_C(self._state_tile(mH0[n, hv, None, None], vb))
            tSrS.store(tSgH0.load())
        else:
            tSrS.fill(0.0)

        # ---- global -> shared copies
        g2s_K = self._g2s_copy(K).get_slice(tidx)
        g2s_U = self._g2s_copy(BV).get_slice(tidx)
        g2s_A = self._g2s_copy(C).get_slice(tidx)
        g_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), Float32,
                                     num_bits_per_copy=128)
        loader = (g2s_K, g2s_U, g2s_A, g_atom)

        if run_chunks > 0:
            self.load_chunk(loader, mQg, mKg, mW, mU, mAqk, mG, sW, sQ, sKg, sU, sA, sG, b, hv, vb, bos,
                            cutlass.min(seqlen, C), Int32(0), tidx, gate_row0)
            cute.arch.cp_async_commit_group()

        for chunk in cutlass.range(run_chunks, unroll=1):
            stage = chunk % 2
            length = cutlass.min(seqlen - chunk * C, C)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # chunk's tiles visible; everyone is done with the other stage
            if chunk + 1 < run_chunks:
                self.load_chunk(loader, mQg, mKg, mW, mU, mAqk, mG, sW, sQ, sKg, sU, sA, sG, b, hv, vb,
                                bos + (chunk + 1) * C, cutlass.min(seqlen - (chunk + 1) * C, C), 1 - stage, tidx,
                                gate_row0 + chunk + 1)
                cute.arch.cp_async_commit_group()

            # γ = exp2(gate row of the last valid token): this warp's private copy, 4 channels per lane
            for i in cutlass.range_constexpr(K // 32):
                sGammaAll[lane + 32 * i, warp_idx] = cute.math.exp2(sG[lane + 32 * i, stage], fastmath=True)

            # ---- accV = Sᵀ_bf · wᵀ (the recurrence's critical path first)
            rSbf = cute.make_rmem_tensor(tSrS.layout, BFloat16)
            rSbf.store(tSrS.load().to(BFloat16))
            tSrSbf_A = self._acc_as_operand_a(rSbf)  # (((2,2),2), 1, K/16)
            accV.fill(0.0)
            for kb in cutlass.range_constexpr(K // self.mma_k):
                cute.copy(s2r_B, tCsW[None, None, kb, stage], tCrW_v[None, None, kb])
                cute.gemm(tiled_mma, accV, tSrSbf_A[None, None, kb], tCrW[None, None, kb], accV)

            # ---- v_newᵀ = uᵀ - accV, rounded to bf16: the A operand of the state and output products
            cute.copy(s2r_C, tCsU[None, None, None, stage], tCrU_v)
            rVn = cute.make_rmem_tensor(accV.layout, BFloat16)
            rVn.store((rU.load().to(Float32) - accV.load()).to(BFloat16))
            tCrVn_A = self._acc_as_operand_a(rVn)  # (((2,2),2), 1, C/16)

            # ---- Sᵀ = γ ⊙ Sᵀ + v_newᵀ · kg
            cute.arch.sync_warp()  # γ written by the other lanes of this warp
            tSrS.store(tSrS.load() * tSsGamma.load())
            for kb in cutlass.range_constexpr(C // self.mma_k):
                cute.copy(s2r_Bt, tCsKg[None, None, kb, stage], tCrKg_v[None, None, kb])
                cute.gemm(tiled_mma, tSrS, tCrVn_A[None, None, kb], tCrKg[None, None, kb], tSrS)

            # ---- oᵀ = scale · Sᵀ_bf · qgᵀ + v_newᵀ · tril(Aqk)ᵀ (off the recurrence's critical path)
            accO.fill(0.0)
            for kb in cutlass.range_constexpr(K // self.mma_k):
                cute.copy(s2r_B, tCsQ[None, None, kb, stage], tCrQ_v[None, None, kb])
                cute.gemm(tiled_mma, accO, tSrSbf_A[None, None, kb], tCrQ[None, None, kb], accO)
            accO.store(accO.load() * scale)
            for kb in cutlass.range_constexpr(C // self.mma_k):  # query tile nt (8 tokens) needs key blocks <= nt/2
                cute.copy(s2r_B, tCsA[None, None, kb, stage], tCrA_v[None, None, kb])
                for nt in cutlass.range_constexpr(2 * kb, C // 8):
                    if const_expr(nt // 2 == kb):  # diagonal block: zero the key tokens after the query token
                        for v in cutlass.range_constexpr(cute.size(tCrA, mode=[0])):
                            query, key = tCcA[v, nt, kb]
                            tCrA[v, nt, kb] = cutlass.select_(key > query, BFloat16(0.0), tCrA[v, nt, kb])
                    acc = self._rank3(accO[None, None, nt])
                    cute.gemm(tiled_mma, acc, self._rank3(tCrVn_A[None, None, kb]),
                              self._rank3(tCrA[None, nt, kb]), acc)

            # ---- o: stage oᵀ over this warp's own u columns (already read), then 16-byte stores of rows < length
            rO.store(accO.load().to(BFloat16))
            cute.arch.sync_warp()
            cute.copy(r2s_C, tCrO_v, tCsO[None, None, None, stage])
            cute.arch.sync_warp()
            self.store_rows(mO, sU[None, None, stage], b, hv, vb, bos + chunk * C, length, tidx)

        # ---- final state (fp32), same layout as the initial state
        if const_expr(c.output_final_state):
            tSgHt = thr_mma.partition_C(self._state_tile(mHt[n, hv, None, None], vb))
            tSgHt.store(tSrS.load())
        if const_expr(c.state_pool):
            if slot >= 0:  # back into the slot, in place: the elements this thread read (rounded to the pool's dtype)
                self._pool_tile(thr_mma, mPool, slot, hv, vb).store(tSrS.load().to(mPool.element_type))
            else:  # a padding row: its o rows are zeros (nothing was loaded or computed)
                self.store_zero_rows(mO, b, hv, vb, bos, seqlen, tidx)

    @cute.jit
    def _state_tile(self, head: cute.Tensor, vb: Int32) -> cute.Tensor:
        """This CTA's ``(BV, K)`` block of ``Sᵀ`` in one head's state ``[K, V]`` (or ``[V, K]``)."""
        c = self.config
        if const_expr(not c.state_v_first):  # (K, V) with V contiguous -> view it as (V, K)
            head = cute.make_tensor(head.iterator, cute.make_layout(
                (head.shape[1], head.shape[0]), stride=(head.stride[1], head.stride[0])
            ))
        return cute.local_tile(head, (c.block_v, c.head_dim), (vb, 0))

    def _pool_tile(self, thr_mma, mPool: cute.Tensor, slot: Int32, hv: Int32, vb: Int32) -> cute.Tensor:
        """This thread's elements of the CTA's block of ``Sᵀ`` in pool slot ``slot``, in accumulator layout."""
        return thr_mma.partition_C(self._state_tile(mPool[slot, hv, None, None], vb))

    @staticmethod
    def _acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
        """View an m16n8 accumulator fragment ``((2,2), M, N)`` as the m16k16 A fragment ``(((2,2),2), M, N/2)``:
        the two adjacent n8 tiles 2j, 2j+1 hold exactly k-block j of the next product (same registers)."""
        split = cute.logical_divide(acc.layout, (None, None, 2))
        layout = cute.make_layout(
            ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
            stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1]),
        )
        return cute.make_tensor(acc.iterator, layout)

    @cute.jit
    def load_chunk(self, loader, mQg: cute.Tensor, mKg: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor,
                   mAqk: cute.Tensor, mG: cute.Tensor, sW: cute.Tensor, sQ: cute.Tensor, sKg: cute.Tensor,
                   sU: cute.Tensor, sA: cute.Tensor, sG: cute.Tensor, b: Int32, hv: Int32, vb: Int32,
                   tok0: Int32, length: Int32, stage: Int32, tidx: Int32, gate_row: Int32):
        """Issue the cp.async copies of one chunk (tokens ``tok0 ..``, ``length`` valid) into ``stage``; rows past
        ``length`` are zero-filled in shared memory and not read. ``gate_row``: the chunk's decay row in ``mG``."""
        C, K, BV = self.config.chunk_size, self.config.head_dim, self.config.block_v
        g2s_K, g2s_U, g2s_A, g_atom = loader
        for mX, sX in ((mW, sW), (mQg, sQ), (mKg, sKg)):
            gX = cute.local_tile(cute.domain_offset((tok0, 0), mX[b, None, hv, None]), (C, K), (0, 0))
            self._copy_rows(g2s_K, gX, sX[None, None, stage], length)
        gU = cute.local_tile(cute.domain_offset((tok0, 0), mU[b, None, hv, None]), (C, BV), (0, vb))
        self._copy_rows(g2s_U, gU, sU[None, None, stage], length)
        gA = cute.local_tile(cute.domain_offset((tok0, 0), mAqk[b, None, hv, None]), (C, C), (0, 0))
        self._copy_rows(g2s_A, gA, sA[None, None, stage], length)
        if tidx < K // 4:  # the decay row: 16 bytes per thread
            gG = cute.local_tile(mG[b, gate_row, hv, None], (4,), (tidx,))
            sGt = cute.local_tile(sG[None, stage], (4,), (tidx,))
            cute.copy(g_atom, gG, sGt)

@functools.lru_cache(maxsize=256)
def _plan(HV: int, K: int, block_v: int, flags: tuple) -> tuple:
    """The config and argument specs of one call signature (cached: no work per call)."""
    varlen, has_h0, want_ht, v_first, pool_dtype, has_flags = flags
    config = KdaRecurrenceConfig(num_v_heads=HV, head_dim=K, block_v=block_v, varlen=varlen,
                                 has_initial_state=has_h0, output_final_state=want_ht, state_v_first=v_first,
                                 state_pool=pool_dtype is not None, state_dtype=pool_dtype or "float32",
                                 initial_state_flags=has_flags)
    ok, reason = KdaRecurrence.can_implement(config)
    if not ok:
        raise ValueError(f"KdaRecurrence: {reason}")
    return config, KdaRecurrence(config).argument_specs()


_OUTPUTS = frozenset({7, 8, 12})  # o, ht and the pool (written in place) among the tensor arguments
_POOL_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}


def chunk_kda_fwd_recurrence(
    qg,
    kg,
    w,
    u,
    Aqk,
    g_last,
    scale: float,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens=None,
    chunk_offsets=None,
    state_v_first: bool = False,
    *,
    block_v: int = 64,
    seq_order=None,
    state=None,
    state_indices=None,
    has_initial_state=None,
):
    """Fused inter-chunk recurrence and chunk output of KDA on the GPU: ``(o, final_state or None)``.

    Args:
        qg, kg, w: ``[B, T, HV, 128]`` bf16 (KDA_SPEC §3.4; qg without scale).
        u: ``[B, T, HV, 128]`` bf16.
        Aqk: ``[B, T, HV, 64]`` bf16, scale included; only the lower triangle (key <= query) is read.
        g_last: fp32 ``[B, NT, HV, 128]`` (varlen ``[1, NC, HV, 128]``, sequence n's chunk c at row
            ``chunk_offsets[n] + c``): each chunk's decay row, the chunk-local cumulative gate in log2 units at its
            last valid token (chunk c decays by ``2^g_last[c]``): what
            :func:`~cula_runtime.cute.kda.intra.chunk_kda_fwd_intra_from_raw` writes.
        scale: the factor of ``qg · S``.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) or None (zeros).
        output_final_state: also return the fp32 final state (same layout as the initial state).
        cu_seqlens: int32 ``[N + 1]`` for packed sequences (B must be 1). Read on the device and clamped there
            (the tokens into ``[0, T)``, the chunks into the sequence's ``g_last`` rows): values unlike those
            ``chunk_offsets`` was built from give a wrong o, never an access outside a tensor.
        chunk_offsets: int32 ``[N + 1]``, each sequence's first row of ``g_last``
            (:func:`~cula_runtime.index.prepare_chunk_offsets`); required with ``cu_seqlens``, unused without.
        block_v: value columns per CTA, 64 or 128 (another value is a ValueError); either gives the same bits.
        seq_order: with ``cu_seqlens``: int32 ``[N]``, the order in which the sequences' CTAs are launched; None:
            :func:`~cula_runtime.index.prepare_sequence_order` (longest first, so that the longest chains start in
            the first wave). Any order gives the same bits.
        state: a state pool instead of ``initial_state`` / ``output_final_state``: fp32 or bf16 ``[P, HV, K, V]``
            (``[P, HV, V, K]`` with ``state_v_first``) on the device, unit last stride, the other strides even and
            the data 8-byte (fp32) or 4-byte (bf16) aligned; read and written in place, never copied.
        state_indices: int32 ``[N]`` on the device, with ``state``: sequence n starts from slot
            ``state_indices[n]`` and its final state (rounded to the pool's dtype) is written back there; a slot
            outside ``[0, P)`` is a padding row (nothing read or written, o rows zero). The values are not read on
            the host; two sequences naming one slot race (the module docstring).
        has_initial_state: bool ``[N]`` on the device or None, with ``state``: where False, the sequence starts from
            zeros instead of its slot (its final state is still written there).

    Returns:
        ``o`` bf16 ``[B, T, HV, 128]`` and the final state (or None; None with ``state``). Launched on the current
        stream; the first call per configuration compiles
        (:func:`cula_runtime.cute.compile_cache.compile_records`).
    """
    import torch

    if w.dim() != 4 or w.shape[3] != 128:
        raise ValueError(f"w must be [B, T, HV, 128], got {tuple(w.shape)}")
    B, T, HV, K = w.shape
    bf16 = torch.bfloat16
    named = {"w": (w, HV, K, bf16), "kg": (kg, HV, K, bf16), "u": (u, HV, K, bf16), "qg": (qg, HV, K, bf16),
             "Aqk": (Aqk, HV, 64, bf16)}
    check_token_tensors(named, B, T)
    device = w.device
    varlen = cu_seqlens is not None
    N = check_cu_seqlens(cu_seqlens, B, device) if varlen else B
    state_shape = (N, HV, K, K)
    if initial_state is not None:
        if tuple(initial_state.shape) != state_shape or initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be float32 {state_shape}, got {initial_state.dtype} "
                             f"{tuple(initial_state.shape)}")
        if initial_state.device != device:
            raise ValueError(f"initial_state must be on {device}")
    if state is not None:
        _check_pool(state, state_indices, has_initial_state, initial_state, output_final_state, N, HV, K, device)
    elif state_indices is not None or has_initial_state is not None:
        raise ValueError("state_indices and has_initial_state index a state pool: pass state (the pool) too")
    rows = "NC" if varlen else -(-T // 64)
    if (g_last.dim() != 4 or g_last.dtype != torch.float32 or g_last.device != device or g_last.shape[0] != B
            or (not varlen and g_last.shape[1] != rows) or tuple(g_last.shape[2:]) != (HV, K)):
        raise ValueError(f"g_last must be float32 [{B}, {rows}, {HV}, {K}] on {device}, got {g_last.dtype} "
                         f"{tuple(g_last.shape)} on {g_last.device}")
    if varlen:
        if chunk_offsets is None:
            raise ValueError("cu_seqlens needs chunk_offsets (each sequence's first row of g_last)")
        if (chunk_offsets.dtype != torch.int32 or tuple(chunk_offsets.shape) != (N + 1,)
                or chunk_offsets.device != device):
            raise ValueError(f"chunk_offsets must be int32 [{N + 1}] on {device}, got {chunk_offsets.dtype} "
                             f"{tuple(chunk_offsets.shape)} on {chunk_offsets.device}")
        if seq_order is None:
            from ...index import prepare_sequence_order

            seq_order = prepare_sequence_order(cu_seqlens)
        if seq_order.dtype != torch.int32 or tuple(seq_order.shape) != (N,) or seq_order.device != device:
            raise ValueError(f"seq_order must be int32 [{N}] on {device}, got {seq_order.dtype} "
                             f"{tuple(seq_order.shape)} on {seq_order.device}")
    elif seq_order is not None:
        raise ValueError("seq_order orders the sequences of a packed batch: it needs cu_seqlens")
    return _run(qg, kg, w, u, Aqk, g_last, scale, initial_state, bool(output_final_state), cu_seqlens,
                chunk_offsets, bool(state_v_first), block_v, seq_order, N, pool=state, state_indices=state_indices,
                has_initial_state=has_initial_state)


def _check_pool(pool, state_indices, has_initial_state, initial_state, output_final_state: bool, N: int, HV: int,
                K: int, device) -> None:
    """:func:`chunk_kda_fwd_recurrence`'s checks of its pool arguments (the layout promises are the launch's)."""
    import torch

    if initial_state is not None or output_final_state:
        raise ValueError("state (the pool) excludes initial_state and output_final_state: the states are read from "
                         "and written to the pool")
    if (pool.dim() != 4 or tuple(pool.shape[1:]) != (HV, K, K) or pool.dtype not in (torch.float32, torch.bfloat16)
            or pool.device != device):
        raise ValueError(f"state must be a float32 or bfloat16 pool [P, {HV}, {K}, {K}] on {device}, got "
                         f"{pool.dtype} {tuple(pool.shape)} on {pool.device}")
    if (state_indices is None or state_indices.dtype != torch.int32 or tuple(state_indices.shape) != (N,)
            or state_indices.device != device):
        got = "None" if state_indices is None else \
            f"{state_indices.dtype} {tuple(state_indices.shape)} on {state_indices.device}"
        raise ValueError(f"state needs state_indices: int32 [{N}] on {device}, got {got}")
    if has_initial_state is not None and (has_initial_state.dtype != torch.bool
                                          or tuple(has_initial_state.shape) != (N,)
                                          or has_initial_state.device != device):
        raise ValueError(f"has_initial_state must be bool [{N}] on {device}, got {has_initial_state.dtype} "
                         f"{tuple(has_initial_state.shape)} on {has_initial_state.device}")


def _run(qg, kg, w, u, Aqk, g_last, scale: float, initial_state, output_final_state: bool, cu_seqlens,
         chunk_offsets, state_v_first: bool, block_v: int, seq_order, N: int, *, pool=None, state_indices=None,
         has_initial_state=None) -> tuple:
    """:func:`chunk_kda_fwd_recurrence` after its checks (``N`` sequences; with ``cu_seqlens``, ``chunk_offsets``
    and ``seq_order`` given; with ``pool``, ``state_indices`` and optionally ``has_initial_state``): plan, allocate
    ``o`` and the final state, launch: ``(o, ht or None)``. The cutedsl backend calls it directly:
    :func:`~cula_runtime.kda_args.validate_kda_prefill`, the backend's ``verify`` and the intra kernel's outputs
    meet what the wrapper checks."""
    import torch

    B, T, HV, K = w.shape
    device = w.device
    config, specs = _plan(HV, K, block_v, _flags(cu_seqlens, initial_state, output_final_state, state_v_first, pool,
                                                 has_initial_state))
    o = torch.empty(B, T, HV, K, dtype=torch.bfloat16, device=device)
    ht = torch.empty((N, HV, K, K), dtype=torch.float32, device=device) if output_final_state else None
    if N == 0:
        return o, ht
    launch(KdaRecurrence, config, specs, _tensors(qg, kg, w, u, Aqk, g_last, initial_state, o, ht, cu_seqlens,
                                                  chunk_offsets, seq_order, pool, state_indices, has_initial_state),
           _OUTPUTS, device, float(scale))
    return o, ht


def _flags(cu_seqlens, initial_state, output_final_state: bool, state_v_first: bool, pool, has_initial_state) -> tuple:
    """The configuration's flags of a call (:func:`_plan`)."""
    pool_dtype = None if pool is None else _POOL_DTYPES[str(pool.dtype)]
    return (cu_seqlens is not None, initial_state is not None, output_final_state, state_v_first, pool_dtype,
            has_initial_state is not None)


def _tensors(qg, kg, w, u, Aqk, g_last, initial_state, o, ht, cu_seqlens, chunk_offsets, seq_order, pool,
             state_indices, has_initial_state) -> tuple:
    """The kernel's tensor arguments in their order (:meth:`KdaRecurrence.argument_specs`); the flags as bytes (a
    view: no copy)."""
    return (qg, kg, w, u, Aqk, g_last, initial_state, o, ht, cu_seqlens, chunk_offsets, seq_order, pool,
            state_indices, flag_bytes(has_initial_state))


def plan_run(shape: tuple, N: int, block_v: int, scale: float, device, *, cu_seqlens=None, initial_state=None,
             output_final_state: bool = False, state_v_first: bool = False, pool=None, has_initial_state=None):
    """:func:`_run` for every call with the signature of these arguments (``shape``: ``(B, T, HV, K)`` of the intra
    outputs; the tensors read for their presence and the pool's dtype; none kept; ``N > 0``): ``run(qg, kg, w, u,
    Aqk, g_last, initial_state, cu_seqlens, chunk_offsets, seq_order, pool, state_indices, has_initial_state) ->
    (o, ht or None)`` allocates ``o`` and the final state and launches through a launch bound once
    (:func:`~cula_runtime.cute.compile_cache.bound_launch`: no per-tensor check; ``LaunchDeclined``, nothing
    launched, where TVM-FFI refuses a pointer). The same configuration, tensors and scalar as :func:`_run`: the
    same bits."""
    import torch

    B, T, HV, K = shape
    config, specs = _plan(HV, K, block_v, _flags(cu_seqlens, initial_state, output_final_state, state_v_first, pool,
                                                 has_initial_state))
    run = bound_launch(KdaRecurrence, config, specs, device)
    scalars = (float(scale),)
    bf16, fp32 = torch.bfloat16, torch.float32

    def run_recurrence(qg, kg, w, u, Aqk, g_last, initial_state, cu_seqlens, chunk_offsets, seq_order, pool,
                       state_indices, has_initial_state) -> tuple:
        o = torch.empty(B, T, HV, K, dtype=bf16, device=device)
        ht = torch.empty((N, HV, K, K), dtype=fp32, device=device) if output_final_state else None
        run(_tensors(qg, kg, w, u, Aqk, g_last, initial_state, o, ht, cu_seqlens, chunk_offsets, seq_order, pool,
                     state_indices, has_initial_state), scalars)
        return o, ht

    return run_recurrence
