// Kernel 1 of the split SM90 KDA prefill ("intra"): its launchers, and the persistent form. The per-item code and
// the one-CTA-per-item kernel are in kda_intra_item.cuh.
#include <string>

#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {
namespace {

// Persistent: gridDim.x CTAs walk the items (chunk, value head) with stride gridDim.x, value head fastest, each
// prefetching the rows of its item persistent_prefetch steps ahead into L2 while it computes the current one
// (0: no prefetch). The same arithmetic per item.
__global__ void __launch_bounds__(kThreads, 2) kda_intra_persistent_kernel(const KdaIntraParams p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int HV = p.num_value_heads;
  const int items = p.num_chunks * HV;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    if (item != static_cast<int>(blockIdx.x)) __syncthreads();  // the previous item's last shared reads are done
    intra_item<true>(p, smem, item / HV, item % HV, item);
  }
}

}  // namespace

cudaError_t launch_kda_intra_tensor(const KdaIntraParams& params, cudaStream_t stream);
cudaError_t launch_kda_intra_bands(const KdaIntraParams& params, cudaStream_t stream);
#ifdef CULA_SM90_ABLATION
cudaError_t launch_kda_intra_ablation(const KdaIntraParams& params, int tuned, cudaStream_t stream);
#endif

// The forms the switch below launches (keep the two together).
constexpr int kIntraForms[] = {0, kTunedNorm, kTunedInverse, kTunedNorm | kTunedInverse,
                               kTunedNorm | kTunedInverse | kTunedTensorInverse,
                               kTunedNorm | kTunedInverse | kTunedTensorInverse | kTunedBands};

bool kda_intra_form_built(int tuned) {
  for (const int form : kIntraForms) {
    if (form == tuned) return true;
  }
#ifdef CULA_SM90_ABLATION
  return kda_intra_ablation_built(tuned);
#else
  return false;
#endif
}

const char* kda_intra_forms_text() {  // "0, 1, ... or N", from kIntraForms
  static const std::string text = [] {
    constexpr int n = static_cast<int>(sizeof(kIntraForms) / sizeof(kIntraForms[0]));
    std::string joined;
    for (int i = 0; i < n; ++i) {
      if (i > 0) joined += i + 1 < n ? ", " : " or ";
      joined += std::to_string(kIntraForms[i]);
    }
    return joined;
  }();
  return text.c_str();
}

cudaError_t launch_kda_intra(const KdaIntraParams& params, int tuned, cudaStream_t stream) {
  if (params.num_chunks <= 0 || params.num_value_heads <= 0) return cudaSuccess;
#ifdef CULA_SM90_ABLATION
  if (tuned >= kAblateGate) {  // (the kAblate* bits)
    return launch_kda_intra_ablation(params, tuned, stream);
  }
#endif
  if (params.num_heads <= 0 || params.num_value_heads % params.num_heads != 0) return cudaErrorInvalidValue;
  if (params.persistent_ctas < 0 || params.persistent_prefetch < 0 || params.persistent_prefetch > 2) {
    return cudaErrorInvalidValue;
  }
  const int64_t items = static_cast<int64_t>(params.num_chunks) * params.num_value_heads;
  // (the persistent kernel counts items in int, up to items + persistent_prefetch * gridDim.x)
  if (params.persistent_ctas > 0 && params.persistent_ctas < items &&
      items + 2 * static_cast<int64_t>(params.persistent_ctas) <= INT32_MAX) {
    const cudaError_t err = allow_dynamic_smem<kda_intra_persistent_kernel>(static_cast<int>(kSmemBytes));
    if (err != cudaSuccess) return err;
    kda_intra_persistent_kernel<<<static_cast<unsigned>(params.persistent_ctas), kThreads, kSmemBytes, stream>>>(
        params);
    return cudaGetLastError();
  }
  switch (tuned) {
    case 0: return launch_one_cta_per_item<0>(params, stream);
    case kTunedNorm: return launch_one_cta_per_item<kTunedNorm>(params, stream);
    case kTunedInverse: return launch_one_cta_per_item<kTunedInverse>(params, stream);
    case kTunedNorm | kTunedInverse: return launch_one_cta_per_item<kTunedNorm | kTunedInverse>(params, stream);
    case kTunedNorm | kTunedInverse | kTunedTensorInverse: return launch_kda_intra_tensor(params, stream);
    case kTunedNorm | kTunedInverse | kTunedTensorInverse | kTunedBands: return launch_kda_intra_bands(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cula::sm90
