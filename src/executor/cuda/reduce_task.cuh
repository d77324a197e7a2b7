// A reduce's task: the record a launch's table holds (ReduceTask), built on the host from a
// ReduceSpec (reduce_task), and the device code that sums one tile of a table's reduces
// (reduce_table_tile). Shared by the reduce kernel (reduce_kernel.cu) and the cast-to-peers kernel
// (cast_to_peers_kernel.cu). CUDA-only (include from .cu files).
#pragma once

#include <cstdint>

#include "convert.cuh"
#include "cuda/cuda_check.hpp"
#include "kernel_launch.hpp"
#include "kernels.cuh"

namespace tide::cuda_kernels {

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

// A reduce's task (tile_begin and source_begin set by the table it joins).
inline ReduceTask reduce_task(const ReduceSpec& s, int num_sources) {
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

}  // namespace tide::cuda_kernels
