// The CUDA executor's lowering as data: a program and its run's pointers -> the driver calls that
// run it (what lowering.cpp's header describes), without CUDA. The executor issues the list
// (lowering.cpp); tests on CPU count its commands (tests/cpp/test_command_list.cpp), so the number
// of driver calls of a collective is pinned where no GPU runs. Built into tide_core for that.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "executor/net/group_schedule.hpp"
#include "tide/executor.hpp"

namespace tide::lowering {

struct Copy {
  const void* src;
  void* dst;
  std::size_t bytes;
};

struct Copy2D {
  const void* src;
  std::size_t src_pitch;
  void* dst;
  std::size_t dst_pitch;
  std::size_t width;
  std::size_t rows;
  std::size_t merged = 0;  // > 0: a run of this many equal 1-D copies, merged
};

struct Reduce {
  std::size_t first_source;  // its num_sources pointers at CommandList::sources[first_source...]
  void* dst;
  const void* partial;  // nullptr: none
  int64_t count;
  float prescale;
  float scale;
  bool accumulate;
  DType src_dtype;
  DType dst_dtype;
  DType partial_dtype;
};

// What the executor enqueues, in order. Driver calls: kEngineCopies one cudaMemcpyBatchAsync;
// kCopy2D one cudaMemcpy2DAsync; kCopyKernel, kReduceKernel one launch per table (kernels.cuh:
// 680 copies, 584 reduces of 2 sources); kFlagOps one cuStreamBatchMemOp; kCasts, kCastToPeers,
// kNetStep and kNetActions as the executor lowers those steps (lowering.cpp).
enum class CommandKind : uint8_t {
  kEngineCopies,  // copies[first, first + count) on the copy engines
  kCopy2D,        // copies_2d[first]
  kCopyKernel,    // copies[first, first + count) as one copy kernel (SM stores)
  kCasts,         // steps [step, end): CastOps, one batch
  kReduceKernel,  // reduces[first, first + count), num_sources each
  kFlagOps,       // steps [step, end): SignalOps and WaitOps
  kCastToPeers,       // steps [step, steps.size()): one cast-to-peers kernel
  kNetStep,       // step `step`, a NetSendOp or NetRecvOp: the network group waits for this point
  kNetActions,    // the schedule's issues and waits before step `step`
};

struct Command {
  CommandKind kind;
  std::size_t step = 0;
  std::size_t end = 0;
  std::size_t first = 0;
  std::size_t count = 0;
  int num_sources = 0;
};

// Reused run after run (clear() keeps the capacity): lowering allocates nothing once warm.
struct CommandList {
  std::vector<Command> commands;
  std::vector<Copy> copies;
  std::vector<Copy2D> copies_2d;
  std::vector<Reduce> reduces;
  std::vector<const void*> sources;
  void clear();
};

// A step's 1-D copies that are more than kMaxEngineCopies and smaller than kMinEngineCopyBytes go
// as one copy kernel; the others on the copy engines (command_list.cpp says why, with the figures).
inline constexpr std::size_t kMaxEngineCopies = 4;
inline constexpr std::size_t kMinEngineCopyBytes = std::size_t{4} << 20;

// cuStreamBatchMemOp takes fewer than 256 operations per call.
inline constexpr std::size_t kMaxMemOps = 254;

// Orders copies[first, end) so that those for one copy kernel come first; returns how many (0: all
// on the copy engines).
std::size_t kernel_copies(std::vector<Copy>& copies, std::size_t first);

struct LoweringContext {
  const std::vector<std::byte*>* window_data;  // rank r's window data as mapped here
  const net::GroupSchedule* schedule;          // nullptr: the program has no network op
  std::size_t cast_to_peers_step;                       // the cast-to-peers kernel's first step; steps.size(): none
};

// `program` has passed validate_run with `bindings`. Fills `out` (cleared first).
void lower(const Program& program, const Bindings& bindings, const LoweringContext& context,
           CommandList& out);

}  // namespace tide::lowering
