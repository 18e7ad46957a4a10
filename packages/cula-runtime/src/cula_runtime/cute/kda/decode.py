"""KDA decode over an in-place state pool, in one CuTeDSL launch (KDA_SPEC.md §1.2, §6, §10; issue 26 item 4).

Per sequence ``n`` (``T_n >= 0`` tokens) and value head ``hv`` (reading q/k head ``hv // (HV // H)``), the state
``S`` ``[K, V]`` is read from its start slot of the pool, the tokens are applied in order while it stays in fp32
registers, and it is written back in place (``state_indices [N]``: to the start slot; ``[N, W]``: after token ``t`` to
``state_indices[n, t]``; the rules are :mod:`cula_runtime.state_pool`'s). Per token, with ``α = exp(g)`` (``g`` the
log-gate, or the in-kernel activation of the raw gate, :func:`~.gate.activate_gate`) and ``q``, ``k`` optionally
L2-normalised (fp32 sum of squares, ``rsqrt(Σx² + 1e-6)``, the result rounded to bf16 as the prefill's intra kernel
does):

* ``a = (α ⊙ k)ᵀ S`` and ``b = (α ⊙ q)ᵀ S`` (V-vectors: ``kᵀ·diag(α)S`` and ``qᵀ·diag(α)S``, the decayed state);
* ``v' = β (v - a)``; ``S ← diag(α) S + k v'ᵀ``;
* ``o = scale · (b + (q·k) v')``, which is ``scale · Sᵀq`` with the updated state (§1.2 step 4), so that both
  reductions over K of a token run in one pass over the state.

Design (bandwidth first; only plain loads/stores, shuffles and FMAs, no MMA: the same source runs on SM90, SM100 and
SM103). Every state access is a 16-byte vector and every warp-wide state access covers whole 128-byte lines (HBM
and L2 move sector pairs at best: a lone 32-byte sector per line wastes part of each fetch); each element is read
once and written once per call (per token with ``[N, W]`` indices, whose every token's state is an output). Lane
``l`` holds 8 K rows × ``cols`` value columns of ``S`` in fp32 registers (32 values with an fp32 pool, 64 with a
bf16 pool) and sums its rows; the two layouts then reduce over K differently (:meth:`KdaDecode.lane_layout`):

* **V-first** (``[V, K]``, a column's K rows contiguous): CTA = one (sequence, value head, 32-column V block), 4
  CTAs per head; each warp owns 8 (fp32 pool) or 16 (bf16) columns for all 128 K rows, so a CTA is 4 or 2 warps.
  The 16 lanes ``r = l % 16`` of a column group (``l // 16``) hold rows ``4 r ..`` and ``64 + 4 r ..`` (fp32) or
  ``8 r ..`` (bf16): one instruction reads 256 contiguous bytes (two lines) of each of two columns. Both
  reductions stay in the warp: a 4-step ``shfl.bfly`` all-reduce over those 16 lanes gives every lane ``a``, ``b``
  (and ``q·k``, ``Σq²``, ``Σk²``) for its columns; no shared memory, no barrier.
* **K-first** (``[K, V]``, a row's V columns contiguous; FLA's and vLLM's layout): CTA = one (sequence, value head,
  V block of one 128-byte line per row: 32 fp32 or 64 bf16 columns), 4 (fp32) or 2 (bf16) CTAs per head, 4 warps
  of 32 K rows each. 8 lanes cover a row's line: lane ``l`` of warp ``w`` holds rows ``32 w + 8 (l // 8) .. + 7``
  and the 16 bytes at ``(l % 8) · vec`` (columns ``col0 ..``), so instruction ``p`` reads rows ``32 w + 8 r + p``
  (``r = 0..3``): 4 whole lines. The lane's 8 rows are contiguous, so its q, k (and bf16 g) rows are one 16-byte
  load each. The reductions over K: the lane's rows, a 2-step ``shfl.bfly`` over the warp's 4 row groups (``kᵀS``,
  ``qᵀS`` of the lane's columns and ``q·k``), then one shared-memory exchange per token (:meth:`KdaDecode.cta_publish`,
  :meth:`KdaDecode.cta_gather`): row group 0 of each warp writes its warp's sums, one barrier, every thread adds the
  4 warps' ``kᵀS`` of its columns in warp order (the same bits in every thread), and warp 0, whose row group 0 holds
  each column once, adds ``qᵀS`` and ``q·k`` and writes o. The exchange is double-buffered by token parity (2 KB
  for an fp32 pool, 4 KB for bf16), so one barrier per token suffices for T > 1: a warp writes token ``t + 1``'s
  sums only after every warp passed token ``t``'s barrier, hence finished reading token ``t - 1``'s from that
  buffer. With the L2 norm each warp sums ``q²`` and ``k²`` over all 128 rows itself (4 elements per lane, a 5-step
  all-reduce over the warp), which keeps it off the exchange. Inside the token loop the token index is clamped into
  ``[0, T)`` (it is already), which keeps the compiler from carrying a strength-reduced pointer and stride per
  input tensor across iterations (on SM90 at 96 registers: 12 spill instructions instead of 51 in the compile
  tests' T = 1 fp32 configuration, 25 instead of 37 with per-token slots and the lower-bound gate).
  **Lines per CTA** (``k_first_lines`` L, chosen per call by :func:`k_first_lines`): a CTA may hold L such line
  groups of 4 warps side by side (warp ``w``: rows ``32 (w % 4) ..``, line ``w // 4``), so that it reads ``L · 128``
  contiguous bytes of every row (L = 4, fp32: the head's 64 KB whole; bf16 L = 2 likewise); each group exchanges
  among its own 4 warps (:meth:`KdaDecode.exchange_warps`) behind its own named barrier, in the same order, and its
  first warp writes its columns' o: the same bits for every L. The register cap is divided by L. A step that reads
  at least :data:`WHOLE_ROWS_BYTES` of state (HBM-bound: a pool far past the 50 MB L2) takes whole rows, a smaller
  one one line (latency- or L2-bound: whole-row CTAs would be a quarter or half as many, each moving 4x or 2x the
  bytes). Timed on a lent H100 (``benchmarks/results/decode_k_first_lines_ab_h100.md``): whole rows 0.3-2.5% faster
  than one line from 128 MiB of state up, up to 45% slower at N = 1; the step stays 1.05-1.15x an in-place pass over
  its bytes, where a pass over one-line blocks alone costs 1.05-1.06x (``decode_state_access_probe_h100.md``).
* **Bytes per step** (T = 1, fp32 pool, HV = 32): ``N · HV · 2 · 64 KB`` of state plus ``≈ 1.3 KB`` of inputs and
  output per (sequence, head): N = 128 moves 537 MB, a floor of 125 us at 4.3 TB/s (bf16 pool: 268 MB, 62 us).
  Little's law at 4.3 TB/s and ≈ 1 us of loaded DRAM latency wants ≈ 33 KB in flight per SM, more counting the
  part of a CTA's life spent on its index load, its math and its stores; a CTA issues all its 16 KB (fp32 pool;
  bf16 V-first: 8 KB) of state loads at once, and an SM holds 5 fp32 CTAs at 96 registers per thread (80 KB), 8
  bf16 V-first CTAs of 64 threads or 4 bf16 K-first CTAs of 128 threads at 128 registers (64 KB)
  (:data:`MIN_BLOCKS_PER_SM`, :data:`MIN_BLOCKS_PER_SM_K_FIRST`), so the loads of some CTAs overlap the math and
  stores of others. K-first CTAs ask for a shared-memory carveout that keeps this occupancy (3-5 KB per CTA with
  the driver's reserved 1 KB).
* **Small N**: 4 CTAs per head fills the machine early: N = 1, HV = 32 is 128 CTAs for 132 SMs (bf16 V-first too:
  its CTAs are 2 warps; bf16 K-first: 64 CTAs of 4 warps, each lane the same 64 values). The critical path is the
  index load, then the state loads (the token's q/k/v/g/β loads are issued before the state's, to overlap them),
  the reductions (K-first: plus the exchange and its barrier, ≈ 0.1 us), and the stores. A later token's inputs are
  loaded at the top of its iteration.
* Nothing is allocated, nothing is read on the host: every index is read on the device, so a call is
  CUDA-graph-capturable. A start slot outside ``[0, P)`` (negative: padding), a ``num_accepted_tokens[n]`` outside
  ``[1, W]`` or ``W = 0`` make a padding row (nothing read or written, zero outputs); a per-token slot outside
  ``[0, P)`` or a token ``t >= W`` is a state not written. ``cu_seqlens`` values are clamped into ``[0, T]`` (so a
  bad one cannot read past the inputs either).

:func:`kda_decode_cutedsl` is the host wrapper.
"""

import dataclasses
import functools

from ..compile_cache import LaunchDeclined, TensorSpec, fake_call_arguments, launch, missing_cutedsl, planned_launch
from ..dsl_compat import SmemAllocator
from .gate import GATE_FORMS, activate_beta, activate_gate
from .intra import L2NORM_EPS, InKernelGate

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["KdaDecode", "KdaDecodeConfig", "k_first_lines", "kda_decode_cutedsl"]

_DTYPES = {"float32": Float32, "bfloat16": BFloat16}
BLOCK_V = 32  # V-first: value columns per CTA, 4 CTAs per head (see the module docstring)
LINE_BYTES = 128  # K-first: a line group's value columns are one 128-byte line of each K row (32 fp32 or 64 bf16)
K_FIRST_ROW_WARPS = 4  # K-first: the warps of a line group, 32 K rows each
# K-first: the bytes of state one step reads from which a CTA takes whole rows (see :func:`k_first_lines`)
WHOLE_ROWS_BYTES = 128 << 20
# Register budget (min CTAs per SM, hence registers per thread): the state bytes resident per SM must cover what
# 4.3 TB/s needs in flight (≈ 33-40 KB per SM at ≈ 1 us of loaded latency), with margin for the CTAs that are in
# their math or store phase. V-first: unconstrained, ptxas takes ≈ 102 (fp32 pool, 128 threads) and ≈ 134 (bf16
# pool, 64 threads) registers: 4 fp32 CTAs (64 KB of state) or 7 bf16 CTAs (57 KB) per SM. Capping at 96 registers
# (fp32: 5 CTAs, 80 KB, a handful of spilled values outside the token math) and 128 (bf16: 8 CTAs, 64 KB) keeps
# each phase overlapped; 80 registers (6 fp32 CTAs) spilled inside the token math. K-first: 128 threads either way
# (16 KB of state per CTA), 96 registers (fp32: 5 CTAs, 80 KB) or 128 (bf16: 4 CTAs, 64 KB).
MIN_BLOCKS_PER_SM = {"float32": 5, "bfloat16": 8}
MIN_BLOCKS_PER_SM_K_FIRST = {"float32": 5, "bfloat16": 4}
WARP_MASKS = (1, 2, 4, 8, 16)  # shfl.bfly masks of an all-reduce over the warp
NO_GATE = InKernelGate(form="none", has_A_log=False, has_dt_bias=False, beta_sigmoid=False)


@dataclasses.dataclass(frozen=True)
class KdaDecodeConfig:
    """Compile-time configuration of :class:`KdaDecode` (the compile-cache key; B, T, N, W and P are not in it).

    Attributes:
        num_heads: H, q/k heads.
        num_v_heads: HV, value heads (a multiple of H).
        head_dim: K = V; only 128.
        gate: the gate form and the raw inputs' dtypes (:class:`~.intra.InKernelGate`: ``form`` ``"none"`` for a
            precomputed log-gate, ``g_dtype``, ``beta_dtype``, ``has_A_log``, ``has_dt_bias``, ``beta_sigmoid``,
            ``allow_neg_eigval``).
        l2norm: q and k are L2-normalised in the kernel (then rounded to bf16).
        state_dtype: the pool's dtype, ``"float32"`` or ``"bfloat16"`` (the running state is fp32 either way).
        state_v_first: the pool is ``[P, HV, V, K]`` (else ``[P, HV, K, V]``).
        varlen: packed sequences (B = 1, ``cu_seqlens``).
        per_token_slots: ``state_indices`` is ``[N, W]`` (speculative verification; else ``[N]``).
        num_accepted: ``num_accepted_tokens [N]`` is given (needs ``per_token_slots``).
        k_first_lines: K-first CTAs' 128-byte lines per K row (1, 2 or 4 fp32; 1 or 2 bf16); 0: one
            (:func:`k_first_lines` chooses per call).
    """

    num_heads: int
    num_v_heads: int
    head_dim: int = 128
    gate: InKernelGate = NO_GATE
    l2norm: bool = False
    state_dtype: str = "float32"
    state_v_first: bool = False
    varlen: bool = False
    per_token_slots: bool = False
    num_accepted: bool = False
    k_first_lines: int = 0


class KdaDecode:
    """The decode kernel (see the module docstring)."""

    @staticmethod
    def can_implement(config: KdaDecodeConfig) -> tuple[bool, str]:
        """Whether this kernel supports ``config``, and why not; compiles nothing."""
        c, gate = config, config.gate
        if c.head_dim != 128:
            return False, f"head_dim={c.head_dim}: only K = V = 128 is supported"
        if c.num_heads < 1 or c.num_v_heads < 1 or c.num_v_heads % c.num_heads:
            return False, f"num_v_heads={c.num_v_heads} must be a positive multiple of num_heads={c.num_heads}"
        if c.state_dtype not in _DTYPES:
            return False, f"state_dtype={c.state_dtype!r}: expected one of {tuple(_DTYPES)}"
        if gate.g_dtype not in _DTYPES or gate.beta_dtype not in _DTYPES:
            return False, f"g_dtype={gate.g_dtype!r}, beta_dtype={gate.beta_dtype!r}: expected {tuple(_DTYPES)}"
        if gate.form not in GATE_FORMS:
            return False, f"gate form {gate.form!r}: expected one of {GATE_FORMS}"
        if gate.form == "softplus" and not gate.has_A_log:
            return False, "the softplus gate needs A_log"
        if gate.form == "none" and (gate.has_A_log or gate.has_dt_bias):
            return False, "A_log/dt_bias are only used by an activated gate (form 'softplus' or 'safe')"
        if gate.allow_neg_eigval and not gate.beta_sigmoid:
            return False, "allow_neg_eigval needs the in-kernel beta sigmoid"
        if c.num_accepted and not c.per_token_slots:
            return False, "num_accepted_tokens needs per-token state indices [N, W]"
        row_lines = c.head_dim * (4 if c.state_dtype == "float32" else 2) // LINE_BYTES
        if c.k_first_lines and (c.state_v_first or c.k_first_lines not in (1, 2, 4) or c.k_first_lines > row_lines):
            return False, (f"k_first_lines={c.k_first_lines}: expected 0 (one line) or, K-first, 1, 2 or 4 up to "
                           f"a row's {row_lines} lines")
        return True, ""

    def __init__(self, config: KdaDecodeConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise ValueError(f"KdaDecode cannot implement {config}: {reason}")
        self.config = config
        state_bytes = 4 if config.state_dtype == "float32" else 2
        self.vec = 16 // state_bytes  # state elements per 16-byte access
        if config.state_v_first:
            self.lines = 1  # (K-first only)
            self.block_v = BLOCK_V  # a CTA's value columns
            self.warp_cols = 32 // state_bytes  # a warp's value columns (all 128 K rows of them)
            self.cols = self.warp_cols // 2  # value columns per lane
            self.num_warps = BLOCK_V // self.warp_cols  # 4 (fp32 pool) or 2 (bf16 pool)
            self.min_blocks_per_sm = MIN_BLOCKS_PER_SM[config.state_dtype]
            # lanes sharing a lane's columns (the reduction over K): the other 16 of its column group
            self.reduce_masks = (1, 2, 4, 8)
            self.smem_carveout = 0  # no shared memory
        else:
            self.lines = config.k_first_lines or 1  # line groups per CTA
            self.line_cols = LINE_BYTES // state_bytes  # 32 (fp32 pool) or 64 (bf16 pool)
            self.block_v = self.lines * self.line_cols
            self.cols = self.vec  # value columns per lane: one 16-byte vector of each of its rows
            self.num_warps = K_FIRST_ROW_WARPS * self.lines
            # the register cap of the one-line CTAs (fp32: 5 CTAs of 128 threads) divided by the lines (fp32 2 lines:
            # 2 CTAs of 256; 3 spilled 67 instructions on sm_90a)
            self.min_blocks_per_sm = max(1, MIN_BLOCKS_PER_SM_K_FIRST[config.state_dtype] // self.lines)
            # lanes sharing a lane's columns within its warp: the 4 row groups (l // 8); the warps then exchange
            # their sums through shared memory
            self.reduce_masks = (8, 16)
            # percent of the SM's 228 KB of shared memory: the K-first CTAs need 3-5 KB each (their exchange
            # buffers and the 1 KB the driver reserves per CTA), ≤ 21 KB per SM at min_blocks_per_sm; 25 % (57 KB,
            # rounded up to the next carveout the SM has) leaves room to spare, so that shared memory never
            # limits the CTAs per SM (a carveout of 0 might pick 8 KB: 2 CTAs)
            self.smem_carveout = 25
        self.num_threads = 32 * self.num_warps
        self.v_blocks = config.head_dim // self.block_v
        # K-first L2 norm: each warp sums q², k² over all 128 K rows itself (4 elements per lane), so that no
        # second exchange between the warps is needed
        self.warp_norms = config.l2norm and not config.state_v_first

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the twelve tensor arguments of ``__call__``, in order (None: argument absent)."""
        c, gate = self.config, self.config.gate
        index = TensorSpec(Int32, 1)
        # K-first: a lane's 8 K rows are contiguous, so its q, k (and bf16 g) rows are one 16-byte vector
        qk_vec = 4 if c.state_v_first else 8
        g_vec = 8 if not c.state_v_first and gate.g_dtype == "bfloat16" else 4
        return (
            TensorSpec(BFloat16, 4, qk_vec),  # q [B, T, H, K]: 4-element (8-byte) row pieces (K-first: 8, 16 bytes)
            TensorSpec(BFloat16, 4, qk_vec),  # k [B, T, H, K]
            TensorSpec(BFloat16, 4, 8),  # v [B, T, HV, V]
            TensorSpec(_DTYPES[gate.g_dtype], 4, g_vec),  # g [B, T, HV, K]: 8- or 16-byte row pieces
            TensorSpec(_DTYPES[gate.beta_dtype], 3),  # beta [B, T, HV]
            TensorSpec(Float32, 1) if gate.has_A_log else None,  # A_log [HV]
            TensorSpec(Float32, 2, 4) if gate.has_dt_bias else None,  # dt_bias [HV, K]
            TensorSpec(_DTYPES[c.state_dtype], 4, self.vec),  # the pool [P, HV, K, V] or [P, HV, V, K]
            TensorSpec(Int32, 2) if c.per_token_slots else index,  # state_indices [N, W] or [N]
            index if c.num_accepted else None,  # num_accepted_tokens [N]
            index if c.varlen else None,  # cu_seqlens [N + 1]
            TensorSpec(BFloat16, 4, 8),  # o [B, T, HV, V]
        )

    def compile_arguments(self) -> tuple:
        """Fake arguments for ``cute.compile``: symbolic B, T, N, W and P; nothing allocated."""
        return fake_call_arguments(self.argument_specs(), Float32(1.0), Float32(0.0))

    # ------------------------------------------------------------------------------------------------------------
    # Host side

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mState: cute.Tensor,
        mIdx: cute.Tensor,
        mAccepted: cute.Tensor | None,
        mCuSeqlens: cute.Tensor | None,
        mO: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
        stream: cuda.CUstream,
    ):
        # one linear index: V block fastest, then value head, then sequence (a slot's heads are read in order)
        grid = [mIdx.shape[0] * (self.config.num_v_heads * self.v_blocks), 1, 1]
        self.kernel(
            mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mIdx, mAccepted, mCuSeqlens, mO, scale, lower_bound,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream,
                 min_blocks_per_mp=self.min_blocks_per_sm, preferred_smem_carveout=self.smem_carveout)

    # ------------------------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        mState: cute.Tensor,
        mIdx: cute.Tensor,
        mAccepted: cute.Tensor | None,
        mCuSeqlens: cute.Tensor | None,
        mO: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
    ):
        c = self.config
        HV, VC = c.num_v_heads, self.cols
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        vb = bidx % self.v_blocks
        pair = bidx // self.v_blocks
        hv = pair % HV
        n = pair // HV
        h = hv // (HV // c.num_heads)
        warp_idx = tidx // 32
        lane = tidx % 32
        r, col0, bases = self.lane_layout(warp_idx, lane, vb)
        stores_o = self.stores_o(r, tidx)
        red = None
        if const_expr(not c.state_v_first):
            # the exchange of the warps' sums over their K rows, double-buffered by token parity (one barrier per
            # token: a warp writes token t + 1's sums only after every warp passed token t's barrier, hence read
            # token t - 1's)
            smem = SmemAllocator()
            sRed = smem.allocate_tensor(Float32, self.exchange_layout(), 16)
            sQk = smem.allocate_tensor(Float32, cute.make_layout((K_FIRST_ROW_WARPS, self.lines, 2)), 16)
            red = (sRed, sQk, warp_idx, lane)

        # ---- the sequence: batch row b, first token bos, length tokens (cu_seqlens clamped into [0, T])
        T = mQ.shape[1]
        b = n
        bos = Int32(0)
        length = T
        if const_expr(c.varlen):
            b = Int32(0)
            bos = cutlass.min(cutlass.max(mCuSeqlens[n], 0), T)
            length = cutlass.min(cutlass.max(mCuSeqlens[n + 1], bos), T) - bos

        # ---- the start slot; -1 for a padding row (negative, past the pool, or an accepted count outside [1, W])
        P = mState.shape[0]
        slot = Int32(-1)
        if const_expr(c.per_token_slots):
            W = mIdx.shape[1]
            column = Int32(0)
            if const_expr(c.num_accepted):
                column = mAccepted[n] - 1
            if cutlass.min(column, W - 1 - column) >= 0:
                slot = mIdx[n, column]
        else:
            slot = mIdx[n]
        slot = cutlass.select_(cutlass.min(slot, P - 1 - slot) >= 0, slot, Int32(-1))

        if length > 0:
            if slot >= 0:
                self.run_sequence(mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mIdx, mO, scale, lower_bound,
                                  b, bos, length, n, h, hv, slot, col0, bases, stores_o, red)
            else:
                rZero = cute.make_rmem_tensor(cute.make_layout(VC), BFloat16)
                rZero.fill(0.0)
                o_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * VC)
                for t in cutlass.range(length, unroll=1):
                    if stores_o:
                        cute.copy(o_atom, rZero, cute.local_tile(mO[b, bos + t, hv, None], (VC,), (col0 // VC,)))

    @cute.jit
    def run_sequence(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                     mALog: cute.Tensor | None, mDtBias: cute.Tensor | None, mState: cute.Tensor, mIdx: cute.Tensor,
                     mO: cute.Tensor, scale: Float32, lower_bound: Float32, b: Int32, bos: Int32, length: Int32,
                     n: Int32, h: Int32, hv: Int32, slot: Int32, col0: Int32, bases: tuple, stores_o, red):
        """The tokens ``bos .. bos + length - 1`` (``length >= 1``) of one (sequence, head, V block) from pool slot
        ``slot``. Token 0 is peeled so that its inputs are loaded before the state (the two latencies overlap);
        a later token's inputs are loaded at the top of its iteration (a register prefetch of the next token would
        cost ≈ 19 registers across the whole loop, half the occupancy the bandwidth needs at T = 1). ``red``:
        K-first, the warps' exchange (shared memory, warp and lane: :meth:`cta_publish`); None in V-first."""
        c = self.config
        VC, VEC = self.cols, self.vec
        state_type = _DTYPES[c.state_dtype]
        frags = (
            cute.make_rmem_tensor(cute.make_layout((4, 2)), BFloat16),  # q: rows bases[p] + e at (e, p)
            cute.make_rmem_tensor(cute.make_layout((4, 2)), BFloat16),  # k
            cute.make_rmem_tensor(cute.make_layout((4, 2)), mG.element_type),  # g
            cute.make_rmem_tensor(cute.make_layout(VC), BFloat16),  # v: the lane's columns
            cute.make_rmem_tensor(cute.make_layout(1), mBeta.element_type),  # beta
        )
        if const_expr(self.warp_norms):  # q and k elements 4 l .. 4 l + 3 (the warp's view of all 128)
            frags = frags + (cute.make_rmem_tensor(cute.make_layout(4), BFloat16),
                             cute.make_rmem_tensor(cute.make_layout(4), BFloat16))
        self.load_token(mQ, mK, mV, mG, mBeta, frags, b, bos, h, hv, col0, bases, red)

        # ---- the start state: 8 16-byte vectors per lane, issued right after token 0's inputs
        s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), state_type, num_bits_per_copy=128)
        head = self.head_state(mState, slot, hv)
        rRaw = cute.make_rmem_tensor(cute.make_layout((VEC, 8)), state_type)
        for p in cutlass.range_constexpr(8):
            cute.copy(s_atom, self.state_vector(head, p, col0, bases), rRaw[None, p])
        rS = cute.make_rmem_tensor(cute.make_layout((VEC, 8)), Float32)
        rS.store(rRaw.load().to(Float32))

        # ---- per-head constants of the gate: exp(A_log), dt_bias of the lane's K rows
        gate = c.gate
        a_scale = Float32(1.0)
        if const_expr(gate.form != "none" and gate.has_A_log):
            a_scale = cute.math.exp(mALog[hv])
        rBias = None
        if const_expr(gate.has_dt_bias):
            rBias = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
            f_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            for p in cutlass.range_constexpr(2):
                cute.copy(f_atom, cute.local_tile(mDtBias[hv, None], (4,), (bases[p] // 4,)), rBias[None, p])
        consts = (a_scale, rBias, scale, lower_bound)

        self.token_step(mState, mIdx, mO, frags, rS, rRaw, s_atom, consts, b, bos, Int32(0), n, hv, col0, bases,
                        stores_o, red)
        for t in cutlass.range(1, length, unroll=1):
            tok = bos + t
            if const_expr(red is not None):
                tok = cutlass.min(tok, mQ.shape[1] - 1)
            self.load_token(mQ, mK, mV, mG, mBeta, frags, b, tok, h, hv, col0, bases, red)
            self.token_step(mState, mIdx, mO, frags, rS, rRaw, s_atom, consts, b, tok, t, n, hv, col0, bases,
                            stores_o, red)

        if const_expr(not c.per_token_slots):  # back to the start slot
            self.store_state(head, rS, rRaw, s_atom, col0, bases)

    @cute.jit
    def token_step(self, mState: cute.Tensor, mIdx: cute.Tensor, mO: cute.Tensor, frags: tuple, rS: cute.Tensor,
                   rRaw: cute.Tensor, s_atom, consts: tuple, b: Int32, tok: Int32, t: Int32, n: Int32, hv: Int32,
                   col0: Int32, bases: tuple, stores_o, red):
        """One token (its inputs in ``frags``) applied to the lane's fp32 state ``rS``; writes o (and, with per-token
        slots, the state after the token)."""
        c, gate = self.config, self.config.gate
        VC, VEC = self.cols, self.vec
        rQ, rK, rG, rV, rB = frags[:5]
        a_scale, rBias, scale, lower_bound = consts
        step_slot = Int32(-1)
        if const_expr(c.per_token_slots):  # the state after this token goes to state_indices[n, t] (if in the pool)
            if t < mIdx.shape[1]:
                step_slot = mIdx[n, t]

        q = rQ.load().to(Float32)
        k = rK.load().to(Float32)
        if const_expr(c.l2norm and not self.warp_norms):  # fp32 sums of squares over the 16 lanes of the column
            # group; bf16 result
            sums_sq = self.lane_sum([(q * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                                     (k * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)])
            q = (q * cute.math.rsqrt(sums_sq[0] + L2NORM_EPS)).to(BFloat16).to(Float32)
            k = (k * cute.math.rsqrt(sums_sq[1] + L2NORM_EPS)).to(BFloat16).to(Float32)
        if const_expr(self.warp_norms):  # K-first: from the warp's view of q and k (4 elements per lane), summed
            # over the warp; every warp gets the same bits, so every lane holding a row rounds it alike
            qw = frags[5].load().to(Float32)
            kw = frags[6].load().to(Float32)
            sums_sq = self.lane_sum([(qw * qw).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                                     (kw * kw).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)], WARP_MASKS)
            q = (q * cute.math.rsqrt(sums_sq[0] + L2NORM_EPS)).to(BFloat16).to(Float32)
            k = (k * cute.math.rsqrt(sums_sq[1] + L2NORM_EPS)).to(BFloat16).to(Float32)
        rQf = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
        rKf = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
        rQf.store(q)
        rKf.store(k)
        if const_expr(red is None):
            qk = self.lane_sum([(q * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)])[0]
        beta = activate_beta(rB[0].to(Float32), gate.beta_sigmoid, gate.allow_neg_eigval)

        # S <- diag(α) S over the lane's 8 K rows (α = exp of the log-gate or of its in-kernel activation)
        for i in cutlass.range_constexpr(8):
            x = rG[i % 4, i // 4].to(Float32)
            if const_expr(gate.form != "none"):
                if const_expr(gate.has_dt_bias):
                    x = x + rBias[i % 4, i // 4]
                x = activate_gate(gate.form, x, a_scale, lower_bound)
            alpha = cute.math.exp(x, fastmath=True)
            for p in cutlass.range_constexpr(8):
                for e in cutlass.range_constexpr(VEC):
                    if const_expr(self.element(e, p)[0] == i):
                        rS[e, p] = alpha * rS[e, p]

        # kᵀS and qᵀS of the decayed state: the lane's rows, then (V-first) the 16 lanes of its column group or
        # (K-first) the warp's 4 row groups and the 4 warps
        part = [Float32(0.0)] * (2 * VC)
        for p in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(VEC):
                i, j = self.element(e, p)
                part[j] = part[j] + rKf[i % 4, i // 4] * rS[e, p]
                part[VC + j] = part[VC + j] + rQf[i % 4, i // 4] * rS[e, p]
        if const_expr(red is None):
            sums = self.lane_sum(part)
        else:  # K-first: the warp's 32 rows (with q·k), then the 4 warps' sums through shared memory
            buf = t % 2
            self.cta_publish(red, buf, self.lane_sum(part + [(q * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)]))
            sums = self.cta_gather(red, buf, 0)

        # v' = β (v - kᵀS);  S += k v'ᵀ;  o = scale (qᵀS + (q·k) v'), the read of the updated state
        vnew = [beta * (rV[j].to(Float32) - sums[j]) for j in range(VC)]
        for p in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(VEC):
                i, j = self.element(e, p)
                rS[e, p] = rS[e, p] + rKf[i % 4, i // 4] * vnew[j]
        if const_expr(red is None):
            self.store_output(mO, sums[VC:], qk, vnew, scale, b, tok, hv, col0, stores_o)
        else:  # K-first: a line group's first warp (its row group 0 holds each column once) gathers qᵀS and q·k and
            # writes o
            if red[2] % K_FIRST_ROW_WARPS == 0:
                self.store_output(mO, self.cta_gather(red, buf, 1), self.cta_gather(red, buf, 2)[0], vnew, scale, b,
                                  tok, hv, col0, stores_o)

        if const_expr(c.per_token_slots):
            if cutlass.min(step_slot, mState.shape[0] - 1 - step_slot) >= 0:
                self.store_state(self.head_state(mState, step_slot, hv), rS, rRaw, s_atom, col0, bases)

    @cute.jit
    def load_token(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                   frags: tuple, b: Int32, tok: Int32, h: Int32, hv: Int32, col0: Int32, bases: tuple, red):
        """Issue the loads of token ``tok``'s q, k, g (the lane's 8 K rows), v (its columns) and β into ``frags``
        (K-first with the L2 norm: also the warp's view of q and k)."""
        qk_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=64)
        g_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mG.element_type,
                                     num_bits_per_copy=4 * mG.element_type.width)
        v_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * self.cols)
        rQ, rK, rG, rV, rB = frags[:5]
        if const_expr(self.config.state_v_first):
            for p in cutlass.range_constexpr(2):
                piece = (bases[p] // 4,)
                cute.copy(qk_atom, cute.local_tile(mQ[b, tok, h, None], (4,), piece), rQ[None, p])
                cute.copy(qk_atom, cute.local_tile(mK[b, tok, h, None], (4,), piece), rK[None, p])
                cute.copy(g_atom, cute.local_tile(mG[b, tok, hv, None], (4,), piece), rG[None, p])
        else:  # rows bases[0] .. bases[0] + 7 are contiguous: one 16-byte vector of q, of k, of bf16 g (fp32 g: two)
            row_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
            piece = (bases[0] // 8,)
            cute.copy(row_atom, cute.local_tile(mQ[b, tok, h, None], (8,), piece), self.flat(rQ))
            cute.copy(row_atom, cute.local_tile(mK[b, tok, h, None], (8,), piece), self.flat(rK))
            if const_expr(mG.element_type.width == 16):
                cute.copy(row_atom, cute.local_tile(mG[b, tok, hv, None], (8,), piece), self.flat(rG))
            else:
                for p in cutlass.range_constexpr(2):
                    cute.copy(g_atom, cute.local_tile(mG[b, tok, hv, None], (4,), (bases[p] // 4,)), rG[None, p])
            if const_expr(self.warp_norms):
                lane = red[3]
                cute.copy(qk_atom, cute.local_tile(mQ[b, tok, h, None], (4,), (lane,)), frags[5])
                cute.copy(qk_atom, cute.local_tile(mK[b, tok, h, None], (4,), (lane,)), frags[6])
        cute.copy(v_atom, cute.local_tile(mV[b, tok, hv, None], (self.cols,), (col0 // self.cols,)), rV)
        rB[0] = mBeta[b, tok, hv]

    def lane_layout(self, warp_idx, lane, vb) -> tuple:
        """``(r, col0, bases)`` of a lane: its K-row group ``r``, its first value column ``col0`` (its columns are
        ``col0 .. col0 + cols - 1``) and the K rows of its row index ``i`` (0..7), ``bases[i // 4] + i % 4``.
        Plain arithmetic: the kernel calls it on device values, the tests on Python ints.

        V-first: the 16 lanes ``r = l % 16`` of each column group (``l // 16``) hold rows ``4 r ..`` and
        ``64 + 4 r ..`` (fp32) or ``8 r ..`` (bf16): each instruction reads 256 contiguous bytes of each of two
        columns. K-first: 8 lanes per 128-byte line, lane ``l`` of warp ``w`` holds rows ``32 w + 8 (l // 8) ..
        + 7`` and the 16 bytes at ``(l % 8) · vec`` of the CTA's line of each: instruction ``p`` reads rows
        ``32 w + 8 r + p`` (r = 0..3), four whole lines."""
        VC = self.cols
        if self.config.state_v_first:
            r = lane % 16
            col0 = vb * BLOCK_V + warp_idx * self.warp_cols + (lane // 16) * VC
            if self.vec == 4:  # fp32: rows 4r.. and 64 + 4r.. (each instruction: 256 B per column)
                bases = (4 * r, 64 + 4 * r)
            else:  # bf16: rows 8r .. 8r + 7, one 16-byte vector
                bases = (8 * r, 8 * r + 4)
        else:  # line group warp_idx // 4, its rows 32 (warp_idx % 4) ..
            r = lane // 8
            col0 = vb * self.block_v + (warp_idx // K_FIRST_ROW_WARPS) * self.line_cols + (lane % 8) * VC
            row0 = 32 * (warp_idx % K_FIRST_ROW_WARPS) + 8 * r
            bases = (row0, row0 + 4)
        return r, col0, bases

    @staticmethod
    def exchange_warps(warp_idx):
        """K-first: the first of the 4 warps whose sums a thread of warp ``warp_idx`` adds (its line group's, which
        hold the 128 K rows of its columns: warps ``first .. first + 3``). Plain arithmetic, as :meth:`lane_layout`."""
        return warp_idx - warp_idx % K_FIRST_ROW_WARPS

    def stores_o(self, r, tidx):
        """Whether thread ``tidx`` (row group ``r``) writes o: one lane per column. V-first: row group 0 of each
        column group; K-first: row group 0 of each line group's first warp (lanes 0..7 of warps 0, 4, ...: the 4
        warps of a line group hold the same columns)."""
        if self.config.state_v_first:
            return r == 0
        return tidx % (32 * K_FIRST_ROW_WARPS) < 8

    @staticmethod
    def flat(frag: cute.Tensor) -> cute.Tensor:
        """A register fragment as one flat mode (a (4, 2) row fragment as its 8 rows in order)."""
        return cute.make_tensor(frag.iterator, cute.make_layout(cute.size(frag)))

    def exchange_shape_stride(self) -> tuple:
        """K-first: shape and strides (fp32 elements) of the warps' column sums in shared memory, modes ``(e, m, c,
        half, w, buf)``: element ``4 m + e`` of column group ``c``'s ``kᵀS`` (half 0) or ``qᵀS`` (half 1) of warp
        ``w`` in buffer ``buf``, so that piece ``m`` of the 8 column groups is 128 contiguous bytes (one
        wavefront per warp access)."""
        VC, NW = self.cols, self.num_warps
        return (4, VC // 4, 8, 2, NW, 2), (1, 32, 4, 8 * VC, 16 * VC, 16 * VC * NW)

    def exchange_layout(self):
        """The layout of :meth:`exchange_shape_stride`."""
        shape, stride = self.exchange_shape_stride()
        return cute.make_layout(shape, stride=stride)

    @cute.jit
    def cta_publish(self, red: tuple, buf: Int32, sums: list):
        """K-first: row group 0 of each warp writes its warp's ``sums`` (the lane's ``cols`` sums of ``kᵀS``, then of
        ``qᵀS``, then q·k, each over the warp's 32 rows, as :meth:`lane_sum` leaves them) into buffer ``buf`` of
        the exchange; then the line group's barrier (:meth:`group_barrier`)."""
        VC = self.cols
        sRed, sQk, warp_idx, lane = red
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        rOut = cute.make_rmem_tensor(cute.make_layout((4, VC // 4, 2)), Float32)
        for x in cutlass.range_constexpr(2 * VC):
            rOut[x % 4, (x % VC) // 4, x // VC] = sums[x]
        if lane < 8:
            for half in cutlass.range_constexpr(2):
                for m in cutlass.range_constexpr(VC // 4):
                    cute.copy(atom, rOut[None, m, half], sRed[None, m, lane, half, warp_idx, buf])
            if lane == 0:
                sQk[warp_idx % K_FIRST_ROW_WARPS, warp_idx // K_FIRST_ROW_WARPS, buf] = sums[2 * VC]
        self.group_barrier(warp_idx)

    @cute.jit
    def group_barrier(self, warp_idx: Int32):
        """K-first: the barrier of the exchange: the CTA's (one line group), or with several line groups the named
        barrier ``1 + warp_idx // 4`` of the thread's group's 128 threads (the groups exchange independently)."""
        if const_expr(self.lines == 1):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=1 + warp_idx // K_FIRST_ROW_WARPS, number_of_threads=32 * K_FIRST_ROW_WARPS)

    @cute.jit
    def cta_gather(self, red: tuple, buf: Int32, half: cutlass.Constexpr) -> list:
        """K-first, after :meth:`cta_publish`: the sums over all 128 K rows, added in warp order over the thread's
        line group (:meth:`exchange_warps`; every thread gets the same bits) from buffer ``buf``: ``kᵀS`` (``half``
        0) or ``qᵀS`` (1) of the lane's columns, or ``[q·k]`` (2)."""
        VC, NW = self.cols, K_FIRST_ROW_WARPS
        sRed, sQk, warp_idx, lane = red
        first = self.exchange_warps(warp_idx)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        if const_expr(half == 2):
            rQk = cute.make_rmem_tensor(cute.make_layout(NW), Float32)
            cute.copy(atom, sQk[None, warp_idx // NW, buf], rQk)
            qk = rQk[0]
            for w in cutlass.range_constexpr(1, NW):
                qk = qk + rQk[w]
            return [qk]
        sums = [None] * VC
        for w in cutlass.range_constexpr(NW):
            rIn = cute.make_rmem_tensor(cute.make_layout((4, VC // 4)), Float32)
            for m in cutlass.range_constexpr(VC // 4):
                cute.copy(atom, sRed[None, m, lane % 8, half, first + w, buf], rIn[None, m])
            for j in cutlass.range_constexpr(VC):
                sums[j] = rIn[j % 4, j // 4] if w == 0 else sums[j] + rIn[j % 4, j // 4]
        return sums

    @cute.jit
    def store_output(self, mO: cute.Tensor, q_sums: list, qk: Float32, vnew: list, scale: Float32, b: Int32,
                     tok: Int32, hv: Int32, col0: Int32, stores_o):
        """o of the lane's columns, ``scale (qᵀS + (q·k) v')`` rounded to bf16, written by the ``stores_o`` lanes."""
        VC = self.cols
        rO = cute.make_rmem_tensor(cute.make_layout(VC), BFloat16)
        for j in cutlass.range_constexpr(VC):
            rO[j] = (scale * (q_sums[j] + qk * vnew[j])).to(BFloat16)
        if stores_o:
            o_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * VC)
            cute.copy(o_atom, rO, cute.local_tile(mO[b, tok, hv, None], (VC,), (col0 // VC,)))

    def element(self, e: int, p: int) -> tuple[int, int]:
        """(K row index among the lane's 8, column among its ``cols``) of state vector ``p``'s element ``e``."""
        if self.config.state_v_first:  # vectors along K: column p // per_column, rows of piece p % per_column
            per_column = 8 // self.vec
            return (p % per_column) * self.vec + e, p // per_column
        return p, e  # vectors along V: row p

    @staticmethod
    def row(i: int, bases: tuple):
        """The K row of the lane's row index ``i`` (0..7): rows ``bases[0] + 0..3`` then ``bases[1] + 0..3``."""
        return bases[i // 4] + i % 4

    def head_state(self, mState: cute.Tensor, slot: Int32, hv: Int32) -> cute.Tensor:
        """One head's state ``[K, V]`` (or ``[V, K]``) in the pool, its row stride static (the pool's last two modes
        are compact, which the wrapper checks): the lane's 8 vectors are then immediate offsets of one address."""
        K = self.config.head_dim
        head = mState[slot, hv, None, None]
        return cute.make_tensor(head.iterator, cute.make_layout((K, K), stride=(K, 1)))

    @cute.jit
    def state_vector(self, head: cute.Tensor, p: cutlass.Constexpr, col0: Int32, bases: tuple) -> cute.Tensor:
        """The 16 bytes of one head's state (``[K, V]`` or ``[V, K]``) that hold the lane's vector ``p``."""
        if const_expr(self.config.state_v_first):
            i, j = self.element(0, p)
            return cute.local_tile(head[col0 + j, None], (self.vec,), (self.row(i, bases) // self.vec,))
        return cute.local_tile(head[self.row(p, bases), None], (self.vec,), (col0 // self.vec,))

    @cute.jit
    def store_state(self, head: cute.Tensor, rS: cute.Tensor, rRaw: cute.Tensor, s_atom, col0: Int32,
                    bases: tuple):
        """Write the lane's fp32 state ``rS`` (rounded to the pool's dtype) into one head of the pool."""
        rRaw.store(rS.load().to(rRaw.element_type))
        for p in cutlass.range_constexpr(8):
            cute.copy(s_atom, rRaw[None, p], self.state_vector(head, p, col0, bases))

    def lane_sum(self, values: list, masks: tuple | None = None) -> list:
        """Each value summed over the lanes sharing this lane's columns (``shfl.bfly`` all-reduce over
        ``reduce_masks``, or ``masks``: every lane gets the same bits, as fp32 addition is commutative)."""
        out = list(values)
        for mask in self.reduce_masks if masks is None else masks:
            out = [x + cute.arch.shuffle_sync_bfly(x, offset=mask) for x in out]
        return out


def k_first_lines(state_dtype: str, state_bytes: int) -> int:
    """The 128-byte lines of each K row a K-first CTA reads for a step that reads ``state_bytes`` of state
    (``N · HV · K · V`` elements of ``state_dtype``): all of a row's (4 fp32, 2 bf16) from
    :data:`WHOLE_ROWS_BYTES` up, else 1."""
    if state_bytes < WHOLE_ROWS_BYTES:
        return 1
    return 4 if state_dtype == "float32" else 2


@functools.lru_cache(maxsize=256)
def _plan(H: int, HV: int, gate: InKernelGate, flags: tuple) -> tuple:
    """The config and argument specs of one call signature (cached: no work per call)."""
    l2norm, state_dtype, v_first, varlen, per_token, accepted, lines = flags
    config = KdaDecodeConfig(num_heads=H, num_v_heads=HV, gate=gate, l2norm=l2norm, state_dtype=state_dtype,
                             state_v_first=v_first, varlen=varlen, per_token_slots=per_token, num_accepted=accepted,
                             k_first_lines=0 if v_first or lines == 1 else lines)
    ok, reason = KdaDecode.can_implement(config)
    if not ok:
        raise ValueError(f"KdaDecode: {reason}")
    return config, KdaDecode(config).argument_specs()


_OUTPUTS = frozenset({7, 11})  # the pool (written in place) and o: refused, never copied, if they break a promise
_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}


def kda_decode_cutedsl(
    q,
    k,
    v,
    g,
    beta,
    *,
    state,
    state_indices,
    scale: float | None = None,
    A_log=None,
    dt_bias=None,
    lower_bound: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens=None,
    num_accepted_tokens=None,
    out=None,
):
    """KDA decode on the GPU over an in-place state pool: ``o``. The arguments must already be validated
    (:func:`cula_runtime.kda_decode_args.validate_kda_decode`): this wrapper checks nothing the validator checks.

    Args:
        q, k: ``[B, T, H, 128]`` bf16, contiguous.
        v: ``[B, T, HV, 128]`` bf16 (``HV % H == 0``; value head ``hv`` reads q/k head ``hv // (HV // H)``).
        g: ``[B, T, HV, 128]`` fp32 or bf16: the log-gate, or with ``use_gate_in_kernel`` the raw gate
            (``lower_bound * sigmoid(exp(A_log) (g + dt_bias))`` when ``lower_bound`` is set, else
            ``-exp(A_log) softplus(g + dt_bias)``, softplus threshold 20).
        beta: ``[B, T, HV]`` fp32 or bf16: β, or its logit with ``use_beta_sigmoid_in_kernel`` (``2 sigmoid`` with
            ``allow_neg_eigval``).
        state: the pool ``[P, HV, 128, 128]`` fp32 or bf16 (``[P, HV, K, V]``; ``[P, HV, V, K]`` with
            ``state_v_first``), contiguous, read and written in place.
        state_indices: int32 ``[N]`` (sequence n starts from and ends in slot ``state_indices[n]``) or ``[N, W]``
            (the state after token t goes to ``state_indices[n, t]``; the start is ``state_indices[n, 0]``, or
            ``state_indices[n, num_accepted_tokens[n] - 1]``). Padding and out-of-pool rules: the module docstring.
        scale: the output scale (default ``K ** -0.5``).
        A_log: fp32 ``[HV]``; dt_bias: fp32 ``[HV * K]`` or ``[HV, K]`` (in-kernel gate only).
        use_qk_l2norm_in_kernel: L2-normalise q and k (fp32, rounded to bf16).
        cu_seqlens: int32 ``[N + 1]`` (B = 1): N packed sequences of any lengths, zero included.
        num_accepted_tokens: int32 ``[N]``, with ``[N, W]`` indices only.
        out: bf16 ``[B, T, HV, 128]`` contiguous, written (every row: padding rows get zeros); None: allocated.

    Returns:
        ``o`` (``out`` when given). Launched on the current stream, with no host synchronisation and no allocation
        (when ``out`` is given): CUDA-graph capturable. The first call per configuration compiles
        (:func:`cula_runtime.cute.compile_cache.compile_records`).
    """
    import torch

    B, T, H, K = q.shape
    HV = v.shape[2]
    if state.stride()[-2:] != (K, 1):
        raise ValueError(f"the state pool's heads must be compact [K, K] blocks (the kernel addresses them with static "
                         f"strides), got strides {list(state.stride())}")
    if out is None:
        out = torch.empty(B, T, HV, K, dtype=torch.bfloat16, device=q.device)
    N = state_indices.shape[0]
    if N == 0 or T == 0:
        return out
    config, specs, A_log, dt_bias, scalars = _launch_args(
        H, HV, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
        num_accepted_tokens)
    tensors = (q, k, v, g, beta, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens, out)
    launch(KdaDecode, config, specs, tensors, _OUTPUTS, q.device, *scalars)
    return out


def _launch_args(H: int, HV: int, g, beta, state, state_indices, scale: float | None, A_log, dt_bias,
                 lower_bound: float | None, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                 use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, state_v_first: bool, cu_seqlens,
                 num_accepted_tokens) -> tuple:
    """``(config, specs, A_log, dt_bias, scalars)`` of one call: the kernel's configuration and argument specs, the
    gate parameters its form reads (``dt_bias`` as ``[HV, K]``; None where unused) and the scalar arguments."""
    K = state.shape[-1]
    if use_gate_in_kernel:
        form = "softplus" if lower_bound is None else "safe"
    else:
        form, A_log, dt_bias = "none", None, None
    if dt_bias is not None:
        dt_bias = dt_bias.reshape(HV, K)
    gate = InKernelGate(form=form, g_dtype=_DTYPE_NAMES[str(g.dtype)], beta_dtype=_DTYPE_NAMES[str(beta.dtype)],
                        has_A_log=A_log is not None, has_dt_bias=dt_bias is not None,
                        beta_sigmoid=bool(use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval))
    state_dtype = _DTYPE_NAMES[str(state.dtype)]
    lines = k_first_lines(state_dtype, state_indices.shape[0] * HV * K * K * state.element_size())
    flags = (bool(use_qk_l2norm_in_kernel), state_dtype, bool(state_v_first), cu_seqlens is not None,
             state_indices.dim() == 2, num_accepted_tokens is not None, lines)
    config, specs = _plan(H, HV, gate, flags)
    scalars = (float(K**-0.5 if scale is None else scale), float(lower_bound) if form == "safe" else 0.0)
    return config, specs, A_log, dt_bias, scalars


def plan_kda_decode_launch(q, v, g, beta, *, state, state_indices, scale: float | None = None, A_log=None,
                           dt_bias=None, lower_bound: float | None = None, use_qk_l2norm_in_kernel: bool = False,
                           use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False, cu_seqlens=None,
                           num_accepted_tokens=None):
    """:func:`kda_decode_cutedsl` for a call plan: ``run(q, k, v, g, beta, state, state_indices, A_log, dt_bias,
    cu_seqlens, num_accepted_tokens, out) -> o`` (``cula.call_plans``' order) runs every later call whose tensors
    have the shapes, strides and dtypes of these (and the same flags and scalars: the plan's signature) with the
    kernel looked up once and called directly (:func:`~cula_runtime.cute.compile_cache.planned_launch`). Nothing is
    checked in Python: TVM-FFI checks the pointers' alignment before launching, and where it refuses one the plan
    raises :class:`~cula_runtime.cute.compile_cache.LaunchDeclined` (nothing launched, nothing written), so that the
    call takes the unplanned path, whose validation and dispatch decide it (a misaligned input copied, a misaligned
    ``out`` refused, a misaligned pool sent to the reference with the backend's reason). ``out``: ``[B, T, HV,
    128]`` bf16 contiguous, or None (then ``o`` is allocated); ``dt_bias`` may be ``[HV * K]`` or ``[HV, K]``;
    ``A_log`` and ``dt_bias`` fp32. Compiles the kernel now if no launch did yet. Holds no tensor of this call."""
    import torch

    B, T, H, K = q.shape
    HV = v.shape[2]
    o_shape, device, empty, bf16 = (B, T, HV, K), q.device, torch.empty, torch.bfloat16
    if state_indices.shape[0] == 0 or T == 0:
        def launch_nothing(q, k, v, g, beta, state, idx, A_log, dt_bias, cu, accepted, out):
            return empty(o_shape, dtype=bf16, device=device) if out is None else out

        return launch_nothing
    config, specs, A_log_used, dt_used, scalars = _launch_args(
        H, HV, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
        num_accepted_tokens)
    kernel = planned_launch(KdaDecode, config, device)
    with_A_log, with_dt_bias = A_log_used is not None, dt_used is not None
    scale_value, lower_value = scalars

    def launch_planned(q, k, v, g, beta, state, idx, A_log, dt_bias, cu, accepted, out):
        if out is None:
            out = empty(o_shape, dtype=bf16, device=device)
        if not with_A_log:  # (the gate form reads no A_log)
            A_log = None
        # (a [HV, K] dt_bias is passed as it is: a view costs a dispatcher call)
        dt = (dt_bias if dt_bias.dim() == 2 else dt_bias.view(HV, K)) if with_dt_bias else None
        try:
            kernel(q, k, v, g, beta, A_log, dt, state, idx, accepted, cu, out, scale_value, lower_value)
        except ValueError:  # (TVM-FFI refused a pointer before launching: the unplanned path decides the call)
            raise LaunchDeclined from None
        return out

    return launch_planned
