// Element types TIDE moves and reduces, and their exact host-side conversions (round to nearest
// even, as CUDA's __float2bfloat16_rn / __float2half_rn), so host and GPU results are bitwise equal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tide {

// kU8: raw bytes, moved as they are and never cast or reduced: the all-gather inputs of FSDP2's
// extension tensors (fp8 data, packed quantized data, int8 scales), whose arithmetic is theirs.
enum class DType : uint8_t { kBF16, kFP16, kFP32, kU8 };

// Whether TIDE computes on `dtype` (casts between such types, reduces them): all but kU8.
bool is_float(DType dtype);

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// Accepts "bf16"/"bfloat16", "fp16"/"float16"/"half", "fp32"/"float32"/"float", "u8"/"uint8"/"bytes".
DType parse_dtype(std::string_view name);

uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_fp16(float value);
float fp16_to_float(uint16_t bits);

// Reads element `index` of a buffer of `dtype` as float / writes it from float (float dtypes only).
float load_as_float(const void* base, DType dtype, std::size_t index);
void store_from_float(void* base, DType dtype, std::size_t index, float value);

}  // namespace tide
