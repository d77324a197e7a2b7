// executor: runs a Program. Binds its symbolic addresses to real buffers: the window (own and
// peers'), and per param one input (all-gather: this rank's shard in shard_dtype, valid rows only;
// reduce-scatter: the full unsharded gradient in the window's dtype) and one output
// (reduce-scatter: this rank's shard in shard_dtype, valid rows only; unused for all-gather).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tide/plan.hpp"
#include "tide/window.hpp"

namespace tide {

struct Bindings {
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  // Per param: the fp32 scale a cast of its input into a scaled dtype (kE4M3) multiplies by, read
  // when the cast runs (on CUDA device memory, so a scale computed on the stream needs no sync);
  // empty, or null for params without such a cast.
  std::vector<const float*> scales = {};
};

// Every wait's bound. TIDE_TIMEOUT_MS overrides the default (120000 ms).
std::chrono::milliseconds default_timeout();

// Whether TIDE_DEBUG is set to 1 (unset, empty or 0: off; anything else is InvalidArgument). When
// on, a host executor whose wait on a peer exceeds half its timeout prints every rank's state to
// stderr once per wait (see docs/FAILURES.md).
bool debug_enabled();

// What a rank's host executor is doing, or last did, on one window: decoded from the state the
// rank publishes in its window segment, so it can be read from any thread or any rank of the group,
// also after the rank died. For debugging hangs (docs/FAILURES.md).
struct ExecutorState {
  enum class Status : uint8_t {
    kIdle,      // has not run a collective on this window
    kRunning,   // inside a collective, at `step`
    kWaiting,   // inside a collective, at `step`, waiting for `wait_kind` from `waiting_on`
    kDone,      // its last collective completed
    kTimedOut,  // its last collective threw TimeoutError (at `step`)
    kDesynced,  // its last collective threw DesyncError (at `step`)
    kFailed,    // its last collective threw another error (at `step`)
  };
  int rank = -1;
  Status status = Status::kIdle;
  uint64_t epoch = 0;  // of the current (or last) collective
  uint32_t bucket = 0;
  Collective collective = Collective::kAllGather;
  Phase phase = Phase::kCastIn;
  int step = 0;        // index into the program's steps (0-based)
  int num_steps = 0;
  int waiting_on = -1;  // the peer of the wait at `step`, or -1
  FlagKind wait_kind = FlagKind::kSlotFree;
  uint64_t seen_epoch = 0;  // failed in a wait: the last signal it saw there (0: none)
  uint64_t seen_tag = 0;
  int cause = -1;           // failed: the rank the failure started at (itself for a desync it
                            // detected on its own side), or -1
  std::chrono::milliseconds elapsed{0};  // time since the current step (or final status) began
  long pid = 0;             // the rank's process
  bool exited = false;      // its process is known to have exited (checked from the reader)
  bool consistent = true;   // false: read while being written by a rank that died mid-update

  bool failed() const {
    return status == Status::kTimedOut || status == Status::kDesynced || status == Status::kFailed;
  }
  // One line, e.g. "rank 3 (pid 812): waiting 512 ms for data_ready from rank 0 at step 7/14
  // (phase data_ready) of bucket 1 all_gather, epoch 3".
  std::string to_string() const;
};
const char* status_name(ExecutorState::Status status);

class Executor {
 public:
  virtual ~Executor() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // Runs (host) or enqueues (CUDA) one collective; takes the window's next epoch.
  virtual void run(const Program& program, const Bindings& bindings) = 0;
};

// Runs programs on the host: memcpy for copies, a loop for casts and reduces, atomics for flags.
// It publishes its state (ExecutorState) in its window segment at every step. A wait on a peer
// fails, naming rank, peer, bucket, phase, step and epoch, and the peer's published state:
//   - TimeoutError when it exceeds the timeout, or as soon as the peer's process has exited;
//   - DesyncError when the peer's signal carries another program's tag or epoch, or belongs to a
//     collective that failed on the peer (a failed collective withdraws its slot-free signals, so
//     a rank arriving late never writes into a window that moved on), or the peer has moved past
//     this epoch without signalling it, or waits on this rank for an epoch it left;
//   - the peer's kind of error (TimeoutError, DesyncError, Error) as soon as the peer's own
//     collective has failed, naming the rank the failure started at: a failure reaches every rank
//     that waits on the failed one, so after any of these errors the group's windows must not be
//     used again.
// An executor must not outlive its window.
class HostExecutor final : public Executor {
 public:
  explicit HostExecutor(HostWindow& window, std::chrono::milliseconds timeout = default_timeout());
  ~HostExecutor() override;
  HostExecutor(const HostExecutor&) = delete;
  HostExecutor& operator=(const HostExecutor&) = delete;

  int rank() const override { return window_.rank(); }
  int world() const override { return window_.world(); }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void run(const Program& program, const Bindings& bindings) override;

  // The state rank `rank` of the window last published (default: this executor's rank).
  ExecutorState state(int rank = -1) const;
  // Every rank's published state, one line each ("  rank r ...\n").
  std::string describe_group() const;

  struct Identity {  // of the process running this executor, for peers' liveness checks
    uint64_t pid = 0, start_time = 0, pid_ns = 0;
  };

 private:
  // Defined in src/executor/host/ (host_internal.hpp lists the files).
  class Publisher;
  struct PostedSend;
  struct RunState;
  struct Awaited;
  ExecutorState peer_state(int peer) const;
  // The one wait loop: until awaited.ready(), bounded by the timeout, ended early by the peer's
  // state (awaited.check_peer).
  void wait_until(int peer, const Awaited& awaited) const;
  void wait_for_flag(RunState& run, std::size_t index, const WaitOp& op) const;
  // Host network transport (a stand-in for NCCL): waits until ready() holds, sleeping on `word`;
  // `what` names the transfer in errors.
  void wait_for_transfer(RunState& run, std::size_t index, int peer, const std::string& what,
                         uint64_t* word, FlagKind kind, const std::function<bool()>& ready) const;
  void net_send(RunState& run, std::size_t index, const NetSendOp& send) const;
  void net_receive(RunState& run, std::size_t index, const NetRecvOp& recv) const;
  void complete_send(RunState& run, const PostedSend& send, std::size_t index) const;
  // Before a step writes own-window bytes [a, a + bytes): the sends reading them complete.
  void complete_sends_reading(RunState& run, const Address& a, std::size_t bytes,
                              std::size_t index) const;
  void retract_slot_free(uint64_t epoch);
  HostWindow& window_;
  std::chrono::milliseconds timeout_;
  bool debug_;
  Identity identity_;
};

// Every HostExecutor alive in this process, one line each: its rank's current state. Callable from
// any thread (e.g. a watchdog or a debugger: `call tide::describe_executor_state()`).
std::string describe_executor_state();

// Checks a program and its bindings against an executor's window before anything runs: rank and
// world match, the window is large and aligned enough, every input and output a step uses is bound.
// Shared by all executors so they reject bad input identically. Network ops (NetSendOp,
// NetRecvOp) are rejected unless the executor has a network transport (net_supported: the host
// executor's stand-in for NCCL; the CUDA executor's NCCL communicator or CUDA IPC on a kHost
// window).
void validate_run(const Program& program, const Bindings& bindings, int rank, int world,
                  std::size_t window_bytes, const void* window_base, bool net_supported = false);

}  // namespace tide
