// A timing aid for benchmarks/sm_share_kda.py, not part of any package: `hog_launch(ctas, ns, stream)` occupies
// `ctas` SMs for `ns` nanoseconds. Each CTA (one warp) takes 200 KiB of dynamic shared memory, so no second hog
// CTA, intra CTA (103.25 KiB) or recurrence CTA fits beside it: the kernels launched meanwhile on another stream
// run on the other SMs only. The CTA sleeps in 1-us steps on %globaltimer, issuing almost nothing and moving no
// bytes. Build: nvcc -arch=sm_90a -shared -Xcompiler -fPIC -o libsm_hog.so tools/sm_hog.cu
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kHogSmemBytes = 200 * 1024;

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// resident: pinned host memory, one int per CTA, set to 1 once the CTA runs (the host waits for all of them).
__global__ void sm_hog_kernel(uint64_t ns, int* resident) {
  extern __shared__ unsigned char smem[];
  smem[threadIdx.x] = 0;  // (the allocation is what matters; touching it keeps it)
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile int*>(resident + blockIdx.x) = 1;
    __threadfence_system();
  }
  const uint64_t start = global_ns();
  while (global_ns() - start < ns) __nanosleep(1000);
}

}  // namespace

extern "C" int hog_launch(int ctas, unsigned long long ns, int* resident, void* stream) {
  cudaError_t err = cudaFuncSetAttribute(sm_hog_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kHogSmemBytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  sm_hog_kernel<<<ctas, 32, kHogSmemBytes, static_cast<cudaStream_t>(stream)>>>(ns, resident);
  return static_cast<int>(cudaGetLastError());
}
