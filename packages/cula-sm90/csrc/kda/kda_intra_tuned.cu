// The intra kernel's opt-in tuned forms (kda_intra_item.cuh: kTunedIndex, kTunedEarlyG, kTunedHeadsFirst, each on top
// of the default kTunedNorm | kTunedInverse), in a translation unit of their own: instantiated beside the other intra
// kernels, they change how nvcc compiles those (their PTX differs), which have run on the H200 as they are.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_opt_in(const KdaIntraParams& params, int tuned, cudaStream_t stream) {
  constexpr int kDefault = kTunedNorm | kTunedInverse;
  switch (tuned) {
    case kDefault | kTunedIndex: return launch_one_cta_per_item<kDefault | kTunedIndex>(params, stream);
    case kDefault | kTunedEarlyG: return launch_one_cta_per_item<kDefault | kTunedEarlyG>(params, stream);
    case kDefault | kTunedHeadsFirst: return launch_one_cta_per_item<kDefault | kTunedHeadsFirst>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cula::sm90
