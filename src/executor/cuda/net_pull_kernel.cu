// The IPC network's receive (launch_net_pull): the receiver's kernel pulls a transfer's bytes out
// of the sender's window, at the offset the sender posted in its mailbox entry (kernels.cuh).
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "copy_task.cuh"
#include "kernel_launch.hpp"
#include "kernels.cuh"

namespace tide::cuda_kernels {
namespace {

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

}  // namespace

void preload_net_pull_kernel() { preload_kernel(reinterpret_cast<const void*>(net_pull_kernel)); }

LaunchInfo launch_net_pull(const uint64_t* offset, const void* peer_data, void* dst,
                           std::size_t bytes, std::size_t limit, cudaStream_t stream) {
  if (bytes == 0) return {};
  const std::size_t per_cta = static_cast<std::size_t>(kThreadsPerCta) * 16 * 8;
  const int grid = static_cast<int>(
      std::min<std::size_t>(kNetPullCtas, (bytes + per_cta - 1) / per_cta));
  const std::byte* src = static_cast<const std::byte*>(peer_data);
  std::byte* out = static_cast<std::byte*>(dst);
  void* args[] = {&offset, &src, &out, &bytes, &limit};
  return {1, launch_kernel(reinterpret_cast<const void*>(net_pull_kernel), grid, args, stream,
                           "net_pull_kernel")};
}

}  // namespace tide::cuda_kernels
