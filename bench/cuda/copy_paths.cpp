// tide_bench_cuda copy-paths: where a step's many 1-D copies should go (command_list.cpp's
// kMinEngineCopyBytes): 384 copies, each from its own allocation (as a reduce-scatter's gradients
// are), as one cudaMemcpyBatchAsync (copy engines) and as one copy kernel (SM stores), per copy
// size. Reported per size and path: the host's median time per call and the GPU's median time per
// call (events around each; host-paced when the host is the slower).
#include <chrono>
#include <cstdio>
#include <vector>

#include "bench_common.hpp"
#include "kernels.cuh"  // the executor's own kernels, timed here: tide_cuda_kernels_internal

namespace tide::bench {
namespace {

constexpr int kCopies = 384;

}  // namespace

void copy_paths_child(const Args& args) {
  select_device(0);
  cudaStream_t stream = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("\n# copy-paths: %d copies per call, each from its own allocation into one buffer\n"
              "# %10s %14s %14s %14s %14s\n", kCopies, "copy", "engine host us", "engine GPU us",
              "kernel host us", "kernel GPU us");
  for (std::size_t bytes : {std::size_t{64} << 10, std::size_t{256} << 10, std::size_t{1} << 20,
                            std::size_t{2} << 20, std::size_t{4} << 20, std::size_t{8} << 20}) {
    std::vector<DeviceMemory> sources;
    for (int k = 0; k < kCopies; ++k) sources.emplace_back(bytes);
    DeviceMemory destination(bytes * kCopies);
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<std::size_t> sizes(kCopies, bytes);
    std::vector<cuda_kernels::CopySpec> specs;
    for (int k = 0; k < kCopies; ++k) {
      dsts.push_back(static_cast<std::byte*>(destination.ptr) + k * bytes);
      srcs.push_back(sources[k].ptr);
      specs.push_back({srcs.back(), dsts.back(), bytes});
    }
    std::vector<double> host;
    auto timed = [&](auto&& call) {
      return [&, call] {
        const auto t0 = std::chrono::steady_clock::now();
        call();
        host.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      };
    };
    auto engines = [&] {
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      std::size_t attribute_index = 0;
#if CUDART_VERSION >= 13000
      BCHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attributes,
                                  &attribute_index, 1, stream));
#else
      std::size_t fail_index = 0;
      BCHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attributes,
                                  &attribute_index, 1, &fail_index, stream));
#endif
    };
    auto kernel = [&] { cuda_kernels::launch_copies(specs.data(), specs.size(), stream); };
    for (int w = 0; w < args.warmup; ++w) engines(), kernel();
    BCHECK(cudaStreamSynchronize(stream));
    host.clear();
    const double engine_gpu = median(time_each(stream, args.iters, timed(engines)));
    const double engine_host = median(host);
    host.clear();
    const double kernel_gpu = median(time_each(stream, args.iters, timed(kernel)));
    const double kernel_host = median(host);
    std::printf("# %7zu KiB %14.1f %14.1f %14.1f %14.1f\n", bytes >> 10, engine_host, engine_gpu,
                kernel_host, kernel_gpu);
  }
  BCHECK(cudaStreamDestroy(stream));
}

}  // namespace tide::bench
