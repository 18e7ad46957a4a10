// The intra kernel's form "bands": "tensor" computing only the 16-row bands holding valid rows (kTunedBands on top of
// kTunedTensor): the same bits, less work in each sequence's partial last chunk. The shim's default ("auto") runs it
// for calls with many such chunks.
// A translation unit of its own: instantiating more forms beside the default ones changes their code.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_bands(const KdaIntraParams& params, cudaStream_t stream) {
  return launch_one_cta_per_item<kTunedTensor | kTunedBands>(params, stream);
}

}  // namespace cula::sm90
