"""The Lightning prefill's segment states and their scan, two CuTeDSL launches (KDA_SPEC §5; issue 28).

A prefill cuts every sequence into segments of at most ``seg_len`` tokens (the segment table of
:mod:`.prefill_backend`: ``segments`` int32 ``[NSEG, 4]``, row s = (sequence n, first token's row in the flattened
token axis, length ``L_s >= 1``, 0); ``seq_segments`` int32 ``[N + 1]``, sequence n's rows ``seq_segments[n] ..
seq_segments[n + 1] - 1`` in order). Per head h, with λ = exp(g_gamma[h]) (``g_gamma <= 0``):

* **Kernel A** (:class:`LightningSegmentStates`, grid ``(NSEG, H, V / block_v)``): each segment's own state from a
  zero start, ``S_loc = Σ_{j < L} λ^(L-1-j) k_jᵀ v_j`` (K x V), written in fp32 to ``seg_state[s, h]``
  (``[NSEG, H, K, V]``, K-first, contiguous). Computed transposed, ``S_locᵀ = vᵀ · diag(λ^(L-1-j)) · k`` (M = the
  CTA's ``block_v`` value rows, 16 per warp; N = K; the MMA's k-mode = tokens), on warp-level MMA (``mma.sync``
  m16n8k16, bf16 or fp16 operands, fp32 accumulators; the same source for SM90, SM100 and SM103). Per 64-token chunk
  the k tile ``(64, K)`` and the CTA's v columns ``(64, block_v)`` are copied by ``cp.async`` into one of two
  shared-memory stages while the previous chunk computes; both operands are read token-major through
  ``ldmatrix.trans``. The decay ``exp(g · (L-1-j))`` (an exponent ``<= 0`` always: rows past the segment's end get
  0, never the exponential of a positive number) is computed in fp32 once per token into a shared table and
  multiplied into the vᵀ fragment in registers, rounded once to the operand dtype. Rows past the segment's end are
  zero-filled in shared memory and never read from global memory (the segment's rows are also clamped into the
  token axis). k and v are read once per V block. With ``skip_last`` (the prefill backend's) a sequence's last
  segment (``segments[s, 3] != 0``) is skipped: nothing read, nothing written (its own state would only feed the
  final state, which kernel C then writes).
* **Kernel B** (:class:`LightningSegmentScan`, grid ``(N, H, 16)``): elementwise over each (sequence, head) state,
  sequential over the sequence's segments: ``S`` = the start state (``initial_state[n]``; or pool slot
  ``state_indices[n]`` when it is in ``[0, P)`` and ``has_initial_state[n]`` is not False; else zeros); for each
  segment s in order: ``S_loc = seg_state[s]``, ``seg_state[s] = S`` (the segment's START state, in place),
  ``S = λ^(L_s) S + S_loc``. At the end ``S`` is the final state: written to ``final_state[n]`` (either layout) when
  asked, or back into the pool slot (in place, fp32 or bf16 rounded to nearest even) when the slot is in ``[0, P)``.
  A sequence without tokens has no segments: its final state is its start state. With ``skip_last`` the last
  segment's own state is not read (kernel A skipped it) and only sequences without tokens get their final states
  here; kernel C finishes the others' from their last segments' start states. Lane ``l`` of warp ``w`` owns a
  4 x 4 block of the state (K rows ``k0 .. k0 + 3``, V columns ``v0 .. v0 + 3``): 8 lanes cover 128 contiguous bytes
  of a K-first row and 4 lanes 64 contiguous bytes of a V-first one, so every access is a 16-byte vector in whole
  sectors. The segments' states are loaded ``prefetch`` segments ahead (one memory latency per group of
  ``prefetch`` segments, not per segment). No MMA. Race-free in place: each element of ``seg_state`` and of a pool
  slot is read and written by one thread only (two sequences naming one slot race, as in KDA's pool form). The
  offsets ``seq_segments`` are clamped into the table.

Host wrappers: :func:`lightning_segment_states` and :func:`lightning_segment_scan` (checked), and the unchecked
``_states_run`` / ``_scan_run`` / the planned forms the prefill backend calls.
"""

import dataclasses
import functools

from ...kda_tuning import BLOCK_V_CHOICES
from ..compile_cache import TensorSpec, bound_launch, fake_call_arguments, flag_bytes, launch, missing_cutedsl
from ..dsl_compat import SmemAllocator
from ..kda.tiles import ChunkTiles

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32, Int32, Uint8, const_expr
    from cutlass.cute.nvgpu import cpasync, warp
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = [
    "LightningSegmentScan",
    "LightningSegmentScanConfig",
    "LightningSegmentStates",
    "LightningSegmentStatesConfig",
    "lightning_segment_scan",
    "lightning_segment_states",
]

CHUNK = 64
HEAD_DIM = 128
LOG2E = 1.4426950408889634  # 1 / ln 2
_OPERAND_DTYPES = {"bfloat16": BFloat16, "float16": Float16}
_STATE_DTYPES = {"float32": Float32, "bfloat16": BFloat16}
_TORCH_NAMES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32"}


# ---------------------------------------------------------------------------------------------------------------------
# Kernel A: each segment's own state


@dataclasses.dataclass(frozen=True)
class LightningSegmentStatesConfig:
    """Compile-time configuration of :class:`LightningSegmentStates` (the compile-cache key; T, B, NSEG are not in
    it).

    Attributes:
        num_heads: H (grid y: at most 65535).
        head_dim: K = V (only 128).
        block_v: value columns per CTA, 64 or 128 (4 or 8 warps); k is read once per V block.
        dtype: the k and v dtype, ``"bfloat16"`` or ``"float16"`` (the MMA operands; fp32 accumulators).
        chunk_size: C; only 64.
        skip_last: the table's last segments (``segments[s, 3] != 0``) are skipped, nothing read or written: their
            own states only feed the final states, which kernel C writes (the prefill backend's segments form).
    """

    num_heads: int
    head_dim: int = HEAD_DIM
    block_v: int = 128
    dtype: str = "bfloat16"
    chunk_size: int = CHUNK
    skip_last: bool = False


class LightningSegmentStates(ChunkTiles):
    """Kernel A: ``seg_state[s, h] = Σ_j λ^(L-1-j) k_jᵀ v_j`` over segment s (see the module docstring)."""

    mma_k = 16

    @staticmethod
    def can_implement(config: LightningSegmentStatesConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c = config
        if c.chunk_size != CHUNK:
            return False, f"chunk_size={c.chunk_size}: only {CHUNK} is supported"
        if c.head_dim != HEAD_DIM:
            return False, f"head_dim={c.head_dim}: only K = V = {HEAD_DIM} is supported"
        if c.block_v not in BLOCK_V_CHOICES:
            return False, f"block_v={c.block_v}: expected one of {BLOCK_V_CHOICES}"
        if c.dtype not in _OPERAND_DTYPES:
            return False, f"dtype={c.dtype!r}: expected one of {tuple(_OPERAND_DTYPES)}"
        if not 1 <= c.num_heads <= 65535:
            return False, f"num_heads={c.num_heads}: must be in [1, 65535] (grid y)"
        return True, ""

    @property
    def operand_type(self):
        return _OPERAND_DTYPES[self.config.dtype]

    def argument_specs(self) -> tuple[TensorSpec, ...]:
        """Layout promises of the five tensor arguments of ``__call__``, in order."""
        tokens = TensorSpec(self.operand_type, 3, 8)  # 16-byte row segments for cp.async
        return (
            tokens,  # k [B·T, H, K]
            tokens,  # v [B·T, H, V]
            TensorSpec(Int32, 2, 4),  # segments [NSEG, 4]
            TensorSpec(Float32, 1),  # g_gamma [H]
            TensorSpec(Float32, 4, 4),  # seg_state [NSEG, H, K, V] (written)
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic token and segment counts; nothing allocated."""
        return fake_call_arguments(self.argument_specs())

    def _g2s_copy(self, cols: int):
        """cp.async tiled copy of a ``(64, cols)`` tile of the operand dtype, 16 bytes per thread and row segment."""
        per_row = cols // 8
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), self.operand_type,
                                   num_bits_per_copy=128)
        threads = cute.make_layout((self.num_threads // per_row, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, 8)))

    def make_tiled_mma(self):
        """m16n8k16 with fp32 accumulators on the operand dtype, warp w on value rows ``16 w .. 16 w + 15``."""
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.operand_type, Float32, (16, 8, 16)),
            (self.num_warps, 1, 1),
            permutation_mnk=(self.config.block_v, 16, 16),
        )

    @cute.jit
    def __call__(self, mK: cute.Tensor, mV: cute.Tensor, mSegments: cute.Tensor, mGamma: cute.Tensor,
                 mSegState: cute.Tensor, stream: cuda.CUstream):
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        dtype = self.operand_type
        sK_layout = self._smem_layout(C, K, 2)
        sV_layout = self._smem_layout(C, BV, 2)

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024]
            sDecay: cute.struct.Align[cute.struct.MemRange[Float32, 2 * C], 16]

        tiled_mma = self.make_tiled_mma()
        grid = [mSegments.shape[0], c.num_heads, K // BV]
        self.kernel(mK, mV, mSegments, mGamma, mSegState, sK_layout, sV_layout, tiled_mma, SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mV: cute.Tensor, mSegments: cute.Tensor, mGamma: cute.Tensor,
               mSegState: cute.Tensor, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        c = self.config
        C, K, BV = c.chunk_size, c.head_dim, c.block_v
        dtype = self.operand_type
        tidx, _, _ = cute.arch.thread_idx()
        s, h, vb = cute.arch.block_idx()
        # the segment's rows, clamped into the token axis (the host's table is always inside it)
        rows = mK.shape[0]
        start = cutlass.min(cutlass.max(mSegments[s, 1], 0), rows)
        length = cutlass.min(cutlass.max(mSegments[s, 2], 0), rows - start)
        skipped = Int32(0)
        if const_expr(c.skip_last):  # a sequence's last segment: nothing read, nothing written
            skipped = cutlass.select_(mSegments[s, 3] != 0, Int32(1), Int32(0))
            length = cutlass.select_(skipped != 0, Int32(0), length)
        gamma2 = mGamma[h] * LOG2E  # log2 of the per-token decay, <= 0
        num_chunks = (length + (C - 1)) // C

        smem = SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sK = storage.sK.get_tensor(sK_layout)  # (C tokens, K, stage)
        sV = storage.sV.get_tensor(sV_layout)  # (C tokens, BV, stage)
        sDecay = storage.sDecay.get_tensor(cute.make_layout((C, 2)))  # λ^(L-1-j) of each token of the chunk
        # transposed views: (column, token, stage) over the token-major tiles
        sKT = cute.composition(sK, cute.make_layout((K, C, 2), stride=(C, 1, C * K)))
        sVT = cute.composition(sV, cute.make_layout((BV, C, 2), stride=(C, 1, C * BV)))

        # S_locᵀ (BV x K) += vᵀ (BV x C tokens) · k (C tokens x K): A = vᵀ, B = kᵀ as (K, C tokens)
        thr_mma = tiled_mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((BV, K)), Float32)  # ((2,2), 1, K/8)
        acc.fill(0.0)
        tCrV = thr_mma.make_fragment_A(thr_mma.partition_A(sVT[None, None, 0]))  # (V, 1, C/16)
        tCrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKT[None, None, 0]))  # (V, K/8, C/16)
        tCcV = thr_mma.partition_A(cute.make_identity_tensor((BV, C)))  # (value row, token) of each A element
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), dtype)
        s2r_A = cute.make_tiled_copy_A(ldsm_t, tiled_mma).get_slice(tidx)
        s2r_B = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
        tCsVT = s2r_A.partition_S(sVT)  # (CPY, 1, C/16, stage)
        tCsKT = s2r_B.partition_S(sKT)  # (CPY, K/16, C/16, stage)
        tCrV_v = s2r_A.retile(tCrV)
        tCrK_v = s2r_B.retile(tCrK)
        rDecay = cute.make_rmem_tensor(tCrV[None, 0, 0].shape, Float32)  # the decays of one k-block's A elements

        g2s_K = self._g2s_copy(K).get_slice(tidx)
        g2s_V = self._g2s_copy(BV).get_slice(tidx)
        if num_chunks > 0:
            self.load_chunk(g2s_K, g2s_V, mK, mV, sK, sV, sDecay, h, vb, start, length, gamma2, Int32(0), Int32(0),
                            tidx)
            cute.arch.cp_async_commit_group()

        for chunk in cutlass.range(num_chunks, unroll=1):
            stage = chunk % 2
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # the chunk's tiles and decays visible; everyone is done with the other stage
            if chunk + 1 < num_chunks:
                self.load_chunk(g2s_K, g2s_V, mK, mV, sK, sV, sDecay, h, vb, start, length, gamma2, chunk + 1,
                                1 - stage, tidx)
                cute.arch.cp_async_commit_group()
            for kb in cutlass.range_constexpr(C // self.mma_k):
                cute.copy(s2r_A, tCsVT[None, None, kb, stage], tCrV_v[None, None, kb])
                for e in cutlass.range_constexpr(cute.size(tCrV, mode=[0])):
                    rDecay[e] = sDecay[tCcV[e, 0, kb][1], stage]
                tCrV[None, 0, kb].store((tCrV[None, 0, kb].load().to(Float32) * rDecay.load()).to(dtype))
                cute.copy(s2r_B, tCsKT[None, None, kb, stage], tCrK_v[None, None, kb])
                cute.gemm(tiled_mma, acc, tCrV[None, None, kb], tCrK[None, None, kb], acc)

        # S_loc (fp32) into seg_state[s, h] ([K, V], V contiguous), this CTA's value columns, from the layout of Sᵀ
        if skipped == 0:
            head = mSegState[s, h, None, None]
            headT = cute.make_tensor(head.iterator, cute.make_layout((K, K), stride=(1, K)))  # (V, K) view
            thr_mma.partition_C(cute.local_tile(headT, (BV, K), (vb, 0))).store(acc.load())

    @cute.jit
    def load_chunk(self, g2s_K, g2s_V, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                   sDecay: cute.Tensor, h: Int32, vb: Int32, start: Int32, length: Int32, gamma2: Float32,
                   chunk: Int32, stage: Int32, tidx: Int32):
        """Issue the cp.async copies of the segment's chunk ``chunk`` into ``stage`` (rows past the segment's end
        zero-filled, not read) and write its tokens' decays ``λ^(L-1-j)`` (0 past the end) into ``sDecay``."""
        C, K, BV = self.config.chunk_size, self.config.head_dim, self.config.block_v
        tok0 = start + chunk * C
        valid = cutlass.min(length - chunk * C, C)
        gK = cute.local_tile(cute.domain_offset((tok0, 0), mK[None, h, None]), (C, K), (0, 0))
        self._copy_rows(g2s_K, gK, sK[None, None, stage], valid)
        gV = cute.local_tile(cute.domain_offset((tok0, 0), mV[None, h, None]), (C, BV), (0, vb))
        self._copy_rows(g2s_V, gV, sV[None, None, stage], valid)
        if tidx < C:
            steps = length - 1 - (chunk * C + tidx)  # tokens after this one in the segment
            decay = Float32(0.0)
            if steps >= 0:
                decay = cute.math.exp2(gamma2 * Float32(steps), fastmath=True)
            sDecay[tidx, stage] = decay


# ---------------------------------------------------------------------------------------------------------------------
# Kernel B: the scan over each sequence's segments


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateIO:
    """The start and final states of a prefill's sequences, as compile-time fields (kernel B's, and kernel C's
    direct form's, :class:`~cula_runtime.cute.lightning.chunk_output.LightningChunkOutputConfig`).

    Attributes:
        has_initial_state: an fp32 ``initial_state`` ``[N, H, K, V]`` (``[N, H, V, K]``) is read (else zeros).
        output_final_state: the fp32 final state is written (same layout).
        state_v_first: the initial/final states and the pool are ``[.., V, K]`` (``seg_state`` is always K-first).
        state_pool: start from and write back to pool slots ``state_indices[n]``; excludes ``has_initial_state`` and
            ``output_final_state``.
        state_dtype: the pool's dtype, ``"float32"`` or ``"bfloat16"`` (only ``"float32"`` without a pool).
        initial_state_flags: (pool only) a ``has_initial_state`` ``[N]`` byte per sequence is read: where 0 the
            sequence starts from zeros (its final state is still written to its slot).
    """

    has_initial_state: bool = False
    output_final_state: bool = False
    state_v_first: bool = False
    state_pool: bool = False
    state_dtype: str = "float32"
    initial_state_flags: bool = False

    @classmethod
    def from_flags(cls, flags: tuple, **fields):
        """The config for :func:`scan_flags`' tuple of a call, with the class's other ``fields``."""
        has_h0, want_ht, v_first, pool_dtype, has_flags = flags
        return cls(has_initial_state=has_h0, output_final_state=want_ht, state_v_first=v_first,
                   state_pool=pool_dtype is not None, state_dtype=pool_dtype or "float32",
                   initial_state_flags=has_flags, **fields)

    def state_io_rejection(self) -> str | None:
        """Why these fields do not go together, or None."""
        if self.state_dtype not in _STATE_DTYPES:
            return f"state_dtype={self.state_dtype!r}: expected one of {tuple(_STATE_DTYPES)}"
        if not self.state_pool:
            if self.state_dtype != "float32":
                return f"state_dtype={self.state_dtype!r}: h0 and ht are fp32 (a bf16 state needs state_pool)"
            if self.initial_state_flags:
                return "initial_state_flags (has_initial_state per sequence) needs state_pool"
        elif self.has_initial_state or self.output_final_state:
            return "state_pool reads and writes the pool: has_initial_state and output_final_state must be False"
        return None


@cute.jit
def pool_slot(mPool: cute.Tensor, mStateIdx: cute.Tensor, n: Int32) -> Int32:
    """Sequence ``n``'s pool slot ``state_indices[n]``, or -1 outside ``[0, P)`` (padding: never read or written)."""
    slot = mStateIdx[n]
    return cutlass.select_(cutlass.min(slot, mPool.shape[0] - 1 - slot) >= 0, slot, Int32(-1))


@cute.jit
def load_pool_slot(slot: Int32, mHasInit: cute.Tensor | None, n: Int32, read_flags: cutlass.Constexpr,
                   load: cutlass.Constexpr):
    """``load(slot)`` (traced in place) reads sequence ``n``'s start state from its pool slot ``slot``
    (:func:`pool_slot`'s) where it is a slot and ``has_initial_state[n]`` (``read_flags``: read, else taken as True)
    is not 0. Kernel B's and kernel C's direct form's start state."""
    if slot >= 0:
        read = Int32(1)
        if const_expr(read_flags):
            read = Int32(mHasInit[n])
        if read != 0:
            load(slot)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LightningSegmentScanConfig(StateIO):
    """Compile-time configuration of :class:`LightningSegmentScan` (the compile-cache key; N, NSEG, P not in it).

    Attributes (and :class:`StateIO`'s):
        num_heads: H (grid y: at most 65535).
        head_dim: K = V (only 128).
        prefetch: segments whose states are loaded ahead (1 to 16).
        skip_last: each sequence's last segment is kernel C's (kernel A skipped it, ``skip_last``): its own state is
            not read, its start state is still written, and the final state is written only for a sequence without
            tokens (kernel C writes the others').
    """

    num_heads: int
    head_dim: int = HEAD_DIM
    prefetch: int = 8
    skip_last: bool = False


class LightningSegmentScan:
    """Kernel B: start states in place, final states out (see the module docstring)."""

    num_warps = 2
    num_threads = 64
    tiles = 16  # CTAs per (sequence, head): 8 bands of 16 K rows x 2 halves of 64 V columns

    def __init__(self, config: LightningSegmentScanConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise ValueError(f"{type(self).__name__} cannot implement {config}: {reason}")
        self.config = config

    @staticmethod
    def can_implement(config: LightningSegmentScanConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c = config
        if c.head_dim != HEAD_DIM:
            return False, f"head_dim={c.head_dim}: only K = V = {HEAD_DIM} is supported"
        if not 1 <= c.num_heads <= 65535:
            return False, f"num_heads={c.num_heads}: must be in [1, 65535] (grid y)"
        if not 1 <= c.prefetch <= 16:
            return False, f"prefetch={c.prefetch}: must be in [1, 16]"
        reason = c.state_io_rejection()
        return (False, reason) if reason else (True, "")

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the eight tensor arguments of ``__call__``, in order (None: argument absent)."""
        c = self.config
        state = TensorSpec(Float32, 4, 4)  # 16-byte vectors
        pool_type = _STATE_DTYPES[c.state_dtype]
        return (
            state,  # seg_state [NSEG, H, K, V] (read and written in place)
            TensorSpec(Int32, 2, 4),  # segments [NSEG, 4]
            TensorSpec(Int32, 1),  # seq_segments [N + 1]
            TensorSpec(Float32, 1),  # g_gamma [H]
            state if c.has_initial_state else None,  # h0 [N, H, K, V] / [N, H, V, K]
            state if c.output_final_state else None,  # ht
            TensorSpec(pool_type, 4, 4) if c.state_pool else None,  # the pool [P, H, K, V] / [P, H, V, K]
            TensorSpec(Int32, 1) if c.state_pool else None,  # state_indices [N]
            TensorSpec(Uint8, 1) if c.initial_state_flags else None,  # has_initial_state [N] (a bool as a byte)
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic N, NSEG and P; nothing allocated."""
        return fake_call_arguments(self.argument_specs())

    @cute.jit
    def __call__(self, mSegState: cute.Tensor, mSegments: cute.Tensor, mSeqSegments: cute.Tensor,
                 mGamma: cute.Tensor, mH0: cute.Tensor | None, mHt: cute.Tensor | None, mPool: cute.Tensor | None,
                 mStateIdx: cute.Tensor | None, mHasInit: cute.Tensor | None, stream: cuda.CUstream):
        grid = [mSeqSegments.shape[0] - 1, self.config.num_heads, self.tiles]
        self.kernel(mSegState, mSegments, mSeqSegments, mGamma, mH0, mHt, mPool, mStateIdx, mHasInit).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mSegState: cute.Tensor, mSegments: cute.Tensor, mSeqSegments: cute.Tensor,
               mGamma: cute.Tensor, mH0: cute.Tensor | None, mHt: cute.Tensor | None, mPool: cute.Tensor | None,
               mStateIdx: cute.Tensor | None, mHasInit: cute.Tensor | None):
        c = self.config
        D = c.prefetch
        tidx, _, _ = cute.arch.thread_idx()
        n, h, tile = cute.arch.block_idx()
        warp_idx = tidx // 32
        lane = tidx % 32
        # the lane's 4 x 4 block: K rows k0 .. k0 + 3, V columns v0 .. v0 + 3
        k0 = (tile // 2) * 16 + (lane // 8) * 4
        v0 = ((tile % 2) * self.num_warps + warp_idx) * 32 + (lane % 8) * 4
        gamma2 = mGamma[h] * LOG2E
        # the sequence's segment rows, clamped into the table (the host's offsets always are)
        nseg = mSegState.shape[0]
        seg0 = cutlass.min(cutlass.max(mSeqSegments[n], 0), nseg)
        seg1 = cutlass.min(cutlass.max(mSeqSegments[n + 1], seg0), nseg)
        read_end = seg1  # the segments whose own states are read and added
        if const_expr(c.skip_last):
            read_end = cutlass.max(seg1 - 1, seg0)

        f_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        rS = cute.make_rmem_tensor(cute.make_layout((4, 4)), Float32)  # rS[j, i]: row k0 + i, column v0 + j
        rS.fill(0.0)

        # ---- the start state
        slot = Int32(-1)
        if const_expr(c.state_pool):  # -1 outside [0, P) (negative: padding; >= P: treated as padding)
            slot = pool_slot(mPool, mStateIdx, n)
            load_pool_slot(slot, mHasInit, n, c.initial_state_flags,
                           lambda s: self.load_block(mPool[s, h, None, None], rS, k0, v0, c.state_v_first))
        elif const_expr(c.has_initial_state):
            self.load_block(mH0[n, h, None, None], rS, k0, v0, c.state_v_first)

        # ---- the segments in order, their own states loaded D at a time
        rBuf = cute.make_rmem_tensor(cute.make_layout((4, 4, D)), Float32)
        rLen = cute.make_rmem_tensor(cute.make_layout(D), Int32)
        for s0 in cutlass.range(seg0, seg1, D, unroll=1):
            for d in cutlass.range_constexpr(D):
                if s0 + d < read_end:
                    rLen[d] = mSegments[s0 + d, 2]
                    head = self.head(mSegState, s0 + d, h)
                    for i in cutlass.range_constexpr(4):
                        cute.copy(f_atom, cute.local_tile(head[k0 + i, None], (4,), (v0 // 4,)), rBuf[None, i, d])
            for d in cutlass.range_constexpr(D):
                if s0 + d < seg1:
                    head = self.head(mSegState, s0 + d, h)
                    for i in cutlass.range_constexpr(4):
                        cute.copy(f_atom, rS[None, i], cute.local_tile(head[k0 + i, None], (4,), (v0 // 4,)))
                    if s0 + d < read_end:
                        decay = cute.math.exp2(gamma2 * Float32(rLen[d]), fastmath=True)
                        rS.store(rS.load() * decay + rBuf[None, None, d].load())

        # ---- the final state (skip_last: kernel C writes those of sequences with tokens)
        writes = Int32(1)
        if const_expr(c.skip_last):
            writes = cutlass.select_(seg1 == seg0, Int32(1), Int32(0))
        if writes != 0:
            if const_expr(c.output_final_state):
                self.store_block(mHt[n, h, None, None], rS, k0, v0, c.state_v_first)
            if const_expr(c.state_pool):
                if slot >= 0:
                    self.store_block(mPool[slot, h, None, None], rS, k0, v0, c.state_v_first)

    def head(self, mState: cute.Tensor, index, h) -> cute.Tensor:
        """One head's ``[128, 128]`` state at ``mState[index, h]``, its row stride static (the heads are compact)."""
        K = self.config.head_dim
        head = mState[index, h, None, None]
        return cute.make_tensor(head.iterator, cute.make_layout((K, K), stride=(K, 1)))

    @cute.jit
    def load_block(self, head: cute.Tensor, rS: cute.Tensor, k0: Int32, v0: Int32, v_first: cutlass.Constexpr):
        """The lane's 4 x 4 block of one head's state (``[K, V]``, or ``[V, K]`` with ``v_first``), widened to
        fp32, into ``rS[j, i]`` (row ``k0 + i``, column ``v0 + j``): four 16-byte (bf16: 8-byte) vectors."""
        K = self.config.head_dim
        dtype = head.element_type
        head = cute.make_tensor(head.iterator, cute.make_layout((K, K), stride=(K, 1)))
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=4 * dtype.width)
        rRaw = cute.make_rmem_tensor(cute.make_layout((4, 4)), dtype)
        for i in cutlass.range_constexpr(4):
            if const_expr(v_first):  # rRaw[None, i]: row v0 + i, columns k0 ..
                cute.copy(atom, cute.local_tile(head[v0 + i, None], (4,), (k0 // 4,)), rRaw[None, i])
            else:
                cute.copy(atom, cute.local_tile(head[k0 + i, None], (4,), (v0 // 4,)), rRaw[None, i])
        if const_expr(v_first):
            for i in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(4):
                    rS[j, i] = rRaw[i, j].to(Float32)
        else:
            rS.store(rRaw.load().to(Float32))

    @cute.jit
    def store_block(self, head: cute.Tensor, rS: cute.Tensor, k0: Int32, v0: Int32, v_first: cutlass.Constexpr):
        """The inverse of :meth:`load_block`: ``rS`` rounded to the head's dtype, written as four vectors."""
        K = self.config.head_dim
        dtype = head.element_type
        head = cute.make_tensor(head.iterator, cute.make_layout((K, K), stride=(K, 1)))
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=4 * dtype.width)
        rRaw = cute.make_rmem_tensor(cute.make_layout((4, 4)), dtype)
        if const_expr(v_first):
            for i in cutlass.range_constexpr(4):
                for j in cutlass.range_constexpr(4):
                    rRaw[i, j] = rS[j, i].to(dtype)
        else:
            rRaw.store(rS.load().to(dtype))
        for i in cutlass.range_constexpr(4):
            if const_expr(v_first):
                cute.copy(atom, rRaw[None, i], cute.local_tile(head[v0 + i, None], (4,), (k0 // 4,)))
            else:
                cute.copy(atom, rRaw[None, i], cute.local_tile(head[k0 + i, None], (4,), (v0 // 4,)))


# ---------------------------------------------------------------------------------------------------------------------
# Host side


@functools.lru_cache(maxsize=256)
def _states_plan(H: int, block_v: int, dtype: str, skip_last: bool = False) -> tuple:
    """The config and argument specs of one kernel-A signature (cached: no work per call)."""
    config = LightningSegmentStatesConfig(num_heads=H, block_v=block_v, dtype=dtype, skip_last=skip_last)
    ok, reason = LightningSegmentStates.can_implement(config)
    if not ok:
        raise ValueError(f"LightningSegmentStates: {reason}")
    return config, LightningSegmentStates(config).argument_specs()


@functools.lru_cache(maxsize=256)
def _scan_plan(H: int, flags: tuple, skip_last: bool = False) -> tuple:
    """The config and argument specs of one kernel-B signature (cached)."""
    config = LightningSegmentScanConfig.from_flags(flags, num_heads=H, skip_last=skip_last)
    ok, reason = LightningSegmentScan.can_implement(config)
    if not ok:
        raise ValueError(f"LightningSegmentScan: {reason}")
    return config, LightningSegmentScan(config).argument_specs()


_STATES_OUTPUTS = frozenset({4})  # seg_state
_SCAN_OUTPUTS = frozenset({0, 5, 6})  # seg_state (in place), ht, the pool (in place)


def _check_tensor(name: str, t, shape: tuple, dtype, device) -> None:
    if t is None or tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        got = "None" if t is None else f"{t.dtype} {list(t.shape)} on {t.device}"
        raise ValueError(f"{name} must be {dtype} {list(shape)} on {device}, got {got}")


def _check_segments(segments, seq_segments, device) -> int:
    """Check the segment table's tensors (shapes and dtypes; the values are the host builder's); return NSEG."""
    import torch

    if segments is None or segments.dim() != 2 or segments.shape[1] != 4 or segments.dtype != torch.int32 \
            or segments.device != device or not segments.is_contiguous():
        got = "None" if segments is None else f"{segments.dtype} {list(segments.shape)} on {segments.device}"
        raise ValueError(f"segments must be a contiguous int32 [NSEG, 4] tensor on {device}, got {got}")
    if seq_segments is not None and (seq_segments.dim() != 1 or seq_segments.numel() < 1
                                     or seq_segments.dtype != torch.int32 or seq_segments.device != device):
        raise ValueError(f"seq_segments must be an int32 [N + 1] tensor on {device}, got {seq_segments.dtype} "
                         f"{list(seq_segments.shape)} on {seq_segments.device}")
    return segments.shape[0]


def lightning_segment_states(k, v, g_gamma, segments, *, seg_state=None, block_v: int = 128):
    """Kernel A on the GPU: each segment's own state ``seg_state[s, h] = Σ_j λ^(L-1-j) k_jᵀ v_j`` (fp32).

    Args:
        k: ``[B·T, H, 128]`` bf16 or fp16, the flattened token axis (a view of ``[B, T, H, K]``).
        v: ``[B·T, H, 128]``, k's dtype.
        g_gamma: fp32 ``[H]``, each ``<= 0`` (λ = exp(g_gamma[h])).
        segments: int32 ``[NSEG, 4]``, contiguous: rows (sequence, first token row, length >= 1, 0) whose tokens
            lie inside ``[0, B·T)`` (the host builder's; the values are not checked here).
        seg_state: fp32 ``[NSEG, H, 128, 128]`` contiguous to write into, or None (allocated).
        block_v: value columns per CTA, 64 or 128 (the same bits).

    Returns:
        ``seg_state``. Launched on the current stream; the first call per configuration compiles.
    """
    import torch

    if k.dim() != 3 or k.shape[2] != HEAD_DIM or k.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"k must be bf16 or fp16 [B·T, H, {HEAD_DIM}], got {k.dtype} {list(k.shape)}")
    BT, H, K = k.shape
    device = k.device
    if device.type != "cuda":
        raise ValueError(f"k must be a CUDA tensor, got one on {device}")
    _check_tensor("v", v, (BT, H, K), k.dtype, device)
    _check_tensor("g_gamma", g_gamma, (H,), torch.float32, device)
    nseg = _check_segments(segments, None, device)
    if seg_state is None:
        seg_state = torch.empty(nseg, H, K, K, dtype=torch.float32, device=device)
    else:
        _check_tensor("seg_state", seg_state, (nseg, H, K, K), torch.float32, device)
    if block_v not in BLOCK_V_CHOICES:
        raise ValueError(f"block_v must be one of {BLOCK_V_CHOICES}, got {block_v!r}")
    _states_run(k, v, g_gamma, segments, seg_state, block_v)
    return seg_state


def _states_run(k, v, g_gamma, segments, seg_state, block_v: int, skip_last: bool = False) -> None:
    """:func:`lightning_segment_states` after its checks (no launch without segments); ``skip_last``: as the
    config's."""
    if segments.shape[0] == 0:
        return
    config, specs = _states_plan(k.shape[1], block_v, _TORCH_NAMES[str(k.dtype)], skip_last)
    launch(LightningSegmentStates, config, specs, (k, v, segments, g_gamma, seg_state), _STATES_OUTPUTS, k.device)


def plan_segment_states(H: int, dtype, block_v: int, device):
    """Kernel A bound to one call signature (``compile_cache.bound_launch``), in the prefill backend's form (each
    sequence's last segment skipped, ``skip_last``): ``run(k, v, g_gamma, segments, seg_state)`` launches with
    nothing checked (no launch without segments)."""
    config, specs = _states_plan(H, block_v, _TORCH_NAMES[str(dtype)], True)
    run = bound_launch(LightningSegmentStates, config, specs, device)

    def run_states(k, v, g_gamma, segments, seg_state) -> None:
        if segments.shape[0]:
            run((k, v, segments, g_gamma, seg_state), ())

    return run_states


def lightning_segment_scan(seg_state, segments, seq_segments, g_gamma, *, initial_state=None,
                           output_final_state: bool = False, state_v_first: bool = False, state=None,
                           state_indices=None, has_initial_state=None):
    """Kernel B on the GPU: the scan over each sequence's segments. ``seg_state`` (each segment's own state in,
    its start state out) is updated in place; returns the fp32 final state or None.

    Args:
        seg_state: fp32 ``[NSEG, H, 128, 128]`` contiguous (kernel A's output).
        segments: int32 ``[NSEG, 4]`` (the lengths ``segments[:, 2]`` are read).
        seq_segments: int32 ``[N + 1]``: sequence n's segments are rows ``seq_segments[n] .. seq_segments[n+1]-1``.
        g_gamma: fp32 ``[H]``.
        initial_state: fp32 ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``) contiguous, or None (zeros).
        output_final_state: return the fp32 final states (``initial_state``'s layout).
        state: a state pool instead of ``initial_state`` / ``output_final_state``: fp32 or bf16 ``[P, H, K, V]``
            (``[P, H, V, K]``), each slot's heads compact ``[128, 128]`` blocks, the slot stride a multiple of 4 and
            the data 16-byte (fp32) or 8-byte (bf16) aligned; read and written in place, never copied.
        state_indices: int32 ``[N]`` with ``state``: sequence n starts from and ends in slot ``state_indices[n]``;
            a slot outside ``[0, P)`` is padding (nothing read or written; the sequence starts from zeros).
        has_initial_state: bool ``[N]`` or None, with ``state``: where False the sequence starts from zeros.

    Returns:
        The final state (or None; None with ``state``). Launched on the current stream.
    """
    import torch

    device = seg_state.device
    if seg_state.dim() != 4 or tuple(seg_state.shape[2:]) != (HEAD_DIM, HEAD_DIM) \
            or seg_state.dtype != torch.float32 or not seg_state.is_contiguous() or device.type != "cuda":
        raise ValueError(f"seg_state must be a contiguous CUDA float32 [NSEG, H, {HEAD_DIM}, {HEAD_DIM}] tensor, "
                         f"got {seg_state.dtype} {list(seg_state.shape)} on {device}")
    nseg, H = seg_state.shape[:2]
    if _check_segments(segments, seq_segments, device) != nseg:
        raise ValueError(f"segments must have one row per seg_state entry ({nseg}), got {segments.shape[0]}")
    _check_tensor("g_gamma", g_gamma, (H,), torch.float32, device)
    N = seq_segments.shape[0] - 1
    shape = (N, H, HEAD_DIM, HEAD_DIM)
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, shape, torch.float32, device)
    if state is not None:
        if initial_state is not None or output_final_state:
            raise ValueError("state (the pool) excludes initial_state and output_final_state")
        if state.dim() != 4 or tuple(state.shape[1:]) != (H, HEAD_DIM, HEAD_DIM) \
                or state.dtype not in (torch.float32, torch.bfloat16) or state.device != device:
            raise ValueError(f"state must be a float32 or bfloat16 pool [P, {H}, {HEAD_DIM}, {HEAD_DIM}] on {device}, "
                             f"got {state.dtype} {list(state.shape)} on {state.device}")
        from .prefill_backend import pool_layout_rejection

        reason = pool_layout_rejection(state)
        if reason:
            raise ValueError(f"state: {reason}")
        _check_tensor("state_indices", state_indices, (N,), torch.int32, device)
        if has_initial_state is not None:
            _check_tensor("has_initial_state", has_initial_state, (N,), torch.bool, device)
    elif state_indices is not None or has_initial_state is not None:
        raise ValueError("state_indices and has_initial_state index a state pool: pass state (the pool) too")
    ht = torch.empty(shape, dtype=torch.float32, device=device) if output_final_state and state is None else None
    _scan_run(seg_state, segments, seq_segments, g_gamma, initial_state, ht, bool(state_v_first), state,
              state_indices, has_initial_state)
    return ht


def scan_flags(initial_state, output_final_state: bool, state_v_first: bool, pool, has_initial_state) -> tuple:
    """The flags of kernel B's configuration for these arguments (what :func:`plan_segment_scan` takes)."""
    return (initial_state is not None, bool(output_final_state), bool(state_v_first),
            None if pool is None else _TORCH_NAMES[str(pool.dtype)], has_initial_state is not None)


def _scan_run(seg_state, segments, seq_segments, g_gamma, initial_state, ht, state_v_first: bool, pool=None,
              state_indices=None, has_initial_state=None, skip_last: bool = False) -> None:
    """:func:`lightning_segment_scan` after its checks, ``ht`` allocated by the caller (or None); no launch
    without sequences; ``skip_last``: as the config's."""
    if seq_segments.shape[0] <= 1:
        return
    config, specs = _scan_plan(seg_state.shape[1], scan_flags(initial_state, ht is not None, state_v_first, pool,
                                                               has_initial_state), skip_last)
    tensors = (seg_state, segments, seq_segments, g_gamma, initial_state, ht, pool, state_indices,
               flag_bytes(has_initial_state))
    launch(LightningSegmentScan, config, specs, tensors, _SCAN_OUTPUTS, seg_state.device)


def plan_segment_scan(H: int, N: int, flags: tuple, device):
    """Kernel B bound to one call signature, in the prefill backend's form (``skip_last``: the final states of
    sequences without tokens only): ``run(seg_state, segments, seq_segments, g_gamma, initial_state, ht, pool,
    state_indices, has_initial_state)`` with nothing checked; ``flags``: :func:`scan_flags` (no launch for N = 0)."""
    if N == 0:
        return lambda *tensors: None
    config, specs = _scan_plan(H, flags, True)
    run = bound_launch(LightningSegmentScan, config, specs, device)

    def run_scan(seg_state, segments, seq_segments, g_gamma, initial_state, ht, pool, state_indices,
                 has_initial_state) -> None:
        run((seg_state, segments, seq_segments, g_gamma, initial_state, ht, pool, state_indices,
             flag_bytes(has_initial_state)), ())

    return run_scan

