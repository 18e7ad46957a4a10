"""Device-side machinery shared by the chunked KDA CuTeDSL kernels: :func:`chunk_span` and
:func:`chunk_grid_extent` (which tokens a chunk-parallel CTA owns, fixed or varlen: the intra kernel) and
:class:`ChunkTiles`, for a kernel that puts value rows on the MMA's M (the recurrence; the Lightning output
kernel): swizzled shared-memory tiles, cp.async row copies, the warp-per-16-rows tiled MMA, an accumulator viewed
as the next product's A operand and the row store of a staged tile.

A class using :class:`ChunkTiles` has ``config`` (with ``chunk_size``, ``block_v``), ``num_warps`` and
``num_threads``.
"""

from ...kda_tuning import BLOCK_V_CHOICES
from ..compile_cache import missing_cutedsl

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr
    from cutlass.cute.nvgpu import cpasync, warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["ChunkTiles", "chunk_span"]


@cute.jit
def chunk_span(mCuSeqlens: cute.Tensor | None, mChunkIndices: cute.Tensor | None, chunk: Int32, seq_len: Int32,
               chunk_size: cutlass.Constexpr, varlen: cutlass.Constexpr):
    """``(start, valid)`` of a chunk-parallel CTA's chunk: its first token within its batch row and its number of
    tokens. Fixed length: chunk ``chunk`` of a row of ``seq_len`` tokens. Varlen: row ``chunk`` of the chunk indices
    ``[NT, 2]`` = (sequence, chunk within it; host-built), bounds from ``cu_seqlens`` (``seq_len``: the packed
    token axis T); a negative sequence id is a padding row (``valid = 0``).

    The device ``cu_seqlens`` may hold other values than the host copy the chunk indices were built from (a
    CUDA-graph replay, a write the version counter did not see): the sequence's bounds are clamped into
    ``0 <= bos <= eos <= T``, so ``valid > 0`` only where ``[start, start + valid)`` lies in ``[0, T)`` (``valid``
    may be negative: the caller does nothing then), whatever those values."""
    if const_expr(varlen):
        seq = mChunkIndices[chunk, 0]
        seq_row = cutlass.max(seq, 0)
        bos = cutlass.min(cutlass.max(mCuSeqlens[seq_row], 0), seq_len)
        eos = cutlass.min(cutlass.max(mCuSeqlens[seq_row + 1], bos), seq_len)
        start = bos + mChunkIndices[chunk, 1] * chunk_size
        valid = cutlass.min(eos - start, chunk_size)
        valid = cutlass.select_(seq >= 0, valid, 0)
    else:
        start = chunk * chunk_size
        valid = cutlass.min(seq_len - start, chunk_size)
    return start, valid


def chunk_grid_extent(mChunkIndices: cute.Tensor | None, seq_len, chunk_size: cutlass.Constexpr,
                      varlen: cutlass.Constexpr):
    """The grid extent over chunks that :func:`chunk_span` indexes (traced in ``__call__``): the rows of the chunk
    indices (varlen), else the chunks of a row of ``seq_len`` tokens."""
    if const_expr(varlen):
        return mChunkIndices.shape[0]
    return cute.ceil_div(seq_len, chunk_size)


class ChunkTiles:
    """Mixin: tiles, copies and the tiled MMA of a kernel whose CTA owns ``block_v`` value rows, 16 per warp.

    A subclass defines ``can_implement(config) -> (ok, reason)`` (starting from :meth:`common_rejection`).
    """

    def __init__(self, config):
        ok, reason = self.can_implement(config)
        if not ok:
            raise ValueError(f"{type(self).__name__} cannot implement {config}: {reason}")
        self.config = config
        self.num_warps = config.block_v // 16
        self.num_threads = self.num_warps * 32

    @staticmethod
    def common_rejection(config) -> str | None:
        """Why a config breaks what every such kernel needs (C = 64, K = V = 128, a block_v choice, HV in the grid's
        y range), or None."""
        c = config
        if c.chunk_size != 64:
            return f"chunk_size={c.chunk_size}: only 64 is supported"
        if c.head_dim != 128:
            return f"head_dim={c.head_dim}: only K = V = 128 is supported"
        if c.block_v not in BLOCK_V_CHOICES:
            return f"block_v={c.block_v}: expected one of {BLOCK_V_CHOICES}"
        if c.num_v_heads < 1 or c.num_v_heads > 65535:
            return f"num_v_heads={c.num_v_heads}: must be in [1, 65535] (grid y)"
        return None

    def _smem_layout(self, rows: int, cols: int, stages: int):
        """Swizzled bf16 tile ``(rows, cols, stages)``, ``cols`` contiguous (a multiple of 64): every 8-row band of
        16-byte chunks is XOR-permuted so that the 8 rows an 8x8 ``ldmatrix`` matrix reads hit 8 distinct bank
        groups."""
        if cols % 64:
            raise ValueError(f"swizzled tiles have a multiple of 64 columns, got {cols}")
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def _g2s_copy(self, cols: int):
        """cp.async tiled copy of a ``(64, cols)`` bf16 tile, 16 bytes per thread and row segment."""
        per_row = cols // 8
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), BFloat16,
                                   num_bits_per_copy=128)
        threads = cute.make_layout((self.num_threads // per_row, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, 8)))

    def make_tiled_mma(self):
        """bf16 m16n8k16 with fp32 accumulators, one atom per warp along M: warp w owns value rows
        ``16 w .. 16 w + 15`` of every product (the u/o staging and the o store rely on it). N is tiled by 16 so that
        one ``ldmatrix.x4`` feeds two n8 MMAs."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)),
            (self.num_warps, 1, 1),
            permutation_mnk=(self.config.block_v, 16, 16),
        )

    @staticmethod
    def _acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
        """View an m16n8 accumulator fragment ``((2,2), M, N)`` as the m16k16 A fragment ``(((2,2),2), M, N/2)``:
        the two adjacent n8 tiles 2j, 2j+1 hold exactly k-block j of the next product (same registers). (The
        Lightning output kernel's; the KDA recurrence still defines its own identical copy.)"""
        split = cute.logical_divide(acc.layout, (None, None, 2))
        layout = cute.make_layout(
            ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
            stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1]),
        )
        return cute.make_tensor(acc.iterator, layout)

    @staticmethod
    def _rank3(t: cute.Tensor) -> cute.Tensor:
        """``t`` with unit modes appended up to rank 3 ``(V, M, N)``: one MMA of a tiled-MMA gemm."""
        return cute.make_tensor(t.iterator, cute.append(t.layout, cute.make_layout(1), up_to_rank=3))

    @cute.jit
    def _copy_rows(self, thr_copy, gX: cute.Tensor, sX: cute.Tensor, length: Int32):
        """Copy the rows ``< length`` of ``gX`` into ``sX`` with ``thr_copy``; zero-fill the others (never read)."""
        tXgX = thr_copy.partition_S(gX)  # (CPY, passes, 1)
        tXsX = thr_copy.partition_D(sX)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor(gX.shape))
        for p in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
            if tXcX[(0, 0), p, 0][0] < length:
                cute.copy(thr_copy, tXgX[None, p, None], tXsX[None, p, None])
            else:
                tXsX[None, p, None].fill(0.0)

    @cute.jit
    def store_rows(self, mO: cute.Tensor, sO: cute.Tensor, b: Int32, hv: Int32, vb: Int32, tok0: Int32,
                   length: Int32, tidx: Int32):
        """Rows ``< length`` of a staged ``(C, block_v)`` tile ``sO`` -> ``mO[b, tok0 + row, hv, block vb]``, one
        16-byte segment per copy. Thread ``32 w + l`` copies row ``l // 2`` (+16 per pass) of columns
        ``16 w + 8 (l % 2) ..``: every warp stores only the 16 columns it staged, so a warp barrier orders staging
        and store.

        The warp's columns come from this one tiled copy over all threads, not from a ``local_tile`` of the
        swizzled tile at a warp-dependent offset: CuTeDSL 4.6 adds such an offset twice when it falls inside the
        swizzle's bits (seen in the PTX; on the H200 the warps read each other's columns)."""
        C, BV = self.config.chunk_size, self.config.block_v
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        threads = cute.make_layout((16, (2, self.num_warps)), stride=(2, (1, 32)))
        thr = cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, 8))).get_slice(tidx)
        gO = cute.local_tile(cute.domain_offset((tok0, 0), mO[b, None, hv, None]), (C, BV), (0, vb))
        tOsO = thr.partition_S(sO)  # (CPY, C/16, 1)
        tOgO = thr.partition_D(gO)
        tOcO = thr.partition_D(cute.make_identity_tensor((C, BV)))
        tOrO = cute.make_fragment_like(tOsO)
        cute.copy(atom, tOsO, tOrO)
        for p in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if tOcO[(0, 0), p, 0][0] < length:
                cute.copy(atom, tOrO[None, p, None], tOgO[None, p, None])

    @cute.jit
    def store_zero_rows(self, mO: cute.Tensor, b: Int32, hv: Int32, vb: Int32, tok0: Int32, length: Int32,
                        tidx: Int32):
        """Zeros into the ``length`` rows of ``mO[b, tok0 .., hv, block vb]`` (a padding row's o: the KDA
        recurrence's and Lightning's kernel C), a C-row tile at a time, one 16-byte segment per copy, straight from
        registers."""
        C, BV = self.config.chunk_size, self.config.block_v
        per_row = BV // 8
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
        threads = cute.make_layout((self.num_threads // per_row, per_row), stride=(per_row, 1))
        thr = cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, 8))).get_slice(tidx)
        tOcO = thr.partition_D(cute.make_identity_tensor((C, BV)))
        for chunk in cutlass.range((length + (C - 1)) // C, unroll=1):  # (rows < length - chunk C of each tile)
            gO = cute.local_tile(cute.domain_offset((tok0 + chunk * C, 0), mO[b, None, hv, None]), (C, BV), (0, vb))
            tOgO = thr.partition_D(gO)  # (CPY, passes, 1)
            rZero = cute.make_fragment_like(tOgO[None, 0, None])
            rZero.fill(0.0)
            for p in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
                if tOcO[(0, 0), p, 0][0] < length - chunk * C:
                    cute.copy(atom, rZero, tOgO[None, p, None])
