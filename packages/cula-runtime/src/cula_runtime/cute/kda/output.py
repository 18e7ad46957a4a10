"""KDA chunk output from per-chunk states, in one chunk-parallel CuTeDSL launch (KDA_SPEC.md §3.6, §3.8): the modular
counterpart of the output half of :mod:`.recurrence` (FLA's ``chunk_gla_fwd_o_gk`` with the gate folded into qg).

Per (chunk, value head, block of ``block_v`` value columns), with ``h`` the bf16 state entering the chunk (as
:func:`~cula_runtime.cute.kda.recurrence.chunk_kda_fwd_h` writes it):

* ``o = bf16(scale · (qg · h) + tril(Aqk) · v_new)`` (``tril`` applied here: Aqk's upper part is never read).

Computed transposed, exactly as the fused recurrence does (M = value rows, warp w owns rows ``16 w ..``): the same
MMA atoms, tiles and k order on the same bf16 operands, so ``o`` has the fused kernel's bits. The A operands come
from shared memory here (``hᵀ`` and ``v_newᵀ`` through ``ldmatrix.trans``, or plain ``ldmatrix`` for a V-first h)
instead of registers. All operands are copied by ``cp.async``; rows past the chunk's end are zero-filled and never
read from global memory. Only warp-level MMA: the same source runs on SM90, SM100 and SM103.

Grid ``(chunks, HV, B · 128 / block_v)``; varlen (``B = 1``) reads row ``x`` of the chunk indices ``[NT, 2]`` and h
entry ``x`` (a negative sequence id is a padding row: nothing is done).

:func:`chunk_kda_fwd_o` is the host wrapper.
"""

import dataclasses
import functools

from ..compile_cache import TensorSpec, fake_call_arguments, launch, missing_cutedsl
from ..varlen import check_token_tensors, chunk_rows
from .tiles import ChunkTiles, chunk_grid_extent, chunk_span

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr
    from cutlass.cute.nvgpu import warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["KdaOutput", "KdaOutputConfig", "chunk_kda_fwd_o"]



@dataclasses.dataclass(frozen=True)
class KdaOutputConfig:
    """Compile-time configuration of :class:`KdaOutput` (the compile-cache key; T, B, NT are not in it).

    Attributes:
        num_v_heads: HV.
        head_dim: K = V (only 128).
        block_v: value columns per CTA (32, 64 or 128 = 2, 4 or 8 warps).
        varlen: packed sequences (B = 1, ``cu_seqlens`` and chunk indices).
        state_v_first: h is ``[.., HV, V, K]`` (else ``[.., HV, K, V]``).
        chunk_size: C; only 64.
    """

    num_v_heads: int
    head_dim: int = 128
    block_v: int = 64
    varlen: bool = False
    state_v_first: bool = False
    chunk_size: int = 64


class KdaOutput(ChunkTiles):
    """The chunk-output kernel family (see the module docstring)."""

    mma_k = 16

    @staticmethod
    def can_implement(config: KdaOutputConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c = config
        reason = ChunkTiles.common_rejection(c)
        if reason is not None:
            return False, reason
        return True, ""

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the seven tensor arguments of ``__call__``, in order (None: argument absent)."""
        c = self.config
        bf16 = TensorSpec(BFloat16, 4, 8)  # 16-byte row segments for cp.async and the o store
        index = (TensorSpec(Int32, 1), TensorSpec(Int32, 2)) if c.varlen else (None, None)
        return (
            bf16,  # qg [B, T, HV, K]
            bf16,  # v_new [B, T, HV, V]
            bf16,  # Aqk [B, T, HV, C]
            TensorSpec(BFloat16, 5, 8),  # h [B, NT, HV, K, V] (or V, K)
            bf16,  # o [B, T, HV, V]
            *index,  # cu_seqlens [N + 1], chunk_indices [NT, 2]
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic B, T, NT and N; nothing allocated."""
        return fake_call_arguments(self.argument_specs(), Float32(1.0))

    @cute.jit
    def __call__(
        self,
        mQg: cute.Tensor,
        mVnew: cute.Tensor,
        mAqk: cute.Tensor,
        mH: cute.Tensor,
        mO: cute.Tensor,
        mCuSeqlens: cute.Tensor | None,
        mChunkIndices: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        sK_layout = self._smem_layout(C, K, 1)  # qg
        sV_layout = self._smem_layout(C, BV, 1)  # v_new, then the staged o
        sA_layout = self._smem_layout(C, C, 1)  # Aqk
        # h: (K rows, BV contiguous) for [K, V] states, (BV rows, K contiguous) for V-first ones
        sH_layout = self._smem_layout(BV, K, 1) if const_expr(c.state_v_first) else self._smem_layout(K, BV, 1)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sV_layout)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_layout)], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sH_layout)], 1024]

        num_chunks = chunk_grid_extent(mChunkIndices, mQg.shape[1], C, c.varlen)
        self.kernel(
            mQg, mVnew, mAqk, mH, mO, mCuSeqlens, mChunkIndices, scale,
            sK_layout, sV_layout, sA_layout, sH_layout, self.make_tiled_mma(), SharedStorage,
        ).launch(grid=[num_chunks, c.num_v_heads, mQg.shape[0] * (K // BV)], block=[self.num_threads, 1, 1],
                 stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQg: cute.Tensor,
        mVnew: cute.Tensor,
        mAqk: cute.Tensor,
        mH: cute.Tensor,
        mO: cute.Tensor,
        mCuSeqlens: cute.Tensor | None,
        mChunkIndices: cute.Tensor | None,
        scale: Float32,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sA_layout: cute.ComposedLayout,
        sH_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        tidx, _, _ = cute.arch.thread_idx()
        chunk, hv, z = cute.arch.block_idx()
        vb, b = z % (K // BV), z // (K // BV)
        # This CTA's chunk (also its entry in h): batch row b, first token start, valid tokens (0: a padding row).
        start, valid = chunk_span(mCuSeqlens, mChunkIndices, chunk, mQg.shape[1], C, c.varlen)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sK_layout)[None, None, 0]  # (C tokens, K)
        sV = storage.sV.get_tensor(sV_layout)[None, None, 0]  # (C tokens, BV)
        sA = storage.sA.get_tensor(sA_layout)[None, None, 0]  # (C query, C key)
        sH = storage.sH.get_tensor(sH_layout)[None, None, 0]  # (K, BV) or (BV, K)
        # transposed views: value rows first (the MMA's M)
        sVT = cute.composition(sV, cute.make_layout((BV, C), stride=(C, 1)))  # (BV, C tokens)
        if const_expr(c.state_v_first):
            sHT = sH  # (BV, K), K contiguous
        else:
            sHT = cute.composition(sH, cute.make_layout((BV, K), stride=(K, 1)))  # (BV, K), BV contiguous

        if valid > 0:
            self.load(mQg, mVnew, mAqk, mH, sQ, sV, sA, sH, b, hv, vb, chunk, start, valid, tidx)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            self.compute(tiled_mma, sQ, sVT, sA, sHT, scale, tidx)
            self.store_rows(mO, sV, b, hv, vb, start, valid, tidx)

    @cute.jit
    def load(self, mQg: cute.Tensor, mVnew: cute.Tensor, mAqk: cute.Tensor, mH: cute.Tensor, sQ: cute.Tensor,
             sV: cute.Tensor, sA: cute.Tensor, sH: cute.Tensor, b: Int32, hv: Int32, vb: Int32, chunk: Int32,
             start: Int32, valid: Int32, tidx: Int32):
        """cp.async of the chunk's qg, v_new (this CTA's columns) and Aqk rows ``< valid`` (others zero-filled), and
        of the CTA's block of the chunk's state."""
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        gQ = cute.local_tile(cute.domain_offset((start, 0), mQg[b, None, hv, None]), (C, K), (0, 0))
        self._copy_rows(self._g2s_copy(K).get_slice(tidx), gQ, sQ, valid)
        gV = cute.local_tile(cute.domain_offset((start, 0), mVnew[b, None, hv, None]), (C, BV), (0, vb))
        self._copy_rows(self._g2s_copy(BV).get_slice(tidx), gV, sV, valid)
        gA = cute.local_tile(cute.domain_offset((start, 0), mAqk[b, None, hv, None]), (C, C), (0, 0))
        self._copy_rows(self._g2s_copy(C).get_slice(tidx), gA, sA, valid)
        head = mH[b, chunk, hv, None, None]
        if const_expr(c.state_v_first):  # (V, K): rows vb*BV .. of the head
            gH = cute.local_tile(head, (BV, K), (vb, 0))
            self._copy_rows(self._g2s_copy(K).get_slice(tidx), gH, sH, BV)
        else:  # (K, V): columns vb*BV ..
            gH = cute.local_tile(head, (K, BV), (0, vb))
            self._copy_rows(self._g2s_copy(BV).get_slice(tidx), gH, sH, K)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def compute(self, tiled_mma: cute.TiledMma, sQ: cute.Tensor, sVT: cute.Tensor, sA: cute.Tensor,
                sHT: cute.Tensor, scale: Float32, tidx: Int32):
        """oᵀ = scale · hᵀ · qgᵀ + v_newᵀ · tril(Aqk)ᵀ in the fused kernel's order, rounded once, staged over this
        warp's own v_new rows (read before, by this warp only)."""
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        thr_mma = tiled_mma.get_slice(tidx)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        stsm_t = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        s2r_B = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
        s2r_At = cute.make_tiled_copy_A(ldsm_t, tiled_mma).get_slice(tidx)
        s2r_H = cute.make_tiled_copy_A(ldsm if const_expr(c.state_v_first) else ldsm_t, tiled_mma).get_slice(tidx)
        r2s_C = cute.make_tiled_copy_C(stsm_t, tiled_mma).get_slice(tidx)

        # A operands: hᵀ (BV x K) and v_newᵀ (BV x C tokens); B operands: qg (C tokens, K), Aqk (C query, C key)
        tCrH = thr_mma.make_fragment_A(thr_mma.partition_A(sHT))  # (V, 1, K/16)
        tCrVn = thr_mma.make_fragment_A(thr_mma.partition_A(sVT))  # (V, 1, C/16)
        tCrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ))  # (V, C/8, K/16)
        tCrA = thr_mma.make_fragment_B(thr_mma.partition_B(sA))  # (V, C/8, C/16)
        tCcA = thr_mma.partition_B(cute.make_identity_tensor((C, C)))  # (query, key) of each Aqk element
        cute.copy(s2r_H, s2r_H.partition_S(sHT), s2r_H.retile(tCrH))
        cute.copy(s2r_At, s2r_At.partition_S(sVT), s2r_At.retile(tCrVn))
        tCsQ = s2r_B.partition_S(sQ)
        tCsA = s2r_B.partition_S(sA)
        tCrQ_v = s2r_B.retile(tCrQ)
        tCrA_v = s2r_B.retile(tCrA)

        accO = cute.make_rmem_tensor(thr_mma.partition_shape_C((BV, C)), Float32)
        accO.fill(0.0)
        for kb in cutlass.range_constexpr(K // self.mma_k):
            cute.copy(s2r_B, tCsQ[None, None, kb], tCrQ_v[None, None, kb])
            cute.gemm(tiled_mma, accO, tCrH[None, None, kb], tCrQ[None, None, kb], accO)
        accO.store(accO.load() * scale)
        for kb in cutlass.range_constexpr(C // self.mma_k):  # query tile nt (8 tokens) needs key blocks <= nt/2
            cute.copy(s2r_B, tCsA[None, None, kb], tCrA_v[None, None, kb])
            for nt in cutlass.range_constexpr(2 * kb, C // 8):
                if const_expr(nt // 2 == kb):  # diagonal block: zero the key tokens after the query token
                    for v in cutlass.range_constexpr(cute.size(tCrA, mode=[0])):
                        query, key = tCcA[v, nt, kb]
                        tCrA[v, nt, kb] = cutlass.select_(key > query, BFloat16(0.0), tCrA[v, nt, kb])
                acc = self._rank3(accO[None, None, nt])
                cute.gemm(tiled_mma, acc, self._rank3(tCrVn[None, None, kb]), self._rank3(tCrA[None, nt, kb]), acc)

        rO = cute.make_rmem_tensor(accO.layout, BFloat16)
        rO.store(accO.load().to(BFloat16))
        cute.arch.sync_warp()  # every lane of this warp has read its v_new rows
        cute.copy(r2s_C, r2s_C.retile(rO), r2s_C.partition_D(sVT))
        cute.arch.sync_warp()


@functools.lru_cache(maxsize=256)
def _plan(HV: int, K: int, block_v: int, varlen: bool, state_v_first: bool) -> tuple:
    config = KdaOutputConfig(num_v_heads=HV, head_dim=K, block_v=block_v, varlen=varlen, state_v_first=state_v_first)
    ok, reason = KdaOutput.can_implement(config)
    if not ok:
        raise ValueError(f"chunk_kda_fwd_o: {reason}")
    return config, KdaOutput(config).argument_specs()


_OUTPUTS = frozenset({4})  # o among the tensor arguments


def chunk_kda_fwd_o(
    qg,
    v_new,
    Aqk,
    h,
    scale: float,
    cu_seqlens=None,
    chunk_indices=None,
    state_v_first: bool = False,
    *,
    block_v: int = 64,
):
    """KDA chunk output on the GPU from per-chunk states (KDA_SPEC §3.6): ``o`` bf16 ``[B, T, HV, 128]``.

    Args:
        qg: ``[B, T, HV, 128]`` bf16, ``q 2^Γ`` (KDA_SPEC §3.4, without scale); v_new: ``[B, T, HV, 128]`` bf16.
        Aqk: ``[B, T, HV, 64]`` bf16, scale included; only the lower triangle (key <= query) is read.
        h: bf16 ``[B, NT, HV, K, V]`` (``[B, NT, HV, V, K]`` with ``state_v_first``; varlen ``[1, NC, HV, ..]``),
            the state entering each chunk, as :func:`~cula_runtime.cute.kda.recurrence.chunk_kda_fwd_h` returns it.
        scale: the factor of ``qg · h``.
        cu_seqlens: int32 ``[N + 1]`` for packed sequences (B must be 1).
        chunk_indices: int32 ``[NC, 2]`` from :func:`cula_runtime.index.prepare_chunk_indices` (computed when None);
            row i is h's chunk i.
        block_v: value columns per CTA (32, 64, 128); any choice gives the same bits.

    Returns:
        ``o`` bf16 ``[B, T, HV, 128]``: the fused recurrence's o, bit for bit, given its h and v_new.
    """
    import torch

    if qg.dim() != 4 or qg.shape[3] != 128:
        raise ValueError(f"qg must be [B, T, HV, 128], got {tuple(qg.shape)}")
    B, T, HV, K = qg.shape
    bf16 = torch.bfloat16
    check_token_tensors({"qg": (qg, HV, K, bf16), "v_new": (v_new, HV, K, bf16), "Aqk": (Aqk, HV, 64, bf16)}, B, T)
    device = qg.device
    if h.device != device:
        raise ValueError(f"h must be a CUDA tensor on {device}")
    varlen = cu_seqlens is not None
    chunk_indices, num_chunks = chunk_rows(cu_seqlens, chunk_indices, B, T, device)
    h_shape = (1 if varlen else B, num_chunks if varlen else -(-T // 64), HV, K, K)
    if tuple(h.shape) != h_shape or h.dtype != torch.bfloat16:
        raise ValueError(f"h must be bfloat16 {h_shape}, got {h.dtype} {tuple(h.shape)}")
    config, specs = _plan(HV, K, block_v, varlen, bool(state_v_first))
    o = torch.empty(B, T, HV, K, dtype=torch.bfloat16, device=device)
    if num_chunks == 0:
        return o
    tensors = (qg, v_new, Aqk, h, o, cu_seqlens, chunk_indices)
    launch(KdaOutput, config, specs, tensors, _OUTPUTS, device, float(scale))
    return o
