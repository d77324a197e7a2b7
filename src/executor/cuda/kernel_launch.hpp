// What the host side of every kernel family shares (cast_kernel.cu, reduce_kernel.cu,
// copy_kernel.cu, cast_to_peers_kernel.cu, net_pull_kernel.cu): tiles, alignment, the launch check
// and the grid, the kernel parameter limit the task tables fit, and each family's preload, which
// preload_kernels (kernel_launch.cpp) calls. Plain C++; not for the executor, which includes
// kernels.cuh.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels.cuh"

namespace tide::cuda_kernels {

// Kernel parameters may take 32764 bytes (CUDA >= 12.1, Volta and newer). A launch copies its whole
// table whatever the bucket holds, so one-task tables serve the one-param bucket, small ones the
// common launch, large ones big buckets and worlds.
inline constexpr std::size_t kMaxParamBytes = 32764;

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline int64_t tiles_of(int64_t elements) { return (elements + kTileElements - 1) / kTileElements; }

// Throws tide::SystemError naming `kernel` if its launch failed.
void check_launch(const char* kernel);

// min(tiles, the cap) CTAs, at least 1; the cap is max_ctas, or default_multiple x the default.
inline int grid_for(int64_t tiles, int max_ctas, int default_multiple = 1) {
  const int cap = max_ctas > 0 ? max_ctas : default_multiple * default_max_ctas();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tiles, cap)));
}

// Each family's kernels loaded into the current context (preload_kernels, kernels.cuh).
void preload_cast_kernels();
void preload_reduce_kernels();
void preload_copy_kernels();
void preload_cast_to_peers_kernel();
void preload_net_pull_kernel();

}  // namespace tide::cuda_kernels
