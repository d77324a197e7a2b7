// The reduce kernel (launch_reduces, reduce_launches): a run of ReduceOps, one launch per table of
// as many reduces as their sources leave room for. See kernels.cuh for the contract; the
// arithmetic (reduce_task.cuh) must stay exactly the host executor's
// (src/executor/host/host_executor.cpp).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "kernel_launch.hpp"
#include "kernels.cuh"
#include "reduce_task.cuh"

namespace tide::cuda_kernels {
namespace {

// A task table, passed by value as a __grid_constant__ kernel parameter: num_tasks tasks, then
// num_tasks x num_sources source pointers, in `data`: a table of kBytes holds as many tasks as
// their sources leave room for.
template <std::size_t kBytes>
struct ReduceTable {
  int num_tasks;
  int num_sources;  // per task (= world)
  int64_t num_tiles;
  alignas(8) unsigned char data[kBytes];

  static constexpr std::size_t capacity(int sources) {
    return kBytes / (sizeof(ReduceTask) + sizeof(void*) * static_cast<std::size_t>(sources));
  }
  __host__ __device__ ReduceTask* tasks() { return reinterpret_cast<ReduceTask*>(data); }
  __host__ __device__ const ReduceTask* tasks() const {
    return reinterpret_cast<const ReduceTask*>(data);
  }
  __host__ __device__ const void** sources() {
    return reinterpret_cast<const void**>(data + sizeof(ReduceTask) * num_tasks);
  }
  __host__ __device__ const void* const* sources() const {
    return reinterpret_cast<const void* const*>(data + sizeof(ReduceTask) * num_tasks);
  }
};

constexpr int kOneReduceSources = 16;
using OneReduceTable = ReduceTable<sizeof(ReduceTask) + kOneReduceSources * sizeof(void*)>;
using SmallReduceTable = ReduceTable<16 * sizeof(ReduceTask) + 256 * sizeof(void*)>;
using LargeReduceTable = ReduceTable<32744>;
static_assert(sizeof(LargeReduceTable) <= kMaxParamBytes, "reduce table exceeds the kernel parameter limit");
static_assert(LargeReduceTable::capacity(2) >= 512, "a 512-param bucket at W = 2 is one launch");
static_assert(LargeReduceTable::capacity(kMaxSources) >= 1, "a task of kMaxSources sources fits");

// Persistent CTAs, grid-striding over every tile of the table.
template <class Table>
__global__ void __launch_bounds__(kThreadsPerCta, 4) reduce_kernel(const __grid_constant__ Table table) {
  int t = 0;
  for (int64_t tile = blockIdx.x; tile < table.num_tiles; tile += gridDim.x)
    reduce_table_tile(table.tasks(), table.num_tasks, table.sources(), table.num_sources, tile, t);
}

// Tasks [first, first + n) (their sources at k * num_sources), n <= Table::capacity(num_sources),
// fewer than 2^31 tiles in all, as one persistent launch, its table built now.
template <class Table>
std::function<int(cudaStream_t)> reduce_table_launch(const std::vector<ReduceTask>& tasks,
                                                     const std::vector<const void*>& sources,
                                                     int num_sources, std::size_t first, std::size_t n,
                                                     int max_ctas) {
  auto table = std::make_shared<Table>();
  table->num_tasks = static_cast<int>(n);
  table->num_sources = num_sources;
  ReduceTask* table_tasks = table->tasks();
  const void** table_sources = table->sources();
  int64_t tiles = 0;
  for (std::size_t i = 0; i < n; ++i) {
    table_tasks[i] = tasks[first + i];
    table_tasks[i].tile_begin = static_cast<int32_t>(tiles);
    tiles += tiles_of(table_tasks[i].count);
  }
  std::copy_n(sources.begin() + static_cast<std::ptrdiff_t>(first * num_sources), n * num_sources,
              table_sources);
  table->num_tiles = tiles;
  return deferred_launch<Table>(reduce_kernel<Table>, std::move(table), grid_for(tiles, max_ctas),
                                "reduce_kernel");
}

}  // namespace

void preload_reduce_kernels() {
  preload_kernel(reinterpret_cast<const void*>(reduce_kernel<OneReduceTable>));
  preload_kernel(reinterpret_cast<const void*>(reduce_kernel<SmallReduceTable>));
  preload_kernel(reinterpret_cast<const void*>(reduce_kernel<LargeReduceTable>));
}

Launches reduce_launches(const ReduceSpec* specs, std::size_t num_specs, int num_sources, int max_ctas) {
  TIDE_CHECK_ARG(num_sources >= 1 && num_sources <= kMaxSources, "launch_reduces", "num_sources",
                 num_sources, detail::concat("in [1, ", kMaxSources, "]"));
  std::vector<ReduceTask> tasks;
  std::vector<const void*> sources;
  std::vector<int64_t> task_tiles;
  tasks.reserve(num_specs);
  sources.reserve(num_specs * num_sources);
  for (std::size_t i = 0; i < num_specs; ++i) {
    if (specs[i].count == 0) continue;
    tasks.push_back(reduce_task(specs[i], num_sources));
    task_tiles.push_back(tiles_of(specs[i].count));
    TIDE_CHECK_ARG(task_tiles.back() <= INT32_MAX, "launch_reduces", "count", specs[i].count,
                   detail::concat("at most ", INT32_MAX, " tiles of ", kTileElements, " elements"));
    sources.insert(sources.end(), specs[i].sources, specs[i].sources + num_sources);
  }
  // Table by size: the one-task and 16-task tables keep a small launch's parameter copy small.
  const std::size_t small = SmallReduceTable::capacity(num_sources);
  const std::size_t large = LargeReduceTable::capacity(num_sources);
  Launches out;
  for (std::size_t first = 0; first < tasks.size();) {
    std::size_t n = 0;
    int64_t tiles = 0;
    while (first + n < tasks.size() && n < large && tiles + task_tiles[first + n] <= INT32_MAX)
      tiles += task_tiles[first + n++];
    out.launches_.push_back(
        n == 1 && num_sources <= kOneReduceSources
            ? reduce_table_launch<OneReduceTable>(tasks, sources, num_sources, first, n, max_ctas)
        : n <= small
            ? reduce_table_launch<SmallReduceTable>(tasks, sources, num_sources, first, n, max_ctas)
            : reduce_table_launch<LargeReduceTable>(tasks, sources, num_sources, first, n, max_ctas));
    first += n;
  }
  return out;
}

LaunchInfo launch_reduces(const ReduceSpec* specs, std::size_t num_specs, int num_sources,
                          int max_ctas, cudaStream_t stream) {
  return reduce_launches(specs, num_specs, num_sources, max_ctas).run(stream);
}

}  // namespace tide::cuda_kernels
