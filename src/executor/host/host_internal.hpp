// What the host executor's files share: a run's state, what one wait waits for, and how a waiting
// rank sleeps on a word of shared memory.
//   host_executor.cpp    the public API, the step loop (copies, casts, reduces, signals)
//   flag_wait.cpp        a WaitOp: the signal matcher (epoch and tag) and the peer checks
//   host_transport.cpp   network ops over shared-memory outboxes (a stand-in for NCCL)
//   wait_loop.cpp        the one wait loop both use: spin, sleep, peer checks, timeout
//   published_state.*    the seqlock state every rank publishes; liveness.*: /proc checks
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <bit>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "published_state.hpp"
#include "tide/executor.hpp"

namespace tide {
namespace host_detail {

using Clock = std::chrono::steady_clock;

// A flag's epoch (or an outbox counter) as a futex word: its low 32 bits. Signals wake ranks
// sleeping on it; shared (not FUTEX_PRIVATE) futexes work across processes mapping the same shared
// memory. A sleeper compares the low 32 bits it last saw, so a signal that lands before it sleeps
// makes it return at once.
static_assert(std::endian::native == std::endian::little, "futex word = low half of the epoch");
inline uint32_t* futex_word(uint64_t* word) { return reinterpret_cast<uint32_t*>(word); }
inline void wake_sleepers(uint64_t* word) {
  ::syscall(SYS_futex, futex_word(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
inline void sleep_on(uint64_t* word, uint64_t seen, std::chrono::microseconds at_most) {
  timespec ts{0, static_cast<long>(at_most.count()) * 1000};
  ::syscall(SYS_futex, futex_word(word), FUTEX_WAIT, static_cast<uint32_t>(seen), &ts, nullptr, 0);
}

}  // namespace host_detail

// A send posted and not yet known to be received.
struct HostExecutor::PostedSend {
  int peer, channel;
  uint64_t seq;
  std::size_t offset, bytes;
};

// One collective as it runs.
struct HostExecutor::RunState {
  const Program& program;
  uint64_t epoch;
  uint64_t tag;
  Publisher& publisher;
  std::vector<PostedSend> posted;
};

// What one wait waits for (wait_until): a word of shared memory reaching a value, and what to do
// when the peer's state shows it never will, at half the timeout, and at the timeout.
struct HostExecutor::Awaited {
  std::function<bool()> ready;  // the awaited value has arrived
  uint64_t* word;               // signals of it wake sleepers on this word
  // The peer's state, read after ready() last said no: throws if the value can no longer come.
  std::function<void(const ExecutorState& peer_state, host_detail::Clock::time_point start)> check_peer;
  // TIDE_DEBUG's note at half the timeout, up to and including "States of the group:\n".
  std::function<std::string(host_detail::Clock::time_point start)> half_timeout_note;
  // Throws the timeout's error, given the peer's state read at the timeout.
  std::function<void(const ExecutorState& peer_state)> time_out;
};

}  // namespace tide
