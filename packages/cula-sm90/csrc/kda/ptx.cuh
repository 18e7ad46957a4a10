// Inline-PTX helpers shared by the SM90 KDA kernels: cp.async, ldmatrix/stmatrix, mma.sync (bf16 -> fp32),
// ex2/rcp, bf16 packing, vector shared-memory accesses and the XOR swizzles of the shared-memory tiles.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cula::sm90::ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes == 0 zero-fills the destination without reading src.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// Programmatic dependent launch (PTX griddepcontrol, sm_90). launch_dependents: this CTA no longer holds back the
// launch of the grid that depends on this one (it launches once every CTA has said so or exited). wait: block until
// the grids this one depends on have completed and their memory is visible (a no-op without such a dependency).
__device__ __forceinline__ void grid_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_group0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8x8 b16 matrices. Lane l supplies the address of row (l & 7) of matrix (l >> 3); register i of lane
// (4*row + w) receives word w (columns 2w, 2w+1) of row `row` of matrix i (transposed with .trans).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// Two 8x8 b16 matrices, transposed: lanes 0-15 supply the row addresses (lane l: row l & 7 of matrix l >> 3).
__device__ __forceinline__ void ldsm_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ void stsm_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// D = A (16x16, row) * B (16x8, col) + D, bf16 inputs, fp32 accumulate.
// Fragments (g = lane >> 2, t = lane & 3):
//   a[0]: A[g][2t..2t+1]   a[1]: A[g+8][2t..]   a[2]: A[g][2t+8..]   a[3]: A[g+8][2t+8..]
//   b0:   B[2t..2t+1][g]   b1:   B[2t+8..2t+9][g]
//   d[0], d[1]: D[g][2t], D[g][2t+1]     d[2], d[3]: D[g+8][2t], D[g+8][2t+1]
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- Warpgroup MMA (sm_90a): D (64 x 64 fp32, this warp's 16 rows) += A (64 x 16 bf16, registers) * B (16 x 64
// bf16, shared memory through a descriptor). A and D use the per-warp fragments of mma.m16n8k16 above (warp w of
// the warpgroup holds rows 16w..16w+15; d[j] is n8 tile j). The four calls below are the whole protocol: fence, any
// number of MMAs, commit, wait. A and D registers must not be touched between an MMA and the wait.

// Shared-memory descriptor of a K-major bf16 B operand in 128-byte-swizzle layout: rows (N) of 128 bytes, 8-row
// groups 1024 bytes apart, the 16-byte chunks of row r XOR-permuted by r & 7 (the tile 1024-byte aligned). `addr` is
// the shared address of this k16 slice (tile + 32 bytes per k16 step inside a 128-byte row).
__device__ __forceinline__ uint64_t wgmma_desc_k_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFFu) | (static_cast<uint64_t>(1) << 16)  // leading offset (unused)
         | (static_cast<uint64_t>(1024 >> 4) << 32)                                       // 8-row group stride
         | (static_cast<uint64_t>(1) << 62);                                              // 128-byte swizzle
}
// The same for an MN-major B operand (N contiguous): rows of 128 bytes hold 64 consecutive N, one per K index; the
// 8-row (K) groups are 1024 bytes apart, the 64-wide N blocks 8192 bytes apart, 128-byte swizzle as above. `addr`:
// the k16 slice (tile + 2048 bytes per k16 step).
__device__ __forceinline__ uint64_t wgmma_desc_mn_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFFu) | (static_cast<uint64_t>(8192 >> 4) << 16)  // N-block stride
         | (static_cast<uint64_t>(1024 >> 4) << 32)                                             // 8-row K groups
         | (static_cast<uint64_t>(1) << 62);                                                    // 128-byte swizzle
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Shared memory written through the generic proxy (st.shared, cp.async) made visible to wgmma's (async proxy) reads.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins the accumulator registers at this point of the program (compiler-level: reads of D stay after the wait).
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
  }
}
__device__ __forceinline__ void wgmma_m64n64k16_bf16_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  // scale-d is a predicate (D += A B when true); then scale-a = scale-b = 1 and B not transposed (K-major)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b)
      : "memory");
}

// D (64 x 128 fp32) += A (64 x 16 bf16, registers) * B (16 x 128 bf16, MN-major shared memory: wgmma_desc_mn_sw128).
__device__ __forceinline__ void wgmma_m64n128k16_bf16_rs_mn(float (&d)[16][4], const uint32_t (&a)[4],
                                                            uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b)
      : "memory");
}

// 2^x, flushing subnormal results to zero (one MUFU.EX2). Used where the result is known to be normal.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// 2^x with subnormal results kept (used for the per-column anchor factors, which may be tiny).
__device__ __forceinline__ float ex2_full(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) (one MUFU.LG2), subnormal inputs flushed; max absolute error 2^-22.6 on [0.5, 2].
__device__ __forceinline__ float lg2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x, max 1 ulp error, subnormal results flushed (rcp.approx(+inf) = 0).
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Round two floats to bf16 (round to nearest even) and pack: `lo` in bits 0..15, `hi` in bits 16..31.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf16_bits(unsigned short h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
__device__ __forceinline__ float round_bf16(float x) { return bf16_lo(pack_bf16x2(x, 0.f)); }

__device__ __forceinline__ float4 ld_shared_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_f4(uint32_t addr, float4 v) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
// One 16-byte global store (ptr 16-byte aligned). Spelled out: through a uint4 pointer into bf16 data nvcc sometimes
// emits four 4-byte stores (it did for three of the recurrence's four o rows per chunk, and for all four at BV 64).
__device__ __forceinline__ void st_global_u4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_shared_u4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Byte offset of 16-byte chunk `ch` of row `r` in a tile of 256-byte rows (128 bf16), XOR-swizzled so that
// 8 consecutive rows at one logical chunk fall in 8 different bank groups (ldmatrix is conflict-free).
__device__ __forceinline__ uint32_t swz256(int r, int ch) {
  return static_cast<uint32_t>(r * 256 + ((ch ^ (r & 7)) << 4));
}
// Same for tiles of 128-byte rows (64 bf16).
__device__ __forceinline__ uint32_t swz128(int r, int ch) {
  return static_cast<uint32_t>(r * 128 + ((ch ^ (r & 7)) << 4));
}

}  // namespace cula::sm90::ptx
