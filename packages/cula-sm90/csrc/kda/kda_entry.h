// Host entry points of the KDA kernels for module.cpp: plain C++ types only (no CUDA header), device pointers
// and the stream as integers, errors returned as cudaError_t codes. See kda_params.h for the meaning of each value.
#pragma once

#include <cstdint>

namespace cula_sm90 {

struct KdaIntraArgs {
  std::uintptr_t q, k, v, g, beta, A_log, dt_bias;
  int g_type, beta_type;  // 0: fp32, 1: bf16
  std::uintptr_t cu_seqlens, chunk_indices, chunk_offsets;
  int num_tokens, num_chunks, num_heads, num_value_heads;
  float scale, lower_bound;
  bool l2norm_qk, gate_in_kernel, beta_sigmoid, allow_neg_eigval, gate_softplus;
  std::uintptr_t qg, kg, w, u, Aqk, g_last;
  int tuned;  // the kernel's form, a bit set (kda_params.h): 11 "tensor", 15 "bands" or 4107 "unbounded"
};

struct KdaRecurrenceArgs {
  std::uintptr_t qg, kg, w, u, Aqk, g_last, cu_seqlens, chunk_offsets, seq_order, initial_state;
  int state_type;  // 0: fp32, 1: bf16
  std::uintptr_t final_state, o;
  int num_seqs, num_value_heads;
  float scale;
  bool state_v_first;
  int block_v;  // 64 or 128 (warpgroup MMAs)
  bool programmatic_launch;  // launch as a programmatic dependent of the intra kernel (kda_params.h)
  int num_tokens;            // Ttot (kda_params.h)
  // the state-pool form (kda_params.h), when state_indices is not 0: then initial_state and final_state are 0
  std::uintptr_t state_pool, state_indices, has_initial_state;
  int pool_size;                   // P
  std::int64_t pool_slot_stride;   // elements
};

int kda_intra(const KdaIntraArgs& args, std::uintptr_t stream);
// Whether the extension has an intra kernel for the form `tuned`, and the valid forms as text; the one list is
// beside the launcher's switch (kda_intra.cu).
bool kda_intra_form_built(int tuned);
const char* kda_intra_forms_text();
int kda_recurrence(const KdaRecurrenceArgs& args, std::uintptr_t stream);

}  // namespace cula_sm90
