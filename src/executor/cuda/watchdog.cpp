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
#include <thread>

#include "cuda_executor_impl.hpp"
#include "tide/error.hpp"

namespace tide {

using namespace cuda_executor_detail;

namespace {
// Idle polls (1 ms each) before the watchdog sleeps until watch() wakes it.
constexpr int kWatchdogIdlePolls = 100;
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

std::exception_ptr CudaExecutor::Impl::diagnose_flag_wait(const PendingWait& w) {
  const int rank = window.rank();
  for (const AwaitedFlag& f : w.flags) {
    const FlagWord seen = read_flag(f.flag);
    const bool epoch_arrived = static_cast<int64_t>(seen.epoch - w.epoch) >= 0;
    if (epoch_arrived && seen.tag == w.tag) continue;  // this one passes: the stream is further on
    if (epoch_arrived) {
      return std::make_exception_ptr(DesyncError(detail::concat(
          "rank ", rank, " runs ", describe_tag(w.tag), " at epoch ", w.epoch, " (phase ",
          phase_name(f.phase), ") but rank ", f.peer, " signalled ", describe_tag(seen.tag),
          " at epoch ", seen.epoch, ": the ranks called collectives in different orders")));
    }
    return std::make_exception_ptr(TimeoutError(detail::concat(
        "rank ", rank, ": timed out after ", timeout.count(), " ms waiting for ",
        flag_kind_name(f.kind), " from rank ", f.peer, " (", describe_tag(w.tag), ", phase ",
        phase_name(f.phase), ", epoch ", w.epoch, ") on the GPU; last signal from rank ", f.peer,
        ": ",
        seen.epoch == 0 ? std::string("none")
                        : detail::concat("epoch ", seen.epoch, ", ", describe_tag(seen.tag)),
        ". The peer is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is "
        "only slow)")));
  }
  return nullptr;
}

void CudaExecutor::Impl::release_flag_wait(const PendingWait& w) {
  for (const AwaitedFlag& f : w.flags) write_flags(f.flag, 1, w.tag);
}

void CudaExecutor::Impl::watchdog_loop() {
  try {
    TIDE_CUDA_CHECK(cudaSetDevice(window.device()));
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
      if (pending.empty()) {
        // Idle: poll every 1 ms for a while before sleeping until watch() notifies. Runs come
        // far more often than that in training, so watch() rarely pays for waking this thread
        // (a futex wake and the lock handed over: microseconds of host time per run).
        if (idle_polls < kWatchdogIdlePolls) {
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
