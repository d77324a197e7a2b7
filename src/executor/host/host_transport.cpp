// The host network transport: a stand-in for NCCL between "nodes" that are ranks of one host (CI,
// virtual nodes). Per (channel, receiver) the sender keeps an outbox in its own segment
// (window/wire.hpp's NetOutbox): a send posts (offset, bytes, epoch, tag); the receiver checks
// epoch and tag (a mismatch is a DesyncError), pulls the bytes out of the sender's window into its
// own and advances `taken`, which completes the send. Waits go through the one wait loop.
#include <atomic>
#include <cstring>

#include "executor/tag.hpp"
#include "host_internal.hpp"
#include "tide/error.hpp"

namespace tide {

using detail::describe_tag;
using host_detail::Clock;
using host_detail::Status;

void HostExecutor::wait_for_transfer(RunState& run, std::size_t index, int peer,
                                     const std::string& what, uint64_t* word, FlagKind kind,
                                     const std::function<bool()>& ready) const {
  if (ready()) return;
  const Program& program = run.program;
  Publisher& publisher = run.publisher;
  const uint64_t epoch = run.epoch;
  const int rank = window_.rank();
  const Phase phase = program.steps[index].phase;
  publisher.publish(Status::kWaiting, phase, index, peer, kind);
  auto context = [&] {
    return detail::concat(what, " (", describe_tag(program.tag()), ", phase ", phase_name(phase),
                          ", epoch ", epoch, ") at step ", index, "/", program.steps.size(),
                          " [host network transport]");
  };
  Awaited awaited;
  awaited.ready = ready;
  awaited.word = word;
  awaited.check_peer = [&](const ExecutorState& ps, Clock::time_point) {
    if (ps.consistent && ps.failed() && ps.epoch >= epoch) {
      publisher.saw(0, 0, ps.cause >= 0 ? ps.cause : peer);
      const std::string m = detail::concat("rank ", rank, ": rank ", peer, " failed (",
                                           status_name(ps.status), "), so rank ", rank,
                                           " stops waiting for ", context(), "; its state: ",
                                           ps.to_string());
      if (ps.status == Status::kDesynced) throw DesyncError(m);
      if (ps.status == Status::kTimedOut) throw TimeoutError(m);
      throw Error(m);
    }
    if (ps.exited) {
      publisher.saw(0, 0, peer);
      throw TimeoutError(detail::concat("rank ", rank, ": rank ", peer, " (pid ", ps.pid,
                                        ") has exited; stopped waiting for ", context(),
                                        "; its last state: ", ps.to_string()));
    }
  };
  awaited.half_timeout_note = [&](Clock::time_point) {
    return detail::concat("tide debug: rank ", rank, " (pid ", identity_.pid,
                          ") has waited half its ", timeout_.count(), " ms timeout for ",
                          context(), ". States of the group:\n");
  };
  awaited.time_out = [&](const ExecutorState& ps) {
    publisher.saw(0, 0, peer);
    throw TimeoutError(detail::concat(
        "rank ", rank, ": timed out after ", timeout_.count(), " ms waiting for ", context(),
        "; its state: ", ps.to_string(), ". Rank ", peer,
        " is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is only slow)"));
  };
  wait_until(peer, awaited);
}

void HostExecutor::complete_send(RunState& run, const PostedSend& p, std::size_t index) const {
  NetOutbox* ob = window_.outbox(window_.rank(), p.channel, p.peer);
  std::atomic_ref<uint64_t> taken(ob->taken);
  wait_for_transfer(run, index, p.peer,
                    detail::concat("net send #", p.seq, " (", p.bytes, " B) to rank ", p.peer,
                                   " to be received"),
                    &ob->taken, FlagKind::kSlotFree,
                    [&] { return taken.load(std::memory_order_acquire) >= p.seq; });
}

void HostExecutor::complete_sends_reading(RunState& run, const Address& a, std::size_t bytes,
                                          std::size_t index) const {
  if (a.space != Space::kWindow || a.index != window_.rank() || run.posted.empty()) return;
  for (auto it = run.posted.begin(); it != run.posted.end();) {
    if (it->offset < a.offset + bytes && a.offset < it->offset + it->bytes) {
      complete_send(run, *it, index);
      it = run.posted.erase(it);
    } else {
      ++it;
    }
  }
}

void HostExecutor::net_send(RunState& run, std::size_t index, const NetSendOp& send) const {
  NetOutbox* ob = window_.outbox(window_.rank(), send.channel, send.peer);
  std::atomic_ref<uint64_t> posted(ob->posted), taken(ob->taken);
  const uint64_t k = posted.load(std::memory_order_relaxed) + 1;
  wait_for_transfer(run, index, send.peer,
                    detail::concat("room in the queue of net sends to rank ", send.peer),
                    &ob->taken, FlagKind::kSlotFree,
                    [&] { return k - taken.load(std::memory_order_acquire) <= kNetQueueDepth; });
  run.publisher.publish(Status::kRunning, run.program.steps[index].phase, index);
  NetEntry& e = ob->entries[(k - 1) % kNetQueueDepth];
  e.epoch = run.epoch, e.tag = run.tag, e.offset = send.src.offset, e.bytes = send.bytes;
  std::atomic_ref<uint64_t>(e.seq).store(k, std::memory_order_release);
  posted.store(k, std::memory_order_release);
  host_detail::wake_sleepers(&ob->posted);
  run.posted.push_back({send.peer, send.channel, k, send.src.offset, send.bytes});
}

void HostExecutor::net_receive(RunState& run, std::size_t index, const NetRecvOp& recv) const {
  const Program& program = run.program;
  const int rank = window_.rank();
  const Phase phase = program.steps[index].phase;
  complete_sends_reading(run, recv.dst, recv.bytes, index);
  NetOutbox* ob = window_.outbox(recv.peer, recv.channel, rank);
  std::atomic_ref<uint64_t> posted(ob->posted), taken(ob->taken);
  const uint64_t k = taken.load(std::memory_order_relaxed) + 1;
  wait_for_transfer(run, index, recv.peer,
                    detail::concat("net recv #", k, " (", recv.bytes, " B) from rank ", recv.peer),
                    &ob->posted, FlagKind::kDataReady,
                    [&] { return posted.load(std::memory_order_acquire) >= k; });
  run.publisher.publish(Status::kRunning, phase, index);
  const NetEntry& e = ob->entries[(k - 1) % kNetQueueDepth];
  const uint64_t seq = std::atomic_ref<uint64_t>(const_cast<uint64_t&>(e.seq)).load(std::memory_order_acquire);
  if (seq != k || e.epoch != run.epoch || e.tag != run.tag || e.bytes != recv.bytes ||
      e.offset > window_.data_bytes() || e.bytes > window_.data_bytes() - e.offset) {
    run.publisher.saw(e.epoch, e.tag, recv.peer);
    throw DesyncError(detail::concat(
        "rank ", rank, " runs ", describe_tag(run.tag), " at epoch ", run.epoch, " (phase ",
        phase_name(phase), ") and expects net recv #", k, " of ", recv.bytes,
        " B from rank ", recv.peer, " at step ", index, "/", program.steps.size(),
        ", but rank ", recv.peer, " posted send #", seq, " of ", e.bytes, " B for ",
        describe_tag(e.tag), " at epoch ", e.epoch,
        ": the ranks called collectives in different orders [host network transport]"));
  }
  std::memcpy(window_.data(rank) + recv.dst.offset, window_.data(recv.peer) + e.offset, recv.bytes);
  taken.store(k, std::memory_order_release);
  host_detail::wake_sleepers(&ob->taken);
}

}  // namespace tide
