// The few CUDA driver entry points TIDE needs (stream memory operations on flags), resolved at run
// time through cudaGetDriverEntryPointByVersion: nothing links against libcuda, so one build runs
// on any driver new enough for the runtime it carries (cudart_static).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

namespace tide::cuda_detail {

struct DriverApi {
  PFN_cuStreamWriteValue64_v11070 stream_write_value64 = nullptr;
  PFN_cuStreamWaitValue64_v11070 stream_wait_value64 = nullptr;
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
};

// Resolved once (thread-safe); throws SystemError naming the entry point that is missing.
const DriverApi& driver_api();

}  // namespace tide::cuda_detail
