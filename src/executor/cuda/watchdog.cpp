// The CUDA executor's watchdog: one host thread per executor looks at the oldest wait not yet
// passed; once its stream has marked it reached but not passed (wait_marks.hpp: host memory the
// stream writes, read here without a driver call) for longer than the timeout, it reads the flags on a side stream, stores TimeoutError (or DesyncError when the epoch
// arrived with another program's tag) for the first one the stream cannot pass, naming rank,
// peer, bucket, phase and epoch, and releases the stuck wait by writing the awaited values into
// the flags, and so every later stuck wait of this executor, so the stream drains and nothing
// hangs. synchronize() and run() then throw the error.
// With nothing to watch it polls for 100 ms, then sleeps until watch() wakes it (watch() wakes
// only a sleeping watchdog, so back-to-back runs do not pay a futex wake each).
// Network waits are diagnosed and released by their transport (nccl_transport.cpp: abort the
// communicator; ipc_transport.cpp: write the awaited mailbox words).
// Waits captured in CUDA graphs are watched apart (watch_captured): replays write their marks
// again and again, and a stuck one ends the process with its diagnosis. They are dropped when
// their graph ends (captured_graphs.cpp).
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <thread>

#include "cuda_executor_impl.hpp"
#include "tide/error.hpp"

namespace tide {

using namespace cuda_executor_detail;

namespace {
// Idle polls (1 ms each) before the watchdog sleeps until watch() wakes it.
constexpr int kWatchdogIdlePolls = 100;
// While a CUDA graph holds captured waits the watchdog polls and never sleeps: replays call nothing.
constexpr int kCapturedPollMs = 5;
}  // namespace

void CudaExecutor::Impl::store_error(std::exception_ptr e) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!error) error = e;
  failed = true;
}

FlagWord CudaExecutor::Impl::read_flag(const FlagWord* flag) {
  TIDE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), flag, sizeof(FlagWord), cudaMemcpyDeviceToHost,
                                  side_stream));
  TIDE_CUDA_CHECK(cudaStreamSynchronize(side_stream));
  return staging[0];
}

void CudaExecutor::Impl::write_flags(FlagWord* flags, std::size_t count, uint64_t tag) {
  for (std::size_t i = 0; i < count; ++i) staging[i] = FlagWord{kReleaseEpoch, tag};
  TIDE_CUDA_CHECK(cudaMemcpyAsync(flags, staging.data(), count * sizeof(FlagWord),
                                  cudaMemcpyHostToDevice, side_stream));
  TIDE_CUDA_CHECK(cudaStreamSynchronize(side_stream));
}

namespace {

// "epoch 12" for a run-by-run collective, "a replay" for one captured in a CUDA graph.
std::string when(uint64_t epoch) {
  return epoch == kCapturedEpoch ? std::string("a replay of a CUDA graph")
                                 : detail::concat("epoch ", epoch);
}

}  // namespace

std::exception_ptr CudaExecutor::Impl::diagnose_flag_wait(const PendingWait& w) {
  const int rank = window.rank();
  for (const AwaitedFlag& f : w.flags) {
    const FlagWord seen = read_flag(f.flag);
    const bool epoch_arrived = w.captured ? seen.epoch == w.epoch
                                          : static_cast<int64_t>(seen.epoch - w.epoch) >= 0;
    if (epoch_arrived && seen.tag == w.tag) continue;  // this one passes: the stream is further on
    if (epoch_arrived) {
      return std::make_exception_ptr(DesyncError(detail::concat(
          "rank ", rank, " runs ", describe_tag(w.tag), " at ", when(w.epoch), " (phase ",
          phase_name(f.phase), ") but rank ", f.peer, " signalled ", describe_tag(seen.tag),
          " at ", when(seen.epoch), ": the ranks called collectives in different orders")));
    }
    return std::make_exception_ptr(TimeoutError(detail::concat(
        "rank ", rank, ": timed out after ", timeout.count(), " ms waiting for ",
        flag_kind_name(f.kind), " from rank ", f.peer, " (", describe_tag(w.tag), ", phase ",
        phase_name(f.phase), ", ", when(w.epoch), ") on the GPU; last signal from rank ", f.peer,
        ": ",
        seen.epoch == 0 ? std::string("none pending")
                        : detail::concat(when(seen.epoch), ", ", describe_tag(seen.tag)),
        ". The peer is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is "
        "only slow)")));
  }
  return nullptr;
}

// A replayed wait is stuck when its slot shows the same reached != passed for the whole timeout
// (ids repeat at each replay, so they are compared for change, not for growth; polled every
// kCapturedPollMs, a replay that passes the same wait between two polls each time would have to
// spend nearly all its time in it for the timeout to be taken for a stuck one). The diagnosis
// reads the flags; a stuck wait ends the process: nothing of TIDE's runs on the host during a
// replay to throw in, and a released wait would hand the model stale bytes.
void CudaExecutor::Impl::watch_captured() {
  const Clock::time_point now = Clock::now();
  std::optional<PendingWait> stuck;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (CapturedSlot& c : captured_slots) {
      const uint64_t reached = marks->reached(c.slot), passed = marks->passed(c.slot);
      if (reached == passed || reached != c.reached || passed != c.passed) {
        c.reached = reached, c.passed = passed, c.since = now;
        continue;
      }
      if (now - c.since < timeout) continue;
      for (const PendingWait& w : captured)
        if (w.id == reached && w.slot == c.slot) stuck = w;
      if (stuck) {
        c.since = now;  // diagnosed now; looked at again after another timeout
        break;
      }
    }
  }
  if (!stuck) return;
  const std::exception_ptr error = diagnose_flag_wait(*stuck);
  if (!error) return;  // the flags meet now: the wait is about to pass
  // The peer may have signalled between the marks and the flags (a passed wait clears its flag,
  // which then reads as never signalled): the wait is stuck only if its slot still shows the same
  // marks a poll later.
  std::this_thread::sleep_for(std::chrono::milliseconds(kCapturedPollMs));
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const CapturedSlot& c : captured_slots)
      if (c.slot == stuck->slot && (marks->reached(c.slot) != stuck->id || marks->passed(c.slot) != c.passed))
        return;
  }
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "tide: %s. This wait was replayed from a CUDA graph, where no call into TIDE "
                 "runs to raise it: the process ends here.\n",
                 e.what());
    std::fflush(stderr);
  }
  std::abort();
}

void CudaExecutor::Impl::release_flag_wait(const PendingWait& w) {
  for (const AwaitedFlag& f : w.flags) write_flags(f.flag, 1, w.tag);
}

void CudaExecutor::Impl::watchdog_loop() {
  try {
    TIDE_CUDA_CHECK(cudaSetDevice(window.device()));
    // A diagnosis copies on a side stream while another thread may be capturing a graph in
    // global mode, which forbids such calls in every thread not relaxed: this one is (PyTorch
    // relaxes its NCCL watchdog the same way).
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    TIDE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&relaxed));
    uint64_t stuck_id = UINT64_MAX;
    int idle_polls = 0;
    Clock::time_point stuck_since{};
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      // The destructor sets `stop` once it has waited for the streams or given up on them
      // (a CUDA error): nothing is left to drain, and waits the stream never reached (a sticky
      // error stops every stream; no mark is written again) must not keep this thread alive.
      if (stop) {
        for (const PendingWait& w : pending) retire(w);
        pending.clear();
        return;
      }
      forget_ended_graphs();
      if (!captured_slots.empty()) {
        lock.unlock();
        watch_captured();
        lock.lock();
      }
      if (pending.empty()) {
        // Idle: poll every 1 ms for a while before sleeping until watch() notifies. Runs come
        // far more often than that in training, so watch() rarely pays for waking this thread
        // (a futex wake and the lock handed over: microseconds of host time per run).
        if (!captured_slots.empty()) {
          wake.wait_for(lock, std::chrono::milliseconds(kCapturedPollMs));
        } else if (idle_polls < kWatchdogIdlePolls) {
          ++idle_polls;
          wake.wait_for(lock, std::chrono::milliseconds(1));
        } else {
          watchdog_asleep = true;
          wake.wait(lock);
          watchdog_asleep = false;
        }
        continue;
      }
      idle_polls = 0;
      // Only this thread removes records, and a deque's push_back keeps references: `w` stays
      // valid while the lock is released.
      const PendingWait& w = pending.front();
      lock.unlock();
      if (marks->passed(w.slot) >= w.id) {
        lock.lock();
        retire(w);
        pending.pop_front();
        continue;
      }
      bool draining = failed.load();
      if (marks->reached(w.slot) >= w.id) {
        const Clock::time_point now = Clock::now();
        if (stuck_id != w.id) stuck_id = w.id, stuck_since = now;
        std::exception_ptr stuck;
        if (!draining && now - stuck_since >= timeout)
          stuck = w.kind == PendingWait::Kind::kNccl      ? diagnose_nccl_group(w)
                  : w.kind == PendingWait::Kind::kMailbox ? diagnose_mailbox(w)
                                                          : diagnose_flag_wait(w);
        const bool timed_out = stuck != nullptr;
        if (timed_out) {
          store_error(stuck);
          // Release every own flag at once (this program's remaining waits pass quickly);
          // waits of later programs, or flags a live peer overwrites, are released one by one.
          write_flags(window.flags(window.rank()), kNumFlagKinds * window.world(), w.tag);
          draining = true;
        }
        if (draining) {
          if (w.kind == PendingWait::Kind::kNccl) {  // NCCL can only be released by an abort
            if (!network->aborted()) {
              std::lock_guard<std::mutex> net_lock(net_mutex);
              network->abort();
            }
          } else if (w.kind == PendingWait::Kind::kMailbox) {
            release_mailbox_wait(w);
          } else if (!timed_out) {
            release_flag_wait(w);
          }
        }
      }
      std::this_thread::sleep_for(draining ? std::chrono::microseconds(100)
                                            : std::chrono::microseconds(1000));
      lock.lock();
    }
  } catch (...) {
    // A CUDA error here (the context is broken): report it and stop; wait_stream() and
    // throw_if_failed() see watchdog_dead and throw instead of waiting for a drain.
    store_error(std::current_exception());
    watchdog_dead = true;
    std::lock_guard<std::mutex> lock(mutex);
    for (const PendingWait& w : pending) retire(w);
    pending.clear();
  }
}

}  // namespace tide
