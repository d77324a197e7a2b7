// What kernels.cuh declares for all the kernel families at once: the default grid (CTAs per SM,
// TIDE_CUDA_CTAS_PER_SM, and the SM count), Launches::run, preload_kernels; and the checked launch
// and preload every family's launcher uses (kernel_launch.hpp).
#include "kernel_launch.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_check.hpp"

namespace tide::cuda_kernels {
namespace {

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

}  // namespace

int launch_kernel(const void* kernel, int grid, void** args, cudaStream_t stream, const char* name) {
  const cudaError_t status = cudaLaunchKernel(kernel, dim3(grid), dim3(kThreadsPerCta), args, 0, stream);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    cuda_detail::throw_cuda_error(name, status, __FILE__, __LINE__);
  }
  return grid;
}

void preload_kernel(const void* kernel) {
  cudaFuncAttributes attributes;
  TIDE_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
}

void preload_kernels() {
  preload_cast_kernels();
  preload_reduce_kernels();
  preload_copy_kernels();
  preload_net_pull_kernel();
  preload_cast_to_peers_kernel();
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

LaunchInfo Launches::run(cudaStream_t stream) const {
  LaunchInfo info;
  for (const auto& launch : launches_) {
    info.launches += 1;
    info.max_ctas = std::max(info.max_ctas, launch(stream));
  }
  return info;
}

}  // namespace tide::cuda_kernels
