// plan: a collective on a BucketLayout becomes a per-rank *program*, a short list of steps in a
// small IR. Executors (host, CUDA) run the same program, so addressing, phases, flags and slot
// reuse are proven on the host executor without a GPU and only the transport differs on a GPU.
//
// Addresses are symbolic: a Space plus an index (a rank for windows, a param for user buffers) and
// a byte offset; an executor binds them to real pointers. Signals write the collective's epoch into
// a peer's flag; waits block until the local flag reaches it. Epochs count up per window and never
// reset, so a flag never has to be cleared.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "tide/layout.hpp"

namespace tide {

enum class Collective : uint8_t { kAllGather, kReduceScatter };
const char* collective_name(Collective collective);

enum class Phase : uint8_t {
  kCastIn,     // own shard -> own slot (all-gather)
  kSlotFree,   // "my window may be overwritten for this epoch" handshake
  kPush,       // copy-engine copies into peers' slots
  kDataReady,  // data-ready handshake
  kReduce,     // accumulate slots into fp32 shards (reduce-scatter)
};
const char* phase_name(Phase phase);

enum class Space : uint8_t {
  kWindow,  // index = rank whose window
  kInput,   // index = param: all-gather shard / reduce-scatter full gradient
  kOutput,  // index = param: reduce-scatter output shard
};

struct Address {
  Space space;
  int index;
  std::size_t offset;  // bytes
  bool operator==(const Address&) const = default;
};

enum class FlagKind : uint8_t { kSlotFree = 0, kDataReady = 1 };
inline constexpr int kNumFlagKinds = 2;

struct CopyOp {
  Address dst;
  Address src;
  std::size_t bytes;
};

// A batch of copies a copy engine may run in any order and in parallel.
struct CopyBatch {
  std::vector<CopyOp> copies;
};

// dst[0:count] = convert(src[0:count]); dst[count:count+pad] = 0.
struct CastOp {
  Address dst;
  Address src;
  int64_t count;
  int64_t pad;
  DType src_dtype;
  DType dst_dtype;
};

// Writes (epoch, tag) into flag[kind][self] of `peer`'s window.
struct SignalOp {
  int peer;
  FlagKind kind;
};

// Waits until own flag[kind][peer] >= epoch, then checks the peer's tag matches ours.
struct WaitOp {
  int peer;
  FlagKind kind;
};

// dst[k] (+)= scale * sum_{p = 0..W-1, in this order} (prescale * float(sources[p][k])), k < count.
// Accumulation is fp32, one rounding per operation, no fused multiply-add: bitwise reproducible
// and identical on every executor.
struct ReduceOp {
  int param;
  std::vector<Address> sources;  // one per rank, rank order
  Address dst;
  int64_t count;
  DType src_dtype;
  DType dst_dtype;
  float prescale;
  float scale;
  bool accumulate;
};

struct Step {
  Phase phase;
  std::variant<CopyBatch, CastOp, SignalOp, WaitOp, ReduceOp> op;
};

struct Program {
  Collective collective = Collective::kAllGather;
  int rank = 0;
  int world = 0;
  uint32_t bucket = 0;  // bucket identity, carried by signals for desync detection
  int num_params = 0;
  std::size_t window_bytes = 0;  // the window this program needs, per rank
  std::size_t alignment = 0;     // the window base alignment it needs
  std::vector<Step> steps;

  // The 32-bit tag every signal of this program carries: bucket and collective.
  uint32_t tag() const { return (bucket << 1) | static_cast<uint32_t>(collective); }
  // Readable listing, one line per step (copy batches summarised per peer).
  std::string to_string() const;
  std::size_t bytes_pushed() const;
};

enum class ReduceKind : uint8_t { kSum, kAvg };

struct ReduceOptions {
  ReduceKind kind = ReduceKind::kAvg;
  float prescale = 1.0f;   // applied to every element before the sum (FSDP2's pre-divide factor)
  float postscale = 1.0f;  // applied to the sum (with 1/W for kAvg)
  bool accumulate = false; // += into the existing output instead of overwriting it
};

// Rank `rank`'s program for the all-gather of `layout`: cast its shard of every param into its own
// slot (zero padding), take the slot-free handshake, push its slots to the same slots on every peer
// (peers in staggered order r+1, r+2, ... to spread incoming traffic), signal data-ready, wait.
Program plan_all_gather(const BucketLayout& layout, int rank, uint32_t bucket = 0);

// Rank `rank`'s program for the reduce-scatter of `layout`'s gradients: slot-free handshake (peers
// must be done with the params before their vacated slots take gradient chunks), push chunk q of
// every gradient into rank q's slot(i, rank), signal data-ready, wait, reduce.
Program plan_reduce_scatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                            uint32_t bucket = 0);

// Checks a full set of programs (one per rank, same collective) against the layout: every window
// byte the collective must deliver is written exactly once, from the right place (a rank's own
// shard, or chunk q of its gradient for rank q), no two writes overlap, every copy stays inside its
// buffers, every read of a window byte reads something written, casts and reduces cover exactly
// each rank's shard with the params' dtypes, every signal is matched by a wait, and the handshakes
// cannot deadlock. Throws Error naming the first violation. Used by tests and the fuzzer.
void verify_programs(const BucketLayout& layout, const std::vector<Program>& programs);

}  // namespace tide
