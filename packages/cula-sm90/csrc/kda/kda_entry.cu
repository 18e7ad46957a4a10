// Converts the integer-typed arguments of kda_entry.h into the kernels' parameter structs and launches them.
#include "kda/kda_entry.h"

#include "kda/kda_params.h"

namespace cula_sm90 {
namespace {

template <typename T>
T* as_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cula::sm90::ScalarType scalar_type(int code) {
  return code == 1 ? cula::sm90::ScalarType::kBFloat16 : cula::sm90::ScalarType::kFloat32;
}

}  // namespace

int kda_intra(const KdaIntraArgs& a, std::uintptr_t stream) {
  cula::sm90::KdaIntraParams p{};
  p.q = as_ptr<const void>(a.q);
  p.k = as_ptr<const void>(a.k);
  p.v = as_ptr<const void>(a.v);
  p.g = as_ptr<const void>(a.g);
  p.beta = as_ptr<const void>(a.beta);
  p.A_log = as_ptr<const float>(a.A_log);
  p.dt_bias = as_ptr<const float>(a.dt_bias);
  p.g_type = scalar_type(a.g_type);
  p.beta_type = scalar_type(a.beta_type);
  p.cu_seqlens = as_ptr<const int32_t>(a.cu_seqlens);
  p.chunk_indices = as_ptr<const int32_t>(a.chunk_indices);
  p.chunk_offsets = as_ptr<const int32_t>(a.chunk_offsets);
  p.num_tokens = a.num_tokens;
  p.num_chunks = a.num_chunks;
  p.num_heads = a.num_heads;
  p.num_value_heads = a.num_value_heads;
  p.scale = a.scale;
  p.lower_bound = a.lower_bound;
  p.l2norm_qk = a.l2norm_qk;
  p.gate_in_kernel = a.gate_in_kernel;
  p.beta_sigmoid = a.beta_sigmoid;
  p.allow_neg_eigval = a.allow_neg_eigval;
  p.gate_softplus = a.gate_softplus;
  p.qg = as_ptr<void>(a.qg);
  p.kg = as_ptr<void>(a.kg);
  p.w = as_ptr<void>(a.w);
  p.u = as_ptr<void>(a.u);
  p.Aqk = as_ptr<void>(a.Aqk);
  p.g_last = as_ptr<float>(a.g_last);
  return static_cast<int>(cula::sm90::launch_kda_intra(p, a.tuned, reinterpret_cast<cudaStream_t>(stream)));
}

bool kda_intra_form_built(int tuned) { return cula::sm90::kda_intra_form_built(tuned); }

const char* kda_intra_forms_text() { return cula::sm90::kda_intra_forms_text(); }

int kda_recurrence(const KdaRecurrenceArgs& a, std::uintptr_t stream) {
  cula::sm90::KdaRecurrenceParams p{};
  p.qg = as_ptr<const void>(a.qg);
  p.kg = as_ptr<const void>(a.kg);
  p.w = as_ptr<const void>(a.w);
  p.u = as_ptr<const void>(a.u);
  p.Aqk = as_ptr<const void>(a.Aqk);
  p.g_last = as_ptr<const float>(a.g_last);
  p.cu_seqlens = as_ptr<const int32_t>(a.cu_seqlens);
  p.chunk_offsets = as_ptr<const int32_t>(a.chunk_offsets);
  p.seq_order = as_ptr<const int32_t>(a.seq_order);
  p.initial_state = as_ptr<const void>(a.initial_state);
  p.state_type = scalar_type(a.state_type);
  p.final_state = as_ptr<float>(a.final_state);
  p.o = as_ptr<void>(a.o);
  p.num_tokens = a.num_tokens;
  p.num_seqs = a.num_seqs;
  p.num_value_heads = a.num_value_heads;
  p.scale = a.scale;
  p.state_v_first = a.state_v_first;
  p.programmatic_launch = a.programmatic_launch;
  p.state_indices = as_ptr<const int32_t>(a.state_indices);
  p.has_initial_state = as_ptr<const uint8_t>(a.has_initial_state);
  p.state_pool = as_ptr<void>(a.state_pool);
  p.pool_size = a.pool_size;
  p.pool_slot_stride = a.pool_slot_stride;
  return static_cast<int>(
      cula::sm90::launch_kda_recurrence(p, a.block_v, reinterpret_cast<cudaStream_t>(stream)));
}

}  // namespace cula_sm90
