"""Lightning Attention decode over an in-place state pool, in one CuTeDSL launch (KDA_SPEC.md §5, §10; issue 28).

Per sequence ``n`` (``T_n >= 0`` tokens) and head ``h``, the state ``S`` ``[K, V]`` is read from pool slot
``state_indices[n]``, the tokens are applied in order while it stays in fp32 registers, and it is written back to
the same slot in place. Per token, with ``λ = exp(g_gamma[h])``:

* ``S ← λ S + k vᵀ`` (an outer product: no gate vector, no β, no delta rule);
* ``o = scale · Sᵀ q`` with the updated state, rounded to q's dtype.

So a token needs one reduction over K (``qᵀS`` of the lane's columns), and each state element is touched once per
token: ``s ← λ s + k_i v_j`` then ``acc_j += q_i s`` (two FMAs), in the same pass.

Design (bandwidth first): the lane → (K row, V column) mapping is the KDA decode kernel's
(:meth:`cula_runtime.cute.kda.decode.KdaDecode.lane_layout`, used here through a :class:`KdaDecode` instance of the
same pool dtype and layout, so both kernels share one tested mapping and the KDA kernel's code is untouched). Every
state access is a 16-byte vector, every warp-wide state access covers whole 128-byte lines, each element is read
once and written once per call. Lane ``l`` holds 8 K rows × ``cols`` value columns (32 fp32 values with an fp32
pool, 64 with a bf16 pool) and sums ``q_i s_ij`` over its rows; then:

* **V-first** (``[V, K]``): CTA = one (sequence, head, 32-column V block), 4 CTAs per head, 4 (fp32) or 2 (bf16)
  warps; the 16 lanes of a column group hold its 128 rows, so a 4-step ``shfl.bfly`` all-reduce finishes the sum and
  row group 0 writes o. No shared memory, no barrier.
* **K-first** (``[K, V]``): CTA = one (sequence, head, one 128-byte line per row: 32 fp32 or 64 bf16 columns), 4
  (fp32) or 2 (bf16) CTAs per head, 4 warps of 32 K rows. A 2-step ``shfl.bfly`` over the warp's 4 row groups,
  then one shared-memory exchange per token: row group 0 of each warp writes its warp's ``cols`` sums, one barrier,
  and warp 0's row group 0 (threads 0..7, each column once) adds the 4 warps in warp order and writes o. The
  exchange is double-buffered by token parity (1 KB for an fp32 pool, 2 KB for bf16), so one barrier per token is
  enough: a warp writes token ``t + 1``'s sums only after passing token ``t``'s barrier, which warp 0 reaches after
  it read token ``t - 1``'s. With ``k_first_lines`` L (the KDA decode's lines per CTA), a CTA is L such groups of 4
  warps side by side, each group over its own line of every row, exchanging among its own warps behind its own
  named barrier; its first warp writes o (the same bits for every L; the register cap divided by L). The
  single-token form takes the KDA decode's rule (:func:`~cula_runtime.cute.kda.decode.k_first_lines`: whole rows
  from 128 MiB of state per step up; H100, ``decode_k_first_lines_ab_h100.md``: 1.7-2.3% faster at N >= 128, H =
  64); the general form (any T, packed sequences; not timed at more lines) keeps one line.
* Every reduction runs in a fixed order (butterflies, then warps 0..3): the same bits on every call.
* **Bytes per step** (T = 1): ``N · H · 2 · K · V`` state elements (read and written) plus ``4 · 128`` q/k/v/o
  elements per (sequence, head). H = 64, N = 128, fp32 pool: 1.07 GB of state (+ 8 MB of inputs and o), a floor
  of 252 us at 4.3 TB/s; bf16 pool: 537 MB, 127 us. At N = 8 the floors are 15.7 us (fp32) and 7.9 us (bf16): the
  6 us small-batch goal is reachable only where the floor is under it (fewer heads, or N <= 2 at H = 64), and
  there the critical path (index load → state load → 2 FMAs per element → reduction → stores, ≈ 3 DRAM latencies)
  is what counts. N = 1, H = 64 is 256 CTAs (K-first bf16: 128), about two per SM.
* **Registers** (:data:`MIN_BLOCKS_PER_SM`): no gate vector and no second reduction leave fewer live values than
  KDA's decode (the lane's state, its 8 q and k rows, its v columns and the partial sums). Each cap is the most
  CTAs per SM at which ptxas (sm_90a, CuTeDSL 4.8 and 4.6) spills nothing. The general form (any T, packed
  sequences) keeps the lane's state in fp32 registers across the token loop: fp32 pool 6 (K-first, 80 registers)
  or 7 (V-first, 72) CTAs of 128 threads, 96-112 KB of state in flight per SM; bf16 pool 4 CTAs of 128 threads
  (K-first, ~125 registers) or 8 of 64 (V-first, ~117), 64 KB. The **single-token form**
  (:attr:`LightningDecodeConfig.single_token`: fixed length with T = 1, a decode step; the host knows it from the
  shape) has no token loop and updates, rounds and stores the state one 16-byte vector at a time, so that only the
  raw vectors stay live: fp32 pool 8 CTAs of 128 threads (61-64 registers, 128 KB per SM), bf16 pool 6 (K-first,
  79 registers, 96 KB) or 10 of 64 threads (V-first, 96 registers, 80 KB), each cap also the most at which all 8
  state loads are issued before the first FMA. Little's law at 4.3 TB/s and ≈ 1 us of loaded latency asks ≈ 33
  KB per SM, so every cap leaves room for CTAs in their math and store phases. sm_100a/sm_103a allocate more
  registers for the same general form and spill 21-71 instructions at its caps (pointers saved around the state's
  loads, loop invariants of the token loop); the single-token form spills nothing there. Timed on a lent H100
  (``benchmarks/ab_lightning_decode_caps.py``, ``benchmarks/results/lightning_decode_caps_ab_h100.md``): the
  single-token form's every cap from 4 to 8 CTAs per SM within 0.2% of the default, 10-12 1-4% slower; the step
  at 1.03x (V-first) and 1.08-1.09x (K-first) an in-place pass over the same bytes. The compile tests pin the
  spill counts of the defaults; :attr:`LightningDecodeConfig.min_blocks_per_sm` overrides them for A/B runs.
* Nothing is allocated (with ``out``), nothing is read on the host: a call is CUDA-graph capturable. A slot outside
  ``[0, P)`` is a padding row: nothing read or written, its o rows zero. ``cu_seqlens`` values are clamped into
  ``[0, T]`` (a bad one cannot read past the inputs); a sequence index past ``B`` (fixed length) or past
  ``len(cu_seqlens) - 1`` reads nothing.

:func:`lightning_decode_cutedsl` is the host wrapper, :func:`plan_lightning_decode_launch` its call-plan form.
"""


import dataclasses
import functools

from ..compile_cache import LaunchDeclined, TensorSpec, fake_call_arguments, launch, missing_cutedsl, planned_launch
from ..dsl_compat import SmemAllocator
from ..kda.decode import K_FIRST_ROW_WARPS, KdaDecode, KdaDecodeConfig, k_first_lines

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32, Int32, const_expr
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["LightningDecode", "LightningDecodeConfig", "lightning_decode_cutedsl", "plan_lightning_decode_launch"]

_STATE_DTYPES = {"float32": Float32, "bfloat16": BFloat16}
_IO_DTYPES = {"bfloat16": BFloat16, "float16": Float16}
HEAD_DIM = 128
# Registers per thread follow from the CTAs per SM asked of ptxas (65536 / (threads per CTA · blocks)). Keyed by
# (state dtype, V-first, single token): the most CTAs at which sm_90a (CuTeDSL 4.8 and 4.6) spills nothing and, for
# the single-token form, still issues all 8 state loads before the first FMA (one more CTA makes ptxas hold some
# loads back until earlier vectors are stored: less in flight per thread, a longer CTA). The comments: registers
# used, state in flight per SM, what one more CTA per SM did.
MIN_BLOCKS_PER_SM = {
    ("float32", False, False): 6,  # 128 threads, 80 registers, 96 KB (7 CTAs: 11 spills)
    ("float32", True, False): 7,  # 128 threads, 72 registers, 112 KB (8 CTAs: 7 spills)
    ("bfloat16", False, False): 4,  # 128 threads, 124-126 registers, 64 KB (5 CTAs: 28 spills)
    ("bfloat16", True, False): 8,  # 64 threads, 115-118 registers, 64 KB (10 CTAs: 46 spills)
    ("float32", False, True): 8,  # 128 threads, 61 registers, 128 KB (9 CTAs: 2 loads held back)
    ("float32", True, True): 8,  # 128 threads, 64 registers, 128 KB (9 CTAs: 4 held back)
    ("bfloat16", False, True): 6,  # 128 threads, 79 registers, 96 KB (7 CTAs: 2 spills)
    ("bfloat16", True, True): 10,  # 64 threads, 96 registers, 80 KB (11 CTAs: 8 spills)
}
# percent of the SM's shared memory for K-first CTAs (1-2 KB of exchange + the driver's 1 KB each): 8 CTAs need at
# most 24 KB; 25 % leaves room, so shared memory never limits the CTAs per SM
SMEM_CARVEOUT_K_FIRST = 25


@dataclasses.dataclass(frozen=True)
class LightningDecodeConfig:
    """Compile-time configuration of :class:`LightningDecode` (the compile-cache key; B, T, N and P are not in it).

    Attributes:
        num_heads: H (q, k, v and the pool have the same heads).
        head_dim: K = V; only 128.
        dtype: q/k/v/o dtype, ``"bfloat16"`` or ``"float16"``.
        state_dtype: the pool's dtype, ``"float32"`` or ``"bfloat16"`` (the running state is fp32 either way).
        state_v_first: the pool is ``[P, H, V, K]`` (else ``[P, H, K, V]``).
        varlen: packed sequences (B = 1, ``cu_seqlens``).
        single_token: every sequence has exactly one token (fixed length, T = 1: the host knows it from q's shape;
            a decode step): no token loop, and the state is updated and stored one 16-byte vector at a time in the
            pool's dtype, which frees registers for more CTAs per SM (:data:`MIN_BLOCKS_PER_SM`).
        min_blocks_per_sm: CTAs per SM asked of ptxas (its register cap); 0: :data:`MIN_BLOCKS_PER_SM`, divided
            by the K-first CTAs' lines (the same threads per SM).
        k_first_lines: K-first CTAs' 128-byte lines per K row (1, 2 or 4 fp32; 1 or 2 bf16); 0: one.
    """

    num_heads: int
    head_dim: int = HEAD_DIM
    dtype: str = "bfloat16"
    state_dtype: str = "float32"
    state_v_first: bool = False
    varlen: bool = False
    single_token: bool = False
    min_blocks_per_sm: int = 0
    k_first_lines: int = 0


class LightningDecode:
    """The Lightning decode kernel (see the module docstring)."""

    @staticmethod
    def can_implement(config: LightningDecodeConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c = config
        if c.head_dim != HEAD_DIM:
            return False, f"head_dim={c.head_dim}: only K = V = {HEAD_DIM} is supported"
        if c.num_heads < 1:
            return False, f"num_heads={c.num_heads} must be positive"
        if c.dtype not in _IO_DTYPES:
            return False, f"dtype={c.dtype!r}: expected one of {tuple(_IO_DTYPES)}"
        if c.state_dtype not in _STATE_DTYPES:
            return False, f"state_dtype={c.state_dtype!r}: expected one of {tuple(_STATE_DTYPES)}"
        if c.single_token and c.varlen:
            return False, "single_token needs fixed-length sequences (T = 1); packed lengths are device values"
        if not 0 <= c.min_blocks_per_sm <= 32:
            return False, f"min_blocks_per_sm={c.min_blocks_per_sm}: expected 0 (the default) to 32"
        return KdaDecode.can_implement(_lane_config(c))

    def __init__(self, config: LightningDecodeConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise ValueError(f"LightningDecode cannot implement {config}: {reason}")
        self.config = config
        # the KDA decode kernel's lane layout of this pool (lane_layout, element, row, state_vector, store_state,
        # lane_sum, stores_o and the CTA shape), shared rather than rewritten
        self.lanes = KdaDecode(_lane_config(config))
        self.vec = self.lanes.vec  # state elements per 16-byte access
        self.cols = self.lanes.cols  # value columns per lane
        self.block_v = self.lanes.block_v  # value columns per CTA
        self.v_blocks = self.lanes.v_blocks  # CTAs per head
        self.num_warps = self.lanes.num_warps
        self.num_threads = 32 * self.num_warps
        self.io_dtype = _IO_DTYPES[config.dtype]
        self.min_blocks_per_sm = config.min_blocks_per_sm or max(1, MIN_BLOCKS_PER_SM[
            (config.state_dtype, config.state_v_first, config.single_token)] // self.lanes.lines)
        self.smem_carveout = 0 if config.state_v_first else SMEM_CARVEOUT_K_FIRST

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the eight tensor arguments of ``__call__``, in order (None: argument absent)."""
        c = self.config
        io = TensorSpec(self.io_dtype, 4, 8)  # 16-byte row pieces: q/k rows, v columns, o columns
        index = TensorSpec(Int32, 1)
        return (
            io,  # q [B, T, H, K]
            io,  # k [B, T, H, K]
            io,  # v [B, T, H, V]
            TensorSpec(Float32, 1),  # g_gamma [H]
            TensorSpec(_STATE_DTYPES[c.state_dtype], 4, self.vec),  # the pool [P, H, K, V] or [P, H, V, K]
            index,  # state_indices [N]
            index if c.varlen else None,  # cu_seqlens [N + 1]
            io,  # o [B, T, H, V]
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic B, T, N and P; nothing allocated."""
        return fake_call_arguments(self.argument_specs(), Float32(1.0))

    # ------------------------------------------------------------------------------------------------------------
    # Host side

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mGamma: cute.Tensor,
        mState: cute.Tensor,
        mIdx: cute.Tensor,
        mCuSeqlens: cute.Tensor | None,
        mO: cute.Tensor,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        # one linear index: V block fastest, then head, then sequence (a slot's heads are read in order)
        grid = [mIdx.shape[0] * (self.config.num_heads * self.v_blocks), 1, 1]
        self.kernel(mQ, mK, mV, mGamma, mState, mIdx, mCuSeqlens, mO, scale).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=self.min_blocks_per_sm,
            preferred_smem_carveout=self.smem_carveout)

    # ------------------------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mGamma: cute.Tensor,
        mState: cute.Tensor,
        mIdx: cute.Tensor,
        mCuSeqlens: cute.Tensor | None,
        mO: cute.Tensor,
        scale: Float32,
    ):
        c = self.config
        VC = self.cols
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        vb = bidx % self.v_blocks
        pair = bidx // self.v_blocks
        h = pair % c.num_heads
        n = pair // c.num_heads
        warp_idx = tidx // 32
        lane = tidx % 32
        r, col0, bases = self.lanes.lane_layout(warp_idx, lane, vb)
        stores_o = self.lanes.stores_o(r, tidx)
        red = None
        if const_expr(not c.state_v_first):
            # the warps' sums over their K rows, double-buffered by token parity (see the module docstring)
            smem = SmemAllocator()
            sRed = smem.allocate_tensor(Float32, self.exchange_layout(), 16)
            red = (sRed, warp_idx, lane)

        # ---- the sequence: batch row b, first token bos, length tokens (cu_seqlens clamped into [0, T]); a
        # sequence index without its row (past B, or past len(cu_seqlens) - 1) has no tokens
        T = mQ.shape[1]
        b = n
        bos = Int32(0)
        length = Int32(0)
        if const_expr(c.varlen):
            b = Int32(0)
            if n + 1 < mCuSeqlens.shape[0]:
                bos = cutlass.min(cutlass.max(mCuSeqlens[n], 0), T)
                length = cutlass.min(cutlass.max(mCuSeqlens[n + 1], bos), T) - bos
        else:
            if n < mQ.shape[0]:
                length = T

        # ---- the slot; -1 for a padding row (negative or past the pool)
        P = mState.shape[0]
        slot = mIdx[n]
        slot = cutlass.select_(cutlass.min(slot, P - 1 - slot) >= 0, slot, Int32(-1))

        if length > 0:
            if slot >= 0:
                self.run_sequence(mQ, mK, mV, mGamma, mState, mO, scale, b, bos, length, h, slot, col0, bases,
                                  stores_o, red)
            else:
                rZero = cute.make_rmem_tensor(cute.make_layout(VC), self.io_dtype)
                rZero.fill(0.0)
                o_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.io_dtype,
                                             num_bits_per_copy=16 * VC)
                for t in cutlass.range(length, unroll=1):
                    if stores_o:
                        cute.copy(o_atom, rZero, cute.local_tile(mO[b, bos + t, h, None], (VC,), (col0 // VC,)))

    @cute.jit
    def run_sequence(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mGamma: cute.Tensor,
                     mState: cute.Tensor, mO: cute.Tensor, scale: Float32, b: Int32, bos: Int32, length: Int32,
                     h: Int32, slot: Int32, col0: Int32, bases: tuple, stores_o, red):
        """The tokens ``bos .. bos + length - 1`` (``length >= 1``) of one (sequence, head, V block) from pool slot
        ``slot``, and the state written back to it. Token 0's inputs are loaded before the state (the two
        latencies overlap); a later token's inputs at the top of its iteration. ``red``: K-first, the warps'
        exchange (:meth:`cta_publish`); None in V-first."""
        c, lanes = self.config, self.lanes
        VEC = self.vec
        state_type = _STATE_DTYPES[c.state_dtype]
        frags = (
            cute.make_rmem_tensor(cute.make_layout((4, 2)), self.io_dtype),  # q: rows bases[p] + e at (e, p)
            cute.make_rmem_tensor(cute.make_layout((4, 2)), self.io_dtype),  # k
            cute.make_rmem_tensor(cute.make_layout(self.cols), self.io_dtype),  # v: the lane's columns
        )
        self.load_token(mQ, mK, mV, frags, b, bos, h, col0, bases)
        decay = cute.math.exp(mGamma[h])  # λ = exp(g_gamma[h]), once per CTA

        # ---- the state: 8 16-byte vectors per lane, issued right after token 0's inputs
        s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), state_type, num_bits_per_copy=128)
        head = lanes.head_state(mState, slot, h)
        rRaw = cute.make_rmem_tensor(cute.make_layout((VEC, 8)), state_type)
        for p in cutlass.range_constexpr(8):
            cute.copy(s_atom, lanes.state_vector(head, p, col0, bases), rRaw[None, p])
        if const_expr(c.single_token):  # each vector updated in place and stored as soon as it is done
            self.token_step(mO, frags, None, decay, scale, b, bos, Int32(0), h, col0, stores_o, red,
                            (head, rRaw, s_atom, bases))
        else:
            rS = cute.make_rmem_tensor(cute.make_layout((VEC, 8)), Float32)
            rS.store(rRaw.load().to(Float32))
            self.token_step(mO, frags, rS, decay, scale, b, bos, Int32(0), h, col0, stores_o, red)
            for t in cutlass.range(1, length, unroll=1):
                tok = cutlass.min(bos + t, mQ.shape[1] - 1)  # it is already; see KdaDecode's note on the clamp
                self.load_token(mQ, mK, mV, frags, b, tok, h, col0, bases)
                self.token_step(mO, frags, rS, decay, scale, b, tok, t, h, col0, stores_o, red)
            lanes.store_state(head, rS, rRaw, s_atom, col0, bases)

    @cute.jit
    def token_step(self, mO: cute.Tensor, frags: tuple, rS: cute.Tensor | None, decay: Float32, scale: Float32,
                   b: Int32, tok: Int32, t: Int32, h: Int32, col0: Int32, stores_o, red, single: tuple | None = None):
        """One token (its inputs in ``frags``): ``s ← λ s + k_i v_j`` and ``acc_j += q_i s`` over the lane's fp32
        state ``rS``, the sums over K, and o. ``single``: the single-token form, ``(head, rRaw, s_atom, bases)``
        (``rS`` None): each of the lane's 8 vectors is taken from ``rRaw`` (the pool's dtype) into fp32, updated,
        rounded back and stored into the pool's ``head`` at once, so that only the raw vectors stay live."""
        VC, VEC = self.cols, self.vec
        rQ, rK, rV = frags
        q = rQ.load().to(Float32)
        k = rK.load().to(Float32)
        rQf = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
        rKf = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
        rQf.store(q)
        rKf.store(k)
        v = [rV[j].to(Float32) for j in range(VC)]
        part = [Float32(0.0)] * VC
        for p in cutlass.range_constexpr(8):
            vector = None
            if const_expr(single is None):
                vector = rS[None, p]
            else:
                vector = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
                vector.store(single[1][None, p].load().to(Float32))
            for e in cutlass.range_constexpr(VEC):
                i, j = self.lanes.element(e, p)
                s = decay * vector[e] + rKf[i % 4, i // 4] * v[j]
                vector[e] = s
                part[j] = part[j] + rQf[i % 4, i // 4] * s
            if const_expr(single is not None):
                head, rRaw, s_atom, bases = single
                rRaw[None, p].store(vector.load().to(rRaw.element_type))
                cute.copy(s_atom, rRaw[None, p], self.lanes.state_vector(head, p, col0, bases))
        sums = self.lanes.lane_sum(part)  # V-first: the column group's 16 lanes; K-first: the warp's 4 row groups
        if const_expr(red is None):
            self.store_output(mO, sums, scale, b, tok, h, col0, stores_o)
        else:  # K-first: the 4 warps' sums of each line group through shared memory; row group 0 of the group's
            # first warp writes o
            buf = t % 2
            self.cta_publish(red, buf, sums)
            if red[1] % K_FIRST_ROW_WARPS == 0:
                self.store_output(mO, self.cta_gather(red, buf), scale, b, tok, h, col0, stores_o)

    @cute.jit
    def load_token(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, frags: tuple, b: Int32, tok: Int32,
                   h: Int32, col0: Int32, bases: tuple):
        """Issue the loads of token ``tok``'s q and k (the lane's 8 K rows) and v (its columns) into ``frags``."""
        rQ, rK, rV = frags
        if const_expr(self.config.state_v_first and self.vec == 4):  # rows bases[0] + 0..3, bases[1] + 0..3
            qk_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.io_dtype, num_bits_per_copy=64)
            for p in cutlass.range_constexpr(2):
                piece = (bases[p] // 4,)
                cute.copy(qk_atom, cute.local_tile(mQ[b, tok, h, None], (4,), piece), rQ[None, p])
                cute.copy(qk_atom, cute.local_tile(mK[b, tok, h, None], (4,), piece), rK[None, p])
        else:  # rows bases[0] .. bases[0] + 7 are contiguous: one 16-byte vector each
            row_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.io_dtype, num_bits_per_copy=128)
            piece = (bases[0] // 8,)
            cute.copy(row_atom, cute.local_tile(mQ[b, tok, h, None], (8,), piece), self.lanes.flat(rQ))
            cute.copy(row_atom, cute.local_tile(mK[b, tok, h, None], (8,), piece), self.lanes.flat(rK))
        v_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.io_dtype, num_bits_per_copy=16 * self.cols)
        cute.copy(v_atom, cute.local_tile(mV[b, tok, h, None], (self.cols,), (col0 // self.cols,)), rV)

    @cute.jit
    def store_output(self, mO: cute.Tensor, sums: list, scale: Float32, b: Int32, tok: Int32, h: Int32, col0: Int32,
                     stores_o):
        """o of the lane's columns, ``scale · (Sᵀq)`` rounded to q's dtype, written by the ``stores_o`` lanes."""
        VC = self.cols
        rO = cute.make_rmem_tensor(cute.make_layout(VC), self.io_dtype)
        for j in cutlass.range_constexpr(VC):
            rO[j] = (scale * sums[j]).to(self.io_dtype)
        if stores_o:
            o_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.io_dtype, num_bits_per_copy=16 * VC)
            cute.copy(o_atom, rO, cute.local_tile(mO[b, tok, h, None], (VC,), (col0 // VC,)))

    def exchange_shape_stride(self) -> tuple:
        """K-first: shape and strides (fp32 elements) of the warps' column sums in shared memory, modes ``(e, m, c,
        w, buf)``: element ``4 m + e`` of column group ``c``'s ``qᵀS`` of warp ``w`` in buffer ``buf``, so that
        piece ``m`` of the 8 column groups is 128 contiguous bytes (one wavefront per warp access)."""
        VC, NW = self.cols, self.num_warps
        return (4, VC // 4, 8, NW, 2), (1, 32, 4, 8 * VC, 8 * VC * NW)

    def exchange_layout(self):
        """The layout of :meth:`exchange_shape_stride`."""
        shape, stride = self.exchange_shape_stride()
        return cute.make_layout(shape, stride=stride)

    @cute.jit
    def cta_publish(self, red: tuple, buf: Int32, sums: list):
        """K-first: row group 0 of each warp (lanes 0..7, column group = lane) writes its warp's ``cols`` sums into
        buffer ``buf`` of the exchange (16-byte stores); then the line group's barrier
        (:meth:`~cula_runtime.cute.kda.decode.KdaDecode.group_barrier`)."""
        VC = self.cols
        sRed, warp_idx, lane = red
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        rOut = cute.make_rmem_tensor(cute.make_layout((4, VC // 4)), Float32)
        for j in cutlass.range_constexpr(VC):
            rOut[j % 4, j // 4] = sums[j]
        if lane < 8:
            for m in cutlass.range_constexpr(VC // 4):
                cute.copy(atom, rOut[None, m], sRed[None, m, lane, warp_idx, buf])
        self.lanes.group_barrier(warp_idx)

    @cute.jit
    def cta_gather(self, red: tuple, buf: Int32) -> list:
        """K-first, after :meth:`cta_publish`: the sums over all 128 K rows of the lane's columns (column group
        ``lane % 8``), added in warp order over its line group's 4 warps from buffer ``buf``."""
        VC = self.cols
        sRed, warp_idx, lane = red
        first = self.lanes.exchange_warps(warp_idx)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        sums = [None] * VC
        for w in cutlass.range_constexpr(K_FIRST_ROW_WARPS):
            rIn = cute.make_rmem_tensor(cute.make_layout((4, VC // 4)), Float32)
            for m in cutlass.range_constexpr(VC // 4):
                cute.copy(atom, sRed[None, m, lane % 8, first + w, buf], rIn[None, m])
            for j in cutlass.range_constexpr(VC):
                sums[j] = rIn[j % 4, j // 4] if w == 0 else sums[j] + rIn[j % 4, j // 4]
        return sums


def _lane_config(config: LightningDecodeConfig) -> KdaDecodeConfig:
    """The KDA decode config whose lane layout (:meth:`KdaDecode.lane_layout`) and CTA shape this kernel uses."""
    return KdaDecodeConfig(num_heads=1, num_v_heads=1, head_dim=config.head_dim, state_dtype=config.state_dtype,
                           state_v_first=config.state_v_first, k_first_lines=config.k_first_lines)


@functools.lru_cache(maxsize=256)
def _plan(H: int, dtype: str, state_dtype: str, v_first: bool, varlen: bool, single_token: bool,
          lines: int) -> tuple:
    """The config and argument specs of one call signature (cached: no work per call)."""
    config = LightningDecodeConfig(num_heads=H, dtype=dtype, state_dtype=state_dtype, state_v_first=v_first,
                                   varlen=varlen, single_token=single_token,
                                   k_first_lines=lines if single_token and not v_first and lines > 1 else 0)
    ok, reason = LightningDecode.can_implement(config)
    if not ok:
        raise ValueError(f"LightningDecode: {reason}")
    return config, LightningDecode(config).argument_specs()


_OUTPUTS = frozenset({4, 7})  # the pool (written in place) and o: refused, never copied, if they break a promise
_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _check_shapes(q, k, v, g_gamma, state, state_indices, cu_seqlens, state_v_first: bool) -> None:
    """The shape facts the kernel's addressing relies on (host ints only: no device read). The full argument
    checks are the validator's (``cula_runtime.lightning_args``); this wrapper refuses only what would make the
    kernel address memory wrongly."""
    B, T, H, K = q.shape
    if K != HEAD_DIM or tuple(k.shape) != (B, T, H, K) or tuple(v.shape) != (B, T, H, HEAD_DIM):
        raise ValueError(f"q, k, v must be [B, T, H, {HEAD_DIM}] alike, got {list(q.shape)}, {list(k.shape)}, "
                         f"{list(v.shape)}")
    if tuple(g_gamma.shape) != (H,):
        raise ValueError(f"g_gamma must be [H] = [{H}], got {list(g_gamma.shape)}")
    layout = "[P, H, V, K]" if state_v_first else "[P, H, K, V]"
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, HEAD_DIM, HEAD_DIM):
        raise ValueError(f"state must be a pool {layout} with H={H}, K=V={HEAD_DIM}, got {list(state.shape)}")
    if state.stride()[-2:] != (HEAD_DIM, 1):
        raise ValueError(f"the state pool's heads must be compact [{HEAD_DIM}, {HEAD_DIM}] blocks (the kernel "
                         f"addresses them with static strides), got strides {list(state.stride())}")
    if state_indices.dim() != 1:
        raise ValueError(f"state_indices must be int32 [N], got shape {list(state_indices.shape)}")
    N = state_indices.shape[0]
    if cu_seqlens is None:
        if N != B:
            raise ValueError(f"state_indices must have one slot per sequence: N = B = {B}, got {N}")
    elif B != 1 or tuple(cu_seqlens.shape) != (N + 1,):
        raise ValueError(f"packed sequences need B = 1 and cu_seqlens [N + 1] = [{N + 1}], got B={B} and "
                         f"cu_seqlens {list(cu_seqlens.shape)}")


def _launch_config(q, state, state_v_first: bool, cu_seqlens) -> tuple:
    """``(config, specs)`` of one call: fixed-length calls of T = 1 (a decode step) take the single-token form."""
    varlen = cu_seqlens is not None
    state_dtype = _DTYPE_NAMES[str(state.dtype)]
    H, K = q.shape[2], q.shape[3]
    # (for the single-token form, fixed length: N = B sequences)
    lines = k_first_lines(state_dtype, q.shape[0] * H * K * K * state.element_size())
    return _plan(H, _DTYPE_NAMES[str(q.dtype)], state_dtype, bool(state_v_first), varlen,
                 not varlen and q.shape[1] == 1, lines)


def lightning_decode_cutedsl(q, k, v, g_gamma, *, state, state_indices, scale: float | None = None,
                             state_v_first: bool = False, cu_seqlens=None, out=None):
    """Lightning Attention decode on the GPU over an in-place state pool: ``o``. The arguments should already be
    validated (``cula_runtime.lightning_args``); this wrapper checks only the shapes its addressing relies on.

    Args:
        q, k: ``[B, T, H, 128]`` bf16 or fp16, contiguous.
        v: ``[B, T, H, 128]``, q's dtype.
        g_gamma: fp32 ``[H]``: the per-head log-decay (``λ_h = exp(g_gamma[h])``; finite, ``<= 0``).
        state: the pool ``[P, H, 128, 128]`` fp32 or bf16 (``[P, H, K, V]``; ``[P, H, V, K]`` with
            ``state_v_first``), each head a compact block, read and written in place (a bf16 pool rounded to
            nearest even).
        state_indices: int32 ``[N]``: sequence n starts from and ends in slot ``state_indices[n]``; a slot outside
            ``[0, P)`` is a padding row (nothing read or written, o rows zero).
        scale: the output scale (default ``K ** -0.5``).
        state_v_first: the pool's layout.
        cu_seqlens: int32 ``[N + 1]`` (B = 1): N packed sequences of any lengths, zero included; None: N = B
            sequences of T tokens.
        out: ``[B, T, H, 128]`` in q's dtype, contiguous, written (every token row of a sequence: padding rows get
            zeros); None: allocated.

    Returns:
        ``o`` (``out`` when given). Launched on the current stream, with no host synchronisation and no allocation
        (when ``out`` is given): CUDA-graph capturable. The first call per configuration compiles.

    Raises:
        ValueError: shapes the kernel cannot address (see :func:`_check_shapes`), a non-compact pool head, or an
            ``out`` that breaks the kernel's layout promises.
    """
    import torch

    _check_shapes(q, k, v, g_gamma, state, state_indices, cu_seqlens, state_v_first)
    B, T, H, K = q.shape
    if out is None:
        out = torch.empty(B, T, H, K, dtype=q.dtype, device=q.device)
    if state_indices.shape[0] == 0 or T == 0:
        return out
    config, specs = _launch_config(q, state, state_v_first, cu_seqlens)
    tensors = (q, k, v, g_gamma, state, state_indices, cu_seqlens, out)
    launch(LightningDecode, config, specs, tensors, _OUTPUTS, q.device, float(K**-0.5 if scale is None else scale))
    return out


def plan_lightning_decode_launch(q, k, v, g_gamma, *, state, state_indices, scale: float | None = None,
                                 state_v_first: bool = False, cu_seqlens=None):
    """:func:`lightning_decode_cutedsl` for a call plan: ``run(q, k, v, g_gamma, state, state_indices, cu_seqlens,
    out) -> o`` runs every later call whose tensors have the shapes, strides and dtypes of these (and the same
    flags and scale: the plan's signature) with the kernel looked up once and called directly
    (:func:`~cula_runtime.cute.compile_cache.planned_launch`: TVM-FFI checks the pointers' alignment, and where it
    refuses one the plan raises :class:`~cula_runtime.cute.compile_cache.LaunchDeclined`, nothing launched, for the
    unplanned path to decide the call). ``out``: ``[B, T, H, 128]`` in q's dtype, contiguous,
    or None (then ``o`` is allocated). Compiles the kernel now if no launch did yet. Holds no tensor of this call.

    Raises:
        ValueError: as :func:`lightning_decode_cutedsl`, for the tensors given here.
    """
    import torch

    _check_shapes(q, k, v, g_gamma, state, state_indices, cu_seqlens, state_v_first)
    o_shape, dtype, device, empty = tuple(q.shape), q.dtype, q.device, torch.empty
    if state_indices.shape[0] == 0 or q.shape[1] == 0:
        def launch_nothing(q, k, v, g_gamma, state, idx, cu, out):
            return empty(o_shape, dtype=dtype, device=device) if out is None else out

        return launch_nothing
    config, specs = _launch_config(q, state, state_v_first, cu_seqlens)
    kernel = planned_launch(LightningDecode, config, device)
    scale_value = float(q.shape[-1] ** -0.5 if scale is None else scale)

    def launch_planned(q, k, v, g_gamma, state, idx, cu, out):
        if out is None:
            out = empty(o_shape, dtype=dtype, device=device)
        try:
            kernel(q, k, v, g_gamma, state, idx, cu, out, scale_value)
        except ValueError:  # (TVM-FFI refused a pointer before launching: the unplanned path decides the call)
            raise LaunchDeclined from None
        return out

    return launch_planned
