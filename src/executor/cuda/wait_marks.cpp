// The watchdog's view of the streams (wait_marks.hpp): blocks of mapped pinned host memory.
#include "wait_marks.hpp"

#include <atomic>
#include <cstddef>
#include <mutex>

#include "cuda/cuda_check.hpp"
#include "tide/error.hpp"

namespace tide::cuda_executor_detail {

namespace {

// Blocks are never freed, only reused by later executors: cudaFreeHost waits for the whole device,
// and with ranks as threads of one process that can wait for a peer's stream that waits for this
// rank (the reason the watchdog's staging is pageable, cuda_executor_impl.hpp). A block is
// allocated only when an executor is made and none is spare.
struct Pool {
  std::mutex mutex;
  std::vector<StreamMarks*> spare;
};

Pool& pool() {
  static Pool* p = new Pool;  // outlives every executor, static destructors included
  return *p;
}

}  // namespace

uint64_t WaitMarks::next_id() {
  static std::atomic<uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

WaitMarks::WaitMarks() : host_(nullptr), device_(0) {
  {
    std::lock_guard<std::mutex> lock(pool().mutex);
    if (!pool().spare.empty()) {
      host_ = pool().spare.back();
      pool().spare.pop_back();
    }
  }
  if (!host_) {
    void* p = nullptr;
    TIDE_CUDA_CHECK(cudaHostAlloc(&p, kSlots * sizeof(StreamMarks),
                                  cudaHostAllocMapped | cudaHostAllocPortable));
    host_ = static_cast<StreamMarks*>(p);
    for (int i = 0; i < kSlots; ++i) host_[i] = StreamMarks{0, 0};
  }
  void* device = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(&device, host_, 0);
  if (status != cudaSuccess) {
    {
      std::lock_guard<std::mutex> lock(pool().mutex);
      pool().spare.push_back(host_);  // no stream has it: back for the next executor
    }
    TIDE_CUDA_CHECK(status);
  }
  device_ = reinterpret_cast<CUdeviceptr>(device);
}

WaitMarks::~WaitMarks() {
  if (abandoned_) return;  // leaked: one page of pinned memory, after a CUDA failure
  std::lock_guard<std::mutex> lock(pool().mutex);
  pool().spare.push_back(host_);
}

int WaitMarks::slot_of(cudaStream_t s, bool captured) {
  int free = -1;
  for (int i = 0; i < kSlots; ++i) {
    if (used_[i] && streams_[i] == s && captured_[i] == captured) return i;
    if (free < 0 && (!used_[i] || pending_[i] == 0)) free = i;
  }
  if (free < 0)
    throw SystemError(detail::concat("CudaExecutor: waits are pending on ", kSlots,
                                     " streams at once, the most the watchdog watches; "
                                     "synchronize() before running on another stream"));
  streams_[free] = s, used_[free] = true, captured_[free] = captured;
  return free;
}

CUdeviceptr WaitMarks::reached_address(int slot) const {
  return device_ + slot * sizeof(StreamMarks) + offsetof(StreamMarks, reached);
}

CUdeviceptr WaitMarks::passed_address(int slot) const {
  return device_ + slot * sizeof(StreamMarks) + offsetof(StreamMarks, passed);
}

}  // namespace tide::cuda_executor_detail
