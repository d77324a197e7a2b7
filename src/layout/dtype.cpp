#include "tide/dtype.hpp"

#include <cmath>
#include <cstring>
#include <string>

#include "layout/bf16_bits.hpp"
#include "tide/error.hpp"

namespace tide {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16: return 2;
    case DType::kFP32: return 4;
    case DType::kU8:
    case DType::kE4M3: return 1;
  }
  throw InvalidArgument(detail::concat("dtype_size: dtype = ", static_cast<int>(dtype),
                                       ", expected bf16, fp16, fp32, u8 or e4m3"));
}

bool is_float(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kFP16 || dtype == DType::kFP32;
}

bool is_scaled(DType dtype) { return dtype == DType::kE4M3; }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kFP16: return "fp16";
    case DType::kFP32: return "fp32";
    case DType::kU8: return "u8";
    case DType::kE4M3: return "e4m3";
  }
  return "invalid";
}

DType parse_dtype(std::string_view name) {
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp16" || name == "float16" || name == "half") return DType::kFP16;
  if (name == "fp32" || name == "float32" || name == "float") return DType::kFP32;
  if (name == "u8" || name == "uint8" || name == "bytes") return DType::kU8;
  if (name == "e4m3" || name == "float8_e4m3fn") return DType::kE4M3;
  throw InvalidArgument(detail::concat("parse_dtype: name = '", std::string(name),
                                       "', expected one of bf16, fp16, fp32, u8, e4m3"));
}

static uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float value) { return detail::bf16_bits_from_float_bits(bits_of(value)); }

float bf16_to_float(uint16_t bits) { return float_of(detail::float_bits_from_bf16_bits(bits)); }

uint16_t float_to_fp16(float value) {
  const uint32_t u = bits_of(value);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t abs = u & 0x7FFFFFFF;
  if (abs > 0x7F800000) return sign | 0x7E00;                  // NaN
  if (abs >= 0x477FF000) return sign | 0x7C00;                 // rounds to >= 65520: inf
  if (abs < 0x38800000) {                                      // subnormal or zero in fp16
    // Value in units of 2^-24, rounded to nearest even, exactly via float arithmetic.
    const float scaled = float_of(abs) * 16777216.0f;          // exact (power of two)
    const float r = std::nearbyint(scaled);                    // default mode: nearest even
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t mant = abs & 0x007FFFFF;
  int32_t exp = static_cast<int32_t>(abs >> 23) - 127 + 15;
  uint32_t half = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // may carry into the exponent
  return sign | static_cast<uint16_t>(half);
}

float fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exp = (bits >> 10) & 0x1F;
  const uint32_t mant = bits & 0x3FF;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // exact
    return sign ? -v : v;
  }
  if (exp == 31) return float_of(sign | 0x7F800000 | (mant << 13));
  return float_of(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

uint8_t float_to_e4m3(float value) {
  const uint32_t u = bits_of(value);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t abs = u & 0x7FFFFFFF;
  if (abs > 0x7F800000) return sign | 0x7F;                    // NaN
  if (abs >= 0x43E00000) return sign | 0x7E;                   // >= 448 (inf too): saturate
  if (abs < 0x3C800000) {                                      // below 2^-6: subnormal or zero
    // Value in units of 2^-9, rounded to nearest even, exactly via float arithmetic; 8 units is
    // the smallest normal, whose encoding is 0x08 as well.
    const float r = std::nearbyint(float_of(abs) * 512.0f);    // exact scaling; default mode: even
    return sign | static_cast<uint8_t>(r);
  }
  const uint32_t mant = abs & 0x007FFFFF;
  const uint32_t exp = (abs >> 23) - 127 + 7;                  // 1..15
  uint32_t bits = (exp << 3) | (mant >> 20);
  const uint32_t rest = mant & 0xFFFFF;
  if (rest > 0x80000 || (rest == 0x80000 && (bits & 1))) ++bits;  // may carry into the exponent
  return sign | static_cast<uint8_t>(bits);                    // < 448 rounds to at most 0x7E
}

float e4m3_to_float(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80) << 24;
  const uint32_t exp = (bits >> 3) & 0xF;
  const uint32_t mant = bits & 0x7;
  if (exp == 0xF && mant == 0x7) return float_of(sign | 0x7FC00000);  // NaN
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 512.0f);  // exact
    return sign ? -v : v;
  }
  return float_of(sign | ((exp - 7 + 127) << 23) | (mant << 20));
}

float load_as_float(const void* base, DType dtype, std::size_t index) {
  switch (dtype) {
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFP16: return fp16_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFP32: return static_cast<const float*>(base)[index];
    case DType::kE4M3: return e4m3_to_float(static_cast<const uint8_t*>(base)[index]);
    case DType::kU8: break;
  }
  throw InvalidArgument(detail::concat("load_as_float: dtype = ", dtype_name(dtype),
                                       ", expected bf16, fp16, fp32 or e4m3 (u8 bytes are not numbers)"));
}

void store_from_float(void* base, DType dtype, std::size_t index, float value) {
  switch (dtype) {
    case DType::kBF16: static_cast<uint16_t*>(base)[index] = float_to_bf16(value); return;
    case DType::kFP16: static_cast<uint16_t*>(base)[index] = float_to_fp16(value); return;
    case DType::kFP32: static_cast<float*>(base)[index] = value; return;
    case DType::kE4M3: static_cast<uint8_t*>(base)[index] = float_to_e4m3(value); return;
    case DType::kU8: break;
  }
  throw InvalidArgument(detail::concat("store_from_float: dtype = ", dtype_name(dtype),
                                       ", expected bf16, fp16, fp32 or e4m3 (u8 bytes are not numbers)"));
}

}  // namespace tide
