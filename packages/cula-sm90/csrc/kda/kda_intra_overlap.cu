// The intra kernel with phase 4a inside phase 3 (kTunedOverlap on top of the default tuned forms: each diagonal
// block of Akk inverted by the warp that made it; the same bits as the default). A translation unit of its own:
// instantiating more forms beside the default ones changes their code.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_overlap(const KdaIntraParams& params, cudaStream_t stream) {
  return launch_one_cta_per_item<kTunedNorm | kTunedInverse | kTunedOverlap>(params, stream);
}

}  // namespace cula::sm90
