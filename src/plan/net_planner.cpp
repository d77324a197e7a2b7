// Across-node plans (W = nodes x local): the paced recursive-doubling all-gather between rail peers,
// the staging the reduce-scatter needs, and what both share; the two-phase reduce-scatter itself is
// net_reduce_scatter.cpp. See plan.hpp and docs/DESIGN.md §2.
#include <algorithm>
#include <cmath>

#include "tide/error.hpp"
#include "tide/plan.hpp"
#include "common/round_up.hpp"
#include "planner_internal.hpp"

namespace tide {
namespace {

using detail::kStagingAlign;
using detail::round_up;
using detail::win;

}  // namespace

void detail::check_net(const AcrossNodesOptions& net, const char* where) {
  TIDE_CHECK_ARG(net.chunk_bytes >= 16 && net.chunk_bytes % 16 == 0 &&
                     net.chunk_bytes <= BucketLayout::kMaxWindowBytes,
                 where, "net.chunk_bytes", net.chunk_bytes, "a multiple of 16 in [16, 2^48]");
  TIDE_CHECK_ARG(net.max_chunks_in_flight >= 1 && net.max_chunks_in_flight <= kNetQueueDepth, where,
                 "net.max_chunks_in_flight", net.max_chunks_in_flight,
                 detail::concat("in [1, ", kNetQueueDepth, "]"));
  TIDE_CHECK_ARG(net.ring_depth >= 1 && net.ring_depth <= kNetQueueDepth, where, "net.ring_depth",
                 net.ring_depth, detail::concat("in [1, ", kNetQueueDepth, "]"));
  TIDE_CHECK_ARG(net.wire_dtype == DType::kFP32 || net.wire_dtype == DType::kBF16, where,
                 "net.wire_dtype", static_cast<int>(net.wire_dtype), "fp32 or bf16");
}

std::vector<int> detail::local_peers(const Topology& t, int rank) {
  std::vector<int> peers;
  const int node = t.node_of(rank), l = t.local_rank_of(rank);
  for (int k = 1; k < t.local; ++k) peers.push_back(node * t.local + (l + k) % t.local);
  return peers;
}

namespace {

using detail::check_net;
using detail::local_peers;

// A contiguous piece of the window: (offset, bytes).
struct Piece {
  std::size_t offset, bytes;
};

// The window pieces holding the all-gather shards of rail-l nodes `nodes`, cut into chunks of at
// most chunk_bytes (a chunk never spans two slots), in node then param order.
std::vector<Piece> rail_chunks(const BucketLayout& layout, int l, const std::vector<int>& nodes,
                               std::size_t chunk_bytes) {
  std::vector<Piece> out;
  const int L = layout.topology().local;
  for (int m : nodes)
    for (const ParamLayout& p : layout.params())
      for (std::size_t at = 0; at < p.slot_bytes(); at += chunk_bytes)
        out.push_back({p.slot_offset(m * L + l) + at, std::min(chunk_bytes, p.slot_bytes() - at)});
  return out;
}

// Paced exchange with `peer`: post up to `in_flight` sends, then one receive per further send.
void add_exchange(Program& program, int peer, const std::vector<Piece>& sends,
                  const std::vector<Piece>& recvs, int in_flight, int channel) {
  const int rank = program.rank;
  std::size_t s = 0, r = 0;
  for (; s < sends.size() && s < static_cast<std::size_t>(in_flight); ++s)
    program.steps.push_back(
        {Phase::kPush, NetSendOp{peer, win(rank, sends[s].offset), sends[s].bytes, channel}});
  for (; r < recvs.size(); ++r) {
    program.steps.push_back(
        {Phase::kPush, NetRecvOp{peer, win(rank, recvs[r].offset), recvs[r].bytes, channel}});
    if (s < sends.size()) {
      program.steps.push_back(
          {Phase::kPush, NetSendOp{peer, win(rank, sends[s].offset), sends[s].bytes, channel}});
      ++s;
    }
  }
  for (; s < sends.size(); ++s)
    program.steps.push_back(
        {Phase::kPush, NetSendOp{peer, win(rank, sends[s].offset), sends[s].bytes, channel}});
}

}  // namespace

int64_t detail::rs_chunk_elems(const BucketLayout& layout, const AcrossNodesOptions& net) {
  int64_t max_shard = 1;
  for (const ParamLayout& p : layout.params()) max_shard = std::max(max_shard, p.shard_numel);
  return std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(net.chunk_bytes / 4), max_shard));
}

std::size_t rs_staging_bytes(const BucketLayout& layout, const AcrossNodesOptions& net) {
  check_net(net, "rs_staging_bytes");
  if (layout.topology().nodes <= 1) return 0;
  const std::size_t chunk = round_up(detail::rs_chunk_elems(layout, net) * 4, kStagingAlign);
  const std::size_t ring = static_cast<std::size_t>(net.ring_depth) * chunk;
  // Recursive halving keeps one fp32 slice (>= 1 element) per node in the ring's place.
  const int N = layout.topology().nodes;
  const bool halving = net.rs_recursive_halving && (N & (N - 1)) == 0;
  return 2 * chunk + (halving ? std::max(ring, round_up(std::size_t(N) * 4, kStagingAlign)) : ring);
}

std::size_t stock_rs_buffer_bytes(const BucketLayout& layout) {
  std::size_t total = 0;
  for (const ParamLayout& p : layout.params()) total += static_cast<std::size_t>(p.shard_numel) * 4;
  return total * layout.world();
}

Program plan_all_gather(const BucketLayout& layout, int rank, uint32_t bucket,
                        const AcrossNodesOptions& net) {
  return plan_all_gather(layout, rank, bucket, net, default_delivery(layout));
}

Program plan_all_gather(const BucketLayout& layout, int rank, uint32_t bucket,
                        const AcrossNodesOptions& net, Delivery delivery) {
  const Topology& t = layout.topology();
  detail::check_delivery(layout, delivery, "plan_all_gather");
  if (t.nodes <= 1) return detail::plan_all_gather_one_node(layout, rank, bucket, delivery);
  check_net(net, "plan_all_gather");
  detail::check_dim0_sharding(layout, "plan_all_gather");
  Program program = detail::empty_program(Collective::kAllGather, layout, rank, bucket, "plan_all_gather");
  const auto& params = layout.params();
  const int N = t.nodes, L = t.local, n = t.node_of(rank), l = t.local_rank_of(rank);
  detail::add_cast_in(program, layout);
  const std::vector<int> locals = local_peers(t, rank);
  for (int q : locals) program.steps.push_back({Phase::kSlotFree, SignalOp{q, FlagKind::kSlotFree}});
  // Own shards to local peers first (their data-ready signal follows the forwarded shards).
  for (int q : locals) {
    program.steps.push_back({Phase::kSlotFree, WaitOp{q, FlagKind::kSlotFree}});
    CopyBatch batch;
    for (const ParamLayout& p : params)
      batch.copies.push_back({win(q, p.slot_offset(rank)), win(rank, p.slot_offset(rank)), p.slot_bytes()});
    program.steps.push_back({Phase::kPush, std::move(batch)});
  }
  // Recursive doubling among rail peers, folding the nodes above the largest power of two P.
  int P = 1;
  while (P * 2 <= N) P *= 2;
  const int c = 0;  // channel
  auto peer_of = [&](int m) { return m * L + l; };
  auto group = [&](int base, int size) {  // core nodes [base, base + size) and their extras
    std::vector<int> nodes;
    for (int m = base; m < base + size; ++m) nodes.push_back(m);
    for (int m = base; m < base + size; ++m)
      if (m + P < N) nodes.push_back(m + P);
    return nodes;
  };
  const std::size_t cb = net.chunk_bytes;
  const int in_flight = net.max_chunks_in_flight;
  // Forwards the rail shards of `nodes`, just received, to every local peer (copy pushes that run
  // while the next network step is in flight); the data-ready signals come after the last one.
  auto forward = [&](const std::vector<int>& nodes) {
    for (int q : locals) {
      CopyBatch batch;
      for (int m : nodes)
        for (const ParamLayout& p : params)
          batch.copies.push_back({win(q, p.slot_offset(peer_of(m))),
                                  win(rank, p.slot_offset(peer_of(m))), p.slot_bytes()});
      if (!batch.copies.empty()) program.steps.push_back({Phase::kPush, std::move(batch)});
    }
  };
  if (n >= P) {
    const int partner = n - P;
    for (const Piece& s : rail_chunks(layout, l, {n}, cb))
      program.steps.push_back({Phase::kPush, NetSendOp{peer_of(partner), win(rank, s.offset), s.bytes, c}});
    std::vector<int> others;
    for (int m = 0; m < N; ++m)
      if (m != n) others.push_back(m);
    for (const Piece& r : rail_chunks(layout, l, others, cb))
      program.steps.push_back({Phase::kPush, NetRecvOp{peer_of(partner), win(rank, r.offset), r.bytes, c}});
    forward(others);
  } else {
    if (n + P < N) {
      for (const Piece& r : rail_chunks(layout, l, {n + P}, cb))
        program.steps.push_back({Phase::kPush, NetRecvOp{peer_of(n + P), win(rank, r.offset), r.bytes, c}});
      forward({n + P});
    }
    for (int size = 1; size < P; size *= 2) {
      const int partner = n ^ size;
      const std::vector<int> theirs = group(partner / size * size, size);
      add_exchange(program, peer_of(partner), rail_chunks(layout, l, group(n / size * size, size), cb),
                   rail_chunks(layout, l, theirs, cb), in_flight, c);
      forward(theirs);
    }
    if (n + P < N) {
      std::vector<int> others;
      for (int m = 0; m < N; ++m)
        if (m != n + P) others.push_back(m);
      for (const Piece& s : rail_chunks(layout, l, others, cb))
        program.steps.push_back({Phase::kPush, NetSendOp{peer_of(n + P), win(rank, s.offset), s.bytes, c}});
    }
  }
  for (int q : locals) program.steps.push_back({Phase::kDataReady, SignalOp{q, FlagKind::kDataReady}});
  for (int q : locals) program.steps.push_back({Phase::kDataReady, WaitOp{q, FlagKind::kDataReady}});
  return program;
}

}  // namespace tide
