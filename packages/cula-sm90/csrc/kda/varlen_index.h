// Host-side index arrays of a packed varlen batch, for the two KDA kernels: plain C++, no CUDA.
#pragma once

#include <cstdint>

namespace cula_sm90 {

// Parts of the buffer, in int32 values from its start, each on a 4-value (16-byte) boundary.
struct VarlenLaunchLayout {
  std::int64_t num_chunks;  // NT: chunk rows
  std::int64_t offsets_at;  // chunk offsets [N + 1] start here; chunk indices [NT][2] start at 0
  std::int64_t order_at;    // the launch order [N] starts here
  std::int64_t size;        // values used
};

// The values need at most this many int32 slots for n sequences over total tokens (chunks of `chunk` tokens).
std::int64_t varlen_launch_capacity(std::int64_t n, std::int64_t total, int chunk);

// From checked boundaries cu[0..n] (cu[0] = 0, non-decreasing), writes into out[0..capacity):
//   [0, 2 NT)                    chunk indices: (sequence, chunk within it) per chunk, sequences in order
//   [offsets_at, offsets_at+n+1) chunk offsets: the first chunk of each sequence, then NT
//   [order_at, order_at+n)       the sequences longest first, equal lengths in batch order
// with zeros in the gaps: the values of cula_runtime.index.prepare_varlen_launch. Returns the layout; num_chunks is
// -1 (nothing written past capacity) when the boundaries decrease or capacity is too small.
VarlenLaunchLayout varlen_launch_values(const std::int32_t* cu, std::int64_t n, int chunk, std::int32_t* out,
                                        std::int64_t capacity);

// The 16-row bands of the sequences' partial last chunks that hold no token: sum over sequences whose length is not a
// multiple of chunk of (chunk - len % chunk) / 16 (what the "bands" intra form skips). -1 for decreasing boundaries.
std::int64_t varlen_idle_bands(const std::int32_t* cu, std::int64_t n, int chunk);

}  // namespace cula_sm90
