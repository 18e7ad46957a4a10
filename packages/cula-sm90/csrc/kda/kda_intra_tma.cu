// The default intra kernel with w and u stored by TMA (kTunedTmaStore on top of the tensor-core inverse: the same
// arithmetic, so the same bits): its kernel, which takes the two tensor descriptors as a __grid_constant__ parameter,
// and its launcher, which encodes them for each call's workspace pointers. Opt-in (CULA_SM90_INTRA_TUNED=tma) until
// the H200 has timed it. A translation unit of its own: instantiating more forms beside the default ones changes
// their code.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstring>

#include "kda/kda_intra_item.cuh"

namespace cula::sm90 {
namespace {

constexpr int kTmaForm = kTunedNorm | kTunedInverse | kTunedTensorInverse | kTunedTmaStore;

// (The descriptors are a parameter of their own, __grid_constant__ so that the TMA reads them where they are: with
// them inside one larger parameter struct ptxas gave the per-item code a 4-byte spill.)
__global__ void __launch_bounds__(kThreads, 2)
    kda_intra_tma_kernel(const KdaIntraParams p, const __grid_constant__ TmaDescriptorPair maps) {
  extern __shared__ __align__(1024) uint8_t smem[];
  grid_launch_dependents();
  intra_item<false, kTmaForm>(p, smem, blockIdx.x, blockIdx.y, 0, maps.map);
}

// cuTensorMapEncodeTiled from the driver, looked up once (the extension links the runtime only).
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// The descriptor of one [Ttot, HV, 128] bf16 workspace tensor: boxes of 64 features x 1 value head x 64 tokens, the
// 128-byte swizzle (the staging tiles' layout).
bool encode_workspace_map(TmaDescriptor& out, void* base, int num_tokens, int num_value_heads) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kD), static_cast<cuuint64_t>(num_value_heads),
                              static_cast<cuuint64_t>(num_tokens)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kD) * 2, static_cast<cuuint64_t>(num_value_heads) * kD * 2};
  const cuuint32_t box[3] = {64, 1, 64};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult res = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  static_assert(sizeof(map) == sizeof(out.bytes), "a CUtensorMap is 128 bytes");
  std::memcpy(out.bytes, &map, sizeof(map));
  return res == CUDA_SUCCESS;
}

}  // namespace

cudaError_t launch_kda_intra_tma(const KdaIntraParams& params, cudaStream_t stream) {
  TmaDescriptorPair maps{};
  if (!encode_workspace_map(maps.map[0], params.w, params.num_tokens, params.num_value_heads) ||
      !encode_workspace_map(maps.map[1], params.u, params.num_tokens, params.num_value_heads)) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t err = allow_dynamic_smem<kda_intra_tma_kernel>(static_cast<int>(kSmemBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(params.num_chunks), static_cast<unsigned>(params.num_value_heads));
  kda_intra_tma_kernel<<<grid, kThreads, kSmemBytes, stream>>>(params, maps);
  return cudaGetLastError();
}

}  // namespace cula::sm90
