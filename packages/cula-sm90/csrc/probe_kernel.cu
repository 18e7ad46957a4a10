// probe_fill: the smallest real kernel of cula_sm90._C. It proves the build end to end (nvcc for
// sm_90a, CuTe headers from the nvidia-cutlass build requirement, the static CUDA runtime, a launch
// on the caller's stream) before the real SM90 kernels land.
#include "probe_kernel.h"

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

namespace cula_sm90 {
namespace {

constexpr int kThreadsPerBlock = 256;
// Grid-stride loop: enough blocks to fill an H200 (132 SMs) several times over, no more.
constexpr std::int64_t kMaxBlocks = 132 * 8;

__global__ void __launch_bounds__(kThreadsPerBlock) probe_fill_kernel(float* out, std::int64_t n, float value) {
  // A rank-1 CuTe view of the buffer: (n):(1).
  cute::Tensor gOut = cute::make_tensor(cute::make_gmem_ptr(out), cute::make_layout(cute::make_shape(n)));
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    gOut(i) = value;
  }
}

}  // namespace

int probe_fill(std::uintptr_t out, std::int64_t n, float value, std::uintptr_t stream) {
  if (n == 0) {
    return static_cast<int>(cudaSuccess);
  }
  const std::int64_t blocks_needed = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const unsigned int blocks = static_cast<unsigned int>(blocks_needed < kMaxBlocks ? blocks_needed : kMaxBlocks);
  probe_fill_kernel<<<blocks, kThreadsPerBlock, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<float*>(out), n, value);
  return static_cast<int>(cudaGetLastError());
}

const char* cuda_error_name(int code) { return cudaGetErrorName(static_cast<cudaError_t>(code)); }

const char* cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace cula_sm90
