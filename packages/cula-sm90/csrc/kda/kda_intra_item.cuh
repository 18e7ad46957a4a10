// Kernel 1 of the split SM90 KDA prefill ("intra"): per (chunk, value head), everything that does not depend
// on the recurrent state (KDA_SPEC §3.1-3.4, safe gate only):
//   q, k  (optionally L2-normalised, rounded to bf16), beta (optionally sigmoid), gate (optionally in-kernel safe
//   form), Γ = chunk-local inclusive cumsum (fp32), g_last = Γ_last / ln2,
//   Aqk = scale · Σ q_i k_j e^{Γi-Γj} (j <= i, bf16), Akk = β_i Σ k_i k_j e^{Γi-Γj} (j < i, fp32, kept on chip),
//   Tinv = (I + Akk)^-1 (fp32, rounded once to bf16), w = Tinv·bf16(β k e^Γ), u = Tinv·bf16(β v),
//   kg = bf16(k e^{Γlast-Γ}), qg = bf16(q e^Γ).
//
// One CTA of 256 threads (8 warps) per (chunk of chunk_indices, value head), in one of two forms ("tensor", and
// "bands", which computes only the 16-row bands holding valid rows; the shim's "auto" picks one per call). 103.25 KiB
// of dynamic shared memory per CTA, so two fit on an SM. Phases (every arrow is a __syncthreads):
//   0/1  cp.async q, k, v (zero-filled rows >= L) | g -> registers, gate, segmented cumsum -> Γ2 (log2 units, smem)
//   1b   per-column anchor factors 2^{Γ2[n_J]}, 2^{Γ2[L-1]-Γ2[n_J]}, 2^{Γ2[n_I]-Γ2[n_J]} (n_J = 16 J)
//   2a   elementwise, warp = full rows: l2norm, a = 2^{Γ2-Γ2[n]}, b = 2^{Γ2[n]-Γ2}; qg, kg -> global;
//        q·a, k·a, k·b, β·v -> smem (bf16, in place); β·k·e^Γ and k·b (rows < 48) kept in registers
//   2b   off-diagonal column operands k·b·2^{Γ2[n_I]-Γ2[n_J]} -> smem (over Γ2)
//   3    mma.sync: 10 lower 16x16 blocks of Aqk and Akk; Aqk staged bf16 -> global; Akk's diagonal blocks -> fp32
//        smem, the blocks below the diagonal as hi/lo bf16 tiles
//   4    inverse: fp32 column substitution on the 4 diagonal blocks, then 2 levels of recursive doubling, their
//        products as bf16x3 MMAs
//   5    mma.sync: w, u = Tinv · (RHS), staged bf16 -> global
//
// Sub-chunk anchoring (KDA_SPEC §3.7): Γ_i - Γ_j = (Γ_i - Γ_n) + (Γ_n - Γ_j) with n the first row of the *query*
// sub-chunk I. Row factor a_i = e^{Γi-Γn} in [e^-75, 1]; column factor e^{Γn-Γj}:
//   off-diagonal (I > J): b_j · e^{Γ_{n_I}-Γ_{n_J}} = e^{Γ_{n_I}-Γ_j} <= 1 (any gate is safe);
//   diagonal (I = J):     b_j = e^{Γ_{n_J}-Γ_j} in [1, e^75] (needs |g| <= 5: safe gate).
// The diagonal uses the unshifted first-row anchor: all factors are normal fp32/bf16 numbers for g in [-5, 0]
// (e^-75 ≈ 2.7e-33 > 1.2e-38, e^75 ≈ 3.7e32 < 3.4e38). FLA's "first row - 15 nats" anchor differs only by a
// constant factor e^{±15} on the two operands, i.e. only in bf16 rounding.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/ptx.cuh"
#include "kda/kda_params.h"
#include "kda/launch_once.cuh"

namespace cula::sm90 {
namespace {

using namespace ptx;

constexpr int kThreads = 256;
constexpr int kD = 128;  // K = V
constexpr float kRcpLn2 = 1.4426950216293335f;  // fp32(1 / ln 2), FLA's RCP_LN2
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// softplus(x) = max(x, 0) + ln 2 * log2(1 + e), e = e^-|x| in [0, 1]: one MUFU.EX2 and one MUFU.LG2, finite for
// every x (the library's log1pf(expf(x)) is a long instruction sequence per element). Where e < 2^-5, log2(1 + e)
// is its series to e^4 (relative error < 2^-22), which keeps tiny gates (x << 0) accurate where 1 + e rounds; the
// CuTeDSL intra kernel's softplus is the same arithmetic (cute/kda/gate.py, activate_gate with mufu_softplus).
__device__ __forceinline__ float softplus_mufu(float x) {
  const float e = ex2_ftz(-fabsf(x) * kLog2e);
  const float series = e * (kLog2e + e * (-kLog2e / 2.f + e * (kLog2e / 3.f - e * (kLog2e / 4.f))));
  const float log_term = e < 0.03125f ? series : lg2_approx(1.f + e);
  return fmaxf(x, 0.f) + log_term * kLn2;
}

// ---- shared memory map (bytes) ----
// Phase 0-3 tiles (bf16 [64][128], 256-byte rows, swz256):
constexpr uint32_t kOffQ = 0;        // q -> q·a (Aqk row operand)
constexpr uint32_t kOffK = 16384;    // k -> k·a (Akk row operand)
constexpr uint32_t kOffV = 32768;    // v -> bf16(β v) (u right-hand side)
constexpr uint32_t kOffX = 49152;    // [phase 1: cumsum totals] -> k·b (diagonal column operand) -> bf16(β k e^Γ)
constexpr uint32_t kOffG = 65536;    // fp32 Γ2 [64][128] -> 6 off-diagonal column tiles + Aqk staging -> w/u staging
constexpr uint32_t kOffF = 98304;    // fp32 [4][128]  2^{Γ2[16J]}
constexpr uint32_t kOffE = 100352;   // fp32 [4][128]  2^{Γ2[L-1] - Γ2[16J]}
constexpr uint32_t kOffD = 102400;   // fp32 [6][128]  2^{Γ2[16I] - Γ2[16J]}, I > J (pair_index order)
constexpr uint32_t kOffBeta = 105472;  // fp32 [64]
constexpr uint32_t kSmemBytes = 105728;
// The "unbounded" form only (kTunedUnbounded): its diagonal blocks of Aqk and Akk (fp32 [2][4][16][16], phase 2d's
// results and Aqk's diagonal from 2a, read by phase 3's epilogue), after the others: 111.25 KiB per CTA, two still
// fit on an SM (2 x (113920 + 1024 reserved) <= 228 KiB).
constexpr uint32_t kOffDiag = kSmemBytes;
constexpr uint32_t kSmemBytesUnbounded = kOffDiag + 8192;
// Aliases, valid after phase 3:
constexpr uint32_t kOffA = 0;        // fp32 [64][kAStride]: Akk's diagonal blocks (phase 4a's input)
constexpr int kAStride = 68;
constexpr uint32_t kOffT = 20480;    // bf16 [64][64] (swz128): Tinv, the A operand of phase 5
constexpr uint32_t kOffKoff = kOffG;           // bf16 6 x [16][128] (swz256)
constexpr uint32_t kOffAqk = kOffG + 24576;    // bf16 [64][64] (swz128)
constexpr uint32_t kOffTot = kOffX;            // fp32 [8][128]: cumsum segment totals
static_assert(kOffT + 8192 <= kOffV, "Tinv staging overlaps the u right-hand side");
static_assert(kOffAqk + 8192 == kOffF, "Aqk staging must end where Γ2 ends");

// Index of the off-diagonal block (I, J), I > J, in the 6-tile arrays:
// (1,0) 0, (2,0) 1, (3,0) 2, (2,1) 3, (3,1) 4, (3,2) 5.
__host__ __device__ constexpr int pair_index(int I, int J) { return J == 0 ? I - 1 : (J == 1 ? I + 1 : 5); }

// Byte offset of the 4 bf16 at (row r, columns 4*lane .. 4*lane+3) of a swz256 tile.
__device__ __forceinline__ uint32_t quad_off(int r, int lane) {
  return swz256(r, lane >> 1) + ((lane & 1) << 3);
}

// 1 / sqrt(sum + 1e-6) of the 8 rows r = warp + 8 pp (pp = 0..7) of a tile, from each lane's partial sum part[pp]
// over its 4 columns: a transposed reduction (lane bits 4, 3, 2 split the rows between lane halves, quarters and
// eighths: 4 + 2 + 1 shuffles, then 2 for the last 4 lanes' columns), one rsqrt per lane, and 8 broadcasts, instead
// of a 5-shuffle butterfly per row (40 shuffles and 8 rsqrt).
// The sum over the warp of row pp = lane >> 2's partial sums part[pp] (the transposed reduction of row_rsqrt8), in
// every lane: lanes 4 pp .. 4 pp + 3 hold row pp's.
__device__ __forceinline__ float row_sum8(const float (&part)[8], int lane) {
  const bool b4 = (lane & 16) != 0, b3 = (lane & 8) != 0, b2 = (lane & 4) != 0;
  float t4[4], t2[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // keep rows 4*b4 + i
    const float keep = b4 ? part[i + 4] : part[i];
    t4[i] = keep + __shfl_xor_sync(0xffffffffu, b4 ? part[i] : part[i + 4], 16);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // keep rows 4*b4 + 2*b3 + i
    const float keep = b3 ? t4[i + 2] : t4[i];
    t2[i] = keep + __shfl_xor_sync(0xffffffffu, b3 ? t4[i] : t4[i + 2], 8);
  }
  float t1 = (b2 ? t2[1] : t2[0]) + __shfl_xor_sync(0xffffffffu, b2 ? t2[0] : t2[1], 4);  // row 4*b4 + 2*b3 + b2
  t1 += __shfl_xor_sync(0xffffffffu, t1, 2);
  t1 += __shfl_xor_sync(0xffffffffu, t1, 1);
  return t1;
}
__device__ __forceinline__ void row_rsqrt8(const float (&part)[8], int lane, float (&r)[8]) {
  const float mine = rsqrtf(row_sum8(part, lane) + 1e-6f);  // x / sqrt(sum x^2 + 1e-6), eps inside the root
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) r[pp] = __shfl_sync(0xffffffffu, mine, ((pp >> 2) << 4) | (((pp >> 1) & 1) << 3) | ((pp & 1) << 2));
}

// ---- Phase 4b: the off-diagonal blocks of Tinv by recursive doubling, after 4a left the diagonal blocks' inverses
// T_II (zeros above their diagonals) in sT and its lo tile, in 4 barrier stages:
//   level 1 (pairs (1,0) and (3,2)):  X = A_BA T_AA;  T_BA = -T_BB X
//   level 2 (halves lo = {0,1}, hi = {2,3}):  Y = A_hl T_lo;  T_hl = -T_hi Y
// with T_lo, T_hi the 32 x 32 lower triangular inverses of level 1: the products of a block forward substitution,
// grouped so that all 8 warps work in every stage, each as bf16x3 tensor-core MMAs. Every fp32 operand is kept as two
// bf16 tiles x = hi + lo (hi = bf16(x), lo = bf16(x - hi)), and a k16 step adds lo·hi' + hi·lo' + hi·hi' with fp32
// accumulation: operands good to ~2^-17 and the dropped lo·lo' ~2^-18 of the product, far below Tinv's one bf16
// rounding (2^-9). Tiles (bf16 [rows][64], swz128, in the free Γ2 region; Tinv's hi part is sT itself):
constexpr uint32_t kOffAkkHi = kOffG;          // Akk's blocks below the diagonal (written after (F))
constexpr uint32_t kOffAkkLo = kOffG + 8192;
constexpr uint32_t kOffTLo = kOffG + 16384;    // Tinv's lo part
constexpr uint32_t kOffXYHi = kOffG + 24576;   // [32][64]: X of level 1, then Y of level 2 (over the Aqk staging,
constexpr uint32_t kOffXYLo = kOffG + 28672;   // consumed before (G))
static_assert(kOffXYLo + 4096 == kOffF, "the split tiles must end where Γ2 ends");

// The bf16x3 parts of two fp32 values (row, columns col, col + 1) into a hi and a lo swz128 tile.
__device__ __forceinline__ void store_split_pair(uint8_t* smem, uint32_t off_hi, uint32_t off_lo, int row, int col,
                                                 float v0, float v1) {
  const uint32_t hi = pack_bf16x2(v0, v1);
  const uint32_t lo = pack_bf16x2(v0 - bf16_lo(hi), v1 - bf16_hi(hi));
  const uint32_t o = swz128(row, col >> 3) + (col & 7) * 2;
  *reinterpret_cast<uint32_t*>(smem + off_hi + o) = hi;
  *reinterpret_cast<uint32_t*>(smem + off_lo + o) = lo;
}

// D += A[ar .. ar+15][ac .. ac+15] · B[br .. br+15][bc .. bc+7] in 3 bf16 MMAs, A and B each a hi/lo pair of swz128
// tiles (A row-major [m][k], B row-major [k][n]; byte offsets from the shared base sbase).
__device__ __forceinline__ void mma_split_step(float (&d)[4], uint32_t sbase, uint32_t a_hi, uint32_t a_lo, int ar,
                                               int ac, uint32_t b_hi, uint32_t b_lo, int br, int bc, int lane) {
  const int lrow = (lane & 7) + (((lane >> 3) & 1) << 3);
  const uint32_t aoff = swz128(ar + lrow, (ac >> 3) + (lane >> 4));
  const uint32_t boff = swz128(br + lrow, bc >> 3);
  uint32_t ah[4], al[4], bh[2], bl[2];
  ldsm_x4(ah, sbase + a_hi + aoff);
  ldsm_x4(al, sbase + a_lo + aoff);
  ldsm_x2_trans(bh, sbase + b_hi + boff);
  ldsm_x2_trans(bl, sbase + b_lo + boff);
  mma_bf16_16816(d, al, bh[0], bh[1]);
  mma_bf16_16816(d, ah, bl[0], bl[1]);
  mma_bf16_16816(d, ah, bh[0], bh[1]);
}

// The doubling's 4 barrier stages, each product a grid of m16n8 tiles over the warps (g = lane >> 2,
// t = lane & 3 index the accumulator):
//   level 1 (warps 0-3 = pair x 8-column half):  X = A_BA T_AA;  T_BA = -T_BB X            (16 x 16)
//   level 2 (warps 0-7 = 16-row half x 8-column quarter):  Y = A_hl T_lo;  T_hl = -T_hi Y   (32 x 32)
// k16 steps that would read a block of sT above the diagonal (never written) are skipped: those blocks of Tinv are 0.
// Only the row blocks below `bands` are computed (the others feed no computed row).
template <bool kBands>
__device__ __forceinline__ void inverse_by_doubling_tensor(uint8_t* smem, int warp, int lane, int bands) {
  const uint32_t sbase = smem_addr(smem);
  const int g = lane >> 2, t = lane & 3;
  const int pr = (warp >> 1) & 1, n1 = 8 * (warp & 1);  // level 1: pair (A, B) = (2 pr, 2 pr + 1), columns n1 ..
  const int A = 2 * pr, B = A + 1;
  if (warp < 4 && (!kBands || B < bands)) {
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    mma_split_step(x, sbase, kOffAkkHi, kOffAkkLo, 16 * B, 16 * A, kOffT, kOffTLo, 16 * A, 16 * A + n1, lane);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      store_split_pair(smem, kOffXYHi, kOffXYLo, 16 * pr + g + 8 * hh, n1 + 2 * t, x[2 * hh], x[2 * hh + 1]);
    }
  }
  __syncthreads();
  if (warp < 4 && (!kBands || B < bands)) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma_split_step(d, sbase, kOffT, kOffTLo, 16 * B, 16 * B, kOffXYHi, kOffXYLo, 16 * pr, n1, lane);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      store_split_pair(smem, kOffT, kOffTLo, 16 * B + g + 8 * hh, 16 * A + n1 + 2 * t, -d[2 * hh], -d[2 * hh + 1]);
    }
  }
  __syncthreads();
  const int mt = warp >> 2, n2 = 8 * (warp & 3);  // level 2: rows 16 mt .., columns n2 .. of the 32 x 32 products
  if (!kBands || 2 + mt < bands) {
    float y[4] = {0.f, 0.f, 0.f, 0.f};
    if (n2 < 16) mma_split_step(y, sbase, kOffAkkHi, kOffAkkLo, 32 + 16 * mt, 0, kOffT, kOffTLo, 0, n2, lane);
    mma_split_step(y, sbase, kOffAkkHi, kOffAkkLo, 32 + 16 * mt, 16, kOffT, kOffTLo, 16, n2, lane);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      store_split_pair(smem, kOffXYHi, kOffXYLo, 16 * mt + g + 8 * hh, n2 + 2 * t, y[2 * hh], y[2 * hh + 1]);
    }
  }
  __syncthreads();
  if (!kBands || 2 + mt < bands) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma_split_step(d, sbase, kOffT, kOffTLo, 32 + 16 * mt, 32, kOffXYHi, kOffXYLo, 0, n2, lane);
    if (mt == 1) mma_split_step(d, sbase, kOffT, kOffTLo, 48, 48, kOffXYHi, kOffXYLo, 16, n2, lane);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      store_split_pair(smem, kOffT, kOffTLo, 32 + 16 * mt + g + 8 * hh, n2 + 2 * t, -d[2 * hh], -d[2 * hh + 1]);
    }
  }
  __syncthreads();
}

// kTuned: the kernel's form as a bit set (the codes the shim's CULA_SM90_INTRA_TUNED names map to). Each bit of
// kTunedTensor ("tensor", code 11) once named a tuning of the first verified kernel (the forms 0-3 without all three
// were retired in issue 25): the L2 norms' row sums by one transposed reduction per tensor and warp (kTunedNorm), the
// off-diagonal inverse by recursive doubling (kTunedInverse), its products as bf16x3 tensor-core MMAs
// (kTunedTensorInverse). Every built form has all three; kTunedBands ("bands", 15) and the timing-only kAblate* bits
// (below) go on top.
constexpr int kTunedNorm = 1;
constexpr int kTunedInverse = 2;
constexpr int kTunedTensorInverse = 8;
constexpr int kTunedTensor = kTunedNorm | kTunedInverse | kTunedTensorInverse;
// kTunedBands: only the 16-row bands holding valid rows are loaded and computed, so a sequence's last, partial chunk
// does a quarter to three quarters of the work. Each valid row's arithmetic is unchanged (the bands after the last
// valid row feed no valid row: every product is lower triangular), so the same bits. Also b = 2^-(Γ2 - Γ2n) from a's
// difference (the negation folds into the exp; IEEE subtraction is sign-symmetric: the same bits). On the H200 the
// band tests cost full chunks 1.6-2%; a second copy of the item code for full chunks cost 1-12% more (twice the code
// per kernel); tests around the products only (not phases 0-2a) saved half as much on partial chunks and still cost
// full ones 0.8% (benchmarks/results/kda_profile_h200.md, twelfth session). So the shim runs it per call only where
// partial chunks leave many bands idle (its default "auto"; "bands" forces it).
constexpr int kTunedBands = 4;
// Whether 16-row band `band` is computed: always, except past the last valid row's band with kTunedBands.
template <int kTuned>
__device__ __forceinline__ bool band_live(int band, int bands) {
  if constexpr ((kTuned & kTunedBands) != 0) {
    return band < bands;
  } else {
    return true;
  }
}
// kTunedUnbounded ("unbounded", on top of kTunedTensor): exact for any log-gate <= 0 (KDA_SPEC §3.7), where the
// sub-chunk-anchored factors of the other forms overflow. It changes three things:
//   * the diagonal 16x16 blocks of Aqk and Akk are phase 2d's "levels" products (below), written to the kOffDiag
//     scratch, and Aqk's diagonal entries the fp32 dots q_i·k_i (2a); phase 3 computes only the 6 blocks below;
//   * the column factor b = 2^{Γ2[16J+15] - Γ2} (<= 1: the key sub-chunk's last row as anchor) in place of
//     2^{Γ2[16J] - Γ2} (>= 1), with the tables E = 2^{Γ2[L-1] - Γ2[16J+15]} and D = 2^{Γ2[16I] - Γ2[16J+15]} (both
//     <= 1): kg and the off-diagonal column operands are the same products of factors <= 1;
//   * with the L2 norm in the kernel, q and k are normalised in place before 2d and rounded to fp16 there (not bf16:
//     2d and 2a read them so, every later use included), and every score product runs in fp16 (2d's, and phase 3's
//     below the diagonal: its operands q·a, k·a and k·b·D all <= 1 in magnitude); the in-kernel gate may be the
//     softplus form (KdaIntraParams::gate_softplus); the Γ2 tile is swizzled (gam_col).
// Rows, kg, qg and the right-hand sides were already safe for any gate. 8 KiB more shared memory and two barriers.
constexpr int kTunedUnbounded = 4096;
template <int kTuned>
__device__ __forceinline__ constexpr bool unbounded_form() {
  return (kTuned & kTunedUnbounded) != 0;
}
// The "unbounded" form's Γ2 tile is swizzled: channel c of row r lives at column c ^ 16 gam_key(r) (the two 64-byte
// halves of each 128-byte bank row swapped in rows with key 1). Phase 2d's lanes g = 2q and 2q + 1 (one quarter-warp
// of a 16-byte load) read two different rows at the same channels; every pair of rows its slot tables put there
// differs in bit 0 or bit 1 (not both), hence in the key, so the two land in different banks (a quarter-warp load of
// two rows is one wavefront, not two). The rows the other phases read whole are unaffected (their chunks permuted
// within a row); rows 16J, 16J + 15 (and 8, 4, 12: 2d's anchors) have key 0.
// Whether the "unbounded" form's products below the diagonal run in fp16 (with the L2 norm in the kernel: phase 2a's
// row operands, phase 2b's column operands and phase 3's MMAs), as a type.
template <bool kHalf>
struct HalfOps {
  static constexpr bool value = kHalf;
};
__device__ __forceinline__ int gam_key(int row) { return (row ^ (row >> 1)) & 1; }
template <int kTuned>
__device__ __forceinline__ int gam_col(int row, int c) {
  if constexpr (unbounded_form<kTuned>()) {
    return c ^ (gam_key(row) << 4);
  } else {
    return c;
  }
}

// ---- Phase 2d ("unbounded" only): the diagonal blocks by levels. In diagonal block I (local token indices 0..15) a
// pair i > j whose indices first differ in bit b ("level" b) is anchored at an m with j <= m <= i:
// q_i k_j 2^{Γi-Γj} = [q_i 2^{Γi-Γm}] [k_j 2^{Γm-Γj}], both factors <= 1, so nothing overflows. Levels 3-1 take for m
// i with the bits below b cleared (the first of the pair's upper half), level 0 takes j. At level b each token has
// one role, a row (bit b set) or a column, its factor against its group's anchor. Two levels share one 16x16 MMA
// product through "slots" (the A operand's rows, the B operand's columns): product P = 0 holds levels 3 and 2, P = 1
// levels 1 and 0; of its 256 outputs 96 (P = 0) or 24 (P = 1) are pairs, every strict pair of the block exactly once
// over the two. Lane (g = lane >> 2, t) holds A rows g ("R1") and g + 8 ("R2"), and column g of B's n-tiles 0 ("C1")
// and 1 ("C2"); the slots' local (token, anchor), with h = g >> 2 and pi = 2 (g & 3) + h:
//   P = 0:  R1 (4 + g + 4h, 4 + 8h) level 2        R2 (8 + pi, 8) level 3
//           C1 (pi, 8) level 3                      C2 (g + 4h, 4 + 8h) level 2
//   P = 1:  R1 (2g + 1, 2g) level 0                 R2 (4(g>>1) + 2 + (g&1), 4(g>>1) + 2) level 1
//           C1 (2g, itself) level 0: factor 1       C2 (4(g>>1) + (g&1), 4(g>>1) + 2) level 1
// (level 0's factor on its row: an unscaled B operand is the 8 bytes of one load, where an unscaled A operand would
// need moves); so R1 and C2 of P = 0 share their anchor, as do R2 and C1 (8), and R2 and C2 of P = 1. The pairs
// (diagonal_product's epilogue): P = 0: n-tile 0 rows 8..15 (level 3, all 64 outputs) and n-tile 1 rows 0..7 where
// t >> 1 == h (level 2); P = 1: the lanes with t == g >> 1, n-tile 0 output (g, g) (level 0) and n-tile 1 rows g + 8
// (level 1). The MMA's k index of a lane's four values {2t, 2t + 1, 2t + 8, 2t + 9} stands for the channels
// c0 .. c0 + 3 (c0 = 16 s + 4 t in k-step s; the same map on both operands), so each lane reads 4 consecutive
// channels: 8 bytes of a tile, 16 of Γ2 (gam_col's swizzle keeps those 16-byte loads free of bank conflicts).
// Two arithmetics, chosen per call: with the L2 norm in the kernel the q and k tiles hold the normalised values in
// fp16 (phase 2a's in-place pass writes them so), and each operand is the fp16 product of the tile value and the
// factor rounded to fp16 (mul.rn.f16x2; the MMAs fp16 with fp32 accumulation): |x| <= 1 and every factor <= 1, so
// nothing overflows, a rounding is at most 2^-11 relative (2^-25 absolute below fp16's normal range: far below the
// bf16 roundings downstream), and one packed multiply scales two channels. Without the norm the tiles hold the raw
// bf16 inputs (unbounded in magnitude): each operand is bf16(x * factor) in fp32, as in the other forms.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ float f16_lo(uint32_t w) {
  float f;
  asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %1;\ncvt.f32.f16 %0, l;\n}\n" : "=f"(f) : "r"(w));
  return f;
}
__device__ __forceinline__ float f16_hi(uint32_t w) {
  float f;
  asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %1;\ncvt.f32.f16 %0, h;\n}\n" : "=f"(f) : "r"(w));
  return f;
}
// D += A · B with fp16 operands (fragments as mma_bf16_16816's).
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// One slot's factors 2^{later - earlier} (<= 1: Γ2 never increases along a chunk) over the lane's 4 channels, from
// the Γ2 of the later and of the earlier token, kept in fp32 and (kHalf) as two packed fp16 pairs.
template <bool kHalf>
struct LevelFactor {
  float f[4];
  uint32_t h[2];
};
template <bool kHalf>
__device__ __forceinline__ LevelFactor<kHalf> level_factor(const float4& later, const float4& earlier) {
  LevelFactor<kHalf> r;
  r.f[0] = ex2_ftz(later.x - earlier.x);
  r.f[1] = ex2_ftz(later.y - earlier.y);
  r.f[2] = ex2_ftz(later.z - earlier.z);
  r.f[3] = ex2_ftz(later.w - earlier.w);
  if constexpr (kHalf) {
    r.h[0] = pack_f16x2(r.f[0], r.f[1]);
    r.h[1] = pack_f16x2(r.f[2], r.f[3]);
  }
  return r;
}
// A slot's operand registers (channels c0, c0 + 1) and (c0 + 2, c0 + 3): the tile's 4 values x times the factors.
template <bool kHalf>
__device__ __forceinline__ void level_scale(const uint2& x, const LevelFactor<kHalf>& fa, uint32_t& lo, uint32_t& hi) {
  if constexpr (kHalf) {
    lo = mul_f16x2(x.x, fa.h[0]);
    hi = mul_f16x2(x.y, fa.h[1]);
  } else {
    lo = pack_bf16x2(bf16_lo(x.x) * fa.f[0], bf16_hi(x.x) * fa.f[1]);
    hi = pack_bf16x2(bf16_lo(x.y) * fa.f[2], bf16_hi(x.y) * fa.f[3]);
  }
}
template <bool kHalf>
__device__ __forceinline__ void level_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kHalf) {
    mma_f16_16816(d, a, b0, b1);
  } else {
    mma_bf16_16816(d, a, b0, b1);
  }
}
// Byte offset, in a swz256 tile, of the lane's 4 values of row `row` in k-step 0; the k-step s ones are at
// offset ^ (32 s): with c0 = 16 s + 4 t the 16-byte chunk is (2 s + (t >> 1)) ^ (row & 7), whose bits 1-2 are
// s ^ ((row >> 1) & 3) and bit 0 is (t >> 1) ^ (row & 1), so only bits 5-7 of the offset depend on s.
__device__ __forceinline__ uint32_t level_tile_base(int row, int t) {
  return static_cast<uint32_t>(row * 256 + ((row & 6) << 4) + ((((t >> 1) ^ row) & 1) << 4) + ((t & 1) << 3));
}
// The lane's 4 Γ2 values of a row in k-step s (channels 16 s + 4 t .., at columns 16 (s ^ gam_key(row)) + 4 t ..):
// two pointers, so that every step's address is one of them plus a constant.
struct LevelGamRow {
  const float* even;  // (s even)
  const float* odd;
  __device__ __forceinline__ LevelGamRow(const float* sG, int row, int t, int key) {  // (key = gam_key(row))
    even = sG + row * kD + 4 * t + 16 * key;
    odd = sG + row * kD + 4 * t - 16 * key;
  }
  __device__ __forceinline__ float4 at(int s) const {
    return *reinterpret_cast<const float4*>(((s & 1) != 0 ? odd : even) + 16 * s);
  }
};
// Product P of diagonal block I (warp-uniform), over the q and k tiles (fp16 if kHalf, else bf16) and Γ2; writes its
// pairs' fp32 sums to the scratch: sDq[I][i][j] (Aqk, unscaled), sDk[I][i][j] (Akk, without β).
// P = 0 puts its level 3 slots in the order pi(g) = 2 (g & 3) + (g >> 2) (rows 8 + pi(g), columns pi(g)): each half
// warp then reads 4 rows of distinct (row & 6), which an 8-byte load of a swz256 tile takes without a bank conflict
// (the level 2 slots and P = 1's R2, C2 hold only 2 such classes: 2-way conflicts, whatever the order).
// P = 1 needs two factors per lane and channel, not three: its R2 factor is 1 for even g (token = anchor) and R1's
// for odd g (both 2^{Γ[2g+1] - Γ[2g]}).
template <bool kHalf, int P>
__device__ __forceinline__ void diagonal_product(uint8_t* smem, const float* sG, int I, int lane) {
  const int g = lane >> 2, t = lane & 3, h = g >> 2;
  const int pi = 2 * (g & 3) + h;
  // Local tokens: rows r1, r2, columns c1, c2; the anchor a of R1 and C2 (P = 0) or of R2 and C2 (P = 1).
  const int r1 = P == 0 ? 4 + g + 4 * h : 2 * g + 1;
  const int r2 = P == 0 ? 8 + pi : 4 * (g >> 1) + 2 + (g & 1);
  const int c1 = P == 0 ? pi : 2 * g;
  const int c2 = P == 0 ? g + 4 * h : 4 * (g >> 1) + (g & 1);
  const int a = P == 0 ? 4 + 8 * h : 4 * (g >> 1) + 2;
  const bool odd = (g & 1) != 0;
  const int n = 16 * I;
  const uint8_t* tq = smem + kOffQ;
  const uint8_t* tk = smem + kOffK;
  const uint32_t o_r1 = level_tile_base(n + r1, t), o_r2 = level_tile_base(n + r2, t);
  const uint32_t o_c1 = level_tile_base(n + c1, t), o_c2 = level_tile_base(n + c2, t);
  // The rows' Γ2 keys (n = 16 I has key 0): P = 0: gam_key(g) for r1 and c2, gam_key(pi) = h ^ (g & 1) for r2 and
  // c1; P = 1: 1 ^ (g & 1) for r1, g & 1 for c1 and c2.
  const int key_g = P == 0 ? gam_key(g) : 1 ^ (g & 1);
  const int key_pi = P == 0 ? h ^ (g & 1) : g & 1;
  const LevelGamRow g_r1(sG, n + r1, t, key_g);
  const LevelGamRow g_c1(sG, n + c1, t, key_pi);
  const LevelGamRow g_c2(sG, n + c2, t, P == 0 ? key_g : key_pi);
  // the anchors' keys: rows 4, 12 and 8 (P = 0) have 0, rows 4m + 2 (P = 1) 1
  const float* g_a = sG + (n + a) * kD + 4 * t;
  float accQ[2][4], accK[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) accQ[nt][e] = accK[nt][e] = 0.f;
  // (fully unrolled on the fp16 path, so that every Γ2 address is a register plus a constant; the bf16 path, taken
  // only without the norm in the kernel, by two steps: a third of the code)
#pragma unroll(kHalf ? 8 : 2)
  for (int s = 0; s < 8; ++s) {
    const uint32_t x = 32u * s;
    uint32_t aq[4], ak[4], b0[2], b1[2];
    const uint2 q1 = *reinterpret_cast<const uint2*>(tq + (o_r1 ^ x));
    const uint2 k1 = *reinterpret_cast<const uint2*>(tk + (o_r1 ^ x));
    const uint2 q2 = *reinterpret_cast<const uint2*>(tq + (o_r2 ^ x));
    const uint2 k2 = *reinterpret_cast<const uint2*>(tk + (o_r2 ^ x));
    const uint2 kc1 = *reinterpret_cast<const uint2*>(tk + (o_c1 ^ x));
    const uint2 kc2 = *reinterpret_cast<const uint2*>(tk + (o_c2 ^ x));
    const float4 G_r1 = g_r1.at(s);
    const float4 G_c1 = g_c1.at(s);
    const float4 G_c2 = g_c2.at(s);
    if constexpr (P == 0) {
      const float4 G_a = *reinterpret_cast<const float4*>(g_a + 16 * s);
      const float4 G_8 = *reinterpret_cast<const float4*>(sG + (n + 8) * kD + 4 * t + 16 * s);
      const float4 G_r2 = LevelGamRow(sG, n + r2, t, key_pi).at(s);
      const LevelFactor<kHalf> f_r1 = level_factor<kHalf>(G_r1, G_a);
      const LevelFactor<kHalf> f_r2 = level_factor<kHalf>(G_r2, G_8);
      const LevelFactor<kHalf> f_c1 = level_factor<kHalf>(G_8, G_c1);
      const LevelFactor<kHalf> f_c2 = level_factor<kHalf>(G_a, G_c2);
      level_scale<kHalf>(q1, f_r1, aq[0], aq[2]);
      level_scale<kHalf>(k1, f_r1, ak[0], ak[2]);
      level_scale<kHalf>(q2, f_r2, aq[1], aq[3]);
      level_scale<kHalf>(k2, f_r2, ak[1], ak[3]);
      level_scale<kHalf>(kc1, f_c1, b0[0], b0[1]);
      level_scale<kHalf>(kc2, f_c2, b1[0], b1[1]);
    } else {
      const float4 G_a = *reinterpret_cast<const float4*>(g_a + 16 * (s ^ 1));
      const LevelFactor<kHalf> f_r1 = level_factor<kHalf>(G_r1, G_c1);
      const LevelFactor<kHalf> f_c2 = level_factor<kHalf>(G_a, G_c2);
      LevelFactor<kHalf> f_r2;
#pragma unroll
      for (int e = 0; e < 4; ++e) f_r2.f[e] = odd ? f_r1.f[e] : 1.f;
      if constexpr (kHalf) {
        f_r2.h[0] = odd ? f_r1.h[0] : 0x3c003c00u;  // (fp16 1.0, 1.0)
        f_r2.h[1] = odd ? f_r1.h[1] : 0x3c003c00u;
      }
      level_scale<kHalf>(q1, f_r1, aq[0], aq[2]);
      level_scale<kHalf>(k1, f_r1, ak[0], ak[2]);
      level_scale<kHalf>(q2, f_r2, aq[1], aq[3]);
      level_scale<kHalf>(k2, f_r2, ak[1], ak[3]);
      b0[0] = kc1.x;  // (level 0 columns: the tile values themselves)
      b0[1] = kc1.y;
      level_scale<kHalf>(kc2, f_c2, b1[0], b1[1]);
    }
    level_mma<kHalf>(accQ[0], aq, b0[0], b0[1]);
    level_mma<kHalf>(accQ[1], aq, b1[0], b1[1]);
    level_mma<kHalf>(accK[0], ak, b0[0], b0[1]);
    level_mma<kHalf>(accK[1], ak, b1[0], b1[1]);
  }
  float* sDq = reinterpret_cast<float*>(smem + kOffDiag) + I * 256;
  float* sDk = sDq + 4 * 256;
  if constexpr (P == 0) {
    {  // level 3: D[8 + g][2t + e] of n-tile 0, the pairs (8 + pi(g), pi(2t + e)): pi(2t) = 4 (t & 1) + (t >> 1)
      const int o = (8 + pi) * 16 + 4 * (t & 1) + (t >> 1);
      sDq[o] = accQ[0][2];
      sDq[o + 2] = accQ[0][3];
      sDk[o] = accK[0][2];
      sDk[o + 2] = accK[0][3];
    }
    if ((t >> 1) == h) {  // level 2: D[g][2t .. 2t + 1] of n-tile 1, columns 2t + e: tokens 2t + e + 4h
      const int o = r1 * 16 + 2 * t + 4 * h;
      *reinterpret_cast<float2*>(sDq + o) = make_float2(accQ[1][0], accQ[1][1]);
      *reinterpret_cast<float2*>(sDk + o) = make_float2(accK[1][0], accK[1][1]);
    }
  } else if (t == (g >> 1)) {
    {  // level 0: D[g][g] of n-tile 0 (element g & 1 of row g), the pair (2g + 1, 2g)
      const int o = (2 * g + 1) * 16 + 2 * g;
      sDq[o] = odd ? accQ[0][1] : accQ[0][0];
      sDk[o] = odd ? accK[0][1] : accK[0][0];
    }
    {  // level 1: D[g + 8][2t .. 2t + 1] of n-tile 1, columns 2t + e: tokens 4t + e
      const int o = r2 * 16 + 4 * t;
      *reinterpret_cast<float2*>(sDq + o) = make_float2(accQ[1][2], accQ[1][3]);
      *reinterpret_cast<float2*>(sDk + o) = make_float2(accK[1][2], accK[1][3]);
    }
  }
}
// Warp w computes product P = w >> 2 of diagonal block I = w & 3 (skipped past the last valid row): each SM
// sub-partition (warps w and w + 4) gets one product of each kind, so the exponentials (MUFU) are spread evenly.
// Called with the whole CTA in step; reads only the tiles and Γ2 (the caller's barriers order it).
template <bool kHalf>
__device__ __forceinline__ void diagonal_levels(uint8_t* smem, const float* sG, int warp, int lane, int L) {
  const int I = warp & 3;
  if (16 * I >= L) return;
  if (warp < 4) {
    diagonal_product<kHalf, 0>(smem, sG, I, lane);
  } else {
    diagonal_product<kHalf, 1>(smem, sG, I, lane);
  }
}

// Timing-only ablations, compiled only in builds with CULA_SM90_ABLATION (kda_intra_ablation.cu; never in a wheel):
// each drops one phase's arithmetic (its loads feeding only that arithmetic go with it), so the outputs are garbage.
// The intra kernel's time without a phase bounds what rewriting that phase could gain.
constexpr int kAblateGate = 16;      // phase 1: no gate activation (the raw g is summed)
constexpr int kAblateNormExp = 32;   // phase 2a: no L2 norms and no row factors (a = b = 1)
constexpr int kAblateProducts = 64;  // phase 3: no Aqk/Akk MMAs
constexpr int kAblateInverse = 128;  // phase 4: no inverse (sT keeps what it held)
constexpr int kAblateSolve = 256;    // phase 5: no w/u MMAs
constexpr int kAblateLoads = 512;    // no input read from global memory (cp.async zero-fills the tiles; g, beta = 0)
constexpr int kAblateStores = 1024;  // no workspace value reaches global memory (the values are still computed)
constexpr int kAblateStoresWU = 2048;  // as kAblateStores, for phase 5's w and u only
// Whether a form reads its inputs / writes its workspace: always, except in the kAblateLoads / kAblateStores forms,
// where the condition is one that never holds at run time (p.num_tokens < 0), so the compiler keeps the address and
// value arithmetic around each access and drops only the memory traffic.
template <int kTuned>
__device__ __forceinline__ bool reads_inputs(const KdaIntraParams& p) {
  return (kTuned & kAblateLoads) == 0 || p.num_tokens < 0;
}
template <int kTuned>
__device__ __forceinline__ bool writes_workspace(const KdaIntraParams& p) {
  return (kTuned & kAblateStores) == 0 || p.num_tokens < 0;
}
template <int kTuned>
__device__ __forceinline__ bool writes_w_u(const KdaIntraParams& p) {
  return (kTuned & (kAblateStores | kAblateStoresWU)) == 0 || p.num_tokens < 0;
}
// Beta of token `token` and value head hv (of HV): its bits as loaded (bf16 in the low half, or fp32), then the value the
// kernel uses (sigmoid when p.beta_sigmoid, doubled with p.allow_neg_eigval; 0 for a row without a token).
__device__ __forceinline__ uint32_t load_beta_bits(const KdaIntraParams& p, int token, int HV, int hv) {
  const int64_t bi = static_cast<int64_t>(token) * HV + hv;
  if (p.beta_type == ScalarType::kBFloat16) return __ldg(static_cast<const unsigned short*>(p.beta) + bi);
  return __float_as_uint(__ldg(static_cast<const float*>(p.beta) + bi));
}
__device__ __forceinline__ float activated_beta(const KdaIntraParams& p, uint32_t bits, bool row_has_token) {
  float b = p.beta_type == ScalarType::kBFloat16 ? bf16_bits(static_cast<unsigned short>(bits)) : __uint_as_float(bits);
  if (p.beta_sigmoid && row_has_token) {
    b = 1.f / (1.f + expf(-b));
    if (p.allow_neg_eigval) b *= 2.f;
  }
  return b;
}
// The whole computation of one (chunk ci, value head hv).
template <int kTuned>
__device__ __forceinline__ void intra_item(const KdaIntraParams& p, uint8_t* smem, const int ci, const int hv) {
  static_assert((kTuned & kTunedTensor) == kTunedTensor, "every built intra form has the bits of \"tensor\"");
  static_assert(!unbounded_form<kTuned>() || (kTuned & (kTunedBands | kAblateNormExp)) == 0,
                "the \"unbounded\" form computes every band and keeps the norms (its in-place normalisation)");
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int HV = p.num_value_heads;
  const int H = p.num_heads;
  const int h = hv / (HV / H);

  const int seq = p.chunk_indices[2 * ci];
  const int cic = p.chunk_indices[2 * ci + 1];
  if (seq < 0) return;  // padding row (static chunk_indices)
  // The device cu_seqlens may hold other values than the host copy chunk_indices was built from (a CUDA-graph
  // replay, a write torch's version counter did not see): clamped into 0 <= bos <= eos <= num_tokens, the rows
  // [t0, t0 + L) lie in [0, num_tokens) whenever L > 0, whatever its values (a wrong chunk for such values, never a
  // read or write outside q/k/v/g/beta or the workspace).
  const int bos = min(max(p.cu_seqlens[seq], 0), p.num_tokens);
  const int eos = min(max(p.cu_seqlens[seq + 1], bos), p.num_tokens);
  const int t0 = bos + cic * 64;
  const int L = min(64, eos - t0);
  if (L <= 0) return;
  const int bands = (L + 15) >> 4;  // 16-row bands holding a valid row (computed alone with kTunedBands)

  const uint32_t sbase = smem_addr(smem);
  float* sG = reinterpret_cast<float*>(smem + kOffG);
  float* sF = reinterpret_cast<float*>(smem + kOffF);
  float* sE = reinterpret_cast<float*>(smem + kOffE);
  float* sD = reinterpret_cast<float*>(smem + kOffD);
  float* sBeta = reinterpret_cast<float*>(smem + kOffBeta);
  float* sTot = reinterpret_cast<float*>(smem + kOffTot);

  // ------------------------------------------------------------------------------------------------------
  // Phase 0: q, k, v tiles by cp.async (rows >= L zero-filled, never read).
  {
    const __nv_bfloat16* gq = static_cast<const __nv_bfloat16*>(p.q);
    const __nv_bfloat16* gk = static_cast<const __nv_bfloat16*>(p.k);
    const __nv_bfloat16* gv = static_cast<const __nv_bfloat16*>(p.v);
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      if (!band_live<kTuned>(it, bands)) break;  // (iteration it copies band it: rows 16 it .. 16 it + 15)
      const int idx = tid + kThreads * it;
      const int row = idx >> 4;
      const int ch = idx & 15;
      const bool valid = row < L;
      const int64_t tok = static_cast<int64_t>(t0 + (valid ? row : 0));
      const int bytes = valid && reads_inputs<kTuned>(p) ? 16 : 0;
      const uint32_t dst = swz256(row, ch);
      cp_async_16(sbase + kOffQ + dst, gq + (tok * H + h) * kD + ch * 8, bytes);
      cp_async_16(sbase + kOffK + dst, gk + (tok * H + h) * kD + ch * 8, bytes);
      cp_async_16(sbase + kOffV + dst, gv + (tok * HV + hv) * kD + ch * 8, bytes);
    }
    cp_async_commit();
  }

  // ------------------------------------------------------------------------------------------------------
  // Phase 1: beta (row tid - 128 in warps 4-5); gate activation and chunk-local cumsum (thread = column, half of the
  // rows). Beta's load is issued here and used only after the g rows' loads are issued (its sigmoid just before (A)),
  // so warps 4-5 wait for one load latency before (A), not two in a row: the intra kernel 3.5-4.6% faster on long
  // inputs (H200, seventeenth session).
  // (beta_row() is evaluated where it is used: kept as a value, it stays live through the gate code below)
  const bool beta_thread = tid >= 128 && tid < 192;
  const auto beta_row = [&] { return tid - 128 < L && reads_inputs<kTuned>(p); };  // this thread's row has a token
  uint32_t beta_bits = 0u;
  if (beta_thread && beta_row()) beta_bits = load_beta_bits(p, t0 + tid - 128, HV, hv);
  {
    // Warp w = rows 8w .. 8w+7 (a segment), lane = columns 4*lane .. 4*lane+3: vector loads, an in-register
    // scan over the segment, then the sum of the preceding segments' totals (exchanged through smem).
    const int c0 = 4 * lane;
    const int rbase = 8 * warp;
    float gv[8][4];
    const int64_t gstride = static_cast<int64_t>(HV) * kD;
    const int64_t g0 = (static_cast<int64_t>(t0 + rbase) * HV + hv) * kD + c0;
    if (p.g_type == ScalarType::kBFloat16) {
      const unsigned short* gp = static_cast<const unsigned short*>(p.g) + g0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint2 raw = make_uint2(0u, 0u);  // rows >= L: g = 0 (Γ constant past the end)
        if (rbase + j < L && reads_inputs<kTuned>(p)) raw = __ldg(reinterpret_cast<const uint2*>(gp + j * gstride));
        gv[j][0] = bf16_lo(raw.x);
        gv[j][1] = bf16_hi(raw.x);
        gv[j][2] = bf16_lo(raw.y);
        gv[j][3] = bf16_hi(raw.y);
      }
    } else {
      const float* gp = static_cast<const float*>(p.g) + g0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float4 raw = make_float4(0.f, 0.f, 0.f, 0.f);
        if (rbase + j < L && reads_inputs<kTuned>(p)) raw = __ldg(reinterpret_cast<const float4*>(gp + j * gstride));
        gv[j][0] = raw.x;
        gv[j][1] = raw.y;
        gv[j][2] = raw.z;
        gv[j][3] = raw.w;
      }
    }
    if (p.gate_in_kernel && (kTuned & kAblateGate) == 0) {
      // g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) = lb / (1 + 2^{(g + bias) * (-exp(A_log) log2 e)})
      float bias[4] = {0.f, 0.f, 0.f, 0.f};
      if (p.dt_bias != nullptr) {
        const float4 b4 = __ldg(reinterpret_cast<const float4*>(p.dt_bias + hv * kD + c0));
        bias[0] = b4.x;
        bias[1] = b4.y;
        bias[2] = b4.z;
        bias[3] = b4.w;
      }
      const float mult = p.A_log != nullptr ? expf(__ldg(p.A_log + hv)) : 1.f;
      const float m2 = -mult * kLog2e;
      const float lb = p.lower_bound;
      if (unbounded_form<kTuned>() && p.gate_softplus) {
        // g = -exp(A_log) * softplus(g + dt_bias) (softplus_mufu: two MUFU operations per element)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (rbase + j < L) {
#pragma unroll
            for (int i = 0; i < 4; ++i) gv[j][i] = -mult * softplus_mufu(gv[j][i] + bias[i]);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (rbase + j < L) {
#pragma unroll
            for (int i = 0; i < 4; ++i) gv[j][i] = lb * rcp_approx(1.f + ex2_ftz((gv[j][i] + bias[i]) * m2));
          }
        }
      }
    }
#pragma unroll
    for (int j = 1; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) gv[j][i] += gv[j - 1][i];
    *reinterpret_cast<float4*>(sTot + warp * kD + c0) = make_float4(gv[7][0], gv[7][1], gv[7][2], gv[7][3]);
    if (beta_thread) sBeta[tid - 128] = activated_beta(p, beta_bits, beta_row());
    __syncthreads();  // (A)
    float off[4] = {0.f, 0.f, 0.f, 0.f};
    for (int sgi = 0; sgi < warp; ++sgi) {
      const float4 t = *reinterpret_cast<const float4*>(sTot + sgi * kD + c0);
      off[0] += t.x;
      off[1] += t.y;
      off[2] += t.z;
      off[3] += t.w;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // FLA: cumsum in natural units, then * RCP_LN2.
      *reinterpret_cast<float4*>(sG + (rbase + j) * kD + gam_col<kTuned>(j, c0)) =  // (key(8w + j) = key(j))
          make_float4((gv[j][0] + off[0]) * kRcpLn2, (gv[j][1] + off[1]) * kRcpLn2, (gv[j][2] + off[2]) * kRcpLn2,
                      (gv[j][3] + off[3]) * kRcpLn2);
    }
  }
  cp_async_wait_all();
  __syncthreads();  // (B): Γ2, beta, q/k/v tiles visible

  // Phase 1b: per-column anchor factors (2^x kept subnormal-accurate: they may be tiny).
  {
    const int c = tid & 127;
    const float G0 = sG[0 * kD + c], G1 = sG[16 * kD + c], G2 = sG[32 * kD + c], G3 = sG[48 * kD + c];
    if (tid < 128) {
      const float GL = sG[(L - 1) * kD + gam_col<kTuned>(L - 1, c)];  // (the other rows read here have key 0)
      if (writes_workspace<kTuned>(p)) p.g_last[(static_cast<int64_t>(ci) * HV + hv) * kD + c] = GL;  // Γ_last / ln 2
      sF[0 * kD + c] = ex2_full(G0);
      sF[1 * kD + c] = ex2_full(G1);
      sF[2 * kD + c] = ex2_full(G2);
      sF[3 * kD + c] = ex2_full(G3);
      if constexpr (unbounded_form<kTuned>()) {  // anchored at each key sub-chunk's last row
        sE[0 * kD + c] = ex2_full(GL - sG[15 * kD + c]);
        sE[1 * kD + c] = ex2_full(GL - sG[31 * kD + c]);
        sE[2 * kD + c] = ex2_full(GL - sG[47 * kD + c]);
        sE[3 * kD + c] = ex2_full(GL - sG[63 * kD + c]);
      } else {
        sE[0 * kD + c] = ex2_full(GL - G0);
        sE[1 * kD + c] = ex2_full(GL - G1);
        sE[2 * kD + c] = ex2_full(GL - G2);
        sE[3 * kD + c] = ex2_full(GL - G3);
      }
    } else if constexpr (unbounded_form<kTuned>()) {
      const float H0 = sG[15 * kD + c], H1 = sG[31 * kD + c], H2 = sG[47 * kD + c];
      sD[pair_index(1, 0) * kD + c] = ex2_full(G1 - H0);
      sD[pair_index(2, 0) * kD + c] = ex2_full(G2 - H0);
      sD[pair_index(3, 0) * kD + c] = ex2_full(G3 - H0);
      sD[pair_index(2, 1) * kD + c] = ex2_full(G2 - H1);
      sD[pair_index(3, 1) * kD + c] = ex2_full(G3 - H1);
      sD[pair_index(3, 2) * kD + c] = ex2_full(G3 - H2);
    } else {
      sD[pair_index(1, 0) * kD + c] = ex2_full(G1 - G0);
      sD[pair_index(2, 0) * kD + c] = ex2_full(G2 - G0);
      sD[pair_index(3, 0) * kD + c] = ex2_full(G3 - G0);
      sD[pair_index(2, 1) * kD + c] = ex2_full(G2 - G1);
      sD[pair_index(3, 1) * kD + c] = ex2_full(G3 - G1);
      sD[pair_index(3, 2) * kD + c] = ex2_full(G3 - G2);
    }
  }
  __syncthreads();  // (C)

  // ------------------------------------------------------------------------------------------------------
  // Phase 2a: elementwise. Warp w owns rows w + 8*pp (pp = 0..7, two rows per sub-chunk); lane owns columns
  // 4*lane .. 4*lane+3. Each element is read and rewritten by its owner only (in-place tiles are safe).
  uint32_t wrhs[8][2];  // bf16(β k e^Γ), stored to smem after phase 3
  float kb[6][4];       // k·b for rows < 48 (key sub-chunks 0..2), for the off-diagonal column operands
  {
    const int gcol = 4 * lane;
    const uint32_t off0 = quad_off(warp, lane);
    __nv_bfloat16* gqg = static_cast<__nv_bfloat16*>(p.qg);
    __nv_bfloat16* gkg = static_cast<__nv_bfloat16*>(p.kg);
    // All 8 rows' norms first, by one transposed reduction per tensor (the rows are re-read below).
    float rq8[8], rk8[8];
    [[maybe_unused]] uint2 qraw8[8], kraw8[8];  // ("unbounded") the raw rows, kept for the in-place normalisation
    if (p.l2norm_qk && (kTuned & kAblateNormExp) == 0) {
      float sq8[8], sk8[8];
#pragma unroll
      for (int pp = 0; pp < 8; ++pp) {
        if (!band_live<kTuned>(pp >> 1, bands)) {  // (rows never read again)
          sq8[pp] = sk8[pp] = 1.f;
          continue;
        }
        const uint2 qraw = *reinterpret_cast<const uint2*>(smem + kOffQ + off0 + pp * 2048);
        const uint2 kraw = *reinterpret_cast<const uint2*>(smem + kOffK + off0 + pp * 2048);
        if constexpr (unbounded_form<kTuned>()) {
          qraw8[pp] = qraw;
          kraw8[pp] = kraw;
        }
        const float q0 = bf16_lo(qraw.x), q1 = bf16_hi(qraw.x), q2 = bf16_lo(qraw.y), q3 = bf16_hi(qraw.y);
        const float k0 = bf16_lo(kraw.x), k1 = bf16_hi(kraw.x), k2 = bf16_lo(kraw.y), k3 = bf16_hi(kraw.y);
        sq8[pp] = q0 * q0 + q1 * q1 + q2 * q2 + q3 * q3;
        sk8[pp] = k0 * k0 + k1 * k1 + k2 * k2 + k3 * k3;
      }
      row_rsqrt8(sq8, lane, rq8);
      row_rsqrt8(sk8, lane, rk8);
    }
    [[maybe_unused]] float qk8[8];  // "unbounded": this lane's part of q_r·k_r (Aqk's diagonal)
    if constexpr (unbounded_form<kTuned>()) {
      if (p.l2norm_qk) {  // normalise in place, rounded to fp16 (|x| <= 1): 2d and 2a read these
#pragma unroll
        for (int pp = 0; pp < 8; ++pp) {
          uint2* qp = reinterpret_cast<uint2*>(smem + kOffQ + off0 + pp * 2048);
          uint2* kp = reinterpret_cast<uint2*>(smem + kOffK + off0 + pp * 2048);
          const uint2 qraw = qraw8[pp], kraw = kraw8[pp];
          const float rq = rq8[pp], rk = rk8[pp];
          *qp = make_uint2(pack_f16x2(bf16_lo(qraw.x) * rq, bf16_hi(qraw.x) * rq),
                           pack_f16x2(bf16_lo(qraw.y) * rq, bf16_hi(qraw.y) * rq));
          *kp = make_uint2(pack_f16x2(bf16_lo(kraw.x) * rk, bf16_hi(kraw.x) * rk),
                           pack_f16x2(bf16_lo(kraw.y) * rk, bf16_hi(kraw.y) * rk));
        }
      }
      __syncthreads();  // (D0)
      if (p.l2norm_qk) {  // phase 2d
        diagonal_levels<true>(smem, sG, warp, lane, L);
      } else {
        diagonal_levels<false>(smem, sG, warp, lane, L);
      }
      __syncthreads();  // (D1): q, k tiles free to be rewritten in place
    }
#pragma unroll
    for (int pp = 0; pp < 8; ++pp) {
      const int J = pp >> 1;
      if (!band_live<kTuned>(J, bands)) break;  // (wrhs and kb of these rows are never read)
      const int r = warp + 8 * pp;
      const uint32_t off = off0 + pp * 2048;  // quad_off(r, lane): r & 7 == warp & 7 for every pp
      const uint2 qraw = *reinterpret_cast<const uint2*>(smem + kOffQ + off);
      const uint2 kraw = *reinterpret_cast<const uint2*>(smem + kOffK + off);
      const uint2 vraw = *reinterpret_cast<const uint2*>(smem + kOffV + off);
      // (gam_col: r & 3 = warp & 3; rows 16 J and 16 J + 15 have key 0)
      const float4 G = *reinterpret_cast<const float4*>(sG + r * kD + gam_col<kTuned>(warp, gcol));
      const float4 Gn = *reinterpret_cast<const float4*>(sG + (16 * J) * kD + gcol);
      const float4 F = *reinterpret_cast<const float4*>(sF + J * kD + gcol);
      const float4 E = *reinterpret_cast<const float4*>(sE + J * kD + gcol);
      const float beta = sBeta[r];
      float q[4], k[4];  // ("unbounded": read below, with its tiles' format)
      if constexpr (!unbounded_form<kTuned>()) {
        q[0] = bf16_lo(qraw.x);
        q[1] = bf16_hi(qraw.x);
        q[2] = bf16_lo(qraw.y);
        q[3] = bf16_hi(qraw.y);
        k[0] = bf16_lo(kraw.x);
        k[1] = bf16_hi(kraw.x);
        k[2] = bf16_lo(kraw.y);
        k[3] = bf16_hi(kraw.y);
      }
      const float v[4] = {bf16_lo(vraw.x), bf16_hi(vraw.x), bf16_lo(vraw.y), bf16_hi(vraw.y)};
      if (p.l2norm_qk && (kTuned & kAblateNormExp) == 0 && !unbounded_form<kTuned>()) {
        const float rq = rq8[pp], rk = rk8[pp];
        // FLA stores the normalised q, k in bf16.
        const uint32_t q01 = pack_bf16x2(q[0] * rq, q[1] * rq), q23 = pack_bf16x2(q[2] * rq, q[3] * rq);
        const uint32_t k01 = pack_bf16x2(k[0] * rk, k[1] * rk), k23 = pack_bf16x2(k[2] * rk, k[3] * rk);
        q[0] = bf16_lo(q01);
        q[1] = bf16_hi(q01);
        q[2] = bf16_lo(q23);
        q[3] = bf16_hi(q23);
        k[0] = bf16_lo(k01);
        k[1] = bf16_hi(k01);
        k[2] = bf16_lo(k23);
        k[3] = bf16_hi(k23);
      }
      const float g[4] = {G.x, G.y, G.z, G.w};
      const float gn[4] = {Gn.x, Gn.y, Gn.z, Gn.w};
      const float f[4] = {F.x, F.y, F.z, F.w};
      const float ef[4] = {E.x, E.y, E.z, E.w};
      float gl[4] = {0.f, 0.f, 0.f, 0.f};  // ("unbounded") Γ2 of the sub-chunk's last row
      if constexpr (unbounded_form<kTuned>()) {
        const float4 Gl = *reinterpret_cast<const float4*>(sG + (16 * J + 15) * kD + gcol);
        gl[0] = Gl.x;
        gl[1] = Gl.y;
        gl[2] = Gl.z;
        gl[3] = Gl.w;
      }
      float a[4], b[4], e[4], kf[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr ((kTuned & kAblateNormExp) != 0) {
          a[i] = b[i] = 1.f + 0.f * (g[i] - gn[i]);
        } else {
          a[i] = ex2_ftz(g[i] - gn[i]);  // e^{Γ - Γn}   in [e^-75, 1]
          if constexpr (unbounded_form<kTuned>()) {
            b[i] = ex2_ftz(gl[i] - g[i]);  // e^{Γ[16J+15] - Γ}   in [0, 1]
          } else if constexpr ((kTuned & kTunedBands) != 0) {
            b[i] = ex2_ftz(-(g[i] - gn[i]));  // e^{Γn - Γ}   in [1, e^75]
          } else {
            b[i] = ex2_ftz(gn[i] - g[i]);
          }
        }
        e[i] = f[i] * a[i];            // e^{Γ}
        kf[i] = ef[i] * b[i];          // e^{Γlast - Γ}
      }
      if constexpr (unbounded_form<kTuned>()) {
        // q, k and phase 3's row operands q·a, k·a: fp16 with the norm in the kernel (its tiles, and phase 3's MMAs,
        // are fp16: fp16(x fp16(a)), |x| <= 1, a <= 1), else bf16 as in the other forms
        uint2 qa, ka;
        if (p.l2norm_qk) {
          q[0] = f16_lo(qraw.x);
          q[1] = f16_hi(qraw.x);
          q[2] = f16_lo(qraw.y);
          q[3] = f16_hi(qraw.y);
          k[0] = f16_lo(kraw.x);
          k[1] = f16_hi(kraw.x);
          k[2] = f16_lo(kraw.y);
          k[3] = f16_hi(kraw.y);
          const uint32_t a01 = pack_f16x2(a[0], a[1]), a23 = pack_f16x2(a[2], a[3]);
          qa = make_uint2(mul_f16x2(qraw.x, a01), mul_f16x2(qraw.y, a23));
          ka = make_uint2(mul_f16x2(kraw.x, a01), mul_f16x2(kraw.y, a23));
        } else {
          q[0] = bf16_lo(qraw.x);
          q[1] = bf16_hi(qraw.x);
          q[2] = bf16_lo(qraw.y);
          q[3] = bf16_hi(qraw.y);
          k[0] = bf16_lo(kraw.x);
          k[1] = bf16_hi(kraw.x);
          k[2] = bf16_lo(kraw.y);
          k[3] = bf16_hi(kraw.y);
          qa = make_uint2(pack_bf16x2(q[0] * a[0], q[1] * a[1]), pack_bf16x2(q[2] * a[2], q[3] * a[3]));
          ka = make_uint2(pack_bf16x2(k[0] * a[0], k[1] * a[1]), pack_bf16x2(k[2] * a[2], k[3] * a[3]));
        }
        *reinterpret_cast<uint2*>(smem + kOffQ + off) = qa;
        *reinterpret_cast<uint2*>(smem + kOffK + off) = ka;
        qk8[pp] = q[0] * k[0] + q[1] * k[1] + q[2] * k[2] + q[3] * k[3];
      }
      if (r < L && writes_workspace<kTuned>(p)) {
        const int64_t o = (static_cast<int64_t>(t0 + r) * HV + hv) * kD + gcol;
        *reinterpret_cast<uint2*>(gqg + o) =
            make_uint2(pack_bf16x2(q[0] * e[0], q[1] * e[1]), pack_bf16x2(q[2] * e[2], q[3] * e[3]));
        *reinterpret_cast<uint2*>(gkg + o) =
            make_uint2(pack_bf16x2(k[0] * kf[0], k[1] * kf[1]), pack_bf16x2(k[2] * kf[2], k[3] * kf[3]));
      }
      if constexpr (!unbounded_form<kTuned>()) {
        *reinterpret_cast<uint2*>(smem + kOffQ + off) =
            make_uint2(pack_bf16x2(q[0] * a[0], q[1] * a[1]), pack_bf16x2(q[2] * a[2], q[3] * a[3]));
        *reinterpret_cast<uint2*>(smem + kOffK + off) =
            make_uint2(pack_bf16x2(k[0] * a[0], k[1] * a[1]), pack_bf16x2(k[2] * a[2], k[3] * a[3]));
        // (the diagonal blocks' column operand)
        *reinterpret_cast<uint2*>(smem + kOffX + off) =
            make_uint2(pack_bf16x2(k[0] * b[0], k[1] * b[1]), pack_bf16x2(k[2] * b[2], k[3] * b[3]));
      }
      *reinterpret_cast<uint2*>(smem + kOffV + off) =
          make_uint2(pack_bf16x2(beta * v[0], beta * v[1]), pack_bf16x2(beta * v[2], beta * v[3]));
      wrhs[pp][0] = pack_bf16x2(beta * k[0] * e[0], beta * k[1] * e[1]);
      wrhs[pp][1] = pack_bf16x2(beta * k[2] * e[2], beta * k[3] * e[3]);
      if (pp < 6) {
#pragma unroll
        for (int i = 0; i < 4; ++i) kb[pp][i] = k[i] * b[i];
      }
    }
    if constexpr (unbounded_form<kTuned>()) {  // Aqk's diagonal: the fp32 dot of row r = warp + 8 pp, pp = lane >> 2
      const float dot = row_sum8(qk8, lane);
      if ((lane & 3) == 0) {
        const int pp = lane >> 2;
        const int rl = warp + 8 * (pp & 1);
        reinterpret_cast<float*>(smem + kOffDiag)[(pp >> 1) * 256 + rl * 17] = dot;
      }
    }
  }
  __syncthreads();  // (D): Γ2 no longer needed

  // Phase 2b: off-diagonal column operands bf16(k_j e^{Γ_{n_I} - Γ_j}) for key sub-chunk J < I, tile rows 0..15.
  if constexpr (unbounded_form<kTuned>()) {  // (the same, in fp16 with the norm in the kernel)
    const auto columns = [&](auto half) {
      const int gcol = 4 * lane;
#pragma unroll
      for (int pp = 0; pp < 6; ++pp) {
        const int J = pp >> 1;
        const uint32_t off = quad_off(warp + 8 * (pp & 1), lane);
#pragma unroll
        for (int I = J + 1; I < 4; ++I) {
          const int pi = pair_index(I, J);
          const float4 Dv = *reinterpret_cast<const float4*>(sD + pi * kD + gcol);
          const float x0 = kb[pp][0] * Dv.x, x1 = kb[pp][1] * Dv.y, x2 = kb[pp][2] * Dv.z, x3 = kb[pp][3] * Dv.w;
          uint2* dst = reinterpret_cast<uint2*>(smem + kOffKoff + pi * 4096 + off);
          if constexpr (decltype(half)::value) {
            *dst = make_uint2(pack_f16x2(x0, x1), pack_f16x2(x2, x3));
          } else {
            *dst = make_uint2(pack_bf16x2(x0, x1), pack_bf16x2(x2, x3));
          }
        }
      }
    };
    if (p.l2norm_qk) {
      columns(HalfOps<true>{});
    } else {
      columns(HalfOps<false>{});
    }
  } else {
    const int gcol = 4 * lane;
#pragma unroll
    for (int pp = 0; pp < 6; ++pp) {
      const int J = pp >> 1;
      const int rl = warp + 8 * (pp & 1);  // row inside the 16-row tile (same parity class as r = 16J + rl)
      const uint32_t off = quad_off(rl, lane);
#pragma unroll
      for (int I = J + 1; I < 4; ++I) {
        if (!band_live<kTuned>(I, bands)) break;
        const int pi = pair_index(I, J);
        const float4 Dv = *reinterpret_cast<const float4*>(sD + pi * kD + gcol);
        *reinterpret_cast<uint2*>(smem + kOffKoff + pi * 4096 + off) =
            make_uint2(pack_bf16x2(kb[pp][0] * Dv.x, kb[pp][1] * Dv.y), pack_bf16x2(kb[pp][2] * Dv.z, kb[pp][3] * Dv.w));
      }
    }
  }
  __syncthreads();  // (E)

  // ------------------------------------------------------------------------------------------------------
  // Phase 3: Aqk and Akk, 10 lower 16x16 blocks (I >= J) over K = 128 (8 k-steps of 16).
  // Warp -> (I, J0, nJ): w0 (3,{0,1}) w1 (2,{0,1}) w2 (3,2) w3 (3,3) w4 (2,2) w5 (1,0) w6 (1,1) w7 (0,0).
  const int g8 = lane >> 2;  // mma groupID
  const int t4 = lane & 3;   // mma threadID_in_group
  {
    const int I = (0x01123323u >> (4 * warp)) & 0xF;
    const int J0 = (0x01023200u >> (4 * warp)) & 0xF;
    const int nJ = (0x11111122u >> (4 * warp)) & 0xF;
    // A (row operand) rows 16I + (lane&7) + 8*((lane>>3)&1), k-chunk 2s + (lane>>4): matrices a0..a3.
    const int arow = 16 * I + (lane & 7) + (((lane >> 3) & 1) << 3);
    const int achk = lane >> 4;
    // B (column operand, stored [n][k]) rows (lane&7) + 8*(lane>>4), k-chunk 2s + ((lane>>3)&1):
    // registers = n-tile 0 {b0, b1}, n-tile 1 {b0, b1}.
    const int brow = (lane & 7) + ((lane >> 4) << 3);
    const int bchk = (lane >> 3) & 1;
    const float scale = p.scale;
    float akk[2][2][4];  // masked, β-scaled Akk of each block, stored to smem after (F)
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      // (the key blocks of a warp one after the other: 16 live accumulators, not 32)
      if (jj < nJ && band_live<kTuned>(I, bands)) {
        const int J = J0 + jj;
        const uint32_t bbase = (J == I) ? sbase + kOffX + static_cast<uint32_t>(16 * I * 256)
                                        : sbase + kOffKoff + static_cast<uint32_t>(pair_index(I, J) * 4096);
        float accQ[2][4], accK[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            accQ[nt][e] = 0.f;
            accK[nt][e] = 0.f;
          }
        if (unbounded_form<kTuned>() && J == I) {  // phase 2d's sums (Aqk's diagonal from 2a)
          const float* sDq = reinterpret_cast<const float*>(smem + kOffDiag) + I * 256;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int o = (g8 + 8 * hh) * 16 + 8 * nt + 2 * t4;
              const float2 dq = *reinterpret_cast<const float2*>(sDq + o);
              const float2 dk = *reinterpret_cast<const float2*>(sDq + 4 * 256 + o);
              accQ[nt][2 * hh] = dq.x;
              accQ[nt][2 * hh + 1] = dq.y;
              accK[nt][2 * hh] = dk.x;
              accK[nt][2 * hh + 1] = dk.y;
            }
        }
        if constexpr (unbounded_form<kTuned>()) {  // (below the diagonal only; fp16 with the norm in the kernel)
          const auto products = [&](auto half) {
#pragma unroll
            for (int s = 0; s < 8; ++s) {
              uint32_t aq[4], ak[4], bb[4];
              ldsm_x4(aq, sbase + kOffQ + swz256(arow, 2 * s + achk));
              ldsm_x4(ak, sbase + kOffK + swz256(arow, 2 * s + achk));
              ldsm_x4(bb, bbase + swz256(brow, 2 * s + bchk));
              level_mma<decltype(half)::value>(accQ[0], aq, bb[0], bb[1]);
              level_mma<decltype(half)::value>(accQ[1], aq, bb[2], bb[3]);
              level_mma<decltype(half)::value>(accK[0], ak, bb[0], bb[1]);
              level_mma<decltype(half)::value>(accK[1], ak, bb[2], bb[3]);
            }
          };
          if (J < I) {
            if (p.l2norm_qk) {
              products(HalfOps<true>{});
            } else {
              products(HalfOps<false>{});
            }
          }
        } else {
#pragma unroll
          for (int s = 0; s < ((kTuned & kAblateProducts) != 0 ? 0 : 8); ++s) {
            uint32_t aq[4], ak[4], bb[4];
            ldsm_x4(aq, sbase + kOffQ + swz256(arow, 2 * s + achk));
            ldsm_x4(ak, sbase + kOffK + swz256(arow, 2 * s + achk));
            ldsm_x4(bb, bbase + swz256(brow, 2 * s + bchk));
            mma_bf16_16816(accQ[0], aq, bb[0], bb[1]);
            mma_bf16_16816(accQ[1], aq, bb[2], bb[3]);
            mma_bf16_16816(accK[0], ak, bb[0], bb[1]);
            mma_bf16_16816(accK[1], ak, bb[2], bb[3]);
          }
        }
        // Epilogue: Aqk -> bf16 staging (scale folded, j <= i, rows < L); Akk masked (j < i, rows < L), * β_i.
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = 16 * I + g8 + 8 * hh;
          const bool ok = i < L;
          const float bi = sBeta[i];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const int j = 16 * J + 8 * nt + 2 * t4;
            const float q0 = (ok && j <= i) ? scale * accQ[nt][2 * hh] : 0.f;
            const float q1 = (ok && j + 1 <= i) ? scale * accQ[nt][2 * hh + 1] : 0.f;
            *reinterpret_cast<uint32_t*>(smem + kOffAqk + swz128(i, j >> 3) + (j & 7) * 2) = pack_bf16x2(q0, q1);
            akk[jj][nt][2 * hh] = (ok && j < i) ? bi * accK[nt][2 * hh] : 0.f;
            akk[jj][nt][2 * hh + 1] = (ok && j + 1 < i) ? bi * accK[nt][2 * hh + 1] : 0.f;
          }
        }
      }
    }
    __syncthreads();  // (F): all operand tiles consumed

    float* sA = reinterpret_cast<float*>(smem + kOffA);
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      if (jj < nJ && band_live<kTuned>(I, bands)) {
        const int J = J0 + jj;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int i = 16 * I + g8 + 8 * hh;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            const int j = 16 * J + 8 * nt + 2 * t4;
            if (J < I) {  // (the diagonal blocks stay fp32, for 4a)
              store_split_pair(smem, kOffAkkHi, kOffAkkLo, i, j, akk[jj][nt][2 * hh], akk[jj][nt][2 * hh + 1]);
            } else {
              *reinterpret_cast<float2*>(sA + i * kAStride + j) =
                  make_float2(akk[jj][nt][2 * hh], akk[jj][nt][2 * hh + 1]);
            }
          }
        }
      }
    }
  }
  // w right-hand side -> the k·b tile (free now).
#pragma unroll
  for (int pp = 0; pp < 8; ++pp) {
    if (!band_live<kTuned>(pp >> 1, bands)) break;
    const int r = warp + 8 * pp;
    *reinterpret_cast<uint2*>(smem + kOffX + quad_off(r, lane)) = make_uint2(wrhs[pp][0], wrhs[pp][1]);
  }
  // Aqk -> global, rows < L, the blocks on and below the diagonal only (the recurrence zero-fills the others).
  // (ch >> 1) <= (row >> 4) is aqk_chunk_written (kda_params.h), spelled out: calling it gave the same bits but a
  // different instruction schedule, 0.3% slower at B1 T16384 on the H200 (thirteenth session).
  {
    __nv_bfloat16* gA = static_cast<__nv_bfloat16*>(p.Aqk);
#pragma unroll
    for (int it = 0; it < 2; ++it) {
      const int idx = tid + kThreads * it;
      const int row = idx >> 3;
      const int ch = idx & 7;
      if (row < L && (ch >> 1) <= (row >> 4) && writes_workspace<kTuned>(p)) {
        const uint4 val = *reinterpret_cast<const uint4*>(smem + kOffAqk + swz128(row, ch));
        *reinterpret_cast<uint4*>(gA + (static_cast<int64_t>(t0 + row) * HV + hv) * 64 + ch * 8) = val;
      }
    }
  }
  __syncthreads();  // (G): Akk's diagonal blocks complete in sA, its lower blocks in the hi/lo tiles

  // ------------------------------------------------------------------------------------------------------
  // Phase 4: Tinv = (I + Akk)^-1 from fp32 arithmetic, as the bf16 hi/lo pair sT and kOffTLo (sT alone is the A
  // operand of phase 5).
  float* sA = reinterpret_cast<float*>(smem + kOffA);
  // 4a: diagonal blocks. Lane (block blk, column c) solves (I + A_bb) x = e_c by forward substitution.
  if (warp < 2 && band_live<kTuned>(2 * warp, bands) && (kTuned & kAblateInverse) == 0) {
    const int blk = 2 * warp + (lane >> 4);  // (a block >= bands: its lanes solve what no computed row reads)
    const int c = lane & 15;
    float* Ab = sA + (16 * blk) * kAStride + 16 * blk;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float s = 0.f;
#pragma unroll
      for (int m = 0; m < r; ++m) s = fmaf(Ab[r * kAStride + m], x[m], s);
      x[r] = (r == c) ? 1.f : ((r < c) ? 0.f : -s);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int R = 16 * blk + r;
      const int Cc = 16 * blk + c;
      const uint32_t w = pack_bf16x2(x[r], 0.f);
      *reinterpret_cast<unsigned short*>(smem + kOffT + swz128(R, Cc >> 3) + (Cc & 7) * 2) =
          static_cast<unsigned short>(w & 0xffffu);
      // T_II's lo part
      const uint32_t lo = pack_bf16x2(x[r] - bf16_lo(w), 0.f);
      *reinterpret_cast<unsigned short*>(smem + kOffTLo + swz128(R, Cc >> 3) + (Cc & 7) * 2) =
          static_cast<unsigned short>(lo & 0xffffu);
    }
  }
  __syncthreads();  // (H)
  if constexpr ((kTuned & kAblateInverse) == 0) {
    inverse_by_doubling_tensor<(kTuned & kTunedBands) != 0>(smem, warp, lane, bands);
  }

  // ------------------------------------------------------------------------------------------------------
  // Phase 5: w = Tinv · wrhs, u = Tinv · urhs. Warp -> (tensor w >> 2, 32 output columns 32*(w & 3)..).
  // Row block I uses k-blocks 0..I only (Tinv is lower triangular).
  {
    const int tsel = warp >> 2;
    const int cs = warp & 3;
    const uint32_t rbase = sbase + (tsel ? kOffV : kOffX);
    uint8_t* stage = smem + kOffG + tsel * 16384;
    const int lrow = (lane & 7) + (((lane >> 3) & 1) << 3);
    const int lchk = lane >> 4;
#pragma unroll
    for (int I = 0; I < 4; ++I) {
      if (!band_live<kTuned>(I, bands)) break;
      float acc[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
      for (int kb2 = 0; kb2 <= ((kTuned & kAblateSolve) != 0 ? -1 : I); ++kb2) {
        uint32_t a[4];
        ldsm_x4(a, sbase + kOffT + swz128(16 * I + lrow, 2 * kb2 + lchk));
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          // .trans over the [token][feature] tile: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15),
          // (k 8-15, n 8-15) = n-tile 2*h2 {b0, b1}, n-tile 2*h2+1 {b0, b1}.
          uint32_t b[4];
          ldsm_x4_trans(b, rbase + swz256(16 * kb2 + lrow, 4 * cs + 2 * h2 + lchk));
          mma_bf16_16816(acc[2 * h2], a, b[0], b[1]);
          mma_bf16_16816(acc[2 * h2 + 1], a, b[2], b[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = 32 * cs + 8 * nt + 2 * t4;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = 16 * I + g8 + 8 * hh;
          *reinterpret_cast<uint32_t*>(stage + swz256(row, col >> 3) + (col & 7) * 2) =
              pack_bf16x2(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
        }
      }
    }
  }
  __syncthreads();
  {
    __nv_bfloat16* gw = static_cast<__nv_bfloat16*>(p.w);
    __nv_bfloat16* gu = static_cast<__nv_bfloat16*>(p.u);
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int idx = tid + kThreads * it;
      const int tsel = idx >> 10;
      const int row = (idx >> 4) & 63;
      const int ch = idx & 15;
      if (row < L && writes_w_u<kTuned>(p)) {
        const uint4 val = *reinterpret_cast<const uint4*>(smem + kOffG + tsel * 16384 + swz256(row, ch));
        __nv_bfloat16* dst = tsel ? gu : gw;
        *reinterpret_cast<uint4*>(dst + (static_cast<int64_t>(t0 + row) * HV + hv) * kD + ch * 8) = val;
      }
    }
  }
}

// One CTA per (chunk, value head). kTuned: its form, kTunedTensor (the default since the tenth session; its instance
// is in kda_intra_tensor.cu) or that with kTunedBands (kda_intra_bands.cu), or a timing-only ablation form.
// Each CTA releases the recurrence's programmatic launch as it starts, so the recurrence grid launches once the last
// intra CTA has started; its CTAs take the SMs the intra kernel frees and wait there (griddepcontrol.wait) for the
// whole intra grid to finish before they read its output (the index arrays and initial states they read first).
template <int kTuned>
__global__ void __launch_bounds__(kThreads, 2) kda_intra_kernel(const KdaIntraParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  grid_launch_dependents();
  intra_item<kTuned>(p, smem, blockIdx.x, blockIdx.y);
}

template <int kTuned>
cudaError_t launch_one_cta_per_item(const KdaIntraParams& params, cudaStream_t stream) {
  constexpr uint32_t smem_bytes = unbounded_form<kTuned>() ? kSmemBytesUnbounded : kSmemBytes;
  const cudaError_t err = allow_dynamic_smem<kda_intra_kernel<kTuned>>(static_cast<int>(smem_bytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(params.num_chunks), static_cast<unsigned>(params.num_value_heads));
  kda_intra_kernel<kTuned><<<grid, kThreads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace
}  // namespace cula::sm90
