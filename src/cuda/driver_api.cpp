#include "cuda/driver_api.hpp"

#include <mutex>
#include <string>

#include "cuda/cuda_check.hpp"

namespace tide::cuda_detail {

namespace {

// 12.0 asks for the stream memory operations' current ABI (the _v2 functions of CUDA 11.7+) and
// is below every driver that can run this CUDA 13 runtime.
constexpr unsigned kEntryPointVersion = 12000;

template <class Fn>
void resolve(const char* symbol, Fn& fn) {
  void* pointer = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  TIDE_CUDA_CHECK(cudaGetDriverEntryPointByVersion(symbol, &pointer, kEntryPointVersion,
                                                   cudaEnableDefault, &status));
  if (status != cudaDriverEntryPointSuccess || pointer == nullptr)
    throw SystemError(detail::concat("cudaGetDriverEntryPointByVersion(\"", symbol, "\", ",
                                     kEntryPointVersion, "): query result ",
                                     static_cast<int>(status),
                                     ", expected cudaDriverEntryPointSuccess (the driver is too "
                                     "old or lacks stream memory operations)"));
  fn = reinterpret_cast<Fn>(pointer);
}

}  // namespace

const DriverApi& driver_api() {
  static DriverApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve("cuGetErrorName", api.get_error_name);
    resolve("cuGetErrorString", api.get_error_string);
    resolve("cuStreamWriteValue64", api.stream_write_value64);
    resolve("cuStreamWaitValue64", api.stream_wait_value64);
    resolve("cuStreamBatchMemOp", api.stream_batch_mem_op);
    resolve("cuDeviceGetAttribute", api.device_get_attribute);
    resolve("cuMemCreate", api.mem_create);
    resolve("cuMemRelease", api.mem_release);
    resolve("cuMemExportToShareableHandle", api.mem_export);
    resolve("cuMemImportFromShareableHandle", api.mem_import);
    resolve("cuMemAddressReserve", api.mem_address_reserve);
    resolve("cuMemAddressFree", api.mem_address_free);
    resolve("cuMemMap", api.mem_map);
    resolve("cuMemUnmap", api.mem_unmap);
    resolve("cuMemSetAccess", api.mem_set_access);
    resolve("cuMemGetAllocationGranularity", api.mem_get_granularity);
  });
  return api;
}

}  // namespace tide::cuda_detail
