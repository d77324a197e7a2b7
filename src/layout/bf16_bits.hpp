// The bf16 conversions on the bits of an fp32 value: one definition for the host (dtype.cpp) and
// the device (src/executor/cuda/convert.cuh), so both round alike by construction (round to
// nearest even; a NaN stays a NaN, quieted, its sign and top payload bits kept).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TIDE_BF16_FN __host__ __device__ __forceinline__
#else
#define TIDE_BF16_FN inline
#endif

namespace tide::detail {

TIDE_BF16_FN uint16_t bf16_bits_from_float_bits(uint32_t u) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040);  // NaN
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

TIDE_BF16_FN uint32_t float_bits_from_bf16_bits(uint16_t bits) {
  return static_cast<uint32_t>(bits) << 16;
}

}  // namespace tide::detail
