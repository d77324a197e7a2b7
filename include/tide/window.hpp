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

// Layouts of what executors keep next to the flags (a host executor's published state, the
// network transports' outboxes): private to the library, src/window/wire.hpp.
struct PublishedState;
struct NetOutbox;

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

 private:
  friend class HostAddressRange;  // maps this rank's data (own_fd_)
  HostWindow(int rank, std::size_t data_bytes, std::size_t mapped_bytes);
  int rank_;
  std::size_t data_bytes_;
  std::size_t mapped_bytes_;
  int own_fd_ = -1;  // kept open for HostAddressRange::map_data_of; the name itself is unlinked at creation
  std::vector<std::byte*> maps_;
  uint64_t epoch_ = 0;
};

// A reserved range of this process's address space (no memory behind it until a window's data is
// mapped into it with map_data_of). Gives a bucket's unsharded parameters one address
// for the life of the model while the memory behind it comes from a small pool of windows.
class HostAddressRange {
 public:
  explicit HostAddressRange(std::size_t bytes);
  ~HostAddressRange();
  HostAddressRange(const HostAddressRange&) = delete;
  HostAddressRange& operator=(const HostAddressRange&) = delete;
  std::byte* base() const { return base_; }
  std::size_t bytes() const { return bytes_; }
  // Maps `window`'s data (this rank's) at the start of this range, replacing whatever was mapped
  // there. The alias shares the pages, so a tensor over a fixed address can be backed by whichever
  // pooled window a bucket holds at the moment.
  void map_data_of(const HostWindow& window);

 private:
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace tide
