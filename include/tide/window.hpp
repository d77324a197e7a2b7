// window: one buffer per rank of a group, mapped into every rank, plus a flag array per rank that
// peers signal into. Data is laid out by BucketLayout; flags are FlagWord[kNumFlagKinds][W]:
// flag (kind, src) of rank q is written only by rank src and read only by rank q.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tide/bootstrap.hpp"
#include "tide/plan.hpp"

namespace tide {

// One signal: the epoch it announces and the tag (bucket, collective) of the program that sent it.
// The tag is written before the epoch (release), so a waiter that sees the epoch sees its tag.
struct alignas(16) FlagWord {
  uint64_t epoch;
  uint64_t tag;
};

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

inline std::size_t flag_index(FlagKind kind, int src_rank, int world) {
  return static_cast<std::size_t>(kind) * world + src_rank;
}
inline std::size_t flag_array_bytes(int world) {
  return sizeof(FlagWord) * kNumFlagKinds * static_cast<std::size_t>(world);
}

// A window over POSIX shared memory, for ranks that are processes or threads on one host.
// Each rank creates its own segment ([data][flags][published state]), the names are exchanged over
// the bootstrap, every rank maps every segment, and after a barrier each segment is unlinked: nothing
// is left in /dev/shm even if a rank is killed later.
class HostWindow {
 public:
  // Collective: every rank of `bootstrap` calls it with the same data_bytes (checked).
  static std::unique_ptr<HostWindow> create(Bootstrap& bootstrap, std::size_t data_bytes);
  ~HostWindow();
  HostWindow(const HostWindow&) = delete;
  HostWindow& operator=(const HostWindow&) = delete;

  int rank() const { return rank_; }
  int world() const { return static_cast<int>(maps_.size()); }
  std::size_t data_bytes() const { return data_bytes_; }
  std::byte* data(int rank) const;      // rank's data, as mapped in this process
  FlagWord* flags(int rank) const;      // rank's flag array, as mapped in this process
  PublishedState* state(int rank) const;  // rank's published executor state, as mapped here
  // The outbox of `sender` (in its segment) for sends to `receiver` on `channel`.
  NetOutbox* outbox(int sender, int channel, int receiver) const;
  // Epochs count collectives run on this window; they never reset.
  uint64_t next_epoch() { return ++epoch_; }
  uint64_t epoch() const { return epoch_; }

  // Maps this rank's data again at the start of `range`, replacing whatever was mapped there. The
  // alias shares the pages, so a tensor over a fixed address can be backed by whichever pooled
  // window a bucket holds at the moment.
  void map_data_into(const class HostAddressRange& range) const;

 private:
  HostWindow(int rank, std::size_t data_bytes, std::size_t mapped_bytes);
  int rank_;
  std::size_t data_bytes_;
  std::size_t mapped_bytes_;
  int own_fd_ = -1;  // kept open for map_data_at; the name itself is unlinked at creation
  std::vector<std::byte*> maps_;
  uint64_t epoch_ = 0;
};

// A reserved range of this process's address space (no memory behind it until a window's data is
// mapped into it with HostWindow::map_data_at). Gives a bucket's unsharded parameters one address
// for the life of the model while the memory behind it comes from a small pool of windows.
class HostAddressRange {
 public:
  explicit HostAddressRange(std::size_t bytes);
  ~HostAddressRange();
  HostAddressRange(const HostAddressRange&) = delete;
  HostAddressRange& operator=(const HostAddressRange&) = delete;
  std::byte* base() const { return base_; }
  std::size_t bytes() const { return bytes_; }

 private:
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace tide
