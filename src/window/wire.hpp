// The words executors exchange through a window segment besides the flags: the host executor's
// published state and the network transports' outboxes (the host transport's, and the CUDA IPC
// transport's mailboxes, which share the layout). Private to the library: the windows size their
// segments with them, the executors read and write them; include/tide/window.hpp only names them.
#pragma once

#include <cstdint>

#include "tide/plan.hpp"

namespace tide {

// What a rank's host executor is doing, published by that rank next to its flags so that peers,
// error messages and debugging aids can read it, also after the rank died (see docs/FAILURES.md).
// Written only by the owning rank, as a seqlock (seq is odd while a write is in progress); every
// field is accessed with std::atomic_ref. Decoded by HostExecutor::state() into ExecutorState.
struct alignas(64) PublishedState {
  uint64_t seq;
  uint64_t epoch;       // of the current (or last) collective
  uint64_t tag;         // its tag (bucket << 1 | collective)
  uint64_t where;       // status | phase << 8 | wait kind << 16 | (waited-on peer + 1) << 32
  uint64_t step;        // step index << 32 | number of steps
  uint64_t since_ns;    // steady-clock time the current step (or the final status) began
  uint64_t pid;         // of the owning process; 0 until the first collective
  uint64_t start_time;  // the process's start time (/proc/<pid>/stat), to tell a reused pid
  uint64_t pid_ns;      // inode of its pid namespace (0 if unknown): pids compare only within one
  uint64_t seen_epoch;  // a failed wait: the flag it last saw (epoch, tag)
  uint64_t seen_tag;
  uint64_t cause;       // a failed collective: the rank its failure started at, + 1 (0: none)
  uint64_t reserved[4];
};

// The host network transport: a stand-in for NCCL between "nodes" that are ranks of one host (CI,
// virtual nodes). Per (channel, receiver) the sender keeps an outbox in its own segment: a queue of
// kNetQueueDepth posted sends (window offset, bytes, epoch, tag). The receiver pulls the bytes out
// of the sender's window into its own and advances `taken`, which completes the send. Counters
// count sends on a window and never reset, like epochs.
struct alignas(64) NetEntry {
  uint64_t seq;  // 1-based send number on this outbox; written last (release)
  uint64_t epoch, tag, offset, bytes;
  uint64_t reserved[3];
};
struct alignas(64) NetOutbox {
  uint64_t posted;  // sends posted (written by the sender)
  uint64_t reserved0[7];
  uint64_t taken;   // sends received (written by the receiver)
  uint64_t reserved1[7];
  NetEntry entries[kNetQueueDepth];
};

}  // namespace tide
