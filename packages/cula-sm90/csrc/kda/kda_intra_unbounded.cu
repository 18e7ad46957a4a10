// The intra kernel's form "unbounded": "tensor" exact for any log-gate <= 0 (kTunedUnbounded on top of kTunedTensor:
// the diagonal blocks split by levels, the column factors anchored at each key sub-chunk's last row, the in-kernel
// softplus gate; kda_intra_item.cuh). The shim runs it for every call whose gate can leave [-5, 0].
// A translation unit of its own: instantiating more forms beside the default ones changes their code.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_unbounded(const KdaIntraParams& params, cudaStream_t stream) {
  return launch_one_cta_per_item<kTunedTensor | kTunedUnbounded>(params, stream);
}

}  // namespace cula::sm90
