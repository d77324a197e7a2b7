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

// Reference: the nearest e4m3 magnitude to |f| by distance in double over all of them, ties to the
// even encoding; beyond 448 the largest (saturation); f's sign.
uint8_t e4m3_reference(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::fabs(f) >= 448.0f) return sign | 0x7E;
  uint8_t best = 0;
  double best_distance = INFINITY;
  for (uint8_t m = 0; m <= 0x7E; ++m) {
    const double d = std::fabs(double(e4m3_to_float(m)) - std::fabs(double(f)));
    if (d < best_distance || (d == best_distance && (m & 1) == 0)) best = m, best_distance = d;
  }
  return sign | best;
}

TEST(DType, E4M3IsAScaledCastDestination) {
  EXPECT_EQ(dtype_size(DType::kE4M3), 1u);
  EXPECT_EQ(parse_dtype(dtype_name(DType::kE4M3)), DType::kE4M3);
  EXPECT_EQ(parse_dtype("float8_e4m3fn"), DType::kE4M3);
  EXPECT_FALSE(is_float(DType::kE4M3));  // never reduced, never a cast's source
  EXPECT_TRUE(is_scaled(DType::kE4M3));
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kU8}) EXPECT_FALSE(is_scaled(d));
}

TEST(DType, E4M3RoundsToNearestEvenAndSaturates) {
  for (int b = 0; b < 256; ++b) {  // every finite encoding decodes and round-trips
    const float f = e4m3_to_float(static_cast<uint8_t>(b));
    if ((b & 0x7F) == 0x7F) {
      ASSERT_TRUE(std::isnan(f)) << b;
      continue;
    }
    ASSERT_EQ(float_to_e4m3(f), b) << "bits " << b;
  }
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), 1.0f / 512);  // the smallest subnormal
  EXPECT_EQ(e4m3_to_float(0x08), 1.0f / 64);   // the smallest normal
  EXPECT_EQ(float_to_e4m3(449.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7E);
  EXPECT_EQ(float_to_e4m3(-INFINITY), 0xFE);
  EXPECT_EQ(float_to_e4m3(NAN) & 0x7F, 0x7F);
  EXPECT_EQ(float_to_e4m3(1.0f / 1024), 0x00);      // half the smallest subnormal: ties to even (0)
  EXPECT_EQ(float_to_e4m3(3.0f / 1024), 0x02);      // 1.5 subnormal units: ties to even (2)
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);          // halfway between 1 and 1.125: to 1 (even)
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);          // halfway between 1.125 and 1.25: to 1.25
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> wide(-500.f, 500.f), small(-0.05f, 0.05f);
  for (int n = 0; n < 200000; ++n) {
    const float f = (n & 1) ? wide(rng) : small(rng);
    ASSERT_EQ(float_to_e4m3(f), e4m3_reference(f)) << "f = " << f;
  }
}

}  // namespace
}  // namespace tide
