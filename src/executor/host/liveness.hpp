// Processes: who a host executor's rank is, and whether a peer's process is gone (Linux /proc;
// anything unknown counts as alive). A waiting rank reads its peer's identity from the peer's
// published state (published_state.hpp) and stops waiting early when the process has exited.
#pragma once

#include <cstdint>

#include "tide/executor.hpp"

namespace tide::host_detail {

// This process: pid, start time and pid namespace.
HostExecutor::Identity self_identity();

// True only when the process that published `pid` is known to be gone (exited, a zombie, or its
// pid now names another process). Pids compare only within one pid namespace.
bool process_exited(const HostExecutor::Identity& self, uint64_t pid, uint64_t start_time,
                    uint64_t pid_ns);

}  // namespace tide::host_detail
