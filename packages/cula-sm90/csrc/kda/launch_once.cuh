// Host-side launch helper shared by the SM90 KDA kernels: raise a kernel's dynamic shared-memory limit once per
// device instead of on every launch (the attribute stays set on the function in the device's context; asking the
// driver again costs a call per launch).
#pragma once

#include <atomic>

#include <cuda_runtime.h>

namespace cula::sm90 {

// `Kernel` is the __global__ function itself (a template argument, so each kernel has its own record of the
// devices it has been set up on: one bit per device ordinal below 64; higher ordinals set it on every launch).
template <auto Kernel>
cudaError_t allow_dynamic_smem(int bytes) {
  static std::atomic<unsigned long long> ready_devices{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const unsigned long long bit = device < 64 ? 1ull << device : 0ull;
  if (bit != 0 && (ready_devices.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit != 0) ready_devices.fetch_or(bit, std::memory_order_release);
  return err;
}

}  // namespace cula::sm90
