// The host executor: the reference semantics of every program step. Built with -ffp-contract=off
// so its fp32 arithmetic rounds exactly as the CUDA kernels' explicit __fadd_rn/__fmul_rn do.
//
// Failure handling (docs/FAILURES.md): every step publishes the executor's state in its window
// segment (PublishedState, a seqlock), so a rank that waits on a peer can tell from the peer's state
// whether the signal can still come: a peer that failed, moved past this epoch, waits on us for an
// epoch we left, or whose process has exited ends the wait at once with an error that names both
// sides; otherwise the wait ends at its timeout.
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include <linux/futex.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <bit>
#include <climits>
#include <ctime>

#include "tide/error.hpp"
#include "tide/executor.hpp"
#include "../resolve.hpp"

namespace tide {
namespace {

using Clock = std::chrono::steady_clock;
using Status = ExecutorState::Status;

// How often a waiting rank looks at its peer's published state and process.
constexpr auto kFirstPeerCheck = std::chrono::milliseconds(1);
constexpr auto kPeerCheckInterval = std::chrono::milliseconds(5);
// Waits spin for this long, then sleep on the flag (futex) for at most kLongestSleep at a time.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);
constexpr auto kLongestSleep = std::chrono::microseconds(1000);

// A flag's epoch as a futex word: its low 32 bits. Signals wake ranks sleeping on it; shared (not
// FUTEX_PRIVATE) futexes work across processes mapping the same shared memory. A sleeper compares
// the low 32 bits it last saw, so a signal that lands before it sleeps makes it return at once.
static_assert(std::endian::native == std::endian::little, "futex word = low half of the epoch");
uint32_t* futex_word(uint64_t* epoch) { return reinterpret_cast<uint32_t*>(epoch); }
void wake_sleepers(uint64_t* epoch) {
  ::syscall(SYS_futex, futex_word(epoch), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
void sleep_on(uint64_t* epoch, uint64_t seen, std::chrono::microseconds at_most) {
  timespec ts{0, static_cast<long>(at_most.count()) * 1000};
  ::syscall(SYS_futex, futex_word(epoch), FUTEX_WAIT, static_cast<uint32_t>(seen), &ts, nullptr, 0);
}

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
}

// A slot-free flag whose collective failed on its sender carries this bit in its tag: it no longer
// lets a peer write into the sender's window (see retract_slot_free).
constexpr uint64_t kAbandoned = uint64_t{1} << 63;

std::string describe_tag(uint64_t tag) {
  return detail::concat("bucket ", (tag & ~kAbandoned) >> 1, " ",
                        collective_name(static_cast<Collective>(tag & 1)));
}
// Appended after "<tag> at epoch <e>" for a signal whose collective failed on its sender.
const char* withdrawn(uint64_t tag) {
  return (tag & kAbandoned) ? " (since withdrawn: that collective failed there)" : "";
}

const char* flag_kind_name(FlagKind kind) {
  return kind == FlagKind::kSlotFree ? "slot_free" : "data_ready";
}

// --- Processes: identity and liveness (Linux /proc; anything unknown counts as alive). ---

struct ProcStat {
  bool ok = false;
  char state = '?';
  uint64_t start_time = 0;
};

ProcStat read_proc_stat(long pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  std::FILE* f = std::fopen(path, "re");
  if (f == nullptr) return {};
  char buf[1024];
  const std::size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may contain spaces and ')'
  if (p == nullptr || p[1] != ' ') return {};
  ProcStat s;
  s.state = p[2];
  // After ") ": state is field 3; starttime is field 22. q starts at the blank before field 4.
  const char* q = p + 3;
  for (int field = 4; field < 22 && q != nullptr; ++field) q = std::strchr(q + 1, ' ');
  if (q == nullptr) return {};
  s.start_time = std::strtoull(q + 1, nullptr, 10);
  s.ok = true;
  return s;
}

HostExecutor::Identity self_identity() {
  HostExecutor::Identity id;
  id.pid = static_cast<uint64_t>(::getpid());
  const ProcStat s = read_proc_stat(::getpid());
  if (s.ok) id.start_time = s.start_time;
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) == 0) id.pid_ns = st.st_ino;
  return id;
}

// True only when the process that published `pid` is known to be gone (exited, a zombie, or its
// pid now names another process). Pids compare only within one pid namespace.
bool process_exited(const HostExecutor::Identity& self, uint64_t pid, uint64_t start_time,
                    uint64_t pid_ns) {
  if (pid == 0 || pid == self.pid || self.pid_ns == 0 || pid_ns != self.pid_ns) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  const ProcStat s = read_proc_stat(static_cast<long>(pid));
  if (!s.ok) return false;  // hidden (/proc hidepid) or just exited: the next check decides
  if (s.state == 'Z' || s.state == 'X') return true;
  return start_time != 0 && s.start_time != start_time;
}

// --- Published state: a seqlock written by one rank, read by any. ---

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
  st.bucket = static_cast<uint32_t>(r.tag >> 1);
  st.collective = static_cast<Collective>(r.tag & 1);
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

// --- Registry of live executors, for describe_executor_state(). ---

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<const HostExecutor*>& registry() {
  static std::vector<const HostExecutor*> executors;
  return executors;
}

}  // namespace

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
  const std::string what = detail::concat(describe_tag((uint64_t{bucket} << 1) |
                                                       static_cast<uint64_t>(collective)),
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

bool debug_enabled() {
  const char* env = std::getenv("TIDE_DEBUG");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "0") == 0) return false;
  TIDE_CHECK_ARG(std::strcmp(env, "1") == 0, "environment", "TIDE_DEBUG",
                 std::string("'") + env + "'", "0 or 1");
  return true;
}

// Publishes this rank's state for one collective. Only the owning rank writes its block.
class HostExecutor::Publisher {
 public:
  Publisher(PublishedState& block, const Identity& id, uint64_t epoch, uint64_t tag,
            std::size_t num_steps)
      : s_(block), id_(id), epoch_(epoch), tag_(tag), num_steps_(num_steps) {}

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
    store(s_.since_ns, now_ns());
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

HostExecutor::HostExecutor(HostWindow& window, std::chrono::milliseconds timeout)
    : window_(window), timeout_(timeout), debug_(debug_enabled()) {
  TIDE_CHECK_ARG(timeout.count() > 0, "HostExecutor", "timeout_ms", timeout.count(), "> 0");
  identity_ = self_identity();
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(this);
}

HostExecutor::~HostExecutor() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  for (auto it = r.begin(); it != r.end(); ++it)
    if (*it == this) {
      r.erase(it);
      break;
    }
}

ExecutorState HostExecutor::state(int rank) const {
  if (rank == -1) rank = window_.rank();
  TIDE_CHECK_ARG(rank >= 0 && rank < window_.world(), "HostExecutor::state", "rank", rank,
                 detail::concat("in [0, ", window_.world(), ") or -1 (own)"));
  return decode(read_raw(*window_.state(rank)), rank, identity_);
}

std::string HostExecutor::describe_group() const {
  std::string out;
  for (int r = 0; r < window_.world(); ++r) out += "  " + state(r).to_string() + "\n";
  return out;
}

std::string describe_executor_state() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (registry().empty()) return "no host executors in this process\n";
  std::string out;
  for (const HostExecutor* e : registry()) out += e->state().to_string() + "\n";
  return out;
}

void HostExecutor::wait(const Program& program, std::size_t index, const WaitOp& op,
                        uint64_t epoch, Publisher& publisher) {
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

  uint64_t seen = flag_epoch.load(std::memory_order_acquire);
  if (seen < epoch) {
    const auto start = Clock::now();
    const auto deadline = start + timeout_;
    auto next_check = start + kFirstPeerCheck;
    bool warned = !debug_;
    for (uint64_t spin = 1;; ++spin) {
      seen = flag_epoch.load(std::memory_order_acquire);
      if (seen >= epoch) break;
      if ((spin & 255) != 0) continue;
      const auto now = Clock::now();
      if (now >= next_check) {
        next_check = now + kPeerCheckInterval;
        // The peer's state first, then the flag again: a peer that signalled before publishing a
        // later state is seen to have signalled.
        const ExecutorState ps = decode(read_raw(*window_.state(peer)), peer, identity_);
        if (flag_epoch.load(std::memory_order_acquire) >= epoch) continue;
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
      }
      if (!warned && now - start >= timeout_ / 2) {
        warned = true;
        const std::string m = detail::concat(
            "tide debug: rank ", rank, " (pid ", identity_.pid, ") has waited ", ms_since(start),
            " ms (half its ", timeout_.count(), " ms timeout) for ", context(), "; ",
            last_signal(), ". States of the group:\n", describe_group());
        std::fputs(m.c_str(), stderr);
        std::fflush(stderr);
      }
      if (now > deadline) {
        const ExecutorState ps = decode(read_raw(*window_.state(peer)), peer, identity_);
        fail(TimeoutError(detail::concat(
                 "rank ", rank, ": timed out after ", timeout_.count(), " ms waiting for ",
                 context(), "; ", last_signal(), "; its state: ", ps.to_string(), ". Rank ", peer,
                 " is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is "
                 "only slow; TIDE_DEBUG=1 prints every rank's state at half the timeout)")),
             peer);
      }
      // Spin a little (a peer on another core signals within microseconds), then sleep until the
      // signal wakes us: a rank that shares cores with the peer it waits for (ranks as processes
      // on a small host, CPU compute) must not take the peer's time. Measured: spinning made a
      // 4-rank FSDP2 step on 2 cores 1.4x slower than stock (tide-bench fsdp).
      if (now - start < kSpinBeforeSleep)
        std::this_thread::yield();
      else
        sleep_on(&f.epoch, seen, std::min(kLongestSleep, std::chrono::duration_cast<std::chrono::microseconds>(
                                                             next_check - now + std::chrono::microseconds(1))));
    }
  }
  const uint64_t seen_tag = flag_tag();
  if (seen == epoch && seen_tag == (tag | kAbandoned)) {
    // The peer ran this very collective and failed in it: the same as a failed peer, unless it
    // has moved on since (then its published failure is gone, but this signal is still withdrawn).
    const ExecutorState ps = decode(read_raw(*window_.state(peer)), peer, identity_);
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

template <class Ready>
void HostExecutor::net_wait(const Program& program, std::size_t index, int peer, uint64_t epoch,
                            const std::string& what, uint64_t* word, FlagKind kind, Ready ready,
                            Publisher& publisher) {
  if (ready()) return;
  const int rank = window_.rank();
  const Phase phase = program.steps[index].phase;
  publisher.publish(Status::kWaiting, phase, index, peer, kind);
  auto context = [&] {
    return detail::concat(what, " (", describe_tag(program.tag()), ", phase ", phase_name(phase),
                          ", epoch ", epoch, ") at step ", index, "/", program.steps.size(),
                          " [host network transport]");
  };
  const auto start = Clock::now();
  auto next_check = start + kFirstPeerCheck;
  bool warned = !debug_;
  for (uint64_t spin = 1;; ++spin) {
    if (ready()) return;
    if ((spin & 255) != 0) continue;
    const auto now = Clock::now();
    if (now >= next_check) {
      next_check = now + kPeerCheckInterval;
      const ExecutorState ps = decode(read_raw(*window_.state(peer)), peer, identity_);
      if (ready()) return;
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
    }
    if (!warned && now - start >= timeout_ / 2) {
      warned = true;
      const std::string m = detail::concat(
          "tide debug: rank ", rank, " (pid ", identity_.pid, ") has waited half its ",
          timeout_.count(), " ms timeout for ", context(), ". States of the group:\n",
          describe_group());
      std::fputs(m.c_str(), stderr);
      std::fflush(stderr);
    }
    if (now - start > timeout_) {
      const ExecutorState ps = decode(read_raw(*window_.state(peer)), peer, identity_);
      publisher.saw(0, 0, peer);
      throw TimeoutError(detail::concat(
          "rank ", rank, ": timed out after ", timeout_.count(), " ms waiting for ", context(),
          "; its state: ", ps.to_string(), ". Rank ", peer,
          " is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is only slow)"));
    }
    const uint64_t seen = std::atomic_ref<uint64_t>(*word).load(std::memory_order_acquire);
    if (ready()) return;
    if (now - start < kSpinBeforeSleep)
      std::this_thread::yield();
    else
      sleep_on(word, seen, kLongestSleep);
  }
}

void HostExecutor::run(const Program& program, const Bindings& bindings) {
  const int rank = window_.rank();
  const int world = window_.world();
  validate_run(program, bindings, rank, world, window_.data_bytes(), window_.data(rank),
               /*net_supported=*/true);
  const uint64_t epoch = window_.next_epoch();
  const uint64_t tag = program.tag();
  Publisher publisher(*window_.state(rank), identity_, epoch, tag, program.steps.size());

  auto resolve = [&](const Address& a) {
    return detail::resolve_address(a, bindings, [&](int r) { return window_.data(r); });
  };

  // Sends posted and not yet known to be received: (peer, channel, number, offset, bytes).
  struct Pending {
    int peer, channel;
    uint64_t seq;
    std::size_t offset, bytes;
  };
  std::vector<Pending> pending;
  auto complete = [&](const Pending& p, std::size_t index) {
    NetOutbox* ob = window_.outbox(rank, p.channel, p.peer);
    std::atomic_ref<uint64_t> taken(ob->taken);
    net_wait(program, index, p.peer, epoch,
             detail::concat("net send #", p.seq, " (", p.bytes, " B) to rank ", p.peer,
                            " to be received"),
             &ob->taken, FlagKind::kSlotFree,
             [&] { return taken.load(std::memory_order_acquire) >= p.seq; }, publisher);
  };
  // Before a step writes own-window bytes [offset, offset + bytes): sends reading them complete.
  auto before_write = [&](const Address& a, std::size_t bytes, std::size_t index) {
    if (a.space != Space::kWindow || a.index != rank || pending.empty()) return;
    for (auto it = pending.begin(); it != pending.end();) {
      if (it->offset < a.offset + bytes && a.offset < it->offset + it->bytes) {
        complete(*it, index);
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
  };

  try {
    for (std::size_t index = 0; index < program.steps.size(); ++index) {
      const Step& step = program.steps[index];
      if (const auto* wait_op = std::get_if<WaitOp>(&step.op)) {
        wait(program, index, *wait_op, epoch, publisher);
        continue;
      }
      if (const auto* send = std::get_if<NetSendOp>(&step.op)) {
        NetOutbox* ob = window_.outbox(rank, send->channel, send->peer);
        std::atomic_ref<uint64_t> posted(ob->posted), taken(ob->taken);
        const uint64_t k = posted.load(std::memory_order_relaxed) + 1;
        net_wait(program, index, send->peer, epoch,
                 detail::concat("room in the queue of net sends to rank ", send->peer),
                 &ob->taken, FlagKind::kSlotFree,
                 [&] { return k - taken.load(std::memory_order_acquire) <= kNetQueueDepth; },
                 publisher);
        publisher.publish(Status::kRunning, step.phase, index);
        NetEntry& e = ob->entries[(k - 1) % kNetQueueDepth];
        e.epoch = epoch, e.tag = tag, e.offset = send->src.offset, e.bytes = send->bytes;
        std::atomic_ref<uint64_t>(e.seq).store(k, std::memory_order_release);
        posted.store(k, std::memory_order_release);
        wake_sleepers(&ob->posted);
        pending.push_back({send->peer, send->channel, k, send->src.offset, send->bytes});
        continue;
      }
      if (const auto* recv = std::get_if<NetRecvOp>(&step.op)) {
        before_write(recv->dst, recv->bytes, index);
        NetOutbox* ob = window_.outbox(recv->peer, recv->channel, rank);
        std::atomic_ref<uint64_t> posted(ob->posted), taken(ob->taken);
        const uint64_t k = taken.load(std::memory_order_relaxed) + 1;
        net_wait(program, index, recv->peer, epoch,
                 detail::concat("net recv #", k, " (", recv->bytes, " B) from rank ", recv->peer),
                 &ob->posted, FlagKind::kDataReady,
                 [&] { return posted.load(std::memory_order_acquire) >= k; }, publisher);
        publisher.publish(Status::kRunning, step.phase, index);
        const NetEntry& e = ob->entries[(k - 1) % kNetQueueDepth];
        const uint64_t seq = std::atomic_ref<uint64_t>(const_cast<uint64_t&>(e.seq)).load(std::memory_order_acquire);
        if (seq != k || e.epoch != epoch || e.tag != tag || e.bytes != recv->bytes ||
            e.offset > window_.data_bytes() || e.bytes > window_.data_bytes() - e.offset) {
          publisher.saw(e.epoch, e.tag, recv->peer);
          throw DesyncError(detail::concat(
              "rank ", rank, " runs ", describe_tag(tag), " at epoch ", epoch, " (phase ",
              phase_name(step.phase), ") and expects net recv #", k, " of ", recv->bytes,
              " B from rank ", recv->peer, " at step ", index, "/", program.steps.size(),
              ", but rank ", recv->peer, " posted send #", seq, " of ", e.bytes, " B for ",
              describe_tag(e.tag), " at epoch ", e.epoch,
              ": the ranks called collectives in different orders [host network transport]"));
        }
        std::memcpy(window_.data(rank) + recv->dst.offset, window_.data(recv->peer) + e.offset,
                    recv->bytes);
        taken.store(k, std::memory_order_release);
        wake_sleepers(&ob->taken);
        continue;
      }
      if (const auto* c = std::get_if<CastOp>(&step.op))
        before_write(c->dst, (c->count + c->pad) * dtype_size(c->dst_dtype), index);
      else if (const auto* b = std::get_if<CopyBatch>(&step.op))
        for (const CopyOp& c : b->copies) before_write(c.dst, c.bytes, index);
      else if (const auto* r = std::get_if<ReduceOp>(&step.op))
        before_write(r->dst, r->count * dtype_size(r->dst_dtype), index);
      publisher.publish(Status::kRunning, step.phase, index);
      if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
        for (const CopyOp& c : batch->copies)
          if (c.bytes > 0) std::memcpy(resolve(c.dst), resolve(c.src), c.bytes);
      } else if (const auto* cast = std::get_if<CastOp>(&step.op)) {
        std::byte* dst = resolve(cast->dst);
        const std::size_t dst_size = dtype_size(cast->dst_dtype);
        if (cast->src_dtype == cast->dst_dtype) {
          if (cast->count > 0) std::memcpy(dst, resolve(cast->src), cast->count * dst_size);
        } else {
          const std::byte* src = resolve(cast->src);
          for (int64_t k = 0; k < cast->count; ++k)
            store_from_float(dst, cast->dst_dtype, k, load_as_float(src, cast->src_dtype, k));
        }
        if (cast->pad > 0) std::memset(dst + cast->count * dst_size, 0, cast->pad * dst_size);
      } else if (const auto* signal = std::get_if<SignalOp>(&step.op)) {
        FlagWord& f = window_.flags(signal->peer)[flag_index(signal->kind, rank, world)];
        std::atomic_ref<uint64_t>(f.tag).store(tag, std::memory_order_relaxed);
        std::atomic_ref<uint64_t>(f.epoch).store(epoch, std::memory_order_release);
        wake_sleepers(&f.epoch);
      } else if (const auto* reduce = std::get_if<ReduceOp>(&step.op)) {
        std::vector<const std::byte*> sources;
        for (const Address& a : reduce->sources) sources.push_back(resolve(a));
        std::byte* dst = resolve(reduce->dst);
        const std::byte* partial = reduce->partial ? resolve(*reduce->partial) : nullptr;
        for (int64_t k = 0; k < reduce->count; ++k) {
          float acc = partial ? load_as_float(partial, reduce->partial_dtype, k) : 0.0f;
          for (const std::byte* src : sources)
            acc = acc + load_as_float(src, reduce->src_dtype, k) * reduce->prescale;
          float result = acc * reduce->scale;
          if (reduce->accumulate) result = load_as_float(dst, reduce->dst_dtype, k) + result;
          store_from_float(dst, reduce->dst_dtype, k, result);
        }
      }
    }
    for (const Pending& p : pending) complete(p, program.steps.empty() ? 0 : program.steps.size() - 1);
    publisher.publish(Status::kDone,
                      program.steps.empty() ? Phase::kCastIn : program.steps.back().phase,
                      program.steps.size());
  } catch (const TimeoutError&) {  // publish first: a peer that sees a withdrawn signal reads why
    publisher.finish(Status::kTimedOut);
    retract_slot_free(epoch);
    throw;
  } catch (const DesyncError&) {
    publisher.finish(Status::kDesynced);
    retract_slot_free(epoch);
    throw;
  } catch (...) {
    publisher.finish(Status::kFailed);
    retract_slot_free(epoch);
    throw;
  }
}

// A failed collective withdraws the slot-free signals it sent: a peer that arrives late at this
// epoch (a rank behind this one) must not write into this window, which has moved on. A peer that
// already saw the signal is inside the same collective, which wrote into this window anyway.
void HostExecutor::retract_slot_free(uint64_t epoch) {
  const int rank = window_.rank();
  for (int q = 0; q < window_.world(); ++q) {
    if (q == rank) continue;
    FlagWord& f = window_.flags(q)[flag_index(FlagKind::kSlotFree, rank, window_.world())];
    if (std::atomic_ref<uint64_t>(f.epoch).load(std::memory_order_relaxed) != epoch) continue;
    std::atomic_ref<uint64_t> tag(f.tag);
    tag.store(tag.load(std::memory_order_relaxed) | kAbandoned, std::memory_order_release);
  }
}

}  // namespace tide
