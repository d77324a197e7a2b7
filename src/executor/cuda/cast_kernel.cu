// The cast kernel (launch_casts): a run of CastOps, any source and destination types, one launch
// per table of up to kLargeCastTasks casts. See kernels.cuh for the contract; the arithmetic
// (cast_task.cuh, convert.cuh) must stay exactly the host executor's (src/layout/dtype.cpp).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cast_task.cuh"
#include "kernel_launch.hpp"
#include "kernels.cuh"

namespace tide::cuda_kernels {
namespace {

// A task table, passed by value as a __grid_constant__ kernel parameter.
template <int kTasks>
struct CastTable {
  int num_tasks;
  int64_t num_tiles;
  CastTask tasks[kTasks];
};

using OneCastTable = CastTable<1>;
using SmallCastTable = CastTable<16>;
constexpr int kLargeCastTasks = 448;  // 72-byte tasks in the 32 KB of a launch's parameters
using LargeCastTable = CastTable<kLargeCastTasks>;
static_assert(sizeof(LargeCastTable) <= kMaxParamBytes, "cast table exceeds the kernel parameter limit");

template <class Table>
__global__ void __launch_bounds__(kThreadsPerCta, 4) cast_kernel(const __grid_constant__ Table table) {
  int t = 0;
  for (int64_t tile = blockIdx.x; tile < table.num_tiles; tile += gridDim.x)
    cast_table_tile(table.tasks, table.num_tasks, tile, t);
}

template <class Table>
int launch_cast_table(const std::vector<CastTask>& tasks, std::size_t first, std::size_t n,
                      int max_ctas, cudaStream_t stream) {
  Table table{};
  table.num_tasks = static_cast<int>(n);
  int64_t tiles = 0;
  for (std::size_t i = 0; i < n; ++i) {
    table.tasks[i] = tasks[first + i];
    table.tasks[i].tile_begin = tiles;
    tiles += tiles_of(table.tasks[i].total);
  }
  table.num_tiles = tiles;
  // Casts read 4 B and write 2 B per element (less in flight per thread than a reduce's W
  // sources): twice the reduce's default grid, 4 CTAs/SM, measured 96% of the copy ceiling on an
  // H200 where 2 CTAs/SM gave 76%.
  void* args[] = {&table};
  return launch_kernel(reinterpret_cast<const void*>(cast_kernel<Table>), grid_for(tiles, max_ctas, 2),
                       args, stream, "cast_kernel");
}

}  // namespace

void preload_cast_kernels() {
  preload_kernel(reinterpret_cast<const void*>(cast_kernel<OneCastTable>));
  preload_kernel(reinterpret_cast<const void*>(cast_kernel<SmallCastTable>));
  preload_kernel(reinterpret_cast<const void*>(cast_kernel<LargeCastTable>));
}

LaunchInfo launch_casts(const CastSpec* specs, std::size_t num_specs, int max_ctas,
                        cudaStream_t stream) {
  std::vector<CastTask> tasks;
  tasks.reserve(num_specs);
  for (std::size_t i = 0; i < num_specs; ++i)
    if (specs[i].count + specs[i].pad > 0) tasks.push_back(cast_task(specs[i]));
  LaunchInfo info;
  for (std::size_t first = 0; first < tasks.size();) {
    const std::size_t n = std::min<std::size_t>(tasks.size() - first, kLargeCastTasks);
    const int grid = n == 1    ? launch_cast_table<OneCastTable>(tasks, first, n, max_ctas, stream)
                     : n <= 16 ? launch_cast_table<SmallCastTable>(tasks, first, n, max_ctas, stream)
                               : launch_cast_table<LargeCastTable>(tasks, first, n, max_ctas, stream);
    info.launches += 1;
    info.max_ctas = std::max(info.max_ctas, grid);
    first += n;
  }
  return info;
}

}  // namespace tide::cuda_kernels
