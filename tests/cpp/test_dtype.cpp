// dtype: exact conversions (round to nearest even), the contract the CUDA kernels must match.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "tide/dtype.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

// Reference: the nearest bf16 by comparing both neighbours in double, ties to even.
uint16_t bf16_reference(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double dlo = std::fabs(double(bf16_to_float(lo)) - f);
  const double dhi = std::fabs(double(bf16_to_float(hi)) - f);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(DType, SizesNamesAndParsing) {
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP32), 4u);
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32}) EXPECT_EQ(parse_dtype(dtype_name(d)), d);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("half"), DType::kFP16);
  EXPECT_EQ(parse_dtype("float32"), DType::kFP32);
  try {
    parse_dtype("int8");
    FAIL() << "int8 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'int8'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("bf16, fp16, fp32"), std::string::npos);
  }
}

TEST(DType, U8IsBytesNotNumbers) {
  EXPECT_EQ(dtype_size(DType::kU8), 1u);
  EXPECT_EQ(parse_dtype(dtype_name(DType::kU8)), DType::kU8);
  EXPECT_EQ(parse_dtype("uint8"), DType::kU8);
  EXPECT_FALSE(is_float(DType::kU8));
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32}) EXPECT_TRUE(is_float(d));
  const uint8_t bytes[2] = {1, 2};
  EXPECT_THROW(load_as_float(bytes, DType::kU8, 0), InvalidArgument);
}

TEST(DType, Bf16RoundsToNearestEven) {
  std::mt19937 rng(1);
  for (int n = 0; n < 200000; ++n) {
    uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    if (std::isnan(f) || std::isinf(f)) continue;
    if (std::fabs(f) > 3.0e38f) continue;  // the reference's hi neighbour would be inf
    ASSERT_EQ(float_to_bf16(f), bf16_reference(f)) << "f = " << f;
  }
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t b = 0; b < 65536; ++b) {  // every finite bf16 round-trips
    const float f = bf16_to_float(static_cast<uint16_t>(b));
    if (!std::isnan(f)) {
      ASSERT_EQ(float_to_bf16(f), b);
    }
  }
}

TEST(DType, Fp16MatchesCompilerConversion) {
  for (uint32_t b = 0; b < 65536; ++b) {  // every fp16 value decodes exactly
    _Float16 h;
    const uint16_t bits = static_cast<uint16_t>(b);
    std::memcpy(&h, &bits, 2);
    const float expected = static_cast<float>(h);
    const float got = fp16_to_float(bits);
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(got));
    } else {
      ASSERT_EQ(got, expected) << "bits " << b;
      ASSERT_EQ(float_to_fp16(got), bits) << "round trip of bits " << b;
    }
  }
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> wide(-70000.f, 70000.f), tiny(-1e-4f, 1e-4f);
  for (int n = 0; n < 200000; ++n) {
    const float f = (n & 1) ? wide(rng) : tiny(rng);
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t expected;
    std::memcpy(&expected, &h, 2);
    ASSERT_EQ(float_to_fp16(f), expected) << "f = " << f;
  }
}

}  // namespace
}  // namespace tide
