// The benchmark's device code: deterministic test data (launch_fill_random), and the checks that
// compare every timed collective's result, on the device, bit for bit with what the inputs
// (filled from known seeds) must give. Test data lives here, not in the executor's kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "tide/dtype.hpp"

#if defined(__CUDACC__)
#define TIDE_HOST_DEVICE __host__ __device__
#else
#define TIDE_HOST_DEVICE
#endif

namespace tide::bench {

// Deterministic test data: an odd multiple of 2^-24 in (-1, 1), so never 0 and exact in fp32;
// the same on host and device, so references need no copy of the device's inputs.
TIDE_HOST_DEVICE inline float random_value(uint64_t seed, int64_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(index) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  const int64_t odd = 2 * (static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) + 1;
  return static_cast<float>(odd) * (1.0f / 16777216.0f);
}

// Fills buffer[k] = round(type, random_value(seed, k)), k < count (bf16, fp16, fp32).
void launch_fill_random(void* buffer, DType type, int64_t count, uint64_t seed,
                        cudaStream_t stream);

// A kernel that does nothing, `grid` CTAs of 32 threads: the floor of a launch on the GPU.
void launch_empty_kernel(int grid, cudaStream_t stream);

// Loads the fill kernels into the current context now, as CudaExecutor does its own kernels when
// it is created: with ranks as threads, a first launch under lazy loading waits
// for the whole context, which a peer's stream waiting on a flag never lets go.
void preload_test_data_kernels();

// Seed of param `param`'s input on rank `rank` (shared by the fills and the checks).
TIDE_HOST_DEVICE inline uint64_t input_seed(uint64_t base, int param, int rank) {
  return base * 1000003ull + static_cast<uint64_t>(param) * 4099ull + static_cast<uint64_t>(rank);
}

struct ParamGeometry {
  int64_t dim0;
  int64_t row_numel;
  int64_t rows_per_rank;  // c
  int64_t shard_numel;    // S
  DType dtype;
  DType shard_dtype;
};

// All-gather: `slots` (W * S elements of dtype, the param's window region) must hold, in slot r,
// round(dtype, round(shard_dtype, random_value(input_seed(base, param, r), k))) for the valid rows
// and zeros after. Adds the number of wrong elements to *mismatches.
void launch_check_all_gather(const void* slots, const ParamGeometry& g, int world, uint64_t base,
                             int param, unsigned long long* mismatches, cudaStream_t stream);

// Reduce-scatter: rank `rank`'s output (valid rows, shard_dtype) must equal, bit for bit, the
// fixed-order fp32 reduction of every rank's gradient chunk (no accumulate); with tolerance > 0
// (another summation order: across-node), be within tolerance x scale x sum |terms| of it.
void launch_check_reduce_scatter(const void* output, const ParamGeometry& g, int world, int rank,
                                 uint64_t base, int param, float prescale, float scale,
                                 float tolerance, unsigned long long* mismatches,
                                 cudaStream_t stream);

}  // namespace tide::bench
