// TIDE_CUDA_CHECK / TIDE_CU_CHECK: every CUDA runtime and driver call is checked; a failure becomes
// tide::SystemError naming the call, the error's name and text, and where it was made.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "tide/error.hpp"

namespace tide::cuda_detail {

[[noreturn]] void throw_cuda_error(const char* call, cudaError_t error, const char* file, int line);
[[noreturn]] void throw_cu_error(const char* call, CUresult error, const char* file, int line);

}  // namespace tide::cuda_detail

#define TIDE_CUDA_CHECK(call)                                                          \
  do {                                                                                 \
    const cudaError_t tide_cuda_status_ = (call);                                      \
    if (tide_cuda_status_ != cudaSuccess)                                              \
      ::tide::cuda_detail::throw_cuda_error(#call, tide_cuda_status_, __FILE__, __LINE__); \
  } while (0)

#define TIDE_CU_CHECK(call)                                                            \
  do {                                                                                 \
    const CUresult tide_cu_status_ = (call);                                           \
    if (tide_cu_status_ != CUDA_SUCCESS)                                               \
      ::tide::cuda_detail::throw_cu_error(#call, tide_cu_status_, __FILE__, __LINE__); \
  } while (0)
