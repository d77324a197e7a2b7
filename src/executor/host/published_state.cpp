#include "published_state.hpp"

#include <thread>

#include "executor/tag.hpp"
#include "liveness.hpp"
#include "tide/error.hpp"

namespace tide {
namespace host_detail {

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

namespace {

struct RawState {
  uint64_t epoch, tag, where, step, since_ns, pid, start_time, pid_ns, seen_epoch, seen_tag, cause;
  bool consistent;
};

RawState read_raw(PublishedState& s) {
  std::atomic_ref<uint64_t> seq(s.seq);
  auto load = [](uint64_t& v) { return std::atomic_ref<uint64_t>(v).load(std::memory_order_relaxed); };
  RawState r{};
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const uint64_t s1 = seq.load(std::memory_order_acquire);
    r = {load(s.epoch),  load(s.tag),        load(s.where),  load(s.step),
         load(s.since_ns), load(s.pid),      load(s.start_time), load(s.pid_ns),
         load(s.seen_epoch), load(s.seen_tag), load(s.cause), false};
    std::atomic_thread_fence(std::memory_order_acquire);
    if ((s1 & 1) == 0 && seq.load(std::memory_order_relaxed) == s1) {
      r.consistent = true;
      return r;
    }
    std::this_thread::yield();
  }
  return r;  // the writer died mid-update: fields may mix two updates
}

ExecutorState decode(const RawState& r, int rank, const HostExecutor::Identity& reader) {
  ExecutorState st;
  st.rank = rank;
  st.consistent = r.consistent;
  if (r.pid == 0) return st;  // never published: idle
  st.status = static_cast<Status>(r.where & 0xFF);
  st.phase = static_cast<Phase>((r.where >> 8) & 0xFF);
  st.wait_kind = static_cast<FlagKind>((r.where >> 16) & 0xFF);
  st.waiting_on = static_cast<int>(static_cast<int64_t>(r.where >> 32) - 1);
  st.epoch = r.epoch;
  st.bucket = detail::tag_bucket(r.tag);
  st.collective = detail::tag_collective(r.tag);
  st.step = static_cast<int>(r.step >> 32);
  st.num_steps = static_cast<int>(r.step & 0xFFFFFFFF);
  const uint64_t now = now_ns();
  st.elapsed = std::chrono::milliseconds(now > r.since_ns ? (now - r.since_ns) / 1000000 : 0);
  st.pid = static_cast<long>(r.pid);
  st.seen_epoch = r.seen_epoch;
  st.seen_tag = r.seen_tag;
  st.cause = static_cast<int>(static_cast<int64_t>(r.cause & 0xFFFFFFFF) - 1);
  st.exited = r.consistent && process_exited(reader, r.pid, r.start_time, r.pid_ns);
  return st;
}

}  // namespace

ExecutorState read_published_state(PublishedState& block, int rank,
                                   const HostExecutor::Identity& reader) {
  return decode(read_raw(block), rank, reader);
}

}  // namespace host_detail

using host_detail::Status;
using detail::describe_tag;
using detail::flag_kind_name;

using detail::withdrawn;

const char* status_name(ExecutorState::Status status) {
  switch (status) {
    case Status::kIdle: return "idle";
    case Status::kRunning: return "running";
    case Status::kWaiting: return "waiting";
    case Status::kDone: return "done";
    case Status::kTimedOut: return "timed out";
    case Status::kDesynced: return "desynced";
    case Status::kFailed: return "failed";
  }
  return "invalid";
}

std::string ExecutorState::to_string() const {
  std::string who = pid != 0 ? detail::concat("rank ", rank, " (pid ", pid, exited ? ", exited" : "",
                                              ")")
                             : detail::concat("rank ", rank);
  const std::string torn = consistent ? "" : " [read mid-update: fields may be mixed]";
  const std::string what = detail::concat(describe_tag(detail::encode_tag(bucket, collective)),
                                          ", epoch ", epoch);
  const std::string at = detail::concat("step ", step, "/", num_steps, " (phase ", phase_name(phase),
                                        ") of ", what);
  const std::string peer = detail::concat(flag_kind_name(wait_kind), " from rank ", waiting_on);
  switch (status) {
    case Status::kIdle:
      return detail::concat(who, ": idle (no collective run on this window yet)", torn);
    case Status::kRunning:
      return detail::concat(who, ": running ", at, ", for ", elapsed.count(), " ms", torn);
    case Status::kWaiting:
      return detail::concat(who, ": waiting ", elapsed.count(), " ms for ", peer, " at ", at, torn);
    case Status::kDone:
      return detail::concat(who, ": done with ", what, " (", elapsed.count(), " ms ago)", torn);
    default: {
      std::string waited;
      if (waiting_on >= 0)
        waited = detail::concat(", waiting for ", peer, ", which had ",
                                seen_epoch == 0 ? std::string("not signalled")
                                                : detail::concat("signalled ", describe_tag(seen_tag),
                                                                 " at epoch ", seen_epoch,
                                                                 withdrawn(seen_tag)));
      const std::string started =
          cause >= 0 && cause != waiting_on ? detail::concat(", a failure that started at rank ", cause)
                                            : std::string();
      return detail::concat(who, ": ", status_name(status), " at ", at, waited, started, " (",
                            elapsed.count(), " ms ago)", torn);
    }
  }
}

}  // namespace tide
