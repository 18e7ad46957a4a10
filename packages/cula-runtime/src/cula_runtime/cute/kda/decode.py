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
SM103):

* **CTA = one (sequence, value head, 32-column V block)**, 4 CTAs per head. Each warp owns ``warp_cols`` value
  columns for all 128 K rows: 8 columns (32 bytes of a K-first fp32 row) with an fp32 pool, 16 (32 bytes) with a bf16
  pool, so a CTA is 4 (fp32) or 2 (bf16) warps. Both reductions over K stay inside the warp (no shared memory, no
  barrier): lane ``l`` holds 8 K rows × ``warp_cols / 2`` columns of ``S`` in fp32 registers (32 values fp32 pool,
  64 bf16 pool), sums its rows, and a 4-step ``shfl.bfly`` all-reduce over the 16 lanes sharing its columns gives
  every lane ``a``, ``b`` (and ``q·k``, ``Σq²``, ``Σk²``) for its columns.
* **Every state access is a 16-byte vector**, coalesced into whole 32-byte sectors: K-first (``[K, V]``): a lane
  holds rows ``8 r .. 8 r + 7`` (``r = l // 2``) and the 16 bytes of columns ``(l % 2) · vec ..``: one instruction of
  the warp reads 16 rows × 32 contiguous bytes. V-first (``[V, K]``): lane ``r = l % 16`` holds K rows ``4r ..`` and
  ``64 + 4r ..`` (fp32) or ``8r ..`` (bf16), and columns ``(l // 16) · warp_cols / 2 ..``: one instruction reads 256
  contiguous bytes of each of two columns. Each element is read once and written once per call (per token with
  ``[N, W]`` indices, whose every token's state is an output).
* **Bytes per step** (T = 1, fp32 pool, HV = 32): ``N · HV · 2 · 64 KB`` of state plus ``≈ 1.3 KB`` of inputs and
  output per (sequence, head): N = 128 moves 537 MB, a floor of 125 us at 4.3 TB/s (bf16 pool: 268 MB, 62 us).
  Little's law at 4.3 TB/s and ≈ 1 us of loaded DRAM latency wants ≈ 33 KB in flight per SM; a CTA issues all its
  16 KB (fp32) of state loads at once, and an SM holds 5 such CTAs at 96 registers per thread (bf16 pool: 8 CTAs of
  8 KB at 128 registers; :data:`MIN_BLOCKS_PER_SM`), so the loads of some CTAs overlap the math and stores of
  others.
* **Small N**: 4 CTAs per head fills the machine early: N = 1, HV = 32 is 128 CTAs for 132 SMs (bf16 too: its CTAs
  are 2 warps). The critical path is the index load, then the state loads (the token's q/k/v/g/β loads are issued
  before the state's, to overlap them), one all-reduce, and the stores. Later tokens' inputs are loaded one token
  ahead.
* Nothing is allocated, nothing is read on the host: every index is read on the device, so a call is
  CUDA-graph-capturable. A start slot outside ``[0, P)`` (negative: padding), a ``num_accepted_tokens[n]`` outside
  ``[1, W]`` or ``W = 0`` make a padding row (nothing read or written, zero outputs); a per-token slot outside
  ``[0, P)`` or a token ``t >= W`` is a state not written. ``cu_seqlens`` values are clamped into ``[0, T]`` (so a
  bad one cannot read past the inputs either).

:func:`kda_decode_cutedsl` is the host wrapper.
"""

import dataclasses
import functools

from ..compile_cache import TensorSpec, bound_launch, fake_call_arguments, launch, missing_cutedsl
from .gate import GATE_FORMS, activate_beta, activate_gate
from .intra import L2NORM_EPS, InKernelGate

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, const_expr
except ImportError as exc:
    raise missing_cutedsl(exc) from exc

__all__ = ["KdaDecode", "KdaDecodeConfig", "kda_decode_cutedsl"]

_DTYPES = {"float32": Float32, "bfloat16": BFloat16}
BLOCK_V = 32  # value columns per CTA: 4 CTAs per head (see the module docstring)
# Register budget (min CTAs per SM, hence registers per thread): the state bytes resident per SM must cover what
# 4.3 TB/s needs in flight (≈ 33-40 KB per SM at ≈ 1 us of loaded latency), with margin for the CTAs that are in
# their math or store phase. Unconstrained, ptxas takes ≈ 102 (fp32 pool, 128 threads) and ≈ 134 (bf16 pool, 64
# threads) registers: 4 fp32 CTAs (64 KB of state) or 7 bf16 CTAs (57 KB) per SM. Capping at 96 registers (fp32: 5
# CTAs, 80 KB, a handful of spilled values outside the token math) and 128 (bf16: 8 CTAs, 64 KB, no spills) keeps
# each phase overlapped; 80 registers (6 fp32 CTAs) spilled inside the token math.
MIN_BLOCKS_PER_SM = {"float32": 5, "bfloat16": 8}
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
        return True, ""

    def __init__(self, config: KdaDecodeConfig):
        ok, reason = self.can_implement(config)
        if not ok:
            raise ValueError(f"KdaDecode cannot implement {config}: {reason}")
        self.config = config
        state_bytes = 4 if config.state_dtype == "float32" else 2
        self.vec = 16 // state_bytes  # state elements per 16-byte access
        self.warp_cols = 32 // state_bytes  # a warp's value columns: 32 bytes of a K-first row (one sector)
        self.cols = self.warp_cols // 2  # value columns per lane
        self.num_warps = BLOCK_V // self.warp_cols  # 4 (fp32 pool) or 2 (bf16 pool)
        self.num_threads = 32 * self.num_warps
        self.v_blocks = config.head_dim // BLOCK_V
        self.min_blocks_per_sm = MIN_BLOCKS_PER_SM[config.state_dtype]
        # lanes sharing a lane's columns (the reduction over K): the other 16 of its column group
        self.reduce_masks = (1, 2, 4, 8) if config.state_v_first else (2, 4, 8, 16)

    def argument_specs(self) -> tuple[TensorSpec | None, ...]:
        """Layout promises of the twelve tensor arguments of ``__call__``, in order (None: argument absent)."""
        c, gate = self.config, self.config.gate
        index = TensorSpec(Int32, 1)
        return (
            TensorSpec(BFloat16, 4, 4),  # q [B, T, H, K]: 4-element (8-byte) row pieces
            TensorSpec(BFloat16, 4, 4),  # k [B, T, H, K]
            TensorSpec(BFloat16, 4, 8),  # v [B, T, HV, V]
            TensorSpec(_DTYPES[gate.g_dtype], 4, 4),  # g [B, T, HV, K]
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
                 min_blocks_per_mp=self.min_blocks_per_sm, preferred_smem_carveout=0)

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
        # this lane's K-row group r and column group (16 lanes each), its first value column and K rows
        if const_expr(c.state_v_first):
            r = lane % 16
            col0 = vb * BLOCK_V + warp_idx * self.warp_cols + (lane // 16) * VC
            if const_expr(self.vec == 4):  # fp32: rows 4r.. and 64 + 4r.. (each instruction: 256 B per column)
                bases = (4 * r, 64 + 4 * r)
            else:  # bf16: rows 8r .. 8r + 7, one 16-byte vector
                bases = (8 * r, 8 * r + 4)
        else:
            r = lane // 2
            col0 = vb * BLOCK_V + warp_idx * self.warp_cols + (lane % 2) * VC
            bases = (8 * r, 8 * r + 4)
        stores_o = r == 0  # one lane per column group writes o

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
                                  b, bos, length, n, h, hv, slot, col0, bases, stores_o)
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
                     n: Int32, h: Int32, hv: Int32, slot: Int32, col0: Int32, bases: tuple, stores_o):
        """The tokens ``bos .. bos + length - 1`` (``length >= 1``) of one (sequence, head, V block) from pool slot
        ``slot``. Token 0 is peeled so that its inputs are loaded before the state (the two latencies overlap);
        a later token's inputs are loaded at the top of its iteration (a register prefetch of the next token would
        cost ≈ 19 registers across the whole loop, half the occupancy the bandwidth needs at T = 1)."""
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
        self.load_token(mQ, mK, mV, mG, mBeta, frags, b, bos, h, hv, col0, bases)

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
                        stores_o)
        for t in cutlass.range(1, length, unroll=1):
            self.load_token(mQ, mK, mV, mG, mBeta, frags, b, bos + t, h, hv, col0, bases)
            self.token_step(mState, mIdx, mO, frags, rS, rRaw, s_atom, consts, b, bos + t, t, n, hv, col0, bases,
                            stores_o)

        if const_expr(not c.per_token_slots):  # back to the start slot
            self.store_state(head, rS, rRaw, s_atom, col0, bases)

    @cute.jit
    def token_step(self, mState: cute.Tensor, mIdx: cute.Tensor, mO: cute.Tensor, frags: tuple, rS: cute.Tensor,
                   rRaw: cute.Tensor, s_atom, consts: tuple, b: Int32, tok: Int32, t: Int32, n: Int32, hv: Int32,
                   col0: Int32, bases: tuple, stores_o):
        """One token (its inputs in ``frags``) applied to the lane's fp32 state ``rS``; writes o (and, with per-token
        slots, the state after the token)."""
        c, gate = self.config, self.config.gate
        VC, VEC = self.cols, self.vec
        rQ, rK, rG, rV, rB = frags
        a_scale, rBias, scale, lower_bound = consts
        step_slot = Int32(-1)
        if const_expr(c.per_token_slots):  # the state after this token goes to state_indices[n, t] (if in the pool)
            if t < mIdx.shape[1]:
                step_slot = mIdx[n, t]

        q = rQ.load().to(Float32)
        k = rK.load().to(Float32)
        if const_expr(c.l2norm):  # fp32 sums of squares over the 16 lanes of the column group; bf16 result
            sums_sq = self.lane_sum([(q * q).reduce(cute.ReductionOp.ADD, Float32(0.0), 0),
                                     (k * k).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)])
            q = (q * cute.math.rsqrt(sums_sq[0] + L2NORM_EPS)).to(BFloat16).to(Float32)
            k = (k * cute.math.rsqrt(sums_sq[1] + L2NORM_EPS)).to(BFloat16).to(Float32)
        rQf = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
        rKf = cute.make_rmem_tensor(cute.make_layout((4, 2)), Float32)
        rQf.store(q)
        rKf.store(k)
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

        # kᵀS and qᵀS of the decayed state: the lane's rows, then the 16 lanes of its column group
        part = [Float32(0.0)] * (2 * VC)
        for p in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(VEC):
                i, j = self.element(e, p)
                part[j] = part[j] + rKf[i % 4, i // 4] * rS[e, p]
                part[VC + j] = part[VC + j] + rQf[i % 4, i // 4] * rS[e, p]
        sums = self.lane_sum(part)

        # v' = β (v - kᵀS);  S += k v'ᵀ;  o = scale (qᵀS + (q·k) v'), the read of the updated state
        vnew = [beta * (rV[j].to(Float32) - sums[j]) for j in range(VC)]
        for p in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(VEC):
                i, j = self.element(e, p)
                rS[e, p] = rS[e, p] + rKf[i % 4, i // 4] * vnew[j]
        rO = cute.make_rmem_tensor(cute.make_layout(VC), BFloat16)
        for j in cutlass.range_constexpr(VC):
            rO[j] = (scale * (sums[VC + j] + qk * vnew[j])).to(BFloat16)
        if stores_o:
            o_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * VC)
            cute.copy(o_atom, rO, cute.local_tile(mO[b, tok, hv, None], (VC,), (col0 // VC,)))

        if const_expr(c.per_token_slots):
            if cutlass.min(step_slot, mState.shape[0] - 1 - step_slot) >= 0:
                self.store_state(self.head_state(mState, step_slot, hv), rS, rRaw, s_atom, col0, bases)

    @cute.jit
    def load_token(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                   frags: tuple, b: Int32, tok: Int32, h: Int32, hv: Int32, col0: Int32, bases: tuple):
        """Issue the loads of token ``tok``'s q, k, g (the lane's 8 K rows), v (its columns) and β into ``frags``."""
        qk_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=64)
        g_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mG.element_type,
                                     num_bits_per_copy=4 * mG.element_type.width)
        v_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=16 * self.cols)
        rQ, rK, rG, rV, rB = frags
        for p in cutlass.range_constexpr(2):
            piece = (bases[p] // 4,)
            cute.copy(qk_atom, cute.local_tile(mQ[b, tok, h, None], (4,), piece), rQ[None, p])
            cute.copy(qk_atom, cute.local_tile(mK[b, tok, h, None], (4,), piece), rK[None, p])
            cute.copy(g_atom, cute.local_tile(mG[b, tok, hv, None], (4,), piece), rG[None, p])
        cute.copy(v_atom, cute.local_tile(mV[b, tok, hv, None], (self.cols,), (col0 // self.cols,)), rV)
        rB[0] = mBeta[b, tok, hv]

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

    def lane_sum(self, values: list) -> list:
        """Each value summed over the 16 lanes sharing this lane's columns (``shfl.bfly`` all-reduce: every lane
        gets the same bits, as fp32 addition is commutative)."""
        out = list(values)
        for mask in self.reduce_masks:
            out = [x + cute.arch.shuffle_sync_bfly(x, offset=mask) for x in out]
        return out


@functools.lru_cache(maxsize=256)
def _plan(H: int, HV: int, gate: InKernelGate, flags: tuple) -> tuple:
    """The config and argument specs of one call signature (cached: no work per call)."""
    l2norm, state_dtype, v_first, varlen, per_token, accepted = flags
    config = KdaDecodeConfig(num_heads=H, num_v_heads=HV, gate=gate, l2norm=l2norm, state_dtype=state_dtype,
                             state_v_first=v_first, varlen=varlen, per_token_slots=per_token, num_accepted=accepted)
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
    flags = (bool(use_qk_l2norm_in_kernel), _DTYPE_NAMES[str(state.dtype)], bool(state_v_first),
             cu_seqlens is not None, state_indices.dim() == 2, num_accepted_tokens is not None)
    config, specs = _plan(H, HV, gate, flags)
    scalars = (float(K**-0.5 if scale is None else scale), float(lower_bound) if form == "safe" else 0.0)
    return config, specs, A_log, dt_bias, scalars


def plan_kda_decode_launch(q, v, g, beta, *, state, state_indices, scale: float | None = None, A_log=None,
                           dt_bias=None, lower_bound: float | None = None, use_qk_l2norm_in_kernel: bool = False,
                           use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False, cu_seqlens=None,
                           num_accepted_tokens=None):
    """:func:`kda_decode_cutedsl` for a call plan: ``run(q, k, v, g, beta, A_log, dt_bias, state, state_indices,
    num_accepted_tokens, cu_seqlens, out) -> out`` runs every later call whose tensors have the shapes, strides and
    dtypes of these (and the same flags and scalars: the plan's signature) with the kernel looked up once
    (:func:`~cula_runtime.compile_cache.bound_launch`). ``out`` is required (``[B, T, HV, 128]`` bf16, contiguous);
    ``dt_bias`` may be ``[HV * K]`` or ``[HV, K]``; ``A_log`` and ``dt_bias`` fp32. Compiles the kernel now if
    no launch did yet. Holds no tensor of this call."""
    T, H, K = q.shape[1], q.shape[2], q.shape[3]
    HV = v.shape[2]
    if state_indices.shape[0] == 0 or T == 0:
        return lambda q, k, v, g, beta, A_log, dt_bias, state, idx, accepted, cu, out: out
    config, specs, A_log_used, dt_used, scalars = _launch_args(
        H, HV, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens,
        num_accepted_tokens)
    run = bound_launch(KdaDecode, config, specs, _OUTPUTS, q.device)
    with_A_log, with_dt_bias = A_log_used is not None, dt_used is not None

    def launch_planned(q, k, v, g, beta, A_log, dt_bias, state, idx, accepted, cu, out):
        dt = dt_bias.view(HV, K) if with_dt_bias else None
        run((q, k, v, g, beta, A_log if with_A_log else None, dt, state, idx, accepted, cu, out), scalars)
        return out

    return launch_planned
