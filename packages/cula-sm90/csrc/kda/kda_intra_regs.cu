// The tensor-core-inverse intra kernel's form that keeps each thread's Γ2 values in registers from phase 1 to phase
// 2a (kTunedGammaRegs on top of kTunedNorm | kTunedInverse | kTunedTensorInverse): no fp32 Γ2 tile round trip
// through shared memory, phase 2b folded into phase 2a, one barrier fewer; the same bits as "tensor". Opt-in
// ("regs") until the H200 has run and timed it.
// A translation unit of its own: instantiating more forms beside the default ones changes their code.
#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {

cudaError_t launch_kda_intra_regs(const KdaIntraParams& params, cudaStream_t stream) {
  return launch_one_cta_per_item<kTunedNorm | kTunedInverse | kTunedTensorInverse | kTunedGammaRegs>(params, stream);
}

}  // namespace cula::sm90
