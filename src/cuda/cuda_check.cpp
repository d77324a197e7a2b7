#include "cuda/cuda_check.hpp"

#include "cuda/driver_api.hpp"

namespace tide::cuda_detail {

void throw_cuda_error(const char* call, cudaError_t error, const char* file, int line) {
  throw SystemError(detail::concat(call, " failed: ", cudaGetErrorName(error), " (",
                                   cudaGetErrorString(error), ") at ", file, ":", line,
                                   ", expected cudaSuccess"));
}

void throw_cu_error(const char* call, CUresult error, const char* file, int line) {
  const char* name = nullptr;
  const char* text = nullptr;
  const DriverApi& api = driver_api();
  if (api.get_error_name) api.get_error_name(error, &name);
  if (api.get_error_string) api.get_error_string(error, &text);
  throw SystemError(detail::concat(call, " failed: ", name ? name : "CUresult",
                                   " ", static_cast<int>(error), " (", text ? text : "?", ") at ",
                                   file, ":", line, ", expected CUDA_SUCCESS"));
}

}  // namespace tide::cuda_detail
