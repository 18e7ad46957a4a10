// See varlen_index.h.
#include "kda/varlen_index.h"

#include <algorithm>
#include <numeric>
#include <vector>

namespace cula_sm90 {
namespace {

constexpr std::int64_t kPartAlign = 4;

std::int64_t aligned(std::int64_t values) { return (values + kPartAlign - 1) / kPartAlign * kPartAlign; }

}  // namespace

std::int64_t varlen_launch_capacity(std::int64_t n, std::int64_t total, int chunk) {
  // each sequence has at most floor(len / chunk) + 1 chunks, so NT <= total / chunk + n
  const std::int64_t max_chunks = (chunk > 0 ? total / chunk : 0) + n;
  return aligned(2 * max_chunks) + aligned(n + 1) + n;
}

VarlenLaunchLayout varlen_launch_values(const std::int32_t* cu, std::int64_t n, int chunk, std::int32_t* out,
                                        std::int64_t capacity) {
  VarlenLaunchLayout layout{-1, 0, 0, 0};
  if (n < 0 || chunk <= 0) return layout;
  std::int64_t num_chunks = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    const std::int64_t len = static_cast<std::int64_t>(cu[s + 1]) - cu[s];
    if (len < 0) return layout;
    num_chunks += (len + chunk - 1) / chunk;
  }
  const std::int64_t offsets_at = aligned(2 * num_chunks);
  const std::int64_t order_at = offsets_at + aligned(n + 1);
  const std::int64_t size = order_at + n;
  if (size > capacity) return layout;
  std::fill(out, out + size, 0);
  std::int64_t row = 0;
  std::int32_t* offsets = out + offsets_at;
  for (std::int64_t s = 0; s < n; ++s) {
    offsets[s] = static_cast<std::int32_t>(row);
    const std::int64_t chunks = (static_cast<std::int64_t>(cu[s + 1]) - cu[s] + chunk - 1) / chunk;
    for (std::int64_t c = 0; c < chunks; ++c, ++row) {
      out[2 * row] = static_cast<std::int32_t>(s);
      out[2 * row + 1] = static_cast<std::int32_t>(c);
    }
  }
  offsets[n] = static_cast<std::int32_t>(row);
  std::int32_t* order = out + order_at;
  std::iota(order, order + n, 0);
  std::stable_sort(order, order + n, [cu](std::int32_t a, std::int32_t b) {
    return static_cast<std::int64_t>(cu[a + 1]) - cu[a] > static_cast<std::int64_t>(cu[b + 1]) - cu[b];
  });
  return {num_chunks, offsets_at, order_at, size};
}

std::int64_t varlen_idle_bands(const std::int32_t* cu, std::int64_t n, int chunk) {
  std::int64_t idle = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    const std::int64_t len = static_cast<std::int64_t>(cu[s + 1]) - cu[s];
    if (len < 0) return -1;
    const std::int64_t tail = len % chunk;
    if (tail != 0) idle += (chunk - tail) / 16;
  }
  return idle;
}

}  // namespace cula_sm90
