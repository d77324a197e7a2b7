// Element types TIDE moves and reduces, and their exact host-side conversions (round to nearest
// even, as CUDA's __float2bfloat16_rn / __float2half_rn), so host and GPU results are bitwise equal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tide {

// kU8: raw bytes, moved as they are and never cast or reduced: the all-gather inputs of FSDP2's
// extension tensors (fp8 data, packed quantized data, int8 scales), whose arithmetic is theirs.
// kE4M3: float8 e4m3fn (no infinities; 0x7F / 0xFF are NaN), the all-gather dtype of torchao's
// float8 weights: only a cast's destination, written from a float times a scale bound per run
// (Bindings::scales), saturated to +-448 as torchao casts; never reduced, never a cast's source.
enum class DType : uint8_t { kBF16, kFP16, kFP32, kU8, kE4M3 };

// Whether TIDE computes on `dtype` (casts between such types, reduces them): bf16, fp16, fp32.
bool is_float(DType dtype);
// Whether a cast into `dtype` multiplies by a scale bound per run: kE4M3.
bool is_scaled(DType dtype);

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// Accepts "bf16"/"bfloat16", "fp16"/"float16"/"half", "fp32"/"float32"/"float", "u8"/"uint8"/"bytes",
// "e4m3"/"float8_e4m3fn".
DType parse_dtype(std::string_view name);

uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_fp16(float value);
float fp16_to_float(uint16_t bits);
// Round to nearest even, saturated to +-448 (torchao's clamp before its cast), NaN stays NaN.
uint8_t float_to_e4m3(float value);
float e4m3_to_float(uint8_t bits);

// Reads element `index` of a buffer of `dtype` as float / writes it from float (float dtypes and
// kE4M3; a kE4M3 store saturates `value`, already scaled).
float load_as_float(const void* base, DType dtype, std::size_t index);
void store_from_float(void* base, DType dtype, std::size_t index, float value);

}  // namespace tide
