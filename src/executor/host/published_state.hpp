// A host executor's published state (window/wire.hpp's PublishedState): a seqlock written by the
// owning rank at every step (Publisher), read by any rank (read_published_state), decoded into
// ExecutorState for messages, peers' early-failure checks and describe_executor_state().
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "tide/executor.hpp"
#include "window/wire.hpp"

namespace tide::host_detail {

using Status = ExecutorState::Status;

uint64_t now_ns();  // steady clock

// Rank `rank`'s state as `reader` sees it (consistent = false: its writer died mid-update).
ExecutorState read_published_state(PublishedState& block, int rank,
                                   const HostExecutor::Identity& reader);

}  // namespace tide::host_detail

namespace tide {

// Publishes this rank's state for one collective. Only the owning rank writes its block.
class HostExecutor::Publisher {
 public:
  Publisher(PublishedState& block, const Identity& id, uint64_t epoch, uint64_t tag,
            std::size_t num_steps)
      : s_(block), id_(id), epoch_(epoch), tag_(tag), num_steps_(num_steps) {}

  using Status = ExecutorState::Status;

  void publish(Status status, Phase phase, std::size_t step, int peer = -1,
               FlagKind kind = FlagKind::kSlotFree) {
    phase_ = phase, step_ = step, peer_ = peer, kind_ = kind;
    write(status);
  }
  void finish(Status status) { write(status); }  // keeps the step and wait it ended at
  void saw(uint64_t epoch, uint64_t tag, int cause) {
    seen_epoch_ = epoch, seen_tag_ = tag, cause_ = cause;
  }

 private:
  void write(Status status) {
    std::atomic_ref<uint64_t> seq(s_.seq);
    auto store = [](uint64_t& f, uint64_t v) {
      std::atomic_ref<uint64_t>(f).store(v, std::memory_order_relaxed);
    };
    const uint64_t v = seq.load(std::memory_order_relaxed);
    seq.store(v + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    store(s_.epoch, epoch_);
    store(s_.tag, tag_);
    store(s_.where, static_cast<uint64_t>(status) | static_cast<uint64_t>(phase_) << 8 |
                        static_cast<uint64_t>(kind_) << 16 |
                        static_cast<uint64_t>(static_cast<uint32_t>(peer_ + 1)) << 32);
    store(s_.step, static_cast<uint64_t>(step_) << 32 | static_cast<uint32_t>(num_steps_));
    store(s_.since_ns, host_detail::now_ns());
    store(s_.pid, id_.pid);
    store(s_.start_time, id_.start_time);
    store(s_.pid_ns, id_.pid_ns);
    store(s_.seen_epoch, seen_epoch_);
    store(s_.seen_tag, seen_tag_);
    store(s_.cause, static_cast<uint64_t>(static_cast<uint32_t>(cause_ + 1)));
    seq.store(v + 2, std::memory_order_release);
  }

  PublishedState& s_;
  const Identity& id_;
  uint64_t epoch_, tag_;
  std::size_t num_steps_;
  Phase phase_ = Phase::kCastIn;
  std::size_t step_ = 0;
  int peer_ = -1;
  FlagKind kind_ = FlagKind::kSlotFree;
  uint64_t seen_epoch_ = 0, seen_tag_ = 0;
  int cause_ = -1;
};

}  // namespace tide
