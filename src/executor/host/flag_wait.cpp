// A WaitOp on the host: wait until the peer's signal reaches this epoch, then match it (the same
// epoch and this program's tag, or DesyncError naming both sides). While waiting, the peer's
// published state ends the wait early when the signal can no longer come: the peer failed, moved
// past this epoch, waits on this rank for an epoch it left, or its process has exited.
#include <atomic>

#include "executor/tag.hpp"
#include "host_internal.hpp"
#include "tide/error.hpp"

namespace tide {

using detail::describe_tag;
using detail::flag_kind_name;
using detail::kAbandonedTag;
using detail::withdrawn;
using host_detail::Clock;
using host_detail::Status;

void HostExecutor::wait_for_flag(RunState& run, std::size_t index, const WaitOp& op) const {
  const Program& program = run.program;
  Publisher& publisher = run.publisher;
  const uint64_t epoch = run.epoch;
  const int rank = window_.rank();
  const int world = window_.world();
  const int peer = op.peer;
  const uint64_t tag = program.tag();
  const Phase phase = program.steps[index].phase;
  FlagWord& f = window_.flags(rank)[flag_index(op.kind, peer, world)];
  std::atomic_ref<uint64_t> flag_epoch(f.epoch);
  auto flag_tag = [&] { return std::atomic_ref<uint64_t>(f.tag).load(std::memory_order_acquire); };
  // Every failure of this wait goes through here, so the published state records what it saw and
  // the rank the failure started at.
  auto fail = [&]<class E>(E error, int cause) {
    publisher.saw(flag_epoch.load(std::memory_order_acquire), flag_tag(), cause);
    throw error;
  };
  publisher.publish(Status::kWaiting, phase, index, peer, op.kind);

  // "data_ready from rank 3 (bucket 1 all_gather, phase data_ready, epoch 3) at step 9/14"
  auto context = [&] {
    return detail::concat(flag_kind_name(op.kind), " from rank ", peer, " (", describe_tag(tag),
                          ", phase ", phase_name(phase), ", epoch ", epoch, ") at step ", index,
                          "/", program.steps.size());
  };
  auto last_signal = [&] {
    const uint64_t seen = flag_epoch.load(std::memory_order_acquire);
    const uint64_t t = flag_tag();
    return detail::concat("last signal from rank ", peer, ": ",
                          seen == 0 ? std::string("none")
                                    : detail::concat(describe_tag(t), " at epoch ", seen, withdrawn(t)));
  };
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
  };
  // The peer failed (its published state says so): its signal will not come. Fail the same way,
  // naming the rank where the failure started.
  auto propagate = [&](const ExecutorState& ps) {
    const int cause = ps.cause >= 0 ? ps.cause : peer;
    const std::string ahead =
        ps.epoch < epoch ? detail::concat(" Rank ", rank, " is ", epoch - ps.epoch,
                                          " collective(s) ahead of rank ", peer,
                                          ": the ranks ran different numbers of collectives.")
                         : std::string();
    const std::string m = detail::concat(
        "rank ", rank, ": rank ", peer, " failed (", status_name(ps.status), ")",
        cause != peer ? detail::concat(", a failure that started at rank ", cause) : std::string(),
        ", so rank ", rank, " stops waiting for ", context(), "; ", last_signal(), "; its state: ",
        ps.to_string(), ".", ahead);
    if (ps.status == Status::kDesynced) fail(DesyncError(m), cause);
    if (ps.status == Status::kTimedOut) fail(TimeoutError(m), cause);
    fail(Error(m), cause);
  };

  uint64_t seen = 0;
  Awaited awaited;
  awaited.ready = [&] {
    seen = flag_epoch.load(std::memory_order_acquire);
    return seen >= epoch;
  };
  awaited.word = &f.epoch;
  awaited.check_peer = [&](const ExecutorState& ps, Clock::time_point start) {
    if (ps.consistent && ps.failed()) propagate(ps);
    if (ps.consistent && ps.pid != 0 && ps.epoch > epoch)
      fail(DesyncError(detail::concat(
               "rank ", rank, " runs ", describe_tag(tag), " at epoch ", epoch, " (phase ",
               phase_name(phase), ") but rank ", peer, " has moved on to epoch ", ps.epoch,
               " (", ps.to_string(), ") without signalling ", flag_kind_name(op.kind),
               " for epoch ", epoch, ": the ranks called collectives in different orders")),
           peer);
    if (ps.consistent && ps.status == Status::kWaiting && ps.waiting_on == rank &&
        ps.epoch < epoch && static_cast<int>(ps.wait_kind) < kNumFlagKinds) {
      FlagWord& mine = window_.flags(peer)[flag_index(ps.wait_kind, rank, world)];
      const uint64_t sent = std::atomic_ref<uint64_t>(mine.epoch).load(std::memory_order_acquire);
      if (sent < ps.epoch)
        fail(DesyncError(detail::concat(
                 "rank ", rank, " runs ", describe_tag(tag), " at epoch ", epoch, " (phase ",
                 phase_name(phase), ") but rank ", peer, " still waits at epoch ", ps.epoch,
                 " for ", flag_kind_name(ps.wait_kind), " from rank ", rank, ", which rank ",
                 rank, " left without signalling it (", ps.to_string(),
                 "): the ranks ran different numbers of collectives")),
             rank);
    }
    if (ps.exited)
      fail(TimeoutError(detail::concat(
               "rank ", rank, ": rank ", peer, " (pid ", ps.pid,
               ") has exited; stopped waiting after ", ms_since(start), " ms for ", context(),
               "; ", last_signal(), "; its last state: ", ps.to_string())),
           peer);
  };
  awaited.half_timeout_note = [&](Clock::time_point start) {
    return detail::concat("tide debug: rank ", rank, " (pid ", identity_.pid, ") has waited ",
                          ms_since(start), " ms (half its ", timeout_.count(), " ms timeout) for ",
                          context(), "; ", last_signal(), ". States of the group:\n");
  };
  awaited.time_out = [&](const ExecutorState& ps) {
    fail(TimeoutError(detail::concat(
             "rank ", rank, ": timed out after ", timeout_.count(), " ms waiting for ", context(),
             "; ", last_signal(), "; its state: ", ps.to_string(), ". Rank ", peer,
             " is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is "
             "only slow; TIDE_DEBUG=1 prints every rank's state at half the timeout)")),
         peer);
  };
  if (!awaited.ready()) wait_until(peer, awaited);

  const uint64_t seen_tag = flag_tag();
  if (seen == epoch && seen_tag == (tag | kAbandonedTag)) {
    // The peer ran this very collective and failed in it: the same as a failed peer, unless it
    // has moved on since (then its published failure is gone, but this signal is still withdrawn).
    const ExecutorState ps = peer_state(peer);
    if (ps.consistent && ps.failed() && ps.epoch == epoch) propagate(ps);
    fail(DesyncError(detail::concat(
             "rank ", rank, " runs ", describe_tag(tag), " at epoch ", epoch, " (phase ",
             phase_name(phase), ") but rank ", peer, " abandoned its ", describe_tag(seen_tag),
             " at epoch ", seen, ", which failed there (", ps.to_string(),
             "): the ranks are out of step")),
         peer);
  }
  if (seen != epoch || seen_tag != tag)
    fail(DesyncError(detail::concat(
             "rank ", rank, " runs ", describe_tag(tag), " at epoch ", epoch, " (phase ",
             phase_name(phase), ") but rank ", peer, " signalled ", describe_tag(seen_tag),
             " at epoch ", seen, withdrawn(seen_tag),
             ": the ranks called collectives in different orders")),
         peer);
}

}  // namespace tide
