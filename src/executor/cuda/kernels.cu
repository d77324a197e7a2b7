// Cast and reduce kernels. See kernels.cuh for the contract; the arithmetic must stay exactly the
// host executor's (src/executor/host/host_executor.cpp, src/layout/dtype.cpp).
#include "kernels.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "convert.cuh"
#include "cuda/cuda_check.hpp"

namespace tide::cuda_kernels {
namespace {

// ---- Task tables, passed by value as __grid_constant__ kernel parameters. --------------------

struct CastTask {
  const void* src;
  void* dst;
  int64_t count;       // converted elements
  int64_t total;       // count + pad
  int64_t row;         // elements per destination row (total when contiguous)
  int64_t dst_pitch;   // elements between destination rows
  int64_t tile_begin;  // first tile of this task in the launch
  const float* scale;  // kE4M3 destinations: what each element is multiplied by
  uint8_t src_type;
  uint8_t dst_type;
  uint8_t vectorized;
};

template <int kTasks>
struct CastTable {
  int num_tasks;
  int64_t num_tiles;
  CastTask tasks[kTasks];
};

// 40 bytes, so that a launch's table holds 584 tasks of 2 sources: a 512-param bucket in one
// launch at W = 2. Task t's sources are the table's sources[t * num_sources ...].
struct ReduceTask {
  void* dst;
  const void* partial;  // nullptr: the sum starts at 0
  int64_t count;
  float prescale;
  float scale;
  int32_t tile_begin;   // a launch covers fewer than 2^31 tiles (launch_reduces checks)
  uint8_t src_type;
  uint8_t dst_type;
  uint8_t partial_type;  // kFP32 or kBF16
  uint8_t accumulate : 1;
  uint8_t vectorized : 1;
};
static_assert(sizeof(ReduceTask) == 40, "ReduceTask must stay 40 bytes (a launch's capacity)");

// num_tasks tasks, then num_tasks x num_sources source pointers, in `data`: a table of kBytes
// holds as many tasks as their sources leave room for.
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

// Kernel parameters may take 32764 bytes (CUDA >= 12.1, Volta and newer). A launch copies its whole
// table whatever the bucket holds, so one-task tables serve the one-param bucket, small ones the
// common launch, large ones big buckets and worlds.
using OneCastTable = CastTable<1>;
using SmallCastTable = CastTable<16>;
constexpr int kLargeCastTasks = 448;  // 72-byte tasks in the 32 KB of a launch's parameters
using LargeCastTable = CastTable<kLargeCastTasks>;
constexpr int kOneReduceSources = 16;
using OneReduceTable = ReduceTable<sizeof(ReduceTask) + kOneReduceSources * sizeof(void*)>;
using SmallReduceTable = ReduceTable<16 * sizeof(ReduceTask) + 256 * sizeof(void*)>;
using LargeReduceTable = ReduceTable<32744>;
static_assert(sizeof(LargeCastTable) <= 32764, "cast table exceeds the kernel parameter limit");
static_assert(sizeof(LargeReduceTable) <= 32764, "reduce table exceeds the kernel parameter limit");
static_assert(LargeReduceTable::capacity(2) >= 512, "a 512-param bucket at W = 2 is one launch");
static_assert(LargeReduceTable::capacity(kMaxSources) >= 1, "a task of kMaxSources sources fits");

// ---- Cast. -----------------------------------------------------------------------------------

// Where element k of the task's destination goes: k itself, or row k / row at its pitch.
__device__ __forceinline__ int64_t dst_index(const CastTask& task, int64_t k) {
  return task.row == task.total ? k : (k / task.row) * task.dst_pitch + k % task.row;
}

template <ElementType Src, ElementType Dst>
__device__ __forceinline__ void cast_tile(const CastTask& task, int64_t begin, int64_t end) {
  // Into e4m3: x * scale, one rounded fp32 multiply (as torchao's eager cast), then convert.
  const float scale = Dst == kE4M3 ? *task.scale : 1.0f;
  auto scaled = [&](float x) { return Dst == kE4M3 ? __fmul_rn(x, scale) : x; };
  if (task.vectorized) {  // strided: rows and pitch are multiples of 8, so a vector stays in a row
    for (int64_t e = begin + threadIdx.x * 8; e < end; e += kThreadsPerCta * 8) {
      if (e + 8 <= task.count) {
        float v[8];
        load8<Src>(task.src, e, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = scaled(v[j]);
        store8<Dst>(task.dst, dst_index(task, e), v);
      } else if (e >= task.count && e + 8 <= end) {
        const float zeros[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        store8<Dst>(task.dst, e, zeros);  // padding: contiguous tasks only
      } else {
        for (int64_t k = e; k < min(e + 8, end); ++k)
          store_scalar<Dst>(task.dst, dst_index(task, k),
                            k < task.count ? scaled(load_scalar<Src>(task.src, k)) : 0.0f);
      }
    }
  } else {
    for (int64_t k = begin + threadIdx.x; k < end; k += kThreadsPerCta)
      store_scalar<Dst>(task.dst, dst_index(task, k),
                        k < task.count ? scaled(load_scalar<Src>(task.src, k)) : 0.0f);
  }
}

template <ElementType Src>
__device__ __forceinline__ void cast_tile_dispatch_dst(const CastTask& task, int64_t begin, int64_t end) {
  switch (task.dst_type) {
    case kBF16: cast_tile<Src, kBF16>(task, begin, end); break;
    case kFP16: cast_tile<Src, kFP16>(task, begin, end); break;
    case kE4M3: cast_tile<Src, kE4M3>(task, begin, end); break;
    default: cast_tile<Src, kFP32>(task, begin, end); break;
  }
}

// Tile `tile` of a table's tasks; `t` is the task of the caller's previous tile (tiles only grow).
__device__ __forceinline__ void cast_table_tile(const CastTask* tasks, int num_tasks, int64_t tile,
                                                int& t) {
  while (t + 1 < num_tasks && tasks[t + 1].tile_begin <= tile) ++t;
  const CastTask& task = tasks[t];
  const int64_t begin = (tile - task.tile_begin) * kTileElements;
  const int64_t end = min(begin + kTileElements, task.total);
  switch (task.src_type) {
    case kBF16: cast_tile_dispatch_dst<kBF16>(task, begin, end); break;
    case kFP16: cast_tile_dispatch_dst<kFP16>(task, begin, end); break;
    default: cast_tile_dispatch_dst<kFP32>(task, begin, end); break;
  }
}

template <class Table>
__global__ void __launch_bounds__(kThreadsPerCta, 4) cast_kernel(const __grid_constant__ Table table) {
  int t = 0;
  for (int64_t tile = blockIdx.x; tile < table.num_tiles; tile += gridDim.x)
    cast_table_tile(table.tasks, table.num_tasks, tile, t);
}

// ---- Reduce. ---------------------------------------------------------------------------------

// One element: acc = partial (or 0); acc += prescale * src_p for p in order; r = acc * scale;
// r += old.
template <ElementType Src, ElementType Dst>
__device__ __forceinline__ void reduce_scalar(const ReduceTask& task, const void* const* sources,
                                              int num_sources, int64_t k) {
  float acc = !task.partial                  ? 0.0f
              : task.partial_type == kBF16 ? load_scalar<kBF16>(task.partial, k)
                                           : load_scalar<kFP32>(task.partial, k);
  for (int p = 0; p < num_sources; ++p)
    acc = __fadd_rn(acc, __fmul_rn(load_scalar<Src>(sources[p], k), task.prescale));
  float result = __fmul_rn(acc, task.scale);
  if (task.accumulate) result = __fadd_rn(load_scalar<Dst>(task.dst, k), result);
  store_scalar<Dst>(task.dst, k, result);
}

// The 8 sums starting at element e: the task's partial, or 0.
__device__ __forceinline__ void start_sum(const ReduceTask& task, int64_t e, float (&acc)[8]) {
  if (task.partial && task.partial_type == kBF16) {
    load8<kBF16>(task.partial, e, acc);
  } else if (task.partial) {
    load8<kFP32>(task.partial, e, acc);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
  }
}

// A full tile, vectorised: two passes; in each, every thread owns kVectors vectors of 8 elements
// (strided by the CTA so the warp's accesses coalesce) and keeps them all in flight per source.
// Two vectors per pass keep the kernel within 64 registers (4 CTAs per SM) without spilling.
template <ElementType Src, ElementType Dst>
__device__ __forceinline__ void reduce_full_tile(const ReduceTask& task,
                                                 const void* const* sources, int num_sources,
                                                 int64_t begin) {
  constexpr int kVectors = 2;
  constexpr int kPasses = static_cast<int>(kTileElements / (kThreadsPerCta * 8 * kVectors));
  for (int pass = 0; pass < kPasses; ++pass) {
    const int64_t first = begin + pass * (kThreadsPerCta * 8 * kVectors) + threadIdx.x * 8;
    float acc[kVectors][8];
#pragma unroll
    for (int v = 0; v < kVectors; ++v) start_sum(task, first + v * kThreadsPerCta * 8, acc[v]);
#pragma unroll 2
    for (int p = 0; p < num_sources; ++p) {
      float x[kVectors][8];
#pragma unroll
      for (int v = 0; v < kVectors; ++v) load8<Src>(sources[p], first + v * kThreadsPerCta * 8, x[v]);
#pragma unroll
      for (int v = 0; v < kVectors; ++v)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          acc[v][j] = __fadd_rn(acc[v][j], __fmul_rn(x[v][j], task.prescale));
    }
#pragma unroll
    for (int v = 0; v < kVectors; ++v) {
      const int64_t e = first + v * kThreadsPerCta * 8;
      float r[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = __fmul_rn(acc[v][j], task.scale);
      if (task.accumulate) {
        float old[8];
        load8<Dst>(task.dst, e, old);
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = __fadd_rn(old[j], r[j]);
      }
      store8<Dst>(task.dst, e, r);
    }
  }
}

template <ElementType Src, ElementType Dst>
__device__ void reduce_tile(const ReduceTask& task, const void* const* sources, int num_sources,
                            int64_t begin, int64_t end) {
  if (task.vectorized && end - begin == kTileElements) {
    reduce_full_tile<Src, Dst>(task, sources, num_sources, begin);
  } else if (task.vectorized) {
    for (int64_t e = begin + threadIdx.x * 8; e < end; e += kThreadsPerCta * 8) {
      if (e + 8 <= end) {
        float acc[8];
        start_sum(task, e, acc);
        for (int p = 0; p < num_sources; ++p) {
          float x[8];
          load8<Src>(sources[p], e, x);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(x[j], task.prescale));
        }
        float r[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) r[j] = __fmul_rn(acc[j], task.scale);
        if (task.accumulate) {
          float old[8];
          load8<Dst>(task.dst, e, old);
#pragma unroll
          for (int j = 0; j < 8; ++j) r[j] = __fadd_rn(old[j], r[j]);
        }
        store8<Dst>(task.dst, e, r);
      } else {
        for (int64_t k = e; k < end; ++k) reduce_scalar<Src, Dst>(task, sources, num_sources, k);
      }
    }
  } else {
    for (int64_t k = begin + threadIdx.x; k < end; k += kThreadsPerCta)
      reduce_scalar<Src, Dst>(task, sources, num_sources, k);
  }
}

template <ElementType Src>
__device__ void reduce_tile_dispatch_dst(const ReduceTask& task, const void* const* sources,
                                         int num_sources, int64_t begin, int64_t end) {
  switch (task.dst_type) {
    case kBF16: reduce_tile<Src, kBF16>(task, sources, num_sources, begin, end); break;
    case kFP16: reduce_tile<Src, kFP16>(task, sources, num_sources, begin, end); break;
    default: reduce_tile<Src, kFP32>(task, sources, num_sources, begin, end); break;
  }
}

// Tile `tile` of a table's reduce tasks; `t` as cast_table_tile's.
__device__ __forceinline__ void reduce_table_tile(const ReduceTask* tasks, int num_tasks,
                                                  const void* const* all_sources, int num_sources,
                                                  int64_t tile, int& t) {
  while (t + 1 < num_tasks && tasks[t + 1].tile_begin <= tile) ++t;
  const ReduceTask& task = tasks[t];
  const void* const* sources = all_sources + static_cast<int64_t>(t) * num_sources;
  const int64_t begin = (tile - task.tile_begin) * kTileElements;
  const int64_t end = min(begin + kTileElements, task.count);
  switch (task.src_type) {
    case kBF16: reduce_tile_dispatch_dst<kBF16>(task, sources, num_sources, begin, end); break;
    case kFP16: reduce_tile_dispatch_dst<kFP16>(task, sources, num_sources, begin, end); break;
    default: reduce_tile_dispatch_dst<kFP32>(task, sources, num_sources, begin, end); break;
  }
}

// Persistent CTAs, grid-striding over every tile of the table.
template <class Table>
__global__ void __launch_bounds__(kThreadsPerCta, 4) reduce_kernel(const __grid_constant__ Table table) {
  int t = 0;
  for (int64_t tile = blockIdx.x; tile < table.num_tiles; tile += gridDim.x)
    reduce_table_tile(table.tasks(), table.num_tasks, table.sources(), table.num_sources, tile, t);
}

// ---- Cast-to-peers kernel: a small program's stores, signals, waits and reduces in one kernel. -------------

struct CopyTask {
  const std::byte* src;
  std::byte* dst;
  int64_t bytes;       // copied
  int64_t total;       // bytes + zeroed
  int64_t tile_begin;  // in kCopyTileBytes tiles
  uint8_t vectorized;  // src, dst, bytes and total multiples of 16
};
constexpr int64_t kCopyTileBytes = kTileElements * 2;  // a bf16 cast tile's bytes

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
static_assert(sizeof(CastToPeersTable) <= 32764, "cast-to-peers kernel table exceeds the kernel parameter limit");

__device__ __forceinline__ void store_release_system(uint64_t* word, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(word), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_system(const uint64_t* word) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(word) : "memory");
  return value;
}

// Bytes [begin, end) of dst from src, zeros past `valid`: this thread takes every `lanes`-th
// 16-B vector (every `lanes`-th byte unless `vectorized`: pointers, begin, end and valid all
// multiples of 16) from `lane` on. The cast-to-peers kernel's copies and the IPC network's pull.
__device__ __forceinline__ void copy_bytes(std::byte* dst, const std::byte* src, uint64_t begin,
                                           uint64_t end, uint64_t valid, uint64_t lane,
                                           uint64_t lanes, bool vectorized) {
  if (vectorized) {
    for (uint64_t b = begin + lane * 16; b < end; b += lanes * 16)
      *reinterpret_cast<uint4*>(dst + b) =
          b < valid ? *reinterpret_cast<const uint4*>(src + b) : make_uint4(0, 0, 0, 0);
  } else {
    for (uint64_t b = begin + lane; b < end; b += lanes) dst[b] = b < valid ? src[b] : std::byte{0};
  }
}

// Tile `tile` of a table's copy tasks; `t` as cast_table_tile's.
__device__ __forceinline__ void copy_table_tile(const CopyTask* tasks, int num_tasks, int64_t tile,
                                                int& t) {
  while (t + 1 < num_tasks && tasks[t + 1].tile_begin <= tile) ++t;
  const CopyTask& task = tasks[t];
  const int64_t begin = (tile - task.tile_begin) * kCopyTileBytes;
  copy_bytes(task.dst, task.src, begin, min(begin + kCopyTileBytes, task.total), task.bytes,
             threadIdx.x, kThreadsPerCta, task.vectorized);
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
        while (static_cast<int64_t>(load_acquire_system(table.waits[k]) - table.epoch) < 0 ||
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

// ---- Copies on the SMs (launch_copies). -----------------------------------------------------

template <int kTasks>
struct CopyTable {
  int num_tasks;
  int64_t num_tiles;
  CopyTask tasks[kTasks];
};
using SmallCopyTable = CopyTable<32>;
using LargeCopyTable = CopyTable<kLargeCopyTasks>;
static_assert(sizeof(LargeCopyTable) <= 32764, "copy table exceeds the kernel parameter limit");

template <class Table>
__global__ void __launch_bounds__(kThreadsPerCta, 4) copy_kernel(const __grid_constant__ Table table) {
  int t = 0;
  for (int64_t tile = blockIdx.x; tile < table.num_tiles; tile += gridDim.x)
    copy_table_tile(table.tasks, table.num_tasks, tile, t);
}

// ---- The IPC network's pull. -------------------------------------------------------------------

__global__ void __launch_bounds__(kThreadsPerCta) net_pull_kernel(const uint64_t* offset,
                                                                 const std::byte* peer_data,
                                                                 std::byte* dst, std::size_t bytes,
                                                                 std::size_t limit) {
  const uint64_t from = *reinterpret_cast<const volatile uint64_t*>(offset);
  if (from > limit || bytes > limit - from) return;
  const std::byte* src = peer_data + from;
  const uint64_t lane = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
  const uint64_t lanes = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  // The 16-B vectors, then the tail byte by byte (the offset a peer sends need not be aligned).
  const bool aligned = (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0;
  const uint64_t vector_bytes = aligned ? bytes / 16 * 16 : 0;
  copy_bytes(dst, src, 0, vector_bytes, vector_bytes, lane, lanes, true);
  copy_bytes(dst, src, vector_bytes, bytes, bytes, lane, lanes, false);
}

// ---- Host side. ------------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
int64_t tiles_of(int64_t elements) { return (elements + kTileElements - 1) / kTileElements; }

// A cast's task (tile_begin set by the table it joins).
CastTask cast_task(const CastSpec& s) {
  const bool strided = s.rows > 1;
  const int64_t total = strided ? s.rows * s.count : s.count + s.pad;
  const bool vectorized = aligned16(s.src) && aligned16(s.dst) &&
                          (!strided || (s.count % 8 == 0 && s.dst_pitch % 8 == 0));
  return {s.src, s.dst, strided ? total : s.count, total, strided ? s.count : total,
          strided ? s.dst_pitch : total, 0, s.scale, s.src_type, s.dst_type,
          static_cast<uint8_t>(vectorized)};
}

// A reduce's task (tile_begin and source_begin set by the table it joins).
ReduceTask reduce_task(const ReduceSpec& s, int num_sources) {
  bool vectorized = aligned16(s.dst) && (!s.partial || aligned16(s.partial));
  for (int p = 0; p < num_sources; ++p) vectorized = vectorized && aligned16(s.sources[p]);
  TIDE_CHECK_ARG(!s.partial || s.partial_type == kFP32 || s.partial_type == kBF16,
                 "launch_reduces", "partial_type", static_cast<int>(s.partial_type), "fp32 or bf16");
  ReduceTask task{s.dst, s.partial, s.count, s.prescale, s.scale, 0, s.src_type, s.dst_type,
                  static_cast<uint8_t>(s.partial_type)};
  task.accumulate = s.accumulate;
  task.vectorized = vectorized;
  return task;
}

// A copy's task (tile_begin set by the table it joins); null for one of no bytes.
std::optional<CopyTask> copy_task(const CopySpec& c) {
  const auto bytes = static_cast<int64_t>(c.bytes);
  const auto total = static_cast<int64_t>(c.bytes + c.zero_bytes);
  if (total == 0) return std::nullopt;
  return CopyTask{static_cast<const std::byte*>(c.src), static_cast<std::byte*>(c.dst), bytes, total,
                  0,
                  static_cast<uint8_t>(aligned16(c.src) && aligned16(c.dst) && bytes % 16 == 0 &&
                                       total % 16 == 0)};
}

void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) cuda_detail::throw_cuda_error(kernel, status, __FILE__, __LINE__);
}

int grid_for(int64_t tiles, int max_ctas, int default_multiple = 1) {
  const int cap = max_ctas > 0 ? max_ctas : default_multiple * default_max_ctas();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tiles, cap)));
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
  const int grid = grid_for(tiles, max_ctas, 2);
  cast_kernel<Table><<<grid, kThreadsPerCta, 0, stream>>>(table);
  check_launch("cast_kernel<<<>>>");
  return grid;
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
  const int grid = grid_for(tiles, max_ctas);
  return [table, grid](cudaStream_t stream) {
    reduce_kernel<Table><<<grid, kThreadsPerCta, 0, stream>>>(*table);
    check_launch("reduce_kernel<<<>>>");
    return grid;
  };
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
  return [table, grid](cudaStream_t stream) {
    copy_kernel<Table><<<grid, kThreadsPerCta, 0, stream>>>(*table);
    check_launch("copy_kernel<<<>>>");
    return grid;
  };
}

}  // namespace

void preload_kernels() {
  cudaFuncAttributes attributes;
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, cast_kernel<OneCastTable>));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, cast_kernel<SmallCastTable>));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, cast_kernel<LargeCastTable>));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reduce_kernel<OneReduceTable>));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reduce_kernel<SmallReduceTable>));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reduce_kernel<LargeReduceTable>));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, copy_kernel<SmallCopyTable>));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, copy_kernel<LargeCopyTable>));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, net_pull_kernel));
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, cast_to_peers_kernel));
}

int ctas_per_sm() {
  // CTAs of 256 threads at 2 per SM: 512 resident threads per SM keep enough 16-byte loads in
  // flight for 93% of the HBM copy ceiling on an H200 (4 per SM: 94%, at twice the SM time), and
  // leave most of each SM to concurrent compute (BENCHMARKS.md, reduce kernel by grid).
  // TIDE_CUDA_CTAS_PER_SM overrides it (casts take twice as many).
  static const int value = [] {
    const char* text = std::getenv("TIDE_CUDA_CTAS_PER_SM");
    if (!text || !*text) return 2;
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    TIDE_CHECK_ARG(*end == '\0' && v >= 1 && v <= 8, "CUDA executor", "TIDE_CUDA_CTAS_PER_SM",
                   std::string("'") + text + "'", "an integer in [1, 8]");
    return static_cast<int>(v);
  }();
  return value;
}

int sm_count() {
  static std::mutex mutex;
  static std::vector<int> per_device;
  int device = 0;
  TIDE_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(per_device.size()) <= device) per_device.resize(device + 1, 0);
  if (per_device[device] == 0)
    TIDE_CUDA_CHECK(cudaDeviceGetAttribute(&per_device[device], cudaDevAttrMultiProcessorCount, device));
  return per_device[device];
}

int default_max_ctas() { return ctas_per_sm() * sm_count(); }

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

LaunchInfo Launches::run(cudaStream_t stream) const {
  LaunchInfo info;
  for (const auto& launch : launches_) {
    info.launches += 1;
    info.max_ctas = std::max(info.max_ctas, launch(stream));
  }
  return info;
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
  table.arrivals = spec.arrivals;
  table.reached = spec.reached;
  table.passed = spec.passed;
  // One CTA per SM and rank on this GPU: with the cast-to-peers kernels of an all-gather and a reduce-scatter
  // in flight on each, the spinning CTAs fill at most half of the 4 per SM that every SM holds
  // (__launch_bounds__), so no CTA of a cast-to-peers kernel waits for a slot that only a spinning one frees.
  const int64_t cap = std::max(1, sm_count() / std::max(1, spec.ranks_on_gpu));
  const int64_t tiles = std::max({table.cast_tiles, table.copy_tiles, table.reduce_tiles, int64_t{1}});
  const int grid = static_cast<int>(std::min(tiles, cap));
  cast_to_peers_kernel<<<grid, kThreadsPerCta, 0, stream>>>(table);
  check_launch("cast_to_peers_kernel<<<>>>");
  return {1, grid};
}

LaunchInfo launch_net_pull(const uint64_t* offset, const void* peer_data, void* dst,
                           std::size_t bytes, std::size_t limit, cudaStream_t stream) {
  if (bytes == 0) return {};
  const std::size_t per_cta = static_cast<std::size_t>(kThreadsPerCta) * 16 * 8;
  const int grid = static_cast<int>(
      std::min<std::size_t>(kNetPullCtas, (bytes + per_cta - 1) / per_cta));
  net_pull_kernel<<<grid, kThreadsPerCta, 0, stream>>>(
      offset, static_cast<const std::byte*>(peer_data), static_cast<std::byte*>(dst), bytes, limit);
  check_launch("net_pull_kernel<<<>>>");
  return {1, grid};
}

}  // namespace tide::cuda_kernels
