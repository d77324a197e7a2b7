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

// The kernel's table, passed by value as a __grid_constant__ kernel parameter, in two sizes: a
// launch's parameters are copied by the host and loaded by the GPU before the kernel starts, and
// a small collective's table (a few casts or copies, one reduce, a few peers) is under 2 KB of
// the large one's ~6 KB.
template <int kCasts, int kCopies, int kReduces, int kSources, int kPeers>
struct CastToPeersTable {
  int num_casts;
  int num_copies;
  int num_reduces;
  int num_sources;
  int num_signals;
  int num_waits;
  int num_free_signals;
  int num_free_waits;
  int64_t cast_tiles;
  int64_t copy_tiles;
  int64_t reduce_tiles;
  uint64_t epoch;
  uint64_t tag;
  uint64_t wait_id;
  uint64_t free_wait_id;
  int equal;
  unsigned int* arrivals;
  unsigned int* departures;
  uint64_t* reached;
  uint64_t* passed;
  uint64_t* signals[kPeers];
  const uint64_t* waits[kPeers];
  uint64_t* free_signals[kPeers];
  uint64_t* free_waits[kPeers];
  CastTask casts[kCasts];
  CopyTask copies[kCopies];
  ReduceTask reduces[kReduces];
  const void* sources[kSources];
};
using LargeCastToPeersTable = CastToPeersTable<kCastToPeersCasts, kCastToPeersCopies, kCastToPeersReduces,
                                               kCastToPeersSources, kCastToPeersPeers>;
using SmallCastToPeersTable = CastToPeersTable<8, 8, 4, 16, 8>;
static_assert(sizeof(LargeCastToPeersTable) <= kMaxParamBytes, "cast-to-peers kernel table exceeds the kernel parameter limit");
static_assert(sizeof(SmallCastToPeersTable) <= 2048, "the small cast-to-peers table is meant to be small");

__device__ __forceinline__ void store_release_system(uint64_t* word, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

// A watchdog mark (wait_marks.hpp) into mapped pinned host memory: relaxed, not a release. A
// release store at system scope first orders every earlier write of the thread system-wide (a
// fence that may wait for the previous mark's write across PCIe to be acknowledged), on the path
// of CTA 0, whose arrival the data-ready signal waits for. Nothing the watchdog reads needs that
// order: it polls the marks, and looks at a stuck slot once more a poll later before it gives up
// (README.md); a store after a spin cannot be performed before the spin has ended.
__device__ __forceinline__ void store_mark(uint64_t* word, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

// An acquire-release fence at system scope: what message passing needs (the CTA's stores, then
// its arrival; the last arrival, then the signal), without the single total order of a
// sequentially consistent fence (__threadfence_system() is membar.sys, i.e. fence.sc.sys).
__device__ __forceinline__ void fence_acq_rel_system() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ uint64_t load_acquire_system(const uint64_t* word) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}

// A flag's epoch word against the awaited epoch: equal (a captured run's fixed value) or reached.
__device__ __forceinline__ bool flag_meets(uint64_t seen, uint64_t epoch, int equal) {
  return equal ? seen == epoch : static_cast<int64_t>(seen - epoch) >= 0;
}

// Adds 1 to a CTA counter with acquire-release semantics at GPU scope: what the CTA's thread did
// before (its flag loads) happens before what the last one to arrive does after (a reset).
__device__ __forceinline__ unsigned int add_acq_rel_gpu(unsigned int* counter) {
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// The first thread of a CTA spins until every flag of `flags` meets the epoch and carries the tag.
__device__ __forceinline__ void spin_on(const uint64_t* const* flags, int count, uint64_t epoch,
                                        uint64_t tag, int equal) {
  for (int k = 0; k < count; ++k) {
    unsigned int backoff = 32;
    while (!flag_meets(load_acquire_system(flags[k]), epoch, equal) ||
           *reinterpret_cast<const volatile uint64_t*>(flags[k] + 1) != tag) {
      __nanosleep(backoff);
      backoff = min(backoff * 2, 256u);
    }
  }
}

// One thread signals each of `words` (a peer's FlagWord: the tag, then the epoch as a release).
__device__ __forceinline__ void signal_all(uint64_t* const* words, int count, uint64_t tag, uint64_t epoch) {
  for (int k = 0; k < count; ++k) {
    *reinterpret_cast<volatile uint64_t*>(words[k] + 1) = tag;
    store_release_system(words[k], epoch);
  }
}

// kernels.cuh says what it does and why; FlagWord is {epoch, tag}.
template <class Table>
__global__ void __launch_bounds__(kThreadsPerCta, 4) cast_to_peers_kernel(const __grid_constant__ Table table) {
  // The slot-free handshake, when the kernel takes it (a fused head): one thread signals every
  // peer; every CTA's first thread waits for every peer before any store into a peer's window.
  // Everything this stream ran before has completed when the kernel starts, so the signal comes
  // after every earlier read of the own window's slots.
  if (table.num_free_signals > 0 && blockIdx.x == 0 && threadIdx.x == 0)
    signal_all(table.free_signals, table.num_free_signals, table.tag, table.epoch);
  if (table.num_free_waits > 0) {
    if (threadIdx.x == 0) {
      if (blockIdx.x == 0) store_mark(table.reached, table.free_wait_id);
      spin_on(table.free_waits, table.num_free_waits, table.epoch, table.tag, table.equal);
      // Once one CTA has passed, every CTA passes: the head is fused run by run only
      // (lowering.cpp), where a flag moves on only after the peer's next slot-free wait.
      if (blockIdx.x == 0) store_mark(table.passed, table.free_wait_id);
    }
    __syncthreads();
  }
  int t = 0;
  for (int64_t tile = blockIdx.x; tile < table.cast_tiles; tile += gridDim.x)
    cast_table_tile(table.casts, table.num_casts, tile, t);
  t = 0;
  for (int64_t tile = blockIdx.x; tile < table.copy_tiles; tile += gridDim.x)
    copy_table_tile(table.copies, table.num_copies, tile, t);
  if (table.num_signals > 0) {
    // The CTA's stores, peers' windows included, before its arrival: the barrier, then one
    // system-wide release fence by the thread that arrives (cumulative over the barrier, as a
    // grid sync), which with the arrival below makes a release pattern; the last CTA's arrival
    // and its fence make the matching acquire pattern, so every CTA's stores precede the
    // signals in causality order, and so a peer's acquire load that sees a signal sees them.
    __syncthreads();
    if (threadIdx.x == 0) fence_acq_rel_system();
    if (threadIdx.x == 0 && atomicAdd(table.arrivals, 1u) + 1 == gridDim.x) {
      // The last CTA: every other CTA fenced before it arrived. The next launch on this window
      // comes after this one (one executor per window, its runs one at a time), so it finds 0.
      atomicExch(table.arrivals, 0u);
      fence_acq_rel_system();
      signal_all(table.signals, table.num_signals, table.tag, table.epoch);
    }
  }
  if (table.num_waits > 0) {
    if (threadIdx.x == 0) {
      if (blockIdx.x == 0) store_mark(table.reached, table.wait_id);
      // The watchdog releases a stuck wait as it does a stream wait: its copy writes the awaited
      // words into the own flags, which completes while this kernel spins (seen on an H200).
      spin_on(table.waits, table.num_waits, table.epoch, table.tag, table.equal);
      // A captured run resets the data-ready flags it waited on once every CTA has passed them:
      // the last CTA to get past does. A peer signals one again only after its next slot-free
      // wait, which needs this rank's next slot-free signal, issued after this kernel ends.
      if (table.equal && add_acq_rel_gpu(table.departures) + 1 == gridDim.x) {
        atomicExch(table.departures, 0u);
        for (int k = 0; k < table.num_waits; ++k)
          *reinterpret_cast<volatile uint64_t*>(const_cast<uint64_t*>(table.waits[k])) = 0;
      }
      // Once one CTA has passed, every CTA passes: a flag moves on only after this kernel ends.
      if (blockIdx.x == 0) store_mark(table.passed, table.wait_id);
    }
    __syncthreads();
  }
  t = 0;
  for (int64_t tile = blockIdx.x; tile < table.reduce_tiles; tile += gridDim.x)
    reduce_table_tile(table.reduces, table.num_reduces, table.sources, table.num_sources, tile, t);
}

// Fills the table of `spec` (checked to fit) and launches the kernel.
template <class Table>
int launch_table(const CastToPeersSpec& spec, cudaStream_t stream) {
  Table table{};
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
  table.num_free_signals = spec.num_free_signals;
  table.num_free_waits = spec.num_free_waits;
  for (int k = 0; k < spec.num_free_signals; ++k) table.free_signals[k] = spec.free_signals[k];
  for (int k = 0; k < spec.num_free_waits; ++k) table.free_waits[k] = spec.free_waits[k];
  table.epoch = spec.epoch;
  table.tag = spec.tag;
  table.wait_id = spec.wait_id;
  table.free_wait_id = spec.free_wait_id;
  table.equal = spec.equal ? 1 : 0;
  table.arrivals = spec.arrivals;
  table.departures = spec.arrivals ? spec.arrivals + 1 : nullptr;
  table.reached = spec.reached;
  table.passed = spec.passed;
  // One CTA per SM and rank on this GPU: with the cast-to-peers kernels of an all-gather and a reduce-scatter
  // in flight on each, the spinning CTAs fill at most half of the 4 per SM that every SM holds
  // (__launch_bounds__), so no CTA of a cast-to-peers kernel waits for a slot that only a spinning one frees.
  const int64_t cap = std::max(1, sm_count() / std::max(1, spec.ranks_on_gpu));
  const int64_t tiles = std::max({table.cast_tiles, table.copy_tiles, table.reduce_tiles, int64_t{1}});
  void* args[] = {&table};
  return launch_kernel(reinterpret_cast<const void*>(cast_to_peers_kernel<Table>),
                       static_cast<int>(std::min(tiles, cap)), args, stream, "cast_to_peers_kernel");
}

// Whether `spec` fits a table of these capacities (its zero-sized casts, copies and reduces
// counted too).
template <int kCasts, int kCopies, int kReduces, int kSources, int kPeers>
bool fits_table(const CastToPeersSpec& spec, const CastToPeersTable<kCasts, kCopies, kReduces, kSources, kPeers>*) {
  const int peers = std::max({spec.num_signals, spec.num_waits, spec.num_free_signals, spec.num_free_waits});
  return spec.num_casts <= std::size_t{kCasts} && spec.num_copies <= std::size_t{kCopies} &&
         spec.num_reduces <= std::size_t{kReduces} && peers <= kPeers &&
         spec.num_reduces * static_cast<std::size_t>(spec.num_sources) <= std::size_t{kSources};
}

}  // namespace

void preload_cast_to_peers_kernel() {
  preload_kernel(reinterpret_cast<const void*>(cast_to_peers_kernel<SmallCastToPeersTable>));
  preload_kernel(reinterpret_cast<const void*>(cast_to_peers_kernel<LargeCastToPeersTable>));
}

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
  TIDE_CHECK_ARG(spec.num_free_signals <= kCastToPeersPeers && spec.num_free_waits <= kCastToPeersPeers &&
                     (!spec.equal || spec.num_free_waits == 0),
                 "launch_cast_to_peers", "slot-free handshake",
                 detail::concat(spec.num_free_signals, " signals, ", spec.num_free_waits, " waits",
                                spec.equal ? ", captured" : ""),
                 detail::concat("at most ", kCastToPeersPeers, " of each, and none in a captured "
                                "kernel (nothing resets those flags: a capture keeps the memop head)"));
  TIDE_CHECK_ARG(!spec.equal || spec.num_waits == 0 || spec.arrivals, "launch_cast_to_peers",
                 "arrivals", "null", "the window's CTA counters when a captured kernel waits");
  TIDE_CHECK_ARG((spec.num_waits == 0 && spec.num_free_waits == 0) || (spec.reached && spec.passed),
                 "launch_cast_to_peers", "marks", "null", "the watchdog's marks when the kernel waits");
  return {1, fits_table(spec, static_cast<const SmallCastToPeersTable*>(nullptr)) ? launch_table<SmallCastToPeersTable>(spec, stream)
                                                     : launch_table<LargeCastToPeersTable>(spec, stream)};
}

}  // namespace tide::cuda_kernels
