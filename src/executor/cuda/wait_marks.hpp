// Where each stream of an executor has got to, for the watchdog, without a driver call: per stream
// two words in mapped pinned host memory that the stream itself writes around every watched wait,
// in the same cuStreamBatchMemOp as the waits (a cast-to-peers kernel, kernels.cuh, writes them itself):
//   reached = id of the last watched wait the stream arrived at (the watchdog's clock starts),
//   passed  = id of the last one it got past (the watchdog retires it).
// Wait ids come from one process-wide counter, so they only grow: a slot handed to another stream
// (once its waits are all retired), or a block another executor used (once its streams drained;
// else it is abandoned), holds only smaller ids than any wait watched later. Waits captured in a
// CUDA graph have slots of their own (slot_of).
// Before (events recorded around each wait, two cudaEventQuery per wait on the watchdog thread),
// a W = 2 collective made 3 more driver calls on the rank's thread and took an event from a pool
// that only the watchdog refilled (BENCHMARKS.md, "Fixed cost").
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace tide::cuda_executor_detail {

struct StreamMarks {
  uint64_t reached;
  uint64_t passed;
};

class WaitMarks {
 public:
  static constexpr int kSlots = 64;  // streams with waits not yet retired, at once

  WaitMarks();   // a block of the process's pool (mapped pinned memory, kSlots pairs)
  ~WaitMarks();  // back to the pool, unless abandoned
  // Streams that may still write these marks were not drained: the block is never reused.
  void abandon() { abandoned_ = true; }
  WaitMarks(const WaitMarks&) = delete;
  WaitMarks& operator=(const WaitMarks&) = delete;

  // The next wait id (process-wide, from 1).
  static uint64_t next_id();

  // The slot of stream `s`: the one it has, else one whose waits are all retired. Throws
  // SystemError when all kSlots streams have waits pending. The calls below that take a slot
  // count its pending waits: all under the executor's mutex.
  // `captured`: the slot of the waits captured in CUDA graphs on `s`, apart from its run-by-run
  // waits. A replay writes the ids fixed at capture again and again, so these marks do not grow:
  // each graph that holds such waits holds the slot until it ends (captured_graphs.cpp), and the
  // watchdog reads it as "reached != passed" (watchdog.cpp).
  int slot_of(cudaStream_t s, bool captured = false);
  void hold(int slot) { ++pending_[slot]; }
  void release(int slot) { --pending_[slot]; }

  // Device addresses for the stream's writes.
  CUdeviceptr reached_address(int slot) const;
  CUdeviceptr passed_address(int slot) const;
  // What the stream has written (any thread).
  uint64_t reached(int slot) const { return __atomic_load_n(&host_[slot].reached, __ATOMIC_ACQUIRE); }
  uint64_t passed(int slot) const { return __atomic_load_n(&host_[slot].passed, __ATOMIC_ACQUIRE); }

 private:
  StreamMarks* host_;
  CUdeviceptr device_;
  bool abandoned_ = false;
  std::vector<cudaStream_t> streams_ = std::vector<cudaStream_t>(kSlots, nullptr);
  std::vector<int> pending_ = std::vector<int>(kSlots, 0);
  std::vector<bool> used_ = std::vector<bool>(kSlots, false);
  std::vector<bool> captured_ = std::vector<bool>(kSlots, false);
};

}  // namespace tide::cuda_executor_detail
