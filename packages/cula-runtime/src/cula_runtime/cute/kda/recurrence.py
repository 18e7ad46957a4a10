"""KDA inter-chunk recurrence fused with the chunk output, in one CuTeDSL launch (KDA_SPEC.md §3.5, §3.6, §3.8).

Per (sequence n, value head hv, block of ``block_v`` value columns), one CTA walks the sequence's 64-token chunks
in order. With S the fp32 state ``[K, V]`` entering a chunk (only the CTA's value columns):

* ``S_bf = bf16(S)``;
* ``v_new = bf16(u - w · S_bf)``;
* ``o = bf16(scale · (qg · S_bf) + tril(Aqk) · v_new)`` (``tril`` is applied here: the upper part of Aqk is ignored);
* ``S = 2^gk[last valid row] ⊙ S + kgᵀ · v_new`` (fp32, kept in registers for the whole sequence).

Everything is computed transposed so that the state is the A operand of every product (M = value rows) and the
products chain in registers:

* ``v_newᵀ = uᵀ - Sᵀ_bf · wᵀ`` and ``oᵀ = scale · Sᵀ_bf · qgᵀ`` share the A fragments of ``Sᵀ_bf``;
* ``oᵀ += v_newᵀ · Aqkᵀ`` and ``Sᵀ = γ ⊙ Sᵀ + v_newᵀ · kg`` take ``v_newᵀ`` as A straight from the accumulator
  (two adjacent n8 accumulator tiles of m16n8k16 are one k16 A fragment once packed to bf16).

Warp w owns rows ``16 w .. 16 w + 15`` of ``Sᵀ`` (64 fp32 registers per thread), so the recurrence needs no
cross-warp exchange. B operands come from shared memory through ``ldmatrix`` (``.trans`` for kg, whose
token-major tile is K-contiguous); ``uᵀ`` is read and ``oᵀ`` staged with ``ldmatrix.trans``/``stmatrix.trans`` in
accumulator layout. Each chunk's operands (w, qg, kg, the CTA's u columns, Aqk, and the gate row of the last
valid token) are copied by ``cp.async`` into one of two shared-memory stages while the previous chunk computes.
Rows past a sequence end are zero-filled in shared memory and never read from global memory (they may belong to
the next sequence). Only warp-level MMA (``mma.sync`` m16n8k16 bf16, fp32 accumulate): the same source runs on
SM90, SM100 and SM103.

Grid ``(N, HV, 128 / block_v)``, ``block_v / 16`` warps per CTA; about 131 KB of shared memory at ``block_v = 64``.

:func:`chunk_kda_fwd_recurrence` is the host wrapper (FLA layouts in, ``(o, final_state)`` out).
"""

import dataclasses
import functools

from ..compile_cache import TensorSpec, fake_call_arguments, launch, missing_cutedsl
from ..varlen import check_cu_seqlens, check_token_tensors
from .tiles import ChunkTiles

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr
    from cutlass.cute.nvgpu import cpasync, warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["KdaRecurrence", "KdaRecurrenceConfig", "chunk_kda_fwd_h", "chunk_kda_fwd_recurrence"]



@dataclasses.dataclass(frozen=True)
class KdaRecurrenceConfig:
    """Compile-time configuration of :class:`KdaRecurrence` (the compile-cache key; T, B, N are not in it).

    Attributes:
        num_v_heads: HV.
        head_dim: K = V (only 128).
        block_v: value columns per CTA (32, 64 or 128 = 2, 4 or 8 warps).
        varlen: packed sequences (B = 1, ``cu_seqlens``).
        has_initial_state: an fp32 initial state is read (else the state starts at zero).
        output_final_state: the fp32 final state is written.
        state_v_first: the states are ``[N, HV, V, K]`` (else ``[N, HV, K, V]``).
        chunk_size: C; only 64.
        output_o: compute and write o (reads qg and Aqk). False: the delta-h primitive alone.
        output_h: also write every chunk's entering state ``h = bf16(S)`` (``[B, NT, HV, K, V]``, or ``V, K`` with
            ``state_v_first``; varlen: ``[1, NC, ...]`` at ``chunk_offsets[n] + c``) and ``v_new`` (bf16, token-major).
        gate_per_chunk: the gate argument holds only each chunk's decay row (``gk`` at its last valid token):
            ``[B, NT, HV, K]``, varlen ``[1, NC, HV, K]`` at ``chunk_offsets[n] + c`` (what the intra kernel writes
            when it computes the gate itself), instead of the token-major ``gk``.
        longest_first: varlen: a 1-D grid numbered V block fastest, then value head, then sequence slot, and slot s
            runs sequence ``seq_order[s]`` (:func:`~cula_runtime.index.prepare_sequence_order`, longest first), so the
            longest chains start in the first wave. Same bits as the (sequence, head, V block) grid.
    """

    num_v_heads: int
    head_dim: int = 128
    block_v: int = 64
    varlen: bool = False
    has_initial_state: bool = False
    output_final_state: bool = False
    state_v_first: bool = False
    chunk_size: int = 64
    output_o: bool = True
    output_h: bool = False
    gate_per_chunk: bool = False
    longest_first: bool = False


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
        if not (c.output_o or c.output_h or c.output_final_state):
            return False, "nothing to write: output_o, output_h and output_final_state are all False"
        if c.longest_first and not c.varlen:
            return False, "longest_first orders the sequences of a packed (varlen) batch"
        return True, ""

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the fourteen tensor arguments of ``__call__``, in order (None: argument absent)."""
        c = self.config
        bf16 = TensorSpec(BFloat16, 4, 8)  # 16-byte rows segments for cp.async and the o store
        state = TensorSpec(Float32, 4, 2)
        return (
            bf16 if c.output_o else None,  # qg [B, T, HV, K]
            bf16,  # kg [B, T, HV, K]
            bf16,  # w [B, T, HV, K]
            bf16,  # u [B, T, HV, V]
            bf16 if c.output_o else None,  # Aqk [B, T, HV, C]
            TensorSpec(Float32, 4, 4),  # gk [B, T, HV, K] (log2 units); gate_per_chunk: [B, NT, HV, K]
            state if c.has_initial_state else None,  # h0 [N, HV, K, V] or [N, HV, V, K]
            bf16 if c.output_o else None,  # o [B, T, HV, V]
            state if c.output_final_state else None,  # ht
            TensorSpec(Int32, 1) if c.varlen else None,  # cu_seqlens [N + 1]
            TensorSpec(BFloat16, 5, 2) if c.output_h else None,  # h [B, NT, HV, K, V] (or V, K)
            bf16 if c.output_h else None,  # v_new [B, T, HV, V]
            TensorSpec(Int32, 1) if (c.output_h or c.gate_per_chunk) and c.varlen else None,  # chunk_offsets [N + 1]
            TensorSpec(Int32, 1) if c.longest_first else None,  # seq_order [N]
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
        mH: cute.Tensor | None,
        mVnew: cute.Tensor | None,
        mChunkOffsets: cute.Tensor | None,
        mSeqOrder: cute.Tensor | None,
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
        if const_expr(c.varlen):
            num_seqs = mCuSeqlens.shape[0] - 1
        else:
            num_seqs = mW.shape[0]
        grid = [num_seqs, c.num_v_heads, K // BV]
        if const_expr(c.longest_first):
            grid = [num_seqs * c.num_v_heads * (K // BV), 1, 1]
        self.kernel(
            mQg, mKg, mW, mU, mAqk, mG, mH0, mO, mHt, mCuSeqlens, mH, mVnew, mChunkOffsets, mSeqOrder, scale,
            sK_layout, sU_layout, sA_layout, tiled_mma, SharedStorage,
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
        mH: cute.Tensor | None,
        mVnew: cute.Tensor | None,
        mChunkOffsets: cute.Tensor | None,
        mSeqOrder: cute.Tensor | None,
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
        if const_expr(c.longest_first):  # one linear index: V block fastest, then head, then sequence slot
            slot_head = n // (K // BV)
            vb = n % (K // BV)
            hv = slot_head % c.num_v_heads
            n = mSeqOrder[slot_head // c.num_v_heads]
        warp_idx = tidx // 32
        lane = tidx % 32

        # The sequence: batch row b, first token bos, seqlen tokens.
        if const_expr(c.varlen):
            b = Int32(0)
            bos = mCuSeqlens[n]
            seqlen = mCuSeqlens[n + 1] - bos
        else:
            b = n
            bos = Int32(0)
            seqlen = mW.shape[1]
        num_chunks = (seqlen + (C - 1)) // C

        # ---- shared memory
        smem = cutlass.utils.SmemAllocator()
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
        if const_expr(c.has_initial_state):
            tSgH0 = thr_mma.partition_C(self._state_tile(mH0[n, hv, None, None], vb))
            tSrS.store(tSgH0.load())
        else:
            tSrS.fill(0.0)

        # ---- global -> shared copies
        g2s_K = self._g2s_copy(K).get_slice(tidx)
        g2s_U = self._g2s_copy(BV).get_slice(tidx)
        g2s_A = self._g2s_copy(C).get_slice(tidx)
        g_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                                     num_bits_per_copy=128)
        loader = (g2s_K, g2s_U, g2s_A, g_atom)

        # the row of the gate tensor holding chunk c's decay, c = 0 (gate_per_chunk: the chunk's own row)
        gate_row0 = Int32(0)
        if const_expr(c.gate_per_chunk and c.varlen):
            gate_row0 = mChunkOffsets[n]
        if num_chunks > 0:
            self.load_chunk(loader, mQg, mKg, mW, mU, mAqk, mG, sW, sQ, sKg, sU, sA, sG, b, hv, vb, bos,
                            cutlass.min(seqlen, C), Int32(0), tidx, gate_row0)
            cute.arch.cp_async_commit_group()

        for chunk in cutlass.range(num_chunks, unroll=1):
            stage = chunk % 2
            length = cutlass.min(seqlen - chunk * C, C)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # chunk's tiles visible; everyone is done with the other stage
            if chunk + 1 < num_chunks:
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
            if const_expr(c.output_h):  # h of this chunk: the state entering it, as the products use it (bf16)
                h_index = mChunkOffsets[n] + chunk if const_expr(c.varlen) else chunk
                thr_mma.partition_C(self._state_tile(mH[b, h_index, hv, None, None], vb)).store(rSbf.load())
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

            # ---- v_new (delta-h primitive): staged over this warp's own u columns (read above), like o below
            if const_expr(c.output_h):
                cute.arch.sync_warp()
                cute.copy(r2s_C, r2s_C.retile(rVn), tCsO[None, None, None, stage])
                cute.arch.sync_warp()
                self.store_rows(mVnew, sU[None, None, stage], b, hv, vb, bos + chunk * C, length, tidx)

            # ---- oᵀ = scale · Sᵀ_bf · qgᵀ + v_newᵀ · tril(Aqk)ᵀ (off the recurrence's critical path)
            if const_expr(c.output_o):
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

    @cute.jit
    def _state_tile(self, head: cute.Tensor, vb: Int32) -> cute.Tensor:
        """This CTA's ``(BV, K)`` block of ``Sᵀ`` in one head's state ``[K, V]`` (or ``[V, K]``)."""
        c = self.config
        if const_expr(not c.state_v_first):  # (K, V) with V contiguous -> view it as (V, K)
            head = cute.make_tensor(head.iterator, cute.make_layout(
                (head.shape[1], head.shape[0]), stride=(head.stride[1], head.stride[0])
            ))
        return cute.local_tile(head, (c.block_v, c.head_dim), (vb, 0))

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
        ``length`` are zero-filled in shared memory and not read. ``gate_row``: the chunk's row of a per-chunk
        gate tensor (``gate_per_chunk``; else the gate row is the token ``tok0 + length - 1``)."""
        C, K, BV = self.config.chunk_size, self.config.head_dim, self.config.block_v
        g2s_K, g2s_U, g2s_A, g_atom = loader
        # qg and Aqk only feed the output
        tiles = ((mW, sW), (mQg, sQ), (mKg, sKg)) if const_expr(self.config.output_o) else ((mW, sW), (mKg, sKg))
        for mX, sX in tiles:
            gX = cute.local_tile(cute.domain_offset((tok0, 0), mX[b, None, hv, None]), (C, K), (0, 0))
            self._copy_rows(g2s_K, gX, sX[None, None, stage], length)
        gU = cute.local_tile(cute.domain_offset((tok0, 0), mU[b, None, hv, None]), (C, BV), (0, vb))
        self._copy_rows(g2s_U, gU, sU[None, None, stage], length)
        if const_expr(self.config.output_o):
            gA = cute.local_tile(cute.domain_offset((tok0, 0), mAqk[b, None, hv, None]), (C, C), (0, 0))
            self._copy_rows(g2s_A, gA, sA[None, None, stage], length)
        if tidx < K // 4:  # the gate row of the last valid token: 16 bytes per thread
            row = gate_row if const_expr(self.config.gate_per_chunk) else tok0 + length - 1
            gG = cute.local_tile(mG[b, row, hv, None], (4,), (tidx,))
            sGt = cute.local_tile(sG[None, stage], (4,), (tidx,))
            cute.copy(g_atom, gG, sGt)

@functools.lru_cache(maxsize=256)
def _plan(HV: int, K: int, block_v: int, flags: tuple) -> tuple:
    varlen, has_h0, want_ht, v_first, want_o, want_h, per_chunk, longest_first = flags
    config = KdaRecurrenceConfig(
        num_v_heads=HV, head_dim=K, block_v=block_v, varlen=varlen, has_initial_state=has_h0,
        output_final_state=want_ht, state_v_first=v_first, output_o=want_o, output_h=want_h,
        gate_per_chunk=per_chunk, longest_first=longest_first,
    )
    ok, reason = KdaRecurrence.can_implement(config)
    if not ok:
        raise ValueError(f"KdaRecurrence: {reason}")
    return config, KdaRecurrence(config).argument_specs()


_OUTPUTS = frozenset({7, 8, 10, 11})  # o, ht, h, v_new among the tensor arguments


def _launch(qg, kg, w, u, Aqk, gk, scale: float, initial_state, output_final_state: bool, cu_seqlens,
            chunk_offsets, state_v_first: bool, block_v: int, want_h: bool, gate_per_chunk: bool = False,
            seq_order=None) -> tuple:
    """Validate, allocate and launch one :class:`KdaRecurrence` configuration: ``(o or None, ht or None, h or None,
    v_new or None)``."""
    import torch

    if w.dim() != 4 or w.shape[3] != 128:
        raise ValueError(f"w must be [B, T, HV, 128], got {tuple(w.shape)}")
    B, T, HV, K = w.shape
    want_o = qg is not None
    bf16 = torch.bfloat16
    named = {"w": (w, HV, K, bf16), "kg": (kg, HV, K, bf16), "u": (u, HV, K, bf16)}
    if not gate_per_chunk:
        named["gk"] = (gk, HV, K, torch.float32)
    if want_o:
        named |= {"qg": (qg, HV, K, bf16), "Aqk": (Aqk, HV, 64, bf16)}
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
    if gate_per_chunk:
        chunks = "NC" if varlen else -(-T // 64)
        if (gk.dim() != 4 or gk.dtype != torch.float32 or gk.device != device or gk.shape[0] != B
                or (not varlen and gk.shape[1] != chunks) or tuple(gk.shape[2:]) != (HV, K)):
            raise ValueError(f"gk (gate_per_chunk) must be float32 [{B}, {chunks}, {HV}, {K}] on {device}, got "
                             f"{gk.dtype} {tuple(gk.shape)} on {gk.device}")
        if varlen and chunk_offsets is None:
            raise ValueError("gate_per_chunk with cu_seqlens needs chunk_offsets (the rows of each sequence's chunks)")
    h = v_new = None
    if want_h:
        if varlen:
            if chunk_offsets is None:
                from ...index import prepare_chunk_offsets

                chunk_offsets = prepare_chunk_offsets(cu_seqlens, 64)
            if chunk_offsets.dtype != torch.int32 or tuple(chunk_offsets.shape) != (N + 1,):
                raise ValueError(f"chunk_offsets must be int32 [{N + 1}], got {chunk_offsets.dtype} "
                                 f"{tuple(chunk_offsets.shape)}")
            num_h = int(chunk_offsets[-1])  # one device read: h's extent
            h = torch.empty(1, num_h, HV, K, K, dtype=torch.bfloat16, device=device)
        else:
            h = torch.empty(B, -(-T // 64), HV, K, K, dtype=torch.bfloat16, device=device)
        v_new = torch.empty(B, T, HV, K, dtype=torch.bfloat16, device=device)
    if seq_order is not None:
        if not varlen:
            raise ValueError("seq_order orders the sequences of a packed batch: it needs cu_seqlens")
        if seq_order.dtype != torch.int32 or tuple(seq_order.shape) != (N,) or seq_order.device != device:
            raise ValueError(f"seq_order must be int32 [{N}] on {device}, got {seq_order.dtype} "
                             f"{tuple(seq_order.shape)} on {seq_order.device}")
    return _run(qg, kg, w, u, Aqk, gk, scale, initial_state, bool(output_final_state), cu_seqlens, chunk_offsets,
                bool(state_v_first), block_v, h, v_new, bool(gate_per_chunk), seq_order, N)


def _run(qg, kg, w, u, Aqk, gk, scale: float, initial_state, output_final_state: bool, cu_seqlens, chunk_offsets,
         state_v_first: bool, block_v: int, h, v_new, gate_per_chunk: bool, seq_order, N: int) -> tuple:
    """:func:`_launch` after its checks (``h`` and ``v_new`` allocated when wanted; ``N`` sequences): plan,
    allocate ``o`` (when ``qg`` is given) and the final state, launch: ``(o or None, ht or None, h, v_new)``. The
    cutedsl backend calls it directly: :func:`~cula_runtime.kda_args.validate_kda_prefill` and the intra kernel's
    outputs meet what :func:`_launch` checks."""
    import torch

    B, T, HV, K = w.shape
    device = w.device
    varlen = cu_seqlens is not None
    want_o, want_h = qg is not None, h is not None
    flags = (varlen, initial_state is not None, output_final_state, state_v_first, want_o, want_h, gate_per_chunk,
             seq_order is not None)
    config, specs = _plan(HV, K, block_v, flags)

    o = torch.empty(B, T, HV, K, dtype=torch.bfloat16, device=device) if want_o else None
    state_shape = (N, HV, K, K)
    ht = torch.empty(state_shape, dtype=torch.float32, device=device) if output_final_state else None
    if N == 0:
        return o, ht, h, v_new
    tensors = (qg, kg, w, u, Aqk, gk, initial_state, o, ht, cu_seqlens, h, v_new,
               chunk_offsets if (want_h or gate_per_chunk) and varlen else None, seq_order)
    launch(KdaRecurrence, config, specs, tensors, _OUTPUTS, device, float(scale))
    return o, ht, h, v_new


def chunk_kda_fwd_recurrence(
    qg,
    kg,
    w,
    u,
    Aqk,
    gk,
    scale: float,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens=None,
    chunk_offsets=None,
    state_v_first: bool = False,
    *,
    block_v: int = 64,
    gate_per_chunk: bool = False,
    seq_order=None,
):
    """Fused inter-chunk recurrence and chunk output of KDA on the GPU: ``(o, final_state or None)``.

    Args:
        qg, kg, w: ``[B, T, HV, 128]`` bf16 (KDA_SPEC §3.4; qg without scale).
        u: ``[B, T, HV, 128]`` bf16.
        Aqk: ``[B, T, HV, 64]`` bf16, scale included; only the lower triangle (key <= query) is read.
        gk: ``[B, T, HV, 128]`` fp32 chunk-local cumulative gate in log2 units; chunk c decays by
            ``2^gk[last valid row of c]``.
        scale: the factor of ``qg · S``.
        initial_state: fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) or None (zeros).
        output_final_state: also return the fp32 final state (same layout as the initial state).
        cu_seqlens: int32 ``[N + 1]`` for packed sequences (B must be 1).
        chunk_offsets: int32 ``[N + 1]``, each sequence's first chunk row; read only with ``gate_per_chunk`` and
            ``cu_seqlens`` (then required), else accepted for FLA's signature and unused.
        block_v: value columns per CTA (32, 64, 128); any choice gives the same bits.
        gate_per_chunk: ``gk`` holds only each chunk's decay row, fp32 ``[B, NT, HV, 128]`` (varlen
            ``[1, NC, HV, 128]``, sequence n's chunk c at row ``chunk_offsets[n] + c``): the ``g_last`` that
            :func:`~cula_runtime.cute.kda.intra.chunk_kda_fwd_intra_from_raw` writes. Same bits as the full ``gk``.
        seq_order: varlen only: int32 ``[N]``, the order in which the sequences' CTAs are launched
            (:func:`~cula_runtime.index.prepare_sequence_order`: longest first); None: batch order. Same bits.

    Returns:
        ``o`` bf16 ``[B, T, HV, 128]`` and the final state (or None). Launched on the current stream; the first call
        per configuration compiles (:func:`cula_runtime.cute.compile_cache.compile_records`).
    """
    if qg is None or Aqk is None:
        raise ValueError("chunk_kda_fwd_recurrence needs qg and Aqk (chunk_kda_fwd_h is the primitive without o)")
    o, ht, _, _ = _launch(qg, kg, w, u, Aqk, gk, scale, initial_state, output_final_state, cu_seqlens,
                          chunk_offsets if gate_per_chunk else None, state_v_first, block_v, want_h=False,
                          gate_per_chunk=gate_per_chunk, seq_order=seq_order)
    return o, ht


def chunk_kda_fwd_h(
    kg,
    w,
    u,
    gk,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens=None,
    chunk_offsets=None,
    state_v_first: bool = False,
    *,
    block_v: int = 64,
):
    """The delta-h primitive (FLA's ``chunk_gated_delta_rule_fwd_h`` for KDA, KDA_SPEC §3.5): ``(h, v_new, ht)``.

    The same kernel as :func:`chunk_kda_fwd_recurrence` without the output: per chunk it writes the state entering
    the chunk and the corrected values, as the fused kernel uses them.

    Args:
        kg, w: ``[B, T, HV, 128]`` bf16; u: ``[B, T, HV, 128]`` bf16; gk: ``[B, T, HV, 128]`` fp32 (log2 units).
        initial_state, output_final_state, cu_seqlens, state_v_first, block_v: as for
            :func:`chunk_kda_fwd_recurrence`.
        chunk_offsets: int32 ``[N + 1]`` first chunk of each sequence in ``h`` (varlen; computed when None, which
            costs one device read).

    Returns:
        ``h`` bf16 ``[B, NT, HV, K, V]`` (``[B, NT, HV, V, K]`` with ``state_v_first``; varlen ``[1, NC, ...]``):
        ``bf16(S)`` entering each chunk; ``v_new`` bf16 ``[B, T, HV, V]``: ``bf16(u - w · h)``; the fp32 final
        state or None.
    """
    _, ht, h, v_new = _launch(None, kg, w, u, None, gk, 1.0, initial_state, output_final_state, cu_seqlens,
                              chunk_offsets, state_v_first, block_v, want_h=True)
    return h, v_new, ht
