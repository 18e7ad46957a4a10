// The default intra kernel: the tuned forms with the off-diagonal inverse's products on the tensor cores
// (kTunedTensorInverse on top of kTunedNorm | kTunedInverse: bf16x3 MMAs, other low bits than the FMA form). A
// translation unit of its own: instantiating more forms beside the default ones changes their code.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_tensor(const KdaIntraParams& params, cudaStream_t stream) {
  return launch_one_cta_per_item<kTunedNorm | kTunedInverse | kTunedTensorInverse>(params, stream);
}

}  // namespace cula::sm90
