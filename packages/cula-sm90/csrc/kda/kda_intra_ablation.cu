// Timing-only forms of the intra kernel: the default tuned kernel without one phase's arithmetic, or without its
// global loads and/or stores (the kAblate* bits of kda_intra_item.cuh). Built only when CMake's CULA_SM90_ABLATION is
// ON (tools/h200_setup.sh with CULA_SM90_ABLATION=1), for measurements on the H200; never in a wheel. Their outputs
// are garbage by design.
// A translation unit of its own: instantiating more forms beside the default ones changes their code.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

constexpr int kBase = kTunedTensor;  // the default form
// The forms the switch below launches (keep the two together).
constexpr int kAblationForms[] = {kBase | kAblateGate, kBase | kAblateNormExp, kBase | kAblateProducts,
                                  kBase | kAblateInverse, kBase | kAblateSolve, kBase | kAblateLoads,
                                  kBase | kAblateStores, kBase | kAblateStoresWU,
                                  kBase | kAblateLoads | kAblateStores};

bool kda_intra_ablation_built(int tuned) {
  for (const int form : kAblationForms) {
    if (form == tuned) return true;
  }
  return false;
}

cudaError_t launch_kda_intra_ablation(const KdaIntraParams& params, int tuned, cudaStream_t stream) {
  switch (tuned) {
    case kBase | kAblateGate: return launch_one_cta_per_item<kBase | kAblateGate>(params, stream);
    case kBase | kAblateNormExp: return launch_one_cta_per_item<kBase | kAblateNormExp>(params, stream);
    case kBase | kAblateProducts: return launch_one_cta_per_item<kBase | kAblateProducts>(params, stream);
    case kBase | kAblateInverse: return launch_one_cta_per_item<kBase | kAblateInverse>(params, stream);
    case kBase | kAblateSolve: return launch_one_cta_per_item<kBase | kAblateSolve>(params, stream);
    case kBase | kAblateLoads: return launch_one_cta_per_item<kBase | kAblateLoads>(params, stream);
    case kBase | kAblateStores: return launch_one_cta_per_item<kBase | kAblateStores>(params, stream);
    case kBase | kAblateStoresWU: return launch_one_cta_per_item<kBase | kAblateStoresWU>(params, stream);
    case kBase | kAblateLoads | kAblateStores:
      return launch_one_cta_per_item<kBase | kAblateLoads | kAblateStores>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cula::sm90
