// The few CUDA driver entry points TIDE needs (stream memory operations on flags, virtual memory
// management for VMM windows), resolved at run
// time through cudaGetDriverEntryPointByVersion: nothing links against libcuda, so one build runs
// on any driver new enough for the runtime it carries (cudart_static).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

namespace tide::cuda_detail {

struct DriverApi {
  PFN_cuStreamWriteValue64_v11070 stream_write_value64 = nullptr;
  PFN_cuStreamWaitValue64_v11070 stream_wait_value64 = nullptr;
  PFN_cuStreamBatchMemOp_v11070 stream_batch_mem_op = nullptr;  // several of the above, one call
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  // Virtual memory management (windows whose memory can also be mapped at a fixed address).
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_granularity = nullptr;
};

// Resolved once (thread-safe); throws SystemError naming the entry point that is missing.
const DriverApi& driver_api();

}  // namespace tide::cuda_detail
