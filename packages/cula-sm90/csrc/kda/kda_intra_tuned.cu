// The intra kernel's opt-in tuned forms (kda_intra_item.cuh: kTunedIndex, kTunedEarlyG, kTunedHeadsFirst,
// kTunedPingPong, each on top of the default kTunedNorm | kTunedInverse), in a translation unit of their own:
// instantiated beside the other intra kernels, they change how nvcc compiles those (their PTX differs), which have
// run on the H200 as they are.
#include <algorithm>

#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {
namespace {

constexpr uint32_t kSlotBytes = (kSmemBytes + 1023) / 1024 * 1024;  // group 1's item starts 1024-aligned
constexpr uint32_t kPingPongSmemBytes = kSlotBytes + kSmemBytes;     // 207.25 KiB: one CTA per SM

// Ping-pong (kTunedPingPong): one persistent CTA per SM of two groups of 8 warps, each with its own item's shared
// memory. CTA c takes items c, c + G, c + 2G, ... (G CTAs; item = chunk * HV + value head, value head fastest), and
// its k-th item goes to group k % 2. The groups take turns loading: item k issues its loads only once item k - 1
// (of the other group) has its inputs in shared memory (barrier (B)), passed on named barrier 3 + group. So one group
// loads while the other computes, instead of both CTAs of an SM loading, then both computing, at the same time (the
// one-CTA-per-item kernel moves its bytes and issues its instructions one after the other: 2.1 TB/s with 47% of
// issue slots). The same arithmetic per item as the one-CTA-per-item kernel.
template <int kTuned>
__global__ void __launch_bounds__(2 * kThreads, 1) kda_intra_pingpong_kernel(const KdaIntraParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  // (only the item index lives across the item: the per-item code runs at the 128-register cap)
  for (int item = static_cast<int>(blockIdx.x + (threadIdx.x >> 8) * gridDim.x); item < p.num_chunks * p.num_value_heads;
       item += static_cast<int>(2 * gridDim.x)) {
    const int group = static_cast<int>(threadIdx.x >> 8);
    // this group's turn to load (the previous item has its inputs); all 256 of its threads are past their last item
    if (item != static_cast<int>(blockIdx.x)) asm volatile("bar.sync %0, 512;\n" ::"r"(3 + group) : "memory");
    const bool next = item + static_cast<int>(gridDim.x) < p.num_chunks * p.num_value_heads;
    const int ci = item / p.num_value_heads;
    intra_item<false, kTuned | kTunedPingPong>(p, smem + group * kSlotBytes, ci, item - ci * p.num_value_heads, item,
                                                next ? 4 - group : 0);
  }
}

template <int kTuned>
cudaError_t launch_pingpong(const KdaIntraParams& params, cudaStream_t stream) {
  const cudaError_t err = allow_dynamic_smem<kda_intra_pingpong_kernel<kTuned>>(static_cast<int>(kPingPongSmemBytes));
  if (err != cudaSuccess) return err;
  const int64_t items = static_cast<int64_t>(params.num_chunks) * params.num_value_heads;
  if (items > INT32_MAX) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  cudaError_t query = cudaGetDevice(&device);
  if (query == cudaSuccess) query = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (query != cudaSuccess) return query;
  const int64_t ctas = std::min<int64_t>(sms, (items + 1) / 2);
  kda_intra_pingpong_kernel<kTuned><<<static_cast<unsigned>(ctas), 2 * kThreads, kPingPongSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_kda_intra_opt_in(const KdaIntraParams& params, int tuned, cudaStream_t stream) {
  constexpr int kDefault = kTunedNorm | kTunedInverse;
  switch (tuned) {
    case kDefault | kTunedIndex: return launch_one_cta_per_item<kDefault | kTunedIndex>(params, stream);
    case kDefault | kTunedEarlyG: return launch_one_cta_per_item<kDefault | kTunedEarlyG>(params, stream);
    case kDefault | kTunedHeadsFirst: return launch_one_cta_per_item<kDefault | kTunedHeadsFirst>(params, stream);
    case kDefault | kTunedPingPong: return launch_pingpong<kDefault>(params, stream);
    case kDefault | kTunedPingPong | kTunedIndex: return launch_pingpong<kDefault | kTunedIndex>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cula::sm90
