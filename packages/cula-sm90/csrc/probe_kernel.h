// Host-side entry points of the CUDA kernels in cula_sm90._C.
//
// Plain C++ types only, so module.cpp (compiled by the host compiler) needs no CUDA header: device
// pointers and streams arrive from Python as integers, and errors leave as cudaError_t codes.
#pragma once

#include <cstdint>

namespace cula_sm90 {

// Fills n floats at device address `out` with `value`, on `stream` (0: the legacy default stream).
// Returns the cudaError_t of the launch (0 on success); n == 0 launches nothing and returns 0.
int probe_fill(std::uintptr_t out, std::int64_t n, float value, std::uintptr_t stream);

// cudaGetErrorName / cudaGetErrorString for a code returned above.
const char* cuda_error_name(int code);
const char* cuda_error_string(int code);

}  // namespace cula_sm90
