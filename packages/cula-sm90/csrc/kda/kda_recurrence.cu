// Kernel 2 of the split SM90 KDA prefill: the sequential inter-chunk recurrence plus the chunk output.
//
// One CTA per (sequence n, value head hv, block of kBV value columns); it walks the sequence's 64-token chunks in
// order. Per chunk, with S the fp32 state [K=128, V] entering the chunk (only the CTA's kBV columns of V):
//   S_bf  = bf16(S)
//   v_new = bf16(u - w . S_bf)                                  [64, kBV]
//   o     = bf16(scale * (qg . S_bf) + Aqk . v_new)             [64, kBV]
//   S     = exp2(g_last)[:, None] * S + kg^T . v_new            (fp32)
// The state-pool form (KdaRecurrenceParams::state_indices) is a kernel of its own, kda_recurrence_kernel_pool: the
// same CTA code with S read from and written back to the sequence's pool slot, and zeros in a padding row's o.
//
// Everything is computed transposed, so the state is the A operand (M = V rows) and the products chain in registers:
//   v_new^T [kBV x 64]  = u^T - S^T_bf . w^T          A = S^T (registers)       B = w^T   (shared memory, K-major)
//   o^T     [kBV x 64]  = scale * S^T_bf . qg^T       A = S^T (registers)       B = qg^T  (shared memory, K-major)
//                       + v_new^T_bf . Aqk^T          A = v_new^T (registers)   B = Aqk^T (shared memory, K-major)
//   S^T     [kBV x 128] = S^T * gamma + v_new^T_bf . kg   A = v_new^T (registers)   B = kg (shared memory, MN-major)
// at V blocks of 64 and 128 (whole warpgroups, kBV / 16 warps). Warp w owns the 16 rows v0 + 16w + [0, 16) of S^T
// (V rows). Every product runs as a warpgroup MMA (wgmma m64n64k16 / m64n128k16) with the A operand (S^T_bf,
// v_new^T_bf) in registers and w, qg, Aqk, kg read from shared memory once per warpgroup; A and the accumulators use
// the per-warp fragments of mma.m16n8k16. (The mma.sync form, at V blocks of 32, was retired in issue 25: the
// history keeps it.)
//
// Fragment layouts used (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type"; cross-checked with
// CuTe's SM80_16x8x16 traits). lane = 4*g + t (g = groupID = lane/4, t = threadID_in_group = lane%4):
//   A (16x16, row):  a0 = (row g,   cols 2t, 2t+1)   a1 = (row g+8, cols 2t, 2t+1)
//                    a2 = (row g,   cols 2t+8, +9)   a3 = (row g+8, cols 2t+8, +9)
//   B (16x8, col):   b0 = (rows 2t, 2t+1, col g)    b1 = (rows 2t+8, 2t+9, col g)
//   C/D (16x8 f32):  c0,c1 = (row g, cols 2t, 2t+1)   c2,c3 = (row g+8, cols 2t, 2t+1)
// Each .b32 register holds two bf16; the lower column/row index is in the low 16 bits.
// Hence two adjacent n8 accumulator tiles j = 2s, 2s+1 (cols 16s..16s+15) give the k16 A fragment of k-step s:
//   a0 = pack(C[2s].c0, c1), a1 = pack(C[2s].c2, c3), a2 = pack(C[2s+1].c0, c1), a3 = pack(C[2s+1].c2, c3).
//
// Shared memory (per pipeline stage, two stages: the next chunk's loads in flight while one computes; every tile is
// token-row-major, 16-byte chunks XOR-swizzled so that the 8 rows of one ldmatrix 8x8 matrix, or of one wgmma core
// matrix, hit 8 distinct 16-byte bank groups):
//   w, qg, kg [64][128] bf16 (256 B rows, 16 chunks), u [64][kBV] bf16, Aqk [64][64] bf16, g_last [128] fp32.
// After the chunk's u has been consumed, each warp reuses its own u columns as the staging tile of its o columns.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kda_params.h"
#include "launch_once.cuh"
#include "ptx.cuh"

namespace cula::sm90 {
namespace recurrence_detail {

// PTX wrappers: the shared ones (ptx.cuh), under the names this kernel uses.
using ptx::bf16_hi;
using ptx::bf16_lo;
using ptx::cp_async_commit;
using ptx::ld_shared_f2;
using ptx::ld_shared_f4;
using ptx::ld_shared_u4;
using ptx::ldsm_x4_trans;
using ptx::smem_addr;
using ptx::st_global_u4;
using ptx::st_shared_f4;
using ptx::stsm_x4_trans;
using ptx::fence_proxy_async_smem;
using ptx::wgmma_commit;
using ptx::wgmma_desc_k_sw128;
using ptx::wgmma_desc_mn_sw128;
using ptx::wgmma_fence;
using ptx::wgmma_fence_operands;
using ptx::wgmma_m64n128k16_bf16_rs_mn;
using ptx::wgmma_m64n64k16_bf16_rs;
using ptx::wgmma_wait0;

// 16-byte async copy global -> shared; an invalid row zero-fills the destination without reading the source.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  ptx::cp_async_16(dst, src, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async_wait_all() { ptx::cp_async_wait_group0(); }
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) { return ptx::pack_bf16x2(lo, hi); }

// ------------------------------------------------------------------------------------------------------------------
// Configuration and shared-memory map
// ------------------------------------------------------------------------------------------------------------------

// kBV 64 and 128 (whole warpgroups): the products run as warpgroup MMAs reading w, qg, kg and Aqk from shared memory
// once per 64 V rows. w, qg, kg use the 128-byte-swizzle layout wgmma reads: [2 halves of 64 columns][64 token
// rows][128 B], 16-byte chunk c of row r at ((c ^ r) & 7), tiles 1024-byte aligned (w, qg K-major; kg MN-major).
// Aqk's [64][128 B] tile with chunk ^ (row & 7) already is that layout.
// kStages: shared-memory pipeline stages (the next chunk's loads are issued while one computes). (A third stage on
// warpgroup MMAs was no faster end to end on the H200 and was retired in issue 25.)
template <int kBV>
struct RecurrenceConfig {
  static_assert(kBV == 64 || kBV == 128, "kBV must be 64 or 128 (whole warpgroups)");
  static constexpr int kStages = 2;
  static constexpr int kWarps = kBV / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kVBlocks = kHeadDim / kBV;

  static constexpr int kChunksK = kHeadDim * 2 / 16;  // 16-byte chunks per 128-wide bf16 row (16)
  static constexpr int kChunksU = kBV * 2 / 16;       // per kBV-wide u row (8 or 16)
  static constexpr int kChunksA = kChunk * 2 / 16;    // per 64-wide Aqk row (8)

  static constexpr int kTileK = kChunk * kChunksK * 16;  // 16384
  static constexpr int kTileU = kChunk * kChunksU * 16;  // 64 * kBV * 2
  static constexpr int kTileA = kChunk * kChunksA * 16;  // 8192
  static constexpr int kTileG = kHeadDim * 4;            // 512

  static constexpr int kOffW = 0;
  static constexpr int kOffQ = kOffW + kTileK;
  static constexpr int kOffKG = kOffQ + kTileK;
  static constexpr int kOffU = kOffKG + kTileK;
  static constexpr int kOffA = kOffU + kTileU;
  static constexpr int kOffG = kOffA + kTileA;
  static constexpr int kStageAlign = 1024;  // (the wgmma tiles' alignment)
  static constexpr int kStageBytes = (kOffG + kTileG + kStageAlign - 1) / kStageAlign * kStageAlign;
  static constexpr int kOffGamma = kStages * kStageBytes;  // per warp: 128 fp32 exp2(g_last)
  static constexpr int kSmemBytes = kOffGamma + kWarps * kTileG;
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an SM90 CTA may have");

  static_assert(kThreads >= kTileG / 16, "g_last copy split");
  static_assert(kOffW % 1024 == 0 && kOffQ % 1024 == 0 && kOffKG % 1024 == 0 && kOffA % 1024 == 0,
                "wgmma tiles must be 1024-byte aligned");
};

// One state element as fp32, and two K-adjacent ones (8-byte fp32 or 4-byte bf16 pair) of a V-first state.
__device__ __forceinline__ float state_value(float x) { return x; }
__device__ __forceinline__ float state_value(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float2 state_pair(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 state_pair(const __nv_bfloat16* p) {
  const uint32_t x = *reinterpret_cast<const uint32_t*>(p);
  return make_float2(bf16_lo(x), bf16_hi(x));
}

// This lane's fragment of S^T from one head's initial state h0 ([K, V], or [V, K] if v_first; fp32 or bf16):
// S[j][e] = S(k = 8j + 2*t4 + (e & 1), v = vr + 8*(e >> 1)).
template <typename T>
__device__ __forceinline__ void load_state(float (&S)[16][4], const T* h0, bool v_first, int vr, int t4) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int k = 8 * j + 2 * t4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int v = vr + 8 * h;
      if (v_first) {
        const float2 x = state_pair(h0 + static_cast<int64_t>(v) * kHeadDim + k);
        S[j][2 * h] = x.x;
        S[j][2 * h + 1] = x.y;
      } else {
        S[j][2 * h] = state_value(h0[static_cast<int64_t>(k) * kHeadDim + v]);
        S[j][2 * h + 1] = state_value(h0[static_cast<int64_t>(k + 1) * kHeadDim + v]);
      }
    }
  }
}

// The state-pool form's accesses (KdaRecurrenceParams::state_indices): the same fragment as load_state, from and to
// one slot's head, one element at a time (so that a pool whose data or slot stride is only element-aligned is read
// and written in place: no aligned copy can be made of it). Element (k, v) is at k * k_stride + v * v_stride: (128, 1)
// for [K, V], (1, 128) for [V, K]. Each lane reads and writes the same elements, and no other lane touches them.
__device__ __forceinline__ void put_state(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void put_state(__nv_bfloat16* dst, float x) { *dst = __float2bfloat16_rn(x); }

template <typename T>
__device__ __forceinline__ void load_slot_state(float (&S)[16][4], const T* h0, int k_stride, int v_stride, int vr,
                                                int t4) {
  const T* base = h0 + 2 * t4 * k_stride + vr * v_stride;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      S[j][e] = state_value(base[(8 * j + (e & 1)) * k_stride + 8 * (e >> 1) * v_stride]);
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_slot_state(T* ht, const float (&S)[16][4], int k_stride, int v_stride, int vr,
                                                 int t4) {
  T* base = ht + 2 * t4 * k_stride + vr * v_stride;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) put_state(base + (8 * j + (e & 1)) * k_stride + 8 * (e >> 1) * v_stride, S[j][e]);
  }
}

// A padding row's output (state-pool form): zeros in this CTA's kBV columns of the sequence's len token rows from bos.
template <int kBV>
__device__ __forceinline__ void zero_output(__nv_bfloat16* out, int64_t bos, int64_t len, int64_t HV, int hv, int v0,
                                            int tid) {
  using C = RecurrenceConfig<kBV>;
  constexpr int kRowsPerPass = C::kThreads / C::kChunksU;
  const int ch = tid % C::kChunksU;
#pragma unroll 1
  for (int64_t row = tid / C::kChunksU; row < len; row += kRowsPerPass) {
    st_global_u4(out + ((bos + row) * HV + hv) * kHeadDim + v0 + ch * 8, make_uint4(0u, 0u, 0u, 0u));
  }
}

// k16 step ks of S^T_bf as an A fragment (mma.m16n8k16 and wgmma register-A layout): the state's K tiles 2ks, 2ks+1.
__device__ __forceinline__ void state_a_fragment(const float (&S)[16][4], int ks, uint32_t (&a)[4]) {
  a[0] = pack_bf16(S[2 * ks][0], S[2 * ks][1]);
  a[1] = pack_bf16(S[2 * ks][2], S[2 * ks][3]);
  a[2] = pack_bf16(S[2 * ks + 1][0], S[2 * ks + 1][1]);
  a[3] = pack_bf16(S[2 * ks + 1][2], S[2 * ks + 1][3]);
}

// S^T *= gamma column-wise: this lane's state columns k = 8j + 2*t4 + (e & 1) by exp2(g_last[k]) from the warp's
// gamma copy in shared memory (gamma_w, 128 fp32).
__device__ __forceinline__ void decay_state(float (&S)[16][4], uint32_t gamma_w, int t4) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 gm = ld_shared_f2(gamma_w + (8 * j + 2 * t4) * 4);
    S[j][0] *= gm.x;
    S[j][1] *= gm.y;
    S[j][2] *= gm.x;
    S[j][3] *= gm.y;
  }
}

// XOR swizzle of the 16-byte chunk index within a row of R >= 8 chunks: the 8 consecutive rows read by one 8x8
// ldmatrix matrix (same logical chunk) land in 8 distinct 16-byte slots of a 128-byte bank window.
template <int R>
__device__ __forceinline__ int swizzle_chunk(int row, int chunk) {
  static_assert(R >= 8, "rows of 8 or more 16-byte chunks");
  return chunk ^ (row & 7);
}

// Copy one [64 x R*8] bf16 tile (token rows) into swizzled smem: thread tid owns 16-byte chunk ch = tid % R of rows
// tid / R + i * (kThreads / R). src_row0 points at (token tok0, this head, first column); rows are row_stride elements
// apart. Rows >= L are zero-filled and their source is never read (the address is clamped to row 0 anyway).
// kSw128: the 128-byte-swizzle layout the warpgroup MMAs read instead (R = 16; w, qg, kg): chunk ch of row r goes to
// (ch / 8) * 8192 + r * 128 + ((ch ^ r) & 7) * 16, i.e. [2 halves][64 rows][128 B].
// kLowerBlocks (Aqk, R = 8): only the 16 x 16 blocks on and below the diagonal are read from global memory (the
// intra kernel writes no others); the blocks above it are zero-filled like the rows >= L.
template <int R, int kThreads, int kTensors, bool kSw128 = false, bool kLowerBlocks = false>
__device__ __forceinline__ void copy_tile(const uint32_t (&dst)[kTensors], const __nv_bfloat16* const (&src_row0)[kTensors],
                                          int64_t row_stride, int L, int tid) {
  static_assert(kThreads % R == 0 && (kChunk * R) % kThreads == 0, "copy split");
  static_assert(!kSw128 || R == 16, "the 128-byte-swizzle layout is for 128-column tiles");
  static_assert(!kLowerBlocks || R == 8, "the lower-block mask is for the 64-column Aqk tile");
  constexpr int kRowsPerPass = kThreads / R;
  const int ch = tid % R;
  const int r0 = tid / R;
#pragma unroll
  for (int i = 0; i < kChunk / kRowsPerPass; ++i) {
    const int row = r0 + i * kRowsPerPass;
    const bool valid = row < L && (!kLowerBlocks || aqk_chunk_written(row, ch));
    const int64_t src = (valid ? static_cast<int64_t>(row) * row_stride : 0) + ch * 8;
    uint32_t off;
    if constexpr (kSw128) {
      off = static_cast<uint32_t>((ch >> 3) * 8192 + row * 128 + (((ch ^ row) & 7) << 4));
    } else {
      off = static_cast<uint32_t>(row * (R * 16) + swizzle_chunk<R>(row, ch) * 16);
    }
#pragma unroll
    for (int t = 0; t < kTensors; ++t) cp_async_16(dst[t] + off, src_row0[t] + src, valid);
  }
}

// Issue the cp.async copies of one chunk's operands into one stage. Rows >= L are zero-filled (never read).
template <int kBV>
__device__ __forceinline__ void load_chunk(const KdaRecurrenceParams& p, uint32_t stage, int64_t tok0, int L,
                                           int64_t gchunk, int hv, int v0, int tid) {
  using C = RecurrenceConfig<kBV>;
  const int64_t HV = p.num_value_heads;
  const int64_t row_k = (tok0 * HV + hv) * kHeadDim;  // element offset of (tok0, hv, 0) in [Ttot, HV, 128]
  {  // (in the 128-byte-swizzle layout; kg is read MN-major from it)
    const uint32_t dst[3] = {stage + C::kOffW, stage + C::kOffQ, stage + C::kOffKG};
    const __nv_bfloat16* const src[3] = {static_cast<const __nv_bfloat16*>(p.w) + row_k,
                                         static_cast<const __nv_bfloat16*>(p.qg) + row_k,
                                         static_cast<const __nv_bfloat16*>(p.kg) + row_k};
    copy_tile<C::kChunksK, C::kThreads, 3, true>(dst, src, HV * kHeadDim, L, tid);
  }
  {
    const uint32_t dst[1] = {stage + C::kOffU};
    const __nv_bfloat16* const src[1] = {static_cast<const __nv_bfloat16*>(p.u) + row_k + v0};
    copy_tile<C::kChunksU, C::kThreads, 1>(dst, src, HV * kHeadDim, L, tid);
  }
  {
    const uint32_t dst[1] = {stage + C::kOffA};
    const __nv_bfloat16* const src[1] = {static_cast<const __nv_bfloat16*>(p.Aqk) + (tok0 * HV + hv) * kChunk};
    copy_tile<C::kChunksA, C::kThreads, 1, false, true>(dst, src, HV * kChunk, L, tid);
  }
  if (tid < C::kTileG / 16) {
    const float* gl = p.g_last + (gchunk * HV + hv) * kHeadDim + tid * 4;
    cp_async_16(stage + C::kOffG + tid * 16, gl, true);
  }
}

// ------------------------------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------------------------------

// One CTA's work; kPool: the state-pool form (KdaRecurrenceParams::state_indices), a kernel of its own so that the
// dense form's machine code stays what it was.
template <int kBV, bool kPool>
__device__ __forceinline__ void recurrence_cta(const KdaRecurrenceParams& p) {
  using C = RecurrenceConfig<kBV>;
  extern __shared__ __align__(1024) uint8_t smem[];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;   // groupID
  const int t4 = lane & 3;   // threadID_in_group
  // ldmatrix/stmatrix address roles. Lane l supplies row (l & 7) of 8x8 matrix l >> 3 (PTX ISA, ldmatrix).
  //  "T" order (ldmatrix.trans of u, stmatrix.trans of o): matrix i = (rows 8*(i & 1).., chunk i >> 1), so a lane
  //      addresses row lrow = l & 15 of a 16-row band, 16-byte chunk lhi = l >> 4 of a chunk pair.
  const int lrow = lane & 15;
  const int lhi = lane >> 4;

  const int HV = p.num_value_heads;
  int bid = static_cast<int>(blockIdx.x);
  const int vb = bid % C::kVBlocks;
  bid /= C::kVBlocks;
  const int hv = bid % HV;
  const int slot = bid / HV;
  if (slot >= p.num_seqs) return;
  const int n = p.seq_order != nullptr ? p.seq_order[slot] : slot;
  const int v0 = vb * kBV;

  // The device cu_seqlens may hold other values than the host copy that was checked and that chunk_offsets (and
  // g_last's rows) were built from (a CUDA-graph replay, a write torch's version counter did not see). Whatever its
  // values, the tokens are clamped into 0 <= bos <= eos <= num_tokens and the chunks into the sequence's g_last rows
  // [chunk0, chunk_offsets[n + 1]) (host-built): every workspace load, o store and g_last read stays in its tensor
  // and the chunk loop ends (a wrong o for such values, never an access outside).
  // (int32 clamps: num_tokens >= 0 is checked on the host; the chunk count in unsigned, no overflow near 2^31)
  const int bos32 = min(max(p.cu_seqlens[n], 0), p.num_tokens);
  const int eos32 = min(max(p.cu_seqlens[n + 1], bos32), p.num_tokens);
  const int64_t bos = bos32;
  const int64_t len = eos32 - bos32;
  const int chunk0_32 = p.chunk_offsets[n];
  const int64_t chunk0 = chunk0_32;
  const int num_chunks = min(static_cast<int>((static_cast<unsigned>(eos32 - bos32) + kChunk - 1) / kChunk),
                             max(p.chunk_offsets[n + 1] - chunk0_32, 0));

  const uint32_t smem_base = smem_addr(smem);
  const uint32_t gamma_w = smem_base + C::kOffGamma + warp * C::kTileG;
  // The swizzled tiles' descriptors assume a 1024-byte aligned base. It is: dynamic shared memory starts after the
  // 1 KB the SM90 reserves per CTA (ptxas folds this check away); kept as the assumption's statement.
  if ((smem_base & 1023u) != 0) __trap();

  // ---- S^T in registers: S[j][e], j = n8 tile over K (k = 8j + 2*t4 + (e & 1)), row v = vr + 8*(e >> 1).
  const int vr = v0 + warp * 16 + g;
  float S[16][4];
  // (the pool form: the slot, and whether it lies in the pool; a slot outside it is a padding row)
  int64_t state_base;
  bool in_pool = true;
  if constexpr (kPool) {
    const int pool_slot = p.state_indices[n];
    in_pool = pool_slot >= 0 && pool_slot < p.pool_size;
    state_base = (in_pool ? pool_slot : 0) * p.pool_slot_stride + static_cast<int64_t>(hv) * kHeadDim * kHeadDim;
  } else {
    state_base = (static_cast<int64_t>(n) * HV + hv) * kHeadDim * kHeadDim;
  }
  const bool reads_state =
      kPool ? in_pool && (p.has_initial_state == nullptr || p.has_initial_state[n] != 0) : p.initial_state != nullptr;
  if (!reads_state) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) S[j][e] = 0.f;
    }
  } else if constexpr (kPool) {
    const int k_stride = p.state_v_first ? 1 : kHeadDim;
    const int v_stride = p.state_v_first ? kHeadDim : 1;
    if (p.state_type == ScalarType::kFloat32) {
      load_slot_state(S, static_cast<const float*>(p.state_pool) + state_base, k_stride, v_stride, vr, t4);
    } else {
      load_slot_state(S, static_cast<const __nv_bfloat16*>(p.state_pool) + state_base, k_stride, v_stride, vr, t4);
    }
  } else if (p.state_type == ScalarType::kFloat32) {
    load_state(S, static_cast<const float*>(p.initial_state) + state_base, p.state_v_first, vr, t4);
  } else {
    load_state(S, static_cast<const __nv_bfloat16*>(p.initial_state) + state_base, p.state_v_first, vr, t4);
  }

  // Launched programmatically after the intra kernel (KdaRecurrenceParams::programmatic_launch), this CTA may run
  // while that grid still does: what it read above (the index arrays, the initial state) was written before the
  // intra kernel was launched, so its loads overlap the intra kernel's last CTAs (on the H200, 2026-11-30: B1 T512
  // 6% faster end to end, B2 T512 3%, the same bits); the workspace below is the intra kernel's output, read only
  // once that grid has finished and its writes are visible. (Without a programmatic launch the wait returns at once.)
  ptx::grid_dependency_wait();
  if constexpr (kPool) {
    if (!in_pool) {  // a padding row: its output is zeros (written after the wait, like every o store)
      zero_output<kBV>(static_cast<__nv_bfloat16*>(p.o), bos, len, HV, hv, v0, tid);
      return;
    }
  }

  // Prefetch chunk 0 while the initial state's loads are in flight.
  if (num_chunks > 0) {
    load_chunk<kBV>(p, smem_base, bos, static_cast<int>(len < kChunk ? len : kChunk), chunk0, hv, v0, tid);
    cp_async_commit();
  }

  // ---- Per-lane smem offsets (bytes, relative to a tile base).
  // u / o staging: row = 16*i + lrow, logical chunk 2*warp + lhi (this warp's 16 V columns).
  const uint32_t off_u = static_cast<uint32_t>(lrow * (C::kChunksU * 16) +
                                               swizzle_chunk<C::kChunksU>(lrow, 2 * warp + lhi) * 16);
  constexpr uint32_t kU16Rows = 16 * C::kChunksU * 16;  // bytes of 16 u rows

  const float scale = p.scale;
  const int64_t HV64 = HV;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.o);

  for (int c = 0; c < num_chunks; ++c) {
    // (c & 1 spelled out: through a stage-index helper ptxas scheduled the retired mma.sync kernel differently, and
    // this SASS is the one that ran on the H200)
    const uint32_t stage = smem_base + (c & 1) * C::kStageBytes;
    const int64_t tok0 = bos + static_cast<int64_t>(c) * kChunk;
    const int64_t rem = len - static_cast<int64_t>(c) * kChunk;
    const int L = static_cast<int>(rem < kChunk ? rem : kChunk);

    cp_async_wait_all();       // this thread's copies of chunk c have landed
    fence_proxy_async_smem();  // ... and are visible to the warpgroup MMAs' reads
    __syncthreads();           // everyone's copies are visible; everyone is done with chunk c-1's stage
    // Chunk c + 1 goes into the stage chunk c - 1 used.
    if (c + 1 < num_chunks) {
      const int64_t rem1 = rem - kChunk;
      load_chunk<kBV>(p, smem_base + ((c + 1) & 1) * C::kStageBytes, tok0 + kChunk,
                      static_cast<int>(rem1 < kChunk ? rem1 : kChunk), chunk0 + c + 1, hv, v0, tid);
      cp_async_commit();
    }

    // gamma = exp2(g_last) for the 128 K columns, one copy per warp (4 per lane).
    {
      const float4 gl = ld_shared_f4(stage + C::kOffG + lane * 16);
      st_shared_f4(gamma_w + lane * 16, make_float4(exp2f(gl.x), exp2f(gl.y), exp2f(gl.z), exp2f(gl.w)));
    }

    // ---- GEMM 1 and the qg half of the output, sharing the A fragments of S^T_bf:
    //   accV[nt] (16 x 8, tokens 8nt..8nt+7) = S^T_bf . w^T;  accO[nt] = S^T_bf . qg^T
    float accV[8][4], accO[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        accV[nt][e] = 0.f;
        accO[nt][e] = 0.f;
      }
    }
    // One warpgroup MMA per (tile, k16 step): this warpgroup's 64 V rows of S^T_bf (A, registers) times the 64 token
    // rows of w / qg (B, shared memory; the k16 step ks is 32 bytes into the 128-byte rows of K half ks / 4).
    uint32_t a[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) state_a_fragment(S, ks, a[ks]);
    wgmma_fence_operands(accV);
    wgmma_fence_operands(accO);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t k_off = static_cast<uint32_t>((ks >> 2) * 8192 + (ks & 3) * 32);
      wgmma_m64n64k16_bf16_rs(accV, a[ks], wgmma_desc_k_sw128(stage + C::kOffW + k_off));
      wgmma_m64n64k16_bf16_rs(accO, a[ks], wgmma_desc_k_sw128(stage + C::kOffQ + k_off));
    }
    wgmma_commit();
    wgmma_wait0();
    wgmma_fence_operands(accV);
    wgmma_fence_operands(accO);

    // ---- v_new^T = u^T - accV, rounded to bf16, packed straight into A fragments (k-step s = tokens 16s..16s+15).
    uint32_t vA[4][4];
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      // T order: 0 = (tokens 16s+0..7, v chunk 2w) -> (v=g, t=2t4,+1) of tile 2s = c0,c1
      //                  1 = (tokens 16s+8..15, chunk 2w) -> c0,c1 of tile 2s+1
      //                  2 = (tokens 16s+0..7, chunk 2w+1) -> c2,c3 of tile 2s;  3 -> c2,c3 of tile 2s+1
      uint32_t uu[4];
      ldsm_x4_trans(uu, stage + C::kOffU + s * kU16Rows + off_u);
      vA[s][0] = pack_bf16(bf16_lo(uu[0]) - accV[2 * s][0], bf16_hi(uu[0]) - accV[2 * s][1]);
      vA[s][1] = pack_bf16(bf16_lo(uu[2]) - accV[2 * s][2], bf16_hi(uu[2]) - accV[2 * s][3]);
      vA[s][2] = pack_bf16(bf16_lo(uu[1]) - accV[2 * s + 1][0], bf16_hi(uu[1]) - accV[2 * s + 1][1]);
      vA[s][3] = pack_bf16(bf16_lo(uu[3]) - accV[2 * s + 1][2], bf16_hi(uu[3]) - accV[2 * s + 1][3]);
    }

    // ---- o^T = scale * accO + v_new^T_bf . Aqk^T and S^T = S^T * gamma + v_new^T_bf . kg
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) accO[nt][e] *= scale;
    }
    // as warpgroup MMAs, one batch: accO += v_new^T_bf . Aqk^T (Aqk K-major: its 64 key columns are one 128-byte row
    // per query token; zeros above the diagonal are multiplied too) and S^T = S^T * gamma + v_new^T_bf . kg (kg
    // MN-major: 128 features over two 8 KB halves, 16 tokens per step).
    __syncwarp();  // gamma_w written by the other lanes of this warp
    decay_state(S, gamma_w, t4);
    wgmma_fence_operands(accO);
    wgmma_fence_operands(S);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      wgmma_m64n64k16_bf16_rs(accO, vA[s], wgmma_desc_k_sw128(stage + C::kOffA + s * 32));
      wgmma_m64n128k16_bf16_rs_mn(S, vA[s], wgmma_desc_mn_sw128(stage + C::kOffKG + s * 2048));
    }
    wgmma_commit();
    wgmma_wait0();
    wgmma_fence_operands(accO);
    wgmma_fence_operands(S);

    // ---- o: stage this warp's 16 columns in its own (already consumed) u slots, then 16-byte coalesced stores.
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint32_t r[4] = {pack_bf16(accO[2 * s][0], accO[2 * s][1]), pack_bf16(accO[2 * s + 1][0], accO[2 * s + 1][1]),
                             pack_bf16(accO[2 * s][2], accO[2 * s][3]), pack_bf16(accO[2 * s + 1][2], accO[2 * s + 1][3])};
      stsm_x4_trans(stage + C::kOffU + s * kU16Rows + off_u, r);
    }
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int row = 16 * s + lrow;
      const uint4 val = ld_shared_u4(stage + C::kOffU + s * kU16Rows + off_u);
      if (row < L) {
        const int64_t dst = ((tok0 + row) * HV64 + hv) * kHeadDim + v0 + (2 * warp + lhi) * 8;
        st_global_u4(out + dst, val);
      }
    }
  }

  // ---- final state: back into the pool slot (its dtype), or fp32 in the initial state's layout
  if constexpr (kPool) {
    const int k_stride = p.state_v_first ? 1 : kHeadDim;
    const int v_stride = p.state_v_first ? kHeadDim : 1;
    if (p.state_type == ScalarType::kFloat32) {
      store_slot_state(static_cast<float*>(p.state_pool) + state_base, S, k_stride, v_stride, vr, t4);
    } else {
      store_slot_state(static_cast<__nv_bfloat16*>(p.state_pool) + state_base, S, k_stride, v_stride, vr, t4);
    }
  } else if (p.final_state != nullptr) {
    float* ht = p.final_state + state_base;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int k = 8 * j + 2 * t4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int v = vr + 8 * h;
        if (p.state_v_first) {
          *reinterpret_cast<float2*>(ht + static_cast<int64_t>(v) * kHeadDim + k) =
              make_float2(S[j][2 * h], S[j][2 * h + 1]);
        } else {
          ht[static_cast<int64_t>(k) * kHeadDim + v] = S[j][2 * h];
          ht[static_cast<int64_t>(k + 1) * kHeadDim + v] = S[j][2 * h + 1];
        }
      }
    }
  }
}

template <int kBV>
__global__ void __launch_bounds__(RecurrenceConfig<kBV>::kThreads, 1)
    kda_recurrence_kernel(const __grid_constant__ KdaRecurrenceParams p) {
  recurrence_cta<kBV, false>(p);
}

// The state-pool form (KdaRecurrenceParams::state_indices not null).
template <int kBV>
__global__ void __launch_bounds__(RecurrenceConfig<kBV>::kThreads, 1)
    kda_recurrence_kernel_pool(const __grid_constant__ KdaRecurrenceParams p) {
  recurrence_cta<kBV, true>(p);
}

template <int kBV>
cudaError_t launch_recurrence_bv(const KdaRecurrenceParams& p, cudaStream_t stream) {
  using C = RecurrenceConfig<kBV>;
  const int64_t blocks = static_cast<int64_t>(p.num_seqs) * p.num_value_heads * C::kVBlocks;
  if (blocks <= 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const bool pool = p.state_indices != nullptr;
  const auto kernel = pool ? kda_recurrence_kernel_pool<kBV> : kda_recurrence_kernel<kBV>;
  if (C::kSmemBytes > 48 * 1024) {
    const cudaError_t err = pool ? allow_dynamic_smem<kda_recurrence_kernel_pool<kBV>>(C::kSmemBytes)
                                 : allow_dynamic_smem<kda_recurrence_kernel<kBV>>(C::kSmemBytes);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(C::kThreads);
  config.dynamicSmemBytes = C::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = p.programmatic_launch ? 1 : 0;
  config.attrs = &attribute;
  config.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, p);
  const cudaError_t last = cudaGetLastError();  // (clears the launch's error state either way)
  return err != cudaSuccess ? err : last;
}

}  // namespace recurrence_detail

cudaError_t launch_kda_recurrence(const KdaRecurrenceParams& params, int block_v, cudaStream_t stream) {
  switch (block_v) {
    case 64: return recurrence_detail::launch_recurrence_bv<64>(params, stream);
    case 128: return recurrence_detail::launch_recurrence_bv<128>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cula::sm90
