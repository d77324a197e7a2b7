#include "bench_kernels.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "convert.cuh"

namespace tide::bench {
namespace {

using cuda_kernels::Element;
using cuda_kernels::ElementType;

template <ElementType T>
__global__ void fill_random_kernel(void* buffer, int64_t count, uint64_t seed) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)
    cuda_kernels::store_scalar<T>(buffer, k, random_value(seed, k));
}

__device__ int64_t valid_numel(const ParamGeometry& g, int rank) {
  const int64_t rows = min(max(g.dim0 - rank * g.rows_per_rank, int64_t{0}), g.rows_per_rank);
  return rows * g.row_numel;
}

template <ElementType D, ElementType S>
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

template <ElementType D, ElementType S>
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

template <template <ElementType, ElementType> class Launcher, class... Args>
void dispatch(ElementType d, ElementType s, Args&&... args) {
  auto with_d = [&](auto dc) {
    constexpr ElementType D = decltype(dc)::value;
    switch (s) {
      case cuda_kernels::kBF16: Launcher<D, cuda_kernels::kBF16>::run(args...); break;
      case cuda_kernels::kFP16: Launcher<D, cuda_kernels::kFP16>::run(args...); break;
      case cuda_kernels::kFP32: Launcher<D, cuda_kernels::kFP32>::run(args...); break;
    }
  };
  switch (d) {
    case cuda_kernels::kBF16: with_d(std::integral_constant<ElementType, cuda_kernels::kBF16>{}); break;
    case cuda_kernels::kFP16: with_d(std::integral_constant<ElementType, cuda_kernels::kFP16>{}); break;
    case cuda_kernels::kFP32: with_d(std::integral_constant<ElementType, cuda_kernels::kFP32>{}); break;
  }
}

int grid_for(int64_t n) { return static_cast<int>(std::clamp<int64_t>((n + 255) / 256, 1, 8192)); }

template <ElementType D, ElementType S>
struct AllGatherCheck {
  static void run(const void* slots, const ParamGeometry& g, int world, uint64_t base, int param,
                  unsigned long long* mismatches, cudaStream_t stream) {
    check_all_gather_kernel<D, S><<<grid_for(world * g.shard_numel), 256, 0, stream>>>(
        slots, g, world, base, param, mismatches);
    check(cudaGetLastError(), "check_all_gather_kernel");
  }
};

template <ElementType D, ElementType S>
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

void launch_fill_random(void* buffer, ElementType type, int64_t count, uint64_t seed,
                        cudaStream_t stream) {
  if (count <= 0) return;
  const int grid = static_cast<int>(std::min<int64_t>((count + 255) / 256, 4096));
  switch (type) {
    case cuda_kernels::kBF16:
      fill_random_kernel<cuda_kernels::kBF16><<<grid, 256, 0, stream>>>(buffer, count, seed);
      break;
    case cuda_kernels::kFP16:
      fill_random_kernel<cuda_kernels::kFP16><<<grid, 256, 0, stream>>>(buffer, count, seed);
      break;
    case cuda_kernels::kFP32:
      fill_random_kernel<cuda_kernels::kFP32><<<grid, 256, 0, stream>>>(buffer, count, seed);
      break;
  }
  check(cudaGetLastError(), "fill_random_kernel<<<>>>");
}

void preload_test_data_kernels() {
  cudaFuncAttributes attributes;
  check(cudaFuncGetAttributes(&attributes, fill_random_kernel<cuda_kernels::kBF16>),
        "cudaFuncGetAttributes");
  check(cudaFuncGetAttributes(&attributes, fill_random_kernel<cuda_kernels::kFP16>),
        "cudaFuncGetAttributes");
  check(cudaFuncGetAttributes(&attributes, fill_random_kernel<cuda_kernels::kFP32>),
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
