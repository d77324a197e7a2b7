// The one-wave bf16 GEMM (2048x1024x16384, cuBLAS loaded with dlopen) every interference figure
// is about: interference.cpp times it beside TIDE-RS, NCCL and a reduce kernel.
#pragma once

#include <dlfcn.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace tide::bench {

// cuBLAS through dlopen: no link-time dependency (the binary builds and runs where cuBLAS is
// absent; the mode then says so). Enum values are cuBLAS's stable ABI.
struct Cublas {
  using Create = int (*)(void**);
  using Destroy = int (*)(void*);
  using SetStream = int (*)(void*, cudaStream_t);
  using GemmEx = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int,
                         const void*, int, int, const void*, void*, int, int, int, int);
  static constexpr int kOpN = 0, kR16BF = 14, kCompute32F = 68, kGemmDefault = -1;
  void* lib = nullptr;
  Create create = nullptr;
  Destroy destroy = nullptr;
  SetStream set_stream = nullptr;
  GemmEx gemm_ex = nullptr;
  std::string where;

  bool load() {
    std::vector<std::string> names = {"libcublas.so.13", "libcublas.so"};
    if (const char* env = std::getenv("TIDE_CUBLAS_LIB")) names.insert(names.begin(), env);
    for (const char* dir : {"/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"})
      names.push_back(std::string(dir) + "/libcublas.so.13");
    for (const std::string& name : names) {
      lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib) {
        where = name;
        break;
      }
    }
    if (!lib) return false;
    create = reinterpret_cast<Create>(::dlsym(lib, "cublasCreate_v2"));
    destroy = reinterpret_cast<Destroy>(::dlsym(lib, "cublasDestroy_v2"));
    set_stream = reinterpret_cast<SetStream>(::dlsym(lib, "cublasSetStream_v2"));
    gemm_ex = reinterpret_cast<GemmEx>(::dlsym(lib, "cublasGemmEx"));
    return create && destroy && set_stream && gemm_ex;
  }
};

// The one-wave bf16 GEMM every interference figure is about, on its own stream.
struct OneWaveGemm {
  static constexpr int M = 2048, N = 1024, K = 16384;
  Cublas cublas;
  void* handle = nullptr;
  cudaStream_t stream = nullptr;
  DeviceMemory a, b, c;
  double alone_us = 0;

  // False (and nothing allocated) when cuBLAS cannot be loaded.
  bool init() {
    if (!cublas.load()) return false;
    BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    a = DeviceMemory(std::size_t{2} * M * K), b = DeviceMemory(std::size_t{2} * K * N);
    c = DeviceMemory(std::size_t{2} * M * N);
    launch_fill_random(a.ptr, DType::kBF16, int64_t{M} * K, 11, stream);
    launch_fill_random(b.ptr, DType::kBF16, int64_t{K} * N, 12, stream);
    if (cublas.create(&handle) != 0) throw std::runtime_error("cublasCreate failed");
    cublas.set_stream(handle, stream);
    for (int w = 0; w < 10; ++w) run();
    BCHECK(cudaStreamSynchronize(stream));
    return true;
  }
  void run() {
    const float alpha = 1.0f, beta = 0.0f;
    const int status = cublas.gemm_ex(handle, Cublas::kOpN, Cublas::kOpN, M, N, K, &alpha, a.ptr,
                                      Cublas::kR16BF, M, b.ptr, Cublas::kR16BF, K, &beta, c.ptr,
                                      Cublas::kR16BF, M, Cublas::kCompute32F, Cublas::kGemmDefault);
    if (status != 0) throw std::runtime_error("cublasGemmEx failed: status " + std::to_string(status));
  }
  std::vector<double> time(int iters) { return time_each(stream, iters, [&] { run(); }); }
  double tflops(double us) const { return 2.0 * M * N * K / (us * 1e-6) / 1e12; }
  ~OneWaveGemm() {
    if (handle) cublas.destroy(handle);
  }
};

}  // namespace tide::bench
