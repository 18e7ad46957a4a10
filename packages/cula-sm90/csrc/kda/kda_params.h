// Parameters of the two SM90 KDA prefill kernels (the split design: chunk-parallel "intra", then the
// sequential "recurrence"), and the workspace contract between them.
//
// Every tensor is dense and token-major. Fixed-length batches are passed as one packed batch: the Python shim
// turns B sequences of length T into cu_seqlens = [0, T, 2T, ..., B*T], so the kernels only know packed varlen.
//   Ttot = total tokens, N = sequences, NT = total chunks (64 tokens; each sequence's chunks start at its first
//   token; only a sequence's last chunk may be partial), H = q/k heads, HV = value heads (HV % H == 0; value
//   head hv reads q/k head hv / (HV / H)), K = V = 128.
// Index tensors (int32, on the device):
//   cu_seqlens    [N + 1]   sequence n is tokens [cu_seqlens[n], cu_seqlens[n+1])
//   chunk_indices [NT, 2]   row i = (sequence id, chunk id within the sequence), sequences in order
//   chunk_offsets [N + 1]   global index of sequence n's first chunk; chunk_offsets[N] = NT
//   seq_order     [N]       optional: the sequences longest first (the recurrence's launch order)
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace cula::sm90 {

constexpr int kChunk = 64;
constexpr int kHeadDim = 128;  // K = V = 128

// Aqk's [64][64] bf16 tile per chunk holds only its 16 x 16 blocks on and below the diagonal: the intra kernel writes
// 16-byte chunk `ch` (8 columns) of row `row` iff this holds (its store spells the test out, see there), and the
// recurrence reads exactly those (zero-filling the others in shared memory).
__host__ __device__ constexpr bool aqk_chunk_written(int row, int ch) { return (ch >> 1) <= (row >> 4); }

enum class ScalarType : int { kFloat32 = 0, kBFloat16 = 1 };

// Kernel 1 ("intra"): one CTA per (chunk, value head); no dependency between chunks.
struct KdaIntraParams {
  // inputs
  const void* q;          // bf16 [Ttot, H, K]
  const void* k;          // bf16 [Ttot, H, K]
  const void* v;          // bf16 [Ttot, HV, V]
  const void* g;          // [Ttot, HV, K], dtype g_type: raw gate if gate_in_kernel, else log-gate in [lower_bound, 0]
  const void* beta;       // [Ttot, HV], dtype beta_type: logits if beta_sigmoid, else beta itself
  const float* A_log;     // [HV] or nullptr (gate multiplier exp(A_log[hv]); nullptr means 1)
  const float* dt_bias;   // [HV * K] or nullptr
  ScalarType g_type;
  ScalarType beta_type;
  const int32_t* cu_seqlens;
  const int32_t* chunk_indices;
  const int32_t* chunk_offsets;
  int num_tokens;         // Ttot
  int num_chunks;         // NT
  int num_heads;          // H
  int num_value_heads;    // HV
  float scale;            // query scale (already resolved; K**-0.5 by default)
  float lower_bound;      // safe gate: g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)); in [-5, 0)
  bool l2norm_qk;         // q, k <- x / sqrt(sum(x^2) + 1e-6), fp32 math, rounded to bf16 before use
  bool gate_in_kernel;    // compute the safe gate from raw g (else g is already the log-gate)
  bool beta_sigmoid;      // beta <- sigmoid(beta) (2 * sigmoid with allow_neg_eigval)
  bool allow_neg_eigval;
  // outputs (the workspace), all dense:
  void* qg;               // bf16 [Ttot, HV, K]  q ⊙ exp(Γ)              (no scale)
  void* kg;               // bf16 [Ttot, HV, K]  k ⊙ exp(Γ_last − Γ)
  void* w;                // bf16 [Ttot, HV, K]  Tinv · (β ⊙ k ⊙ exp(Γ))
  void* u;                // bf16 [Ttot, HV, V]  Tinv · (β ⊙ v)
  void* Aqk;              // bf16 [Ttot, HV, 64] scale·Σ_k q_i k_j exp(Γ_i − Γ_j) for j <= i (local index j); only the
                          //                      16 x 16 blocks on and below the diagonal are written (3 KB fewer
                          //                      bytes per chunk each way): the recurrence reads no others
  float* g_last;          // fp32 [NT, HV, K]    Γ_last / ln 2 (log2 units): the chunk's total decay exponent
  // The in-kernel gate's form (with gate_in_kernel; last, so that the members above keep their offsets): false the
  // lower-bound form above, true Kimi-Linear's softplus form g = -exp(A_log) * softplus(g + dt_bias) (torch's
  // softplus: x for x > 20), unbounded below: only the "unbounded" intra form (kTunedUnbounded) serves it.
  bool gate_softplus;
};

// Kernel 2 ("recurrence"): one CTA per (sequence, value head, V block); walks the sequence's chunks in order.
// CTAs are numbered V block fastest, then value head, then sequence slot; slot s runs sequence seq_order[s] (or s),
// so with seq_order longest first the longest chains start in the first wave and the short ones fill in behind.
struct KdaRecurrenceParams {
  const void* qg;         // workspace from kernel 1
  const void* kg;
  const void* w;
  const void* u;
  const void* Aqk;
  const float* g_last;
  const int32_t* cu_seqlens;
  const int32_t* chunk_offsets;
  const int32_t* seq_order;   // [N] or nullptr (slot order)
  const void* initial_state;  // [N, HV, K, V] (or [N, HV, V, K] if state_v_first), dtype state_type, or nullptr
  ScalarType state_type;      // (of the pool in the state-pool form below)
  float* final_state;         // fp32, same layout, or nullptr
  void* o;                    // bf16 [Ttot, HV, V]
  int num_seqs;               // N
  int num_value_heads;        // HV
  float scale;
  bool state_v_first;
  // Launch as a programmatic dependent of the kernel before it on the stream (the intra kernel): the grid launches
  // while the intra kernel's last CTAs run, and its CTAs read the index arrays and the initial state, then wait for
  // it to finish (griddepcontrol) before they read the workspace.
  bool programmatic_launch;
  // Ttot: the workspace's and o's token rows (for TMA descriptors of the workspace; last, so that the other members
  // keep their offsets: inserted before num_seqs it changed the warpgroup-MMA kernels' register allocation)
  int num_tokens;
  // The state-pool form (issue 26; after the members above, which keep their offsets; its own kernel,
  // kda_recurrence_kernel_pool), taken when state_indices is not null; initial_state and final_state are null then.
  // The CTAs of sequence n read its start state from slot s = state_indices[n] of state_pool ([P, HV, K, V], or
  // [P, HV, V, K] if state_v_first; dtype state_type; slot p at p * pool_slot_stride elements, each slot dense; only
  // element-aligned) and write its final state back there in place (bf16: rounded to nearest even). A slot outside
  // [0, pool_size) makes n a padding row: nothing read or written in the pool, its o rows zeros. has_initial_state[n]
  // == 0: n starts from zeros (its final state is still written).
  // The in-place update needs no barrier: each CTA owns one (slot, head, V block) piece, each thread reads its
  // elements of it first and writes the same elements at the end, and no other CTA touches the piece as long as no
  // two sequences share a slot (the host refuses duplicates where it sees the values). Like initial_state, the
  // index arrays and the start state are read before the programmatic wait (written before the intra kernel was
  // launched); the final state is written after it.
  const int32_t* state_indices;        // [N] or nullptr (the dense form above)
  const uint8_t* has_initial_state;    // bool [N] (one byte each) or nullptr (every sequence reads its slot)
  void* state_pool;                    // [P, HV, K, V] or [P, HV, V, K] (unused when pool_size == 0)
  int pool_size;                       // P
  int64_t pool_slot_stride;            // elements from slot p to slot p + 1
};

// Launchers: enqueue on `stream`, return the launch's cudaError_t (cudaGetLastError after the launch).
// tuned: the intra kernel's form as a bit set (kda_intra_item.cuh): 11 = "tensor" (the inverse's products on the
// tensor cores), 15 = 11 computing only the 16-row bands that hold tokens ("bands"; the shim's default "auto" picks 11
// or 15 per call), 4107 = 11 for any log-gate <= 0 ("unbounded": the diagonal blocks split by levels, KDA_SPEC §3.7;
// the shim runs it for every call whose gate can leave [-5, 0]), and in a CULA_SM90_ABLATION build the timing-only
// forms.
cudaError_t launch_kda_intra(const KdaIntraParams& params, int tuned, cudaStream_t stream);
// Whether launch_kda_intra has a kernel for `tuned` (the one list of valid forms: the extension's argument check and
// the Python shim's form names are tested against it), and that list as text for messages.
bool kda_intra_form_built(int tuned);
const char* kda_intra_forms_text();
#ifdef CULA_SM90_ABLATION
bool kda_intra_ablation_built(int tuned);  // the timing-only forms of kda_intra_ablation.cu
#endif
// block_v: the V columns per CTA, 64 or 128 (whole warpgroups, products on warpgroup MMAs); anything else is
// cudaErrorInvalidValue.
cudaError_t launch_kda_recurrence(const KdaRecurrenceParams& params, int block_v, cudaStream_t stream);

}  // namespace cula::sm90
