// cula_sm90._C: the pybind11 module. It never sees a torch tensor: the Python shim passes device
// pointers, sizes and the CUDA stream as integers, so this module links neither libtorch nor libpython.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/kda_entry.h"
#include "kda/varlen_index.h"
#include "probe_kernel.h"

namespace py = pybind11;

namespace {

// Raises RuntimeError naming the kernel when a launch returned a CUDA error.
int check_launch(const char* kernel, int code) {
  if (code != 0) {
    throw std::runtime_error(std::string("cula_sm90.") + kernel + ": CUDA error " + std::to_string(code) + " (" +
                             cula_sm90::cuda_error_name(code) + "): " + cula_sm90::cuda_error_string(code));
  }
  return code;
}

int probe_fill(std::uintptr_t ptr, std::int64_t n, float value, std::uintptr_t stream) {
  if (n < 0) {
    throw std::invalid_argument("cula_sm90.probe_fill: n must be >= 0, got " + std::to_string(n));
  }
  if (n > 0 && ptr == 0) {
    throw std::invalid_argument("cula_sm90.probe_fill: null device pointer");
  }
  if (ptr % alignof(float) != 0) {
    throw std::invalid_argument("cula_sm90.probe_fill: pointer is not aligned to 4 bytes (fp32)");
  }
  int code;
  {
    py::gil_scoped_release release;
    code = cula_sm90::probe_fill(ptr, n, value, stream);
  }
  return check_launch("probe_fill", code);
}

// The KDA kernels: argument order as in cula_sm90/kda.py. Pointers arrive as integers (0 = absent).
int kda_intra(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t g, std::uintptr_t beta,
              std::uintptr_t A_log, std::uintptr_t dt_bias, int g_type, int beta_type, std::uintptr_t cu_seqlens,
              std::uintptr_t chunk_indices, std::uintptr_t chunk_offsets, int num_tokens, int num_chunks,
              int num_heads, int num_value_heads, float scale, float lower_bound, bool l2norm_qk,
              bool gate_in_kernel, bool beta_sigmoid, bool allow_neg_eigval, bool gate_softplus, std::uintptr_t qg,
              std::uintptr_t kg,
              std::uintptr_t w, std::uintptr_t u, std::uintptr_t Aqk, std::uintptr_t g_last, int tuned,
              std::uintptr_t stream) {
  if (num_tokens < 0) {  // (the kernel clamps cu_seqlens into [0, num_tokens])
    throw std::invalid_argument("cula_sm90.kda_intra: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  }
  // (the valid forms are listed once, beside the launcher's switch; an ablation build adds its timing-only ones)
  if (!cula_sm90::kda_intra_form_built(tuned)) {
    throw std::invalid_argument(std::string("cula_sm90.kda_intra: tuned must be ") +
                                cula_sm90::kda_intra_forms_text() + "; got " + std::to_string(tuned));
  }
  const cula_sm90::KdaIntraArgs args{q, k, v, g, beta, A_log, dt_bias, g_type, beta_type, cu_seqlens,
                                     chunk_indices, chunk_offsets, num_tokens, num_chunks, num_heads,
                                     num_value_heads, scale, lower_bound, l2norm_qk, gate_in_kernel, beta_sigmoid,
                                     allow_neg_eigval, gate_softplus, qg, kg, w, u, Aqk, g_last, tuned};
  int code;
  {
    py::gil_scoped_release release;
    code = cula_sm90::kda_intra(args, stream);
  }
  return check_launch("kda_intra", code);
}

// The state-pool form's arguments come after the stream (with defaults: the dense form's calls keep their shape).
int kda_recurrence(std::uintptr_t qg, std::uintptr_t kg, std::uintptr_t w, std::uintptr_t u, std::uintptr_t Aqk,
                   std::uintptr_t g_last, std::uintptr_t cu_seqlens, std::uintptr_t chunk_offsets,
                   std::uintptr_t seq_order, std::uintptr_t initial_state, int state_type, std::uintptr_t final_state, std::uintptr_t o,
                   int num_seqs, int num_value_heads, float scale, bool state_v_first, int block_v,
                   bool programmatic_launch, int num_tokens, std::uintptr_t stream, std::uintptr_t state_pool,
                   std::uintptr_t state_indices, std::uintptr_t has_initial_state, int pool_size,
                   std::int64_t pool_slot_stride) {
  if (num_tokens < 0) {
    throw std::invalid_argument("cula_sm90.kda_recurrence: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  }
  if (block_v != 64 && block_v != 128) {  // (whole warpgroups: the products run as warpgroup MMAs)
    throw std::invalid_argument("cula_sm90.kda_recurrence: block_v must be 64 or 128, got " +
                                std::to_string(block_v));
  }
  if (state_indices == 0 && (state_pool != 0 || has_initial_state != 0)) {
    throw std::invalid_argument("cula_sm90.kda_recurrence: state_pool and has_initial_state need state_indices");
  }
  if (state_indices != 0 && (initial_state != 0 || final_state != 0 || pool_size < 0 || pool_slot_stride < 0 ||
                             (pool_size > 0 && state_pool == 0))) {
    throw std::invalid_argument("cula_sm90.kda_recurrence: with state_indices (the pool form) initial_state and "
                                "final_state must be 0, pool_size and pool_slot_stride >= 0, and state_pool set for "
                                "pool_size > 0");
  }
  const cula_sm90::KdaRecurrenceArgs args{qg, kg, w, u, Aqk, g_last, cu_seqlens, chunk_offsets, seq_order, initial_state,
                                          state_type, final_state, o, num_seqs, num_value_heads, scale,
                                          state_v_first, block_v, programmatic_launch, num_tokens, state_pool,
                                          state_indices, has_initial_state, pool_size, pool_slot_stride};
  int code;
  {
    py::gil_scoped_release release;
    code = cula_sm90::kda_recurrence(args, stream);
  }
  return check_launch("kda_recurrence", code);
}

// The varlen index arrays into a host int32 buffer (see varlen_index.h); returns (NT, offsets_at, order_at, size).
py::tuple varlen_launch_values(std::uintptr_t cu, std::int64_t n, int chunk, std::uintptr_t out,
                               std::int64_t capacity) {
  if (cu == 0 || out == 0 || n < 1 || chunk <= 0 || capacity < 0) {
    throw std::invalid_argument("cula_sm90.varlen_launch_values: needs host pointers, n >= 1, chunk > 0 and "
                                "capacity >= 0");
  }
  const auto layout = cula_sm90::varlen_launch_values(reinterpret_cast<const std::int32_t*>(cu), n, chunk,
                                                      reinterpret_cast<std::int32_t*>(out), capacity);
  if (layout.num_chunks < 0) {
    throw std::invalid_argument("cula_sm90.varlen_launch_values: decreasing boundaries, or capacity " +
                                std::to_string(capacity) + " too small");
  }
  return py::make_tuple(layout.num_chunks, layout.offsets_at, layout.order_at, layout.size);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cuLA native SM90 kernels (sm_90a). Use through the cula_sm90 shim, not directly.";

  m.def(
      "version", [] { return std::string(CULA_SM90_VERSION); },
      "The cula-sm90 version this extension was built as (must equal cula_sm90.__version__).");
  m.def(
      "compiled_archs", [] { return std::vector<std::string>{CULA_SM90_ARCHS}; },
      "The GPU architectures this extension holds machine code for, e.g. ['sm_90a'].");
  m.def("probe_fill", &probe_fill, py::arg("ptr"), py::arg("n"), py::arg("value"), py::arg("stream"),
        "Fill n fp32 values at device address ptr with value on the CUDA stream given as an integer "
        "(0: the legacy default stream). Returns the CUDA error code (0); raises RuntimeError naming the "
        "kernel when the launch fails, ValueError for a bad pointer or size.");
  m.def("kda_intra", &kda_intra, "KDA chunk-parallel kernel (see cula_sm90/kda.py); raises RuntimeError on a CUDA error.");
  m.def("intra_form_built", &cula_sm90::kda_intra_form_built, py::arg("tuned"),
        "Whether kda_intra has a kernel for the form code `tuned`; the codes of cula_sm90.kda._TUNED_FORMS must "
        "all be built (the timing-only \"ablate:\" ones only with CMake's CULA_SM90_ABLATION=ON).");
  m.def("varlen_launch_capacity", &cula_sm90::varlen_launch_capacity, py::arg("n"), py::arg("total"),
        py::arg("chunk"), "int32 slots varlen_launch_values needs at most for n sequences over total tokens.");
  m.def("varlen_launch_values", &varlen_launch_values, py::arg("cu"), py::arg("n"), py::arg("chunk"), py::arg("out"),
        py::arg("capacity"),
        "Chunk indices, chunk offsets and the longest-first order of a packed batch, from host boundaries cu[0..n] "
        "into the host int32 buffer out, on the host (no CUDA). Returns (NT, offsets_at, order_at, size).");
  m.def(
      "varlen_idle_bands",
      [](std::uintptr_t cu, std::int64_t n, int chunk) {
        if (cu == 0 || n < 1 || chunk <= 0) {
          throw std::invalid_argument("cula_sm90.varlen_idle_bands: needs a host pointer, n >= 1 and chunk > 0");
        }
        return cula_sm90::varlen_idle_bands(reinterpret_cast<const std::int32_t*>(cu), n, chunk);
      },
      py::arg("cu"), py::arg("n"), py::arg("chunk"),
      "The 16-row bands without a token in the sequences' partial last chunks, from host boundaries cu[0..n] "
      "(-1 for decreasing ones).");
  m.def("kda_recurrence", &kda_recurrence, py::arg("qg"), py::arg("kg"), py::arg("w"), py::arg("u"), py::arg("Aqk"),
        py::arg("g_last"), py::arg("cu_seqlens"), py::arg("chunk_offsets"), py::arg("seq_order"),
        py::arg("initial_state"), py::arg("state_type"), py::arg("final_state"), py::arg("o"), py::arg("num_seqs"),
        py::arg("num_value_heads"), py::arg("scale"), py::arg("state_v_first"), py::arg("block_v"),
        py::arg("programmatic_launch"), py::arg("num_tokens"), py::arg("stream"), py::arg("state_pool") = 0,
        py::arg("state_indices") = 0, py::arg("has_initial_state") = 0, py::arg("pool_size") = 0,
        py::arg("pool_slot_stride") = 0,
        "KDA state recurrence + output kernel (see cula_sm90/kda.py); with state_indices, the state-pool form "
        "(kda_params.h). Raises RuntimeError on a CUDA error.");
}
