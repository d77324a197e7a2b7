#include <cstdio>
#include <thread>

#include "host_internal.hpp"

namespace tide {
namespace {

using host_detail::Clock;

// How often a waiting rank looks at its peer's published state and process.
constexpr auto kFirstPeerCheck = std::chrono::milliseconds(1);
constexpr auto kPeerCheckInterval = std::chrono::milliseconds(5);
// Waits spin for this long, then sleep on the awaited word (futex) for at most kLongestSleep at a
// time, and never past the next peer check.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(50);
constexpr auto kLongestSleep = std::chrono::microseconds(1000);

}  // namespace

ExecutorState HostExecutor::peer_state(int peer) const {
  return host_detail::read_published_state(*window_.state(peer), peer, identity_);
}

void HostExecutor::wait_until(int peer, const Awaited& awaited) const {
  const auto start = Clock::now();
  auto next_check = start + kFirstPeerCheck;
  bool warned = !debug_;
  for (uint64_t spin = 1;; ++spin) {
    if (awaited.ready()) return;
    if ((spin & 255) != 0) continue;
    const auto now = Clock::now();
    if (now >= next_check) {
      next_check = now + kPeerCheckInterval;
      // The peer's state first, then the awaited word again: a peer that signalled before
      // publishing a later state is seen to have signalled.
      const ExecutorState ps = peer_state(peer);
      if (awaited.ready()) return;
      awaited.check_peer(ps, start);
    }
    if (!warned && now - start >= timeout_ / 2) {
      warned = true;
      const std::string m = awaited.half_timeout_note(start) + describe_group();
      std::fputs(m.c_str(), stderr);
      std::fflush(stderr);
    }
    if (now - start > timeout_) awaited.time_out(peer_state(peer));
    const uint64_t seen = std::atomic_ref<uint64_t>(*awaited.word).load(std::memory_order_acquire);
    if (awaited.ready()) return;
    // Spin a little (a peer on another core signals within microseconds), then sleep until the
    // signal wakes us: a rank that shares cores with the peer it waits for (ranks as processes
    // on a small host, CPU compute) must not take the peer's time. Measured: spinning made a
    // 4-rank FSDP2 step on 2 cores 1.4x slower than stock (tide-bench fsdp).
    if (now - start < kSpinBeforeSleep)
      std::this_thread::yield();
    else
      host_detail::sleep_on(awaited.word, seen,
                            std::min(kLongestSleep, std::chrono::duration_cast<std::chrono::microseconds>(
                                                        next_check - now + std::chrono::microseconds(1))));
  }
}

}  // namespace tide
