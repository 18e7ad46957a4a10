// The default intra kernel's form "tensor" (kTunedTensor: the off-diagonal inverse's products on the tensor cores, as
// bf16x3 MMAs). A translation unit of its own: instantiating more forms beside the default ones changes their code.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_tensor(const KdaIntraParams& params, cudaStream_t stream) {
  return launch_one_cta_per_item<kTunedTensor>(params, stream);
}

}  // namespace cula::sm90
