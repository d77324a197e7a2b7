// The copy kernel (launch_copies, copy_launches): a step's many 1-D copies as SM stores, into the
// peers' windows as well, one launch per table of up to kLargeCopyTasks copies (kernels.cuh says
// when the lowering uses it instead of the copy engines).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "copy_task.cuh"
#include "kernel_launch.hpp"
#include "kernels.cuh"

namespace tide::cuda_kernels {
namespace {

// A task table, passed by value as a __grid_constant__ kernel parameter.
template <int kTasks>
struct CopyTable {
  int num_tasks;
  int64_t num_tiles;
  CopyTask tasks[kTasks];
};
using SmallCopyTable = CopyTable<32>;
using LargeCopyTable = CopyTable<kLargeCopyTasks>;
static_assert(sizeof(LargeCopyTable) <= kMaxParamBytes, "copy table exceeds the kernel parameter limit");

template <class Table>
__global__ void __launch_bounds__(kThreadsPerCta, 4) copy_kernel(const __grid_constant__ Table table) {
  int t = 0;
  for (int64_t tile = blockIdx.x; tile < table.num_tiles; tile += gridDim.x)
    copy_table_tile(table.tasks, table.num_tasks, tile, t);
}

template <class Table>
std::function<int(cudaStream_t)> copy_table_launch(const std::vector<CopyTask>& tasks, std::size_t first,
                                                   std::size_t n) {
  auto table = std::make_shared<Table>();
  table->num_tasks = static_cast<int>(n);
  for (std::size_t i = 0; i < n; ++i) {
    table->tasks[i] = tasks[first + i];
    table->tasks[i].tile_begin = table->num_tiles;
    table->num_tiles += (table->tasks[i].total + kCopyTileBytes - 1) / kCopyTileBytes;
  }
  // As the casts' grid: stores only, little in flight per thread.
  const int grid = grid_for(table->num_tiles, 0, 2);
  return deferred_launch<Table>(copy_kernel<Table>, std::move(table), grid, "copy_kernel");
}

}  // namespace

void preload_copy_kernels() {
  preload_kernel(reinterpret_cast<const void*>(copy_kernel<SmallCopyTable>));
  preload_kernel(reinterpret_cast<const void*>(copy_kernel<LargeCopyTable>));
}

Launches copy_launches(const CopySpec* specs, std::size_t num_specs) {
  std::vector<CopyTask> tasks;
  tasks.reserve(num_specs);
  for (std::size_t i = 0; i < num_specs; ++i)
    if (const std::optional<CopyTask> task = copy_task(specs[i])) tasks.push_back(*task);
  Launches out;
  for (std::size_t first = 0; first < tasks.size();) {
    const std::size_t n = std::min<std::size_t>(tasks.size() - first, kLargeCopyTasks);
    out.launches_.push_back(n <= 32 ? copy_table_launch<SmallCopyTable>(tasks, first, n)
                                    : copy_table_launch<LargeCopyTable>(tasks, first, n));
    first += n;
  }
  return out;
}

LaunchInfo launch_copies(const CopySpec* specs, std::size_t num_specs, cudaStream_t stream) {
  return copy_launches(specs, num_specs).run(stream);
}

}  // namespace tide::cuda_kernels
