// The default intra kernel with w and u written by bulk (TMA) copies instead of vector stores (kTunedBulkStore on
// top of the tensor-core inverse: the same arithmetic, so the same bits). Opt-in (CULA_SM90_INTRA_TUNED=bulk) until
// the H200 has timed it. A translation unit of its own: instantiating more forms beside the default ones changes
// their code.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_bulk(const KdaIntraParams& params, cudaStream_t stream) {
  return launch_one_cta_per_item<kTunedNorm | kTunedInverse | kTunedTensorInverse | kTunedBulkStore>(params, stream);
}

}  // namespace cula::sm90
