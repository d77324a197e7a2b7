// Device-side element conversions and 8-wide vector accesses, bit for bit as tide/dtype.hpp's host
// versions (round to nearest even, the same NaN encodings; bf16 from the one definition in
// src/layout/bf16_bits.hpp), for the executor's kernels (cast_task.cuh, reduce_task.cuh).
// CUDA-only (include from .cu files).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels.cuh"
#include "layout/bf16_bits.hpp"

namespace tide::cuda_kernels {

__device__ __forceinline__ float bf16_to_float(uint16_t bits) {
  return __uint_as_float(detail::float_bits_from_bf16_bits(bits));
}

__device__ __forceinline__ uint16_t float_to_bf16(float value) {
  return detail::bf16_bits_from_float_bits(__float_as_uint(value));
}

__device__ __forceinline__ float fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exp = (bits >> 10) & 0x1F;
  const uint32_t mant = bits & 0x3FF;
  if (exp == 0) {
    const float v = __fmul_rn(static_cast<float>(mant), 1.0f / 16777216.0f);  // exact
    return sign ? -v : v;
  }
  if (exp == 31) return __uint_as_float(sign | 0x7F800000u | (mant << 13));  // keeps NaN payloads
  return __uint_as_float(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

__device__ __forceinline__ uint16_t float_to_fp16(float value) {
  if (isnan(value))
    return static_cast<uint16_t>(((__float_as_uint(value) >> 16) & 0x8000) | 0x7E00);
  // IEEE round to nearest even, subnormals and overflow to inf included: the host's algorithm.
  return __half_as_ushort(__float2half_rn(value));
}

// Round to nearest even, saturated to +-448, NaN as the host's sign | 0x7F: tide::float_to_e4m3.
__device__ __forceinline__ uint8_t float_to_e4m3(float value) {
  if (isnan(value)) return static_cast<uint8_t>(((__float_as_uint(value) >> 24) & 0x80) | 0x7F);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
}

template <ElementType T>
struct Element;
template <>
struct Element<kBF16> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float to_float(Storage s) { return bf16_to_float(s); }
  static __device__ __forceinline__ Storage from_float(float v) { return float_to_bf16(v); }
};
template <>
struct Element<kFP16> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float to_float(Storage s) { return fp16_to_float(s); }
  static __device__ __forceinline__ Storage from_float(float v) { return float_to_fp16(v); }
};
template <>
struct Element<kE4M3> {  // a destination only: no to_float
  using Storage = uint8_t;
  static __device__ __forceinline__ Storage from_float(float v) { return float_to_e4m3(v); }
};
template <>
struct Element<kFP32> {
  using Storage = float;
  static __device__ __forceinline__ float to_float(Storage s) { return s; }
  static __device__ __forceinline__ Storage from_float(float v) { return v; }
};

template <ElementType T>
__device__ __forceinline__ float load_scalar(const void* base, int64_t index) {
  return Element<T>::to_float(static_cast<const typename Element<T>::Storage*>(base)[index]);
}

template <ElementType T>
__device__ __forceinline__ void store_scalar(void* base, int64_t index, float value) {
  static_cast<typename Element<T>::Storage*>(base)[index] = Element<T>::from_float(value);
}

// Eight consecutive elements starting at `index` (a multiple of 8; base 16-byte aligned): one
// 16-byte access for 16-bit types, two for fp32.
template <ElementType T>
__device__ __forceinline__ void load8(const void* base, int64_t index, float (&out)[8]) {
  if constexpr (T == kFP32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + index);
    const float4 a = p[0], b = p[1];
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
  } else {
    const uint4 raw =
        *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + index);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[2 * j] = Element<T>::to_float(static_cast<uint16_t>(words[j] & 0xFFFF));
      out[2 * j + 1] = Element<T>::to_float(static_cast<uint16_t>(words[j] >> 16));
    }
  }
}

template <ElementType T>
__device__ __forceinline__ void store8(void* base, int64_t index, const float (&in)[8]) {
  if constexpr (T == kE4M3) {  // eight bytes, one 8-byte store
    uint32_t words[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) words[j / 4] |= static_cast<uint32_t>(float_to_e4m3(in[j])) << (8 * (j % 4));
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(base) + index) = make_uint2(words[0], words[1]);
  } else if constexpr (T == kFP32) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + index);
    p[0] = make_float4(in[0], in[1], in[2], in[3]);
    p[1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
    uint32_t words[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      words[j] = static_cast<uint32_t>(Element<T>::from_float(in[2 * j])) |
                 (static_cast<uint32_t>(Element<T>::from_float(in[2 * j + 1])) << 16);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + index) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace tide::cuda_kernels
