// NCCL as TIDE's network transport between nodes: loaded at run time (never linked), its version
// checked before any entry point is used. No NCCL header is needed to build or use this one.
//
//   NcclLibrary  the libnccl in use: the one already in the process (PyTorch's) if any, else
//                TIDE_NCCL_LIB, else the system's libnccl.so.2. Requires NCCL >= 2.18.
//   NcclComm     a communicator over the collective's W ranks (its rank i = TIDE rank i): made
//                from a unique id exchanged over a Bootstrap, or wrapping one the caller owns.
//
// A CudaExecutor given an NcclComm runs the network ops of across-node programs as grouped
// ncclSend/ncclRecv (see src/executor/net/group_schedule.hpp). NCCL's own settings (NCCL_*) apply;
// TIDE never turns NVLink SHARP/multicast on (keep NCCL_NVLS_ENABLE=0 on shared machines).
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "tide/bootstrap.hpp"

namespace tide {

class NcclLibrary {
 public:
  static constexpr int kMinVersion = 21800;  // 2.18.0
  // Loads NCCL once per process. Throws SystemError naming every place it looked, or the version
  // found when it is older than kMinVersion.
  static const NcclLibrary& get();

  int version() const { return version_; }            // e.g. 22809 for 2.28.9
  std::string version_string() const;                  // "2.28.9"
  const std::string& path() const { return path_; }   // where it was loaded from

  // Entry points, with NCCL's C ABI (ncclComm_t = void*, cudaStream_t = void*, enums as int).
  struct UniqueId {
    char internal[128];
  };
  int (*get_unique_id)(UniqueId*) = nullptr;
  int (*comm_init_rank)(void** comm, int nranks, UniqueId id, int rank) = nullptr;
  int (*comm_destroy)(void* comm) = nullptr;
  int (*comm_abort)(void* comm) = nullptr;
  int (*comm_get_async_error)(void* comm, int* result) = nullptr;
  int (*comm_count)(const void* comm, int* count) = nullptr;
  int (*comm_user_rank)(const void* comm, int* rank) = nullptr;
  int (*comm_cu_device)(const void* comm, int* device) = nullptr;
  const char* (*get_error_string)(int result) = nullptr;
  int (*group_start)() = nullptr;
  int (*group_end)() = nullptr;
  int (*send)(const void* buf, std::size_t count, int datatype, int peer, void* comm,
              void* stream) = nullptr;
  int (*recv)(void* buf, std::size_t count, int datatype, int peer, void* comm,
              void* stream) = nullptr;
  // For baselines (benchmarks compare TIDE with NCCL's own collectives).
  int (*all_gather)(const void* send, void* recv, std::size_t count, int datatype, void* comm,
                    void* stream) = nullptr;
  int (*reduce_scatter)(const void* send, void* recv, std::size_t count, int datatype, int op,
                        void* comm, void* stream) = nullptr;

  // ncclDataType_t / ncclRedOp_t values (stable across NCCL 2.x).
  static constexpr int kUint8 = 1, kFloat32 = 7, kBfloat16 = 9;
  static constexpr int kSum = 0, kAvg = 4;

  // Throws SystemError "<what>: <NCCL's message>" unless result is ncclSuccess (0).
  void check(int result, const char* what) const;

 private:
  NcclLibrary() = default;
  void* handle_ = nullptr;
  int version_ = 0;
  std::string path_;
};

class NcclComm {
 public:
  // Collective over `bootstrap` (every rank calls it; rank 0 makes the unique id): a new
  // communicator on the current CUDA device, destroyed with this object.
  static std::unique_ptr<NcclComm> create(Bootstrap& bootstrap);
  // Wraps the caller's ncclComm_t (not destroyed here; it must outlive this object). A network
  // transfer stuck past an executor's timeout aborts it all the same (ncclCommAbort frees it:
  // NCCL's only way to return its kernels); after a TimeoutError its owner must not use it again.
  static std::unique_ptr<NcclComm> wrap(void* comm);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  void* get() const { return comm_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  // Aborts the communicator (its kernels return; its operations fail): how a stuck network
  // transfer is released after a timeout. The communicator is unusable afterwards.
  void abort();
  bool aborted() const { return aborted_.load(); }
  // Throws SystemError when NCCL reports an asynchronous error on this communicator.
  void check_async() const;

 private:
  NcclComm() = default;
  void* comm_ = nullptr;
  bool owned_ = false;
  std::atomic<bool> aborted_{false};  // set by an executor's watchdog thread
  int rank_ = 0, world_ = 0, device_ = 0;
};

}  // namespace tide
