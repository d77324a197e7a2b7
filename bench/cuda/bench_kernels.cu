#include "bench_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace tide::bench {
namespace {

// The element types the test data and the checks use, converted with CUDA's own round-to-nearest-
// even conversions (tide/dtype.hpp: TIDE's round as these do; the data is finite, never NaN).
template <DType T>
struct Element;
template <>
struct Element<DType::kBF16> {
  using Storage = uint16_t;
  static __device__ float to_float(Storage s) { return __bfloat162float(__ushort_as_bfloat16(s)); }
  static __device__ Storage from_float(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};
template <>
struct Element<DType::kFP16> {
  using Storage = uint16_t;
  static __device__ float to_float(Storage s) { return __half2float(__ushort_as_half(s)); }
  static __device__ Storage from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
template <>
struct Element<DType::kFP32> {
  using Storage = float;
  static __device__ float to_float(Storage s) { return s; }
  static __device__ Storage from_float(float v) { return v; }
};

template <DType T>
__global__ void fill_random_kernel(void* buffer, int64_t count, uint64_t seed) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)
    static_cast<typename Element<T>::Storage*>(buffer)[k] = Element<T>::from_float(random_value(seed, k));
}

__device__ int64_t valid_numel(const ParamGeometry& g, int rank) {
  const int64_t rows = min(max(g.dim0 - rank * g.rows_per_rank, int64_t{0}), g.rows_per_rank);
  return rows * g.row_numel;
}

template <DType D, DType S>
__global__ void check_all_gather_kernel(const void* slots, ParamGeometry g, int world,
                                        uint64_t base, int param, unsigned long long* mismatches) {
  using Storage = typename Element<D>::Storage;
  unsigned long long wrong = 0;
  const int64_t total = world * g.shard_numel;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int owner = static_cast<int>(e / g.shard_numel);
    const int64_t k = e % g.shard_numel;
    Storage expected = Element<D>::from_float(0.0f);
    if (k < valid_numel(g, owner)) {
      const float shard = Element<S>::to_float(Element<S>::from_float(
          random_value(input_seed(base, param, owner), k)));
      expected = Element<D>::from_float(shard);
    }
    wrong += static_cast<const Storage*>(slots)[e] != expected;
  }
  if (wrong) atomicAdd(mismatches, wrong);
}

template <DType D, DType S>
__global__ void check_reduce_scatter_kernel(const void* output, ParamGeometry g, int world,
                                            int rank, uint64_t base, int param, float prescale,
                                            float scale, float tolerance,
                                            unsigned long long* mismatches) {
  using Storage = typename Element<S>::Storage;
  unsigned long long wrong = 0;
  const int64_t n = valid_numel(g, rank);
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < n;
       k += int64_t{gridDim.x} * blockDim.x) {
    float acc = 0.0f, magnitude = 0.0f;
    for (int r = 0; r < world; ++r) {
      const float grad = Element<D>::to_float(Element<D>::from_float(
          random_value(input_seed(base, param, r), rank * g.shard_numel + k)));
      acc = __fadd_rn(acc, __fmul_rn(grad, prescale));
      magnitude += fabsf(grad * prescale);
    }
    const Storage expected = Element<S>::from_float(__fmul_rn(acc, scale));
    const Storage got = static_cast<const Storage*>(output)[k];
    if (tolerance == 0.0f)
      wrong += got != expected;
    else  // another summation order (across-node): |error| within tolerance of the magnitude
      wrong += !(fabsf(Element<S>::to_float(got) - Element<S>::to_float(expected)) <=
                 tolerance * fabsf(scale) * magnitude);
  }
  if (wrong) atomicAdd(mismatches, wrong);
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(status));
}

template <template <DType, DType> class Launcher, class... Args>
void dispatch(DType d, DType s, Args&&... args) {
  auto with_d = [&](auto dc) {
    constexpr DType D = decltype(dc)::value;
    switch (s) {
      case DType::kBF16: Launcher<D, DType::kBF16>::run(args...); break;
      case DType::kFP16: Launcher<D, DType::kFP16>::run(args...); break;
      case DType::kFP32: Launcher<D, DType::kFP32>::run(args...); break;
      default: break;  // no test data of other types
    }
  };
  switch (d) {
    case DType::kBF16: with_d(std::integral_constant<DType, DType::kBF16>{}); break;
    case DType::kFP16: with_d(std::integral_constant<DType, DType::kFP16>{}); break;
    case DType::kFP32: with_d(std::integral_constant<DType, DType::kFP32>{}); break;
    default: break;
  }
}

int grid_for(int64_t n) { return static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 8192)); }

template <DType D, DType S>
struct AllGatherCheck {
  static void run(const void* slots, const ParamGeometry& g, int world, uint64_t base, int param,
                  unsigned long long* mismatches, cudaStream_t stream) {
    check_all_gather_kernel<D, S><<<grid_for(world * g.shard_numel), 256, 0, stream>>>(
        slots, g, world, base, param, mismatches);
    check(cudaGetLastError(), "check_all_gather_kernel");
  }
};

template <DType D, DType S>
struct ReduceScatterCheck {
  static void run(const void* output, const ParamGeometry& g, int world, int rank, uint64_t base,
                  int param, float prescale, float scale, float tolerance,
                  unsigned long long* mismatches, cudaStream_t stream) {
    check_reduce_scatter_kernel<D, S><<<grid_for(g.shard_numel), 256, 0, stream>>>(
        output, g, world, rank, base, param, prescale, scale, tolerance, mismatches);
    check(cudaGetLastError(), "check_reduce_scatter_kernel");
  }
};

}  // namespace

void launch_fill_random(void* buffer, DType type, int64_t count, uint64_t seed,
                        cudaStream_t stream) {
  if (count <= 0) return;
  const int grid = static_cast<int>(std::min<int64_t>((count + 255) / 256, 4096));
  switch (type) {
    case DType::kBF16:
      fill_random_kernel<DType::kBF16><<<grid, 256, 0, stream>>>(buffer, count, seed);
      break;
    case DType::kFP16:
      fill_random_kernel<DType::kFP16><<<grid, 256, 0, stream>>>(buffer, count, seed);
      break;
    case DType::kFP32:
      fill_random_kernel<DType::kFP32><<<grid, 256, 0, stream>>>(buffer, count, seed);
      break;
    default:
      break;
  }
  check(cudaGetLastError(), "fill_random_kernel<<<>>>");
}

namespace {
__global__ void empty_kernel() {}
}  // namespace

void launch_empty_kernel(int grid, cudaStream_t stream) {
  empty_kernel<<<grid, 32, 0, stream>>>();
  check(cudaGetLastError(), "empty_kernel launch");
}

void preload_test_data_kernels() {
  cudaFuncAttributes attributes;
  check(cudaFuncGetAttributes(&attributes, empty_kernel), "cudaFuncGetAttributes");
  check(cudaFuncGetAttributes(&attributes, fill_random_kernel<DType::kBF16>),
        "cudaFuncGetAttributes");
  check(cudaFuncGetAttributes(&attributes, fill_random_kernel<DType::kFP16>),
        "cudaFuncGetAttributes");
  check(cudaFuncGetAttributes(&attributes, fill_random_kernel<DType::kFP32>),
        "cudaFuncGetAttributes");
}

void launch_check_all_gather(const void* slots, const ParamGeometry& g, int world, uint64_t base,
                             int param, unsigned long long* mismatches, cudaStream_t stream) {
  dispatch<AllGatherCheck>(g.dtype, g.shard_dtype, slots, g, world, base, param, mismatches, stream);
}

void launch_check_reduce_scatter(const void* output, const ParamGeometry& g, int world, int rank,
                                 uint64_t base, int param, float prescale, float scale,
                                 float tolerance, unsigned long long* mismatches,
                                 cudaStream_t stream) {
  dispatch<ReduceScatterCheck>(g.dtype, g.shard_dtype, output, g, world, rank, base, param,
                               prescale, scale, tolerance, mismatches, stream);
}

}  // namespace tide::bench
