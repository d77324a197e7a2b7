// A cast's task: the record a launch's table holds (CastTask), built on the host from a CastSpec
// (cast_task), and the device code that converts one tile of a table's casts (cast_table_tile).
// Shared by the cast kernel (cast_kernel.cu) and the cast-to-peers kernel (cast_to_peers_kernel.cu).
// CUDA-only (include from .cu files).
#pragma once

#include <cstdint>

#include "convert.cuh"
#include "kernel_launch.hpp"
#include "kernels.cuh"

namespace tide::cuda_kernels {

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

// A cast's task (tile_begin set by the table it joins).
inline CastTask cast_task(const CastSpec& s) {
  const bool strided = s.rows > 1;
  const int64_t total = strided ? s.rows * s.count : s.count + s.pad;
  const bool vectorized = aligned16(s.src) && aligned16(s.dst) &&
                          (!strided || (s.count % 8 == 0 && s.dst_pitch % 8 == 0));
  return {s.src, s.dst, strided ? total : s.count, total, strided ? s.count : total,
          strided ? s.dst_pitch : total, 0, s.scale, s.src_type, s.dst_type,
          static_cast<uint8_t>(vectorized)};
}

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

}  // namespace tide::cuda_kernels
