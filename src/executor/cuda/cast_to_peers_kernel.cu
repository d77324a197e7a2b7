// The cast-to-peers kernel (launch_cast_to_peers): a small single-node program's tail (its casts
// and copies into the own and the peers' windows, its signals, its waits, its reduces) in one
// launch. kernels.cuh says what it does, in which order and why; the casts, copies and reduces are
// the other kernels' tiles (cast_task.cuh, copy_task.cuh, reduce_task.cuh).
#include <algorithm>
#include <cstdint>
#include <optional>

#include "cast_task.cuh"
#include "copy_task.cuh"
#include "cuda/cuda_check.hpp"
#include "kernel_launch.hpp"
#include "kernels.cuh"
#include "reduce_task.cuh"

namespace tide::cuda_kernels {
namespace {

// The kernel's table, passed by value as a __grid_constant__ kernel parameter.
struct CastToPeersTable {
  int num_casts;
  int num_copies;
  int num_reduces;
  int num_sources;
  int num_signals;
  int num_waits;
  int64_t cast_tiles;
  int64_t copy_tiles;
  int64_t reduce_tiles;
  uint64_t epoch;
  uint64_t tag;
  uint64_t wait_id;
  int equal;
  unsigned int* arrivals;
  uint64_t* reached;
  uint64_t* passed;
  uint64_t* signals[kCastToPeersPeers];
  const uint64_t* waits[kCastToPeersPeers];
  CastTask casts[kCastToPeersCasts];
  CopyTask copies[kCastToPeersCopies];
  ReduceTask reduces[kCastToPeersReduces];
  const void* sources[kCastToPeersSources];
};
static_assert(sizeof(CastToPeersTable) <= kMaxParamBytes, "cast-to-peers kernel table exceeds the kernel parameter limit");

__device__ __forceinline__ void store_release_system(uint64_t* word, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_system(const uint64_t* word) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}

// A flag's epoch word against the awaited epoch: equal (a captured run's fixed value) or reached.
__device__ __forceinline__ bool flag_meets(uint64_t seen, uint64_t epoch, int equal) {
  return equal ? seen == epoch : static_cast<int64_t>(seen - epoch) >= 0;
}

// kernels.cuh says what it does and why; FlagWord is {epoch, tag}.
__global__ void __launch_bounds__(kThreadsPerCta, 4) cast_to_peers_kernel(const __grid_constant__ CastToPeersTable table) {
  int t = 0;
  for (int64_t tile = blockIdx.x; tile < table.cast_tiles; tile += gridDim.x)
    cast_table_tile(table.casts, table.num_casts, tile, t);
  t = 0;
  for (int64_t tile = blockIdx.x; tile < table.copy_tiles; tile += gridDim.x)
    copy_table_tile(table.copies, table.num_copies, tile, t);
  if (table.num_signals > 0) {
    // The CTA's stores, peers' windows included, before its arrival: the barrier, then one
    // system-wide fence by the thread that arrives (cumulative over the barrier, as a grid sync).
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
    if (threadIdx.x == 0 && atomicAdd(table.arrivals, 1u) + 1 == gridDim.x) {
      // The last CTA: every other CTA fenced before it arrived. The next launch on this window
      // comes after this one (one executor per window, its runs one at a time), so it finds 0.
      atomicExch(table.arrivals, 0u);
      __threadfence_system();
      for (int k = 0; k < table.num_signals; ++k) {
        *reinterpret_cast<volatile uint64_t*>(table.signals[k] + 1) = table.tag;
        store_release_system(table.signals[k], table.epoch);
      }
    }
  }
  if (table.num_waits > 0) {
    if (threadIdx.x == 0) {
      if (blockIdx.x == 0) store_release_system(table.reached, table.wait_id);
      // The watchdog releases a stuck wait as it does a stream wait: its copy writes the awaited
      // words into the own flags, which completes while this kernel spins (seen on an H200).
      for (int k = 0; k < table.num_waits; ++k) {
        unsigned int backoff = 32;
        while (!flag_meets(load_acquire_system(table.waits[k]), table.epoch, table.equal) ||
               *reinterpret_cast<const volatile uint64_t*>(table.waits[k] + 1) != table.tag) {
          __nanosleep(backoff);
          backoff = min(backoff * 2, 256u);
        }
      }
      // Once one CTA has passed, every CTA passes: a flag moves on only after this kernel ends.
      if (blockIdx.x == 0) store_release_system(table.passed, table.wait_id);
    }
    __syncthreads();
  }
  t = 0;
  for (int64_t tile = blockIdx.x; tile < table.reduce_tiles; tile += gridDim.x)
    reduce_table_tile(table.reduces, table.num_reduces, table.sources, table.num_sources, tile, t);
}

}  // namespace

void preload_cast_to_peers_kernel() { preload_kernel(reinterpret_cast<const void*>(cast_to_peers_kernel)); }

bool cast_to_peers_fits(std::size_t casts, std::size_t copies, int signals, int waits,
                  std::size_t reduces, int num_sources) {
  return casts <= kCastToPeersCasts && copies <= kCastToPeersCopies && signals <= kCastToPeersPeers &&
         waits <= kCastToPeersPeers && reduces <= kCastToPeersReduces &&
         reduces * static_cast<std::size_t>(num_sources) <= kCastToPeersSources;
}

LaunchInfo launch_cast_to_peers(const CastToPeersSpec& spec, cudaStream_t stream) {
  TIDE_CHECK_ARG(cast_to_peers_fits(spec.num_casts, spec.num_copies, spec.num_signals, spec.num_waits,
                              spec.num_reduces, spec.num_sources),
                 "launch_cast_to_peers", "spec",
                 detail::concat(spec.num_casts, " casts, ", spec.num_copies, " copies, ",
                                spec.num_signals, " signals, ", spec.num_waits, " waits, ",
                                spec.num_reduces, " reduces of ", spec.num_sources, " sources"),
                 detail::concat("at most ", kCastToPeersCasts, " casts, ", kCastToPeersCopies, " copies, ",
                                kCastToPeersPeers, " signals and waits, ", kCastToPeersReduces,
                                " reduces, ", kCastToPeersSources, " sources in all"));
  TIDE_CHECK_ARG(spec.num_signals == 0 || spec.arrivals, "launch_cast_to_peers", "arrivals", "null",
                 "the window's CTA counter when the kernel signals");
  TIDE_CHECK_ARG(spec.num_waits == 0 || (spec.reached && spec.passed),
                 "launch_cast_to_peers", "marks", "null", "the watchdog's marks when the kernel waits");
  CastToPeersTable table{};
  for (std::size_t i = 0; i < spec.num_casts; ++i) {
    const CastSpec& c = spec.casts[i];
    if (c.count + c.pad == 0) continue;
    CastTask& task = table.casts[table.num_casts++];
    task = cast_task(c);
    task.tile_begin = table.cast_tiles;
    table.cast_tiles += tiles_of(task.total);
  }
  for (std::size_t i = 0; i < spec.num_copies; ++i) {
    const std::optional<CopyTask> task = copy_task(spec.copies[i]);
    if (!task) continue;
    CopyTask& entry = table.copies[table.num_copies++];
    entry = *task;
    entry.tile_begin = table.copy_tiles;
    table.copy_tiles += (entry.total + kCopyTileBytes - 1) / kCopyTileBytes;
  }
  table.num_sources = spec.num_sources;
  for (std::size_t i = 0; i < spec.num_reduces; ++i) {
    const ReduceSpec& r = spec.reduces[i];
    if (r.count == 0) continue;
    ReduceTask& task = table.reduces[table.num_reduces];
    task = reduce_task(r, spec.num_sources);
    task.tile_begin = static_cast<int32_t>(table.reduce_tiles);
    for (int p = 0; p < spec.num_sources; ++p)
      table.sources[table.num_reduces * spec.num_sources + p] = r.sources[p];
    table.reduce_tiles += tiles_of(task.count);
    ++table.num_reduces;
  }
  table.num_signals = spec.num_signals;
  table.num_waits = spec.num_waits;
  for (int k = 0; k < spec.num_signals; ++k) table.signals[k] = spec.signals[k];
  for (int k = 0; k < spec.num_waits; ++k) table.waits[k] = spec.waits[k];
  table.epoch = spec.epoch;
  table.tag = spec.tag;
  table.wait_id = spec.wait_id;
  table.equal = spec.equal ? 1 : 0;
  table.arrivals = spec.arrivals;
  table.reached = spec.reached;
  table.passed = spec.passed;
  // One CTA per SM and rank on this GPU: with the cast-to-peers kernels of an all-gather and a reduce-scatter
  // in flight on each, the spinning CTAs fill at most half of the 4 per SM that every SM holds
  // (__launch_bounds__), so no CTA of a cast-to-peers kernel waits for a slot that only a spinning one frees.
  const int64_t cap = std::max(1, sm_count() / std::max(1, spec.ranks_on_gpu));
  const int64_t tiles = std::max({table.cast_tiles, table.copy_tiles, table.reduce_tiles, int64_t{1}});
  void* args[] = {&table};
  return {1, launch_kernel(reinterpret_cast<const void*>(cast_to_peers_kernel),
                           static_cast<int>(std::min(tiles, cap)), args, stream, "cast_to_peers_kernel")};
}

}  // namespace tide::cuda_kernels
