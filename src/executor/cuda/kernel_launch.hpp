// What the host side of every kernel family shares (cast_kernel.cu, reduce_kernel.cu,
// copy_kernel.cu, cast_to_peers_kernel.cu, net_pull_kernel.cu): tiles, alignment, the grid, the
// checked launch (now, or deferred with its table), the kernel parameter limit the task tables
// fit, and each family's preload, which preload_kernels (kernel_launch.cpp) calls. Plain C++; not
// for the executor, which includes kernels.cuh.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "kernels.cuh"

namespace tide::cuda_kernels {

// Kernel parameters may take 32764 bytes (CUDA >= 12.1, Volta and newer). A launch copies its whole
// table whatever the bucket holds, so one-task tables serve the one-param bucket, small ones the
// common launch, large ones big buckets and worlds.
inline constexpr std::size_t kMaxParamBytes = 32764;

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline int64_t tiles_of(int64_t elements) { return (elements + kTileElements - 1) / kTileElements; }

// kernel<<<grid, kThreadsPerCta, 0, stream>>>(*args...) (cudaLaunchKernel); throws
// tide::SystemError naming `name` if the launch failed, leaving no error behind for the next
// cudaGetLastError (PyTorch's launch checks). Returns grid.
int launch_kernel(const void* kernel, int grid, void** args, cudaStream_t stream, const char* name);

// A launch of a table kernel (its one parameter, the table, passed by value), deferred (Launches):
// the table is built once, now, and every run copies it into the launch; a run returns its grid.
template <class Table>
std::function<int(cudaStream_t)> deferred_launch(void (*kernel)(Table), std::shared_ptr<Table> table,
                                                 int grid, const char* name) {
  return [kernel, table = std::move(table), grid, name](cudaStream_t stream) {
    void* args[] = {table.get()};
    return launch_kernel(reinterpret_cast<const void*>(kernel), grid, args, stream, name);
  };
}

// Loads `kernel` into the current context (each family's preload).
void preload_kernel(const void* kernel);

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
