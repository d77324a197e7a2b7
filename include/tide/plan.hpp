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
#include <optional>
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
  kPush,       // delivery into peers' slots: copy-engine copies (casts with Delivery::kCastToPeers)
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

// `rows` rows of `bytes` bytes: row j from src + j * src_pitch to dst + j * dst_pitch (rows = 1 is
// a plain copy, pitches unused). 2-D copies move a param's block when it is sharded on a dim > 0
// (layout.hpp); rows must not overlap (pitch >= bytes), so every executor may run them in any order.
struct CopyOp {
  Address dst;
  Address src;
  std::size_t bytes;  // per row
  std::size_t rows = 1;
  std::size_t src_pitch = 0;
  std::size_t dst_pitch = 0;

  std::size_t total_bytes() const { return rows * bytes; }
  // Bytes from the first row's start to the last row's end.
  std::size_t src_extent() const { return rows > 1 ? (rows - 1) * src_pitch + bytes : bytes; }
  std::size_t dst_extent() const { return rows > 1 ? (rows - 1) * dst_pitch + bytes : bytes; }
};

// A batch of copies a copy engine may run in any order and in parallel.
struct CopyBatch {
  std::vector<CopyOp> copies;
};

// dst[0:count] = convert(src[0:count]); dst[count:count+pad] = 0. With rows > 1 (an all-gather
// shard of a param sharded on a dim > 0, cast into its strided block) the source is rows x count
// contiguous elements and row j goes to dst + j * dst_pitch bytes: dst_row_j[0:count] =
// convert(src[j * count:(j + 1) * count]); pad is then 0 (such shards are never padded).
struct CastOp {
  Address dst;
  Address src;
  int64_t count;  // per row
  int64_t pad;
  DType src_dtype;
  DType dst_dtype;
  int64_t rows = 1;
  std::size_t dst_pitch = 0;  // bytes, rows > 1

  std::size_t dst_extent() const {
    const std::size_t row = static_cast<std::size_t>(count + pad) * dtype_size(dst_dtype);
    return rows > 1 ? (rows - 1) * dst_pitch + row : row;
  }
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

// dst[k] (+)= scale * (float(partial[k]) + sum_{p = 0..W-1, in this order} (prescale * float(sources[p][k]))),
// k < count; without a partial the sum starts at 0. Accumulation is fp32, one rounding per
// operation, no fused multiply-add: bitwise reproducible and identical on every executor.
struct ReduceOp {
  int param;
  std::vector<Address> sources;  // one per rank, rank order (across-node: the node's local ranks)
  Address dst;
  int64_t count;
  DType src_dtype;
  DType dst_dtype;
  float prescale;
  float scale;
  bool accumulate;
  // Across-node plans: a partial sum (received from another node) in the own window that the
  // sources are added to, so a ring step reads the gradients once (no separate local partial).
  std::optional<Address> partial = std::nullopt;
  DType partial_dtype = DType::kFP32;  // AcrossNodesOptions::wire_dtype
};

// --- Network ops (between nodes; W = nodes x local, see Topology) ---
//
// Two-sided transfers between ranks on different nodes, matched in order per (sender, receiver,
// channel): the k-th NetSendOp from s to r on a channel pairs with the k-th NetRecvOp of r from s on
// it, with equal bytes. Both addresses are in the own window. A send is *posted* (it does not wait
// for the receiver, like an ncclSend inside a group) and completes once the receiver has taken the
// bytes; its source must not be written until then (executors wait for that before any step that
// writes over it, and before the program ends). A receive blocks until its bytes are in place.
// At most kNetQueueDepth sends per (sender, receiver, channel) may be outstanding; a further send
// waits for the receiver. verify_programs checks a set against exactly these semantics.
inline constexpr int kNetChannels = 2;     // channel 0: all-gather, 1: reduce-scatter
inline constexpr int kNetQueueDepth = 16;  // outstanding sends per (sender, receiver, channel)

struct NetSendOp {
  int peer;
  Address src;  // own window
  std::size_t bytes;
  int channel;
};

struct NetRecvOp {
  int peer;
  Address dst;  // own window
  std::size_t bytes;
  int channel;
};

struct Step {
  Phase phase;
  std::variant<CopyBatch, CastOp, SignalOp, WaitOp, ReduceOp, NetSendOp, NetRecvOp> op;
};

// How a single-node collective hands a rank's bytes to its peers' windows.
enum class Delivery : uint8_t {
  // Copy engines move them, no SM does. All-gather: cast the shard into the own block, then push
  // the block to every peer. Reduce-scatter: push each peer's gradient chunks into its slots. Peer
  // by peer in staggered order, each behind its own slot-free wait. On a CudaExecutor: per peer a
  // push call and a flag call, 2W driver calls at W ranks.
  kPush,
  // SMs store them. The slot-free handshake with every peer comes first. All-gather: one cast
  // writes the shard into the own block and into the same block of every peer's window.
  // Reduce-scatter: the chunks are copied into the peers' slots. Then the data-ready handshake
  // (and the reduce). A CudaExecutor runs everything after the slot-free handshake as one kernel
  // (src/executor/cuda/kernels.cuh, the cast-to-peers kernel) where its peers' kernels can run beside it:
  // 2 driver calls at any W, while SMs move the bytes and spin on the peers' flags. For small
  // buckets.
  kCastToPeers,
};
const char* delivery_name(Delivery delivery);

struct Program {
  Collective collective = Collective::kAllGather;
  int rank = 0;
  int world = 0;
  uint32_t bucket = 0;  // bucket identity, carried by signals for desync detection
  int num_params = 0;
  std::size_t window_bytes = 0;  // the window this program needs, per rank
  std::size_t alignment = 0;     // the window base alignment it needs
  Delivery delivery = Delivery::kPush;  // how it hands bytes to peers (across-node: kPush)
  std::vector<Step> steps;

  // The 32-bit tag every signal of this program carries: bucket and collective.
  uint32_t tag() const { return (bucket << 1) | static_cast<uint32_t>(collective); }
  // Readable listing, one line per step (copy batches summarised per peer).
  std::string to_string() const;
  std::size_t bytes_pushed() const;
};

// Pacing of the network part of across-node plans: every transfer is split into chunks of at most
// chunk_bytes (one send/recv pair each), and a rank has at most max_chunks_in_flight sends to one
// peer outstanding before it receives from it: bytes in flight per step and per peer are bounded by
// chunk_bytes x max_chunks_in_flight. The reduce-scatter's staging ring has ring_depth send buffers
// of one chunk (plus two receive buffers, so that one chunk's transfer overlaps another's reduce).
//
// The 16 MiB default: per-chunk costs (a send/recv group, a copy, a reduce launch) made 1 MiB
// chunks 2.7x stock FSDP2's step time in tide.fsdp across two H200s over NCCL; with 16 MiB its
// collectives took 0.70-0.78x stock's time (three runs; BENCHMARKS.md). Staging is
// (2 + ring_depth) chunks of fp32 (96 MiB per window).
struct AcrossNodesOptions {
  std::size_t chunk_bytes = std::size_t{16} << 20;  // multiple of 16, >= 16
  int max_chunks_in_flight = 4;                    // in [1, kNetQueueDepth]
  int ring_depth = 4;                              // in [1, kNetQueueDepth]
  // Reduce-scatter phase 2 by recursive halving among rail peers instead of the ring (node counts
  // that are powers of two; others use the ring). Same staging bytes: the staging holds one slice
  // of every node's partial, so slices shrink as 1/nodes (log2 nodes steps instead of nodes - 1).
  // Halving exchanges slices pairwise (one send, then one receive), whatever max_chunks_in_flight.
  bool rs_recursive_halving = false;
  // The dtype of the reduce-scatter's partial sums on the wire between nodes: kFP32 (exact: every
  // addition in fp32, as on one node) or kBF16, which is LOSSY: each partial sum is rounded to
  // bf16 before it crosses the network (on the ring N - 1 roundings, N - 2 with one rank per node,
  // whose first send is the raw gradient either way; recursive halving also keeps its running
  // partial in bf16), for half the bytes; each addition stays fp32. Staging stays sized for fp32.
  DType wire_dtype = DType::kFP32;
};

enum class ReduceKind : uint8_t { kSum, kAvg };

struct ReduceOptions {
  ReduceKind kind = ReduceKind::kAvg;
  float prescale = 1.0f;   // applied to every element before the sum (FSDP2's pre-divide factor)
  float postscale = 1.0f;  // applied to the sum (with 1/W for kAvg)
  bool accumulate = false; // += into the existing output instead of overwriting it
};

// Buckets whose window holds at most this many bytes are delivered by kCastToPeers by default
// (both collectives).
// Why 2 MiB: a push call costs the host ~5 µs (BENCHMARKS.md, `tide_bench_cuda calls`); SM stores
// of 2 MiB into peers over NVLink (~400 GB/s out of one GPU) take about as long.
inline constexpr std::size_t kCastToPeersMaxBytes = std::size_t{2} << 20;
// kCastToPeers for a single-node layout of W > 1 ranks whose window is at most
// kCastToPeersMaxBytes, kPush otherwise. A pure function of the layout, so every rank picks the
// same (a set mixing the two deliveries is correct as well: each pair of ranks hands over its
// blocks under the same two flags either way).
Delivery default_delivery(const BucketLayout& layout);

// Rank `rank`'s program for the all-gather of `layout`, delivered as default_delivery(layout)
// says: cast its shard of every param into its own block (zero padding; a strided cast for a param
// sharded on a dim > 0), take the slot-free handshake, push its blocks to the same blocks on every
// peer (2-D copies for dims > 0; peers in staggered order r+1, r+2, ... to spread incoming
// traffic), signal data-ready, wait. With kCastToPeers the handshake comes first and the casts
// write every window's block, own and peers' (no pushes).
Program plan_all_gather(const BucketLayout& layout, int rank, uint32_t bucket = 0);

// Rank `rank`'s program for the reduce-scatter of `layout`'s gradients, delivered as
// default_delivery(layout) says: slot-free handshake (peers must be done with the params before
// their vacated slots take gradient chunks), push chunk q of every gradient into rank q's
// slot(i, rank), signal data-ready, wait, reduce (kCastToPeers: every slot-free wait first, then
// the chunks as one run of copies). Chunk q of a param
// sharded on a dim > 0 is its block q of the gradient, read in place by a 2-D copy and staged
// contiguously; the own block is staged in the own slot(i, rank) the same way, so every reduce
// reads contiguous chunks.
Program plan_reduce_scatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                            uint32_t bucket = 0);

// Across-node versions (layout.topology().nodes > 1; with one node they equal the ones above). They
// take params sharded on dim 0 only (InvalidArgument otherwise).
//
// All-gather: node-local delivery as on one node (copy pushes into local peers' slots), and between
// nodes recursive doubling among rail peers (same local rank): at step k node n exchanges every
// shard gathered so far with node n xor 2^k; with a node count N that is not a power of two, the
// N - P nodes above the largest power of two P first send their shards to node n - P and finally
// receive everything from it. Received shards land in their slots by address and, after each step,
// are forwarded to local peers by copy pushes (which run while the next step is on the network).
//
// Reduce-scatter in two phases: (1) node-local: every rank pushes its gradient chunks destined to
// rail l (ranks m * local + l of every node m) into local rank l's vacated slots; (2) across nodes,
// a ring among rail peers over partial sums, in chunks through a fixed staging ring at the end of
// the window: node n reduces the local slots of a chunk onto the partial it received from node
// n - 1 (one pass, fp32 arithmetic) and sends the sum to node n + 1; after N - 1 steps it holds the full sum
// of its own chunk and writes the output. Partial sums cross the network in net.wire_dtype; with
// one rank per node the first step sends the raw gradient instead (the whole partial: lossless),
// staged by a copy into the own vacated slot. Staging is constant in W (rs_staging_bytes); the
// window of a across-node reduce-scatter program is layout.window_bytes() + rs_staging_bytes().
Program plan_all_gather(const BucketLayout& layout, int rank, uint32_t bucket,
                        const AcrossNodesOptions& net);
// Either version with the delivery chosen by the caller (single node; a across-node plan delivers
// node-locally by kPush, so `delivery` must be kPush there: InvalidArgument otherwise).
Program plan_all_gather(const BucketLayout& layout, int rank, uint32_t bucket,
                        const AcrossNodesOptions& net, Delivery delivery);
Program plan_reduce_scatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                            uint32_t bucket, const AcrossNodesOptions& net);
Program plan_reduce_scatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                            uint32_t bucket, const AcrossNodesOptions& net, Delivery delivery);

// Bytes of reduce-scatter staging per rank beyond the bucket's window (0 on one node, where peers'
// chunks are staged in vacated slots): a fixed ring of fp32 chunks, independent of W.
std::size_t rs_staging_bytes(const BucketLayout& layout, const AcrossNodesOptions& net = {});
// Stock FSDP2's reduce-scatter input: one fp32 full-group buffer, W x sum_i S_i x 4 bytes per rank.
std::size_t stock_rs_buffer_bytes(const BucketLayout& layout);

// Checks a full set of programs (one per rank, same collective) against the layout: every window
// byte the collective must deliver is written exactly once, from the right place (a rank's own
// shard, or chunk q of its gradient for rank q), no two writes overlap, every copy stays inside its
// buffers, every read of a window byte reads something written, casts and reduces cover exactly
// each rank's shard with the params' dtypes, every signal is matched by a wait, and the handshakes
// cannot deadlock. Throws Error naming the first violation. Used by tests and the fuzzer.
void verify_programs(const BucketLayout& layout, const std::vector<Program>& programs);

}  // namespace tide
