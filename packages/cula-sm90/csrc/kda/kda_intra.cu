// Kernel 1 of the split SM90 KDA prefill ("intra"): its launcher and the one list of the forms it launches. The
// per-item code and the kernel are in kda_intra_item.cuh; each form's instance is in a translation unit of its own
// (kda_intra_tensor.cu, kda_intra_bands.cu, kda_intra_unbounded.cu, and the timing-only kda_intra_ablation.cu).
#include <string>

#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_tensor(const KdaIntraParams& params, cudaStream_t stream);
cudaError_t launch_kda_intra_bands(const KdaIntraParams& params, cudaStream_t stream);
cudaError_t launch_kda_intra_unbounded(const KdaIntraParams& params, cudaStream_t stream);
#ifdef CULA_SM90_ABLATION
cudaError_t launch_kda_intra_ablation(const KdaIntraParams& params, int tuned, cudaStream_t stream);
#endif

// The forms the switch below launches (keep the two together).
constexpr int kIntraForms[] = {kTunedTensor, kTunedTensor | kTunedBands, kTunedTensor | kTunedUnbounded};

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

const char* kda_intra_forms_text() {  // "11, 15 or 4107", from kIntraForms
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
  switch (tuned) {
    case kTunedTensor: return launch_kda_intra_tensor(params, stream);
    case kTunedTensor | kTunedBands: return launch_kda_intra_bands(params, stream);
    case kTunedTensor | kTunedUnbounded: return launch_kda_intra_unbounded(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cula::sm90
