// A copy's task: the record a launch's table holds (CopyTask), built on the host from a CopySpec
// (copy_task), and the device code that moves bytes (copy_bytes) and one tile of a table's copies
// (copy_table_tile). Shared by the copy kernel (copy_kernel.cu), the cast-to-peers kernel
// (cast_to_peers_kernel.cu) and the IPC network's pull (net_pull_kernel.cu, copy_bytes).
// CUDA-only (include from .cu files).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "kernel_launch.hpp"
#include "kernels.cuh"

namespace tide::cuda_kernels {

struct CopyTask {
  const std::byte* src;
  std::byte* dst;
  int64_t bytes;       // copied
  int64_t total;       // bytes + zeroed
  int64_t tile_begin;  // in kCopyTileBytes tiles
  uint8_t vectorized;  // src, dst, bytes and total multiples of 16
};
inline constexpr int64_t kCopyTileBytes = kTileElements * 2;  // a bf16 cast tile's bytes

// A copy's task (tile_begin set by the table it joins); null for one of no bytes.
inline std::optional<CopyTask> copy_task(const CopySpec& c) {
  const auto bytes = static_cast<int64_t>(c.bytes);
  const auto total = static_cast<int64_t>(c.bytes + c.zero_bytes);
  if (total == 0) return std::nullopt;
  return CopyTask{static_cast<const std::byte*>(c.src), static_cast<std::byte*>(c.dst), bytes, total,
                  0,
                  static_cast<uint8_t>(aligned16(c.src) && aligned16(c.dst) && bytes % 16 == 0 &&
                                       total % 16 == 0)};
}

// Bytes [begin, end) of dst from src, zeros past `valid`: this thread takes every `lanes`-th
// 16-B vector (every `lanes`-th byte unless `vectorized`: pointers, begin, end and valid all
// multiples of 16) from `lane` on. Every copy tile (copy_table_tile) and the IPC network's pull.
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

}  // namespace tide::cuda_kernels
