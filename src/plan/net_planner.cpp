// Multi-node plans (W = nodes x local): paced recursive-doubling all-gather between rail peers and
// the two-phase reduce-scatter (node-local accumulation, then a chunked ring of partial sums, fp32
// or bf16 on the wire, through a fixed staging ring). See plan.hpp and DESIGN.md §2.
#include <algorithm>
#include <cmath>

#include "tide/error.hpp"
#include "tide/plan.hpp"
#include "planner_internal.hpp"

namespace tide {
namespace {

constexpr std::size_t kStagingAlign = 256;

std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }

Address win(int rank, std::size_t offset) { return {Space::kWindow, rank, offset}; }

void check_net(const NetOptions& net, const char* where) {
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

// Local peers of `rank` on its node, staggered (local + 1, local + 2, ...).
std::vector<int> local_peers(const Topology& t, int rank) {
  std::vector<int> peers;
  const int node = t.node_of(rank), l = t.local_rank_of(rank);
  for (int k = 1; k < t.local; ++k) peers.push_back(node * t.local + (l + k) % t.local);
  return peers;
}

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

// Elements of one staging chunk (sized for fp32 whatever the wire dtype), and its bytes in the
// window (rounded up to 256 B).
int64_t rs_chunk_elems(const BucketLayout& layout, const NetOptions& net) {
  int64_t max_shard = 1;
  for (const ParamLayout& p : layout.params()) max_shard = std::max(max_shard, p.shard_numel);
  return std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(net.chunk_bytes / 4), max_shard));
}

}  // namespace

std::size_t rs_staging_bytes(const BucketLayout& layout, const NetOptions& net) {
  check_net(net, "rs_staging_bytes");
  if (layout.topology().nodes <= 1) return 0;
  const std::size_t chunk = round_up(rs_chunk_elems(layout, net) * 4, kStagingAlign);
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
                        const NetOptions& net) {
  const Topology& t = layout.topology();
  if (t.nodes <= 1) return detail::plan_all_gather_one_node(layout, rank, bucket);
  check_net(net, "plan_all_gather");
  Program program = detail::empty_program(Collective::kAllGather, layout, rank, bucket, "plan_all_gather");
  const auto& params = layout.params();
  const int N = t.nodes, L = t.local, n = t.node_of(rank), l = t.local_rank_of(rank);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamLayout& p = params[i];
    const int64_t valid = p.valid_numel(rank);
    program.steps.push_back({Phase::kCastIn, CastOp{win(rank, p.slot_offset(rank)),
                                                   {Space::kInput, static_cast<int>(i), 0}, valid,
                                                   p.shard_numel - valid, p.shard_dtype, p.dtype}});
  }
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

Program plan_reduce_scatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                            uint32_t bucket, const NetOptions& net) {
  const Topology& t = layout.topology();
  if (t.nodes <= 1) return detail::plan_reduce_scatter_one_node(layout, rank, options, bucket);
  check_net(net, "plan_reduce_scatter");
  detail::check_reduce_options(layout, options);
  Program program =
      detail::empty_program(Collective::kReduceScatter, layout, rank, bucket, "plan_reduce_scatter");
  const auto& params = layout.params();
  const int N = t.nodes, L = t.local, n = t.node_of(rank), l = t.local_rank_of(rank);
  const std::size_t base = round_up(layout.window_bytes(), kStagingAlign);
  program.window_bytes = base + rs_staging_bytes(layout, net);
  const int64_t chunk_elems = rs_chunk_elems(layout, net);
  const std::size_t cb = round_up(chunk_elems * 4, kStagingAlign);
  // Staging: two receive buffers (R, R1), then the send ring S(j).
  const std::size_t R = base, R1 = base + cb;
  auto S = [&](int j) { return base + (2 + j) * cb; };

  // Phase 1: chunks destined to rail q go to local rank q's slot(i, m * L + l), m = every node.
  const std::vector<int> locals = local_peers(t, rank);
  for (int q : locals) program.steps.push_back({Phase::kSlotFree, SignalOp{q, FlagKind::kSlotFree}});
  for (int q : locals) {
    const int lq = t.local_rank_of(q);
    program.steps.push_back({Phase::kSlotFree, WaitOp{q, FlagKind::kSlotFree}});
    CopyBatch batch;
    for (int m = 0; m < N; ++m)
      for (std::size_t i = 0; i < params.size(); ++i) {
        const ParamLayout& p = params[i];
        const int dest = m * L + lq;
        const int64_t cnt = p.valid_numel(dest);
        if (cnt == 0) continue;
        batch.copies.push_back({win(q, p.slot_offset(m * L + l)),
                                {Space::kInput, static_cast<int>(i), dest * p.slot_bytes()},
                                static_cast<std::size_t>(cnt) * p.elem_size});
      }
    if (!batch.copies.empty()) program.steps.push_back({Phase::kPush, std::move(batch)});
    program.steps.push_back({Phase::kDataReady, SignalOp{q, FlagKind::kDataReady}});
  }
  for (int q : locals) program.steps.push_back({Phase::kDataReady, WaitOp{q, FlagKind::kDataReady}});

  // Phase 2: ring over rail peers, chunk by chunk. Block b = the chunk destined to rank b * L + l.
  const int next = ((n + 1) % N) * L + l, prev = ((n + N - 1) % N) * L + l;
  const int ch = 1;
  const DType wire = net.wire_dtype;  // of partial sums between nodes
  const std::size_t wire_size = dtype_size(wire);
  const float scale = options.kind == ReduceKind::kAvg
                          ? options.postscale / static_cast<float>(layout.world())
                          : options.postscale;
  // The node's chunks [e0, e0 + cnt) of block b (the own gradient and the local ranks' slots), in
  // local rank order, added onto what another node sent (`received`: a partial sum in the wire
  // dtype, or with `raw` that node's gradient in its own dtype, then the first source, so the sum
  // runs in the same order and is bitwise the same), into a staging buffer in the wire dtype or,
  // for the final sum, the output.
  auto local_reduce = [&](int i, int b, int64_t e0, int64_t cnt, std::optional<std::size_t> received,
                          bool raw, bool final_sum, std::size_t dst = 0) {
    const ParamLayout& p = params[i];
    const Address out = final_sum ? Address{Space::kOutput, i, static_cast<std::size_t>(e0) * dtype_size(p.shard_dtype)}
                                  : win(rank, dst);
    ReduceOp op{i, {}, out, cnt, p.dtype, final_sum ? p.shard_dtype : wire, options.prescale,
                final_sum ? scale : 1.0f, final_sum && options.accumulate};
    if (received && raw) op.sources.push_back(win(rank, *received));
    for (int q = 0; q < L; ++q)
      op.sources.push_back(q == l ? Address{Space::kInput, i, (b * L + l) * p.slot_bytes() + e0 * p.elem_size}
                                  : win(rank, p.slot_offset(b * L + q) + e0 * p.elem_size));
    if (received && !raw) op.partial = win(rank, *received), op.partial_dtype = wire;
    program.steps.push_back({Phase::kReduce, std::move(op)});
  };
  // With one rank per node the partial a node sends first is its own gradient alone: it goes on
  // the wire as is (lossless, half of fp32's bytes for bf16 gradients, no reduce kernel), staged
  // by a copy engine in the own slot of block b, which is vacated and which no peer writes.
  const bool raw_first = L == 1;
  auto wire_bytes = [&](int i, int step, int64_t cnt) {
    return static_cast<std::size_t>(cnt) * (raw_first && step == 0 ? params[i].elem_size : wire_size);
  };
  auto send_raw = [&](int i, int b, int64_t e0, int64_t cnt, int to) {
    const ParamLayout& p = params[i];
    const int dest = b * L + l;  // = b: only with one rank per node
    const Address slot = win(rank, p.slot_offset(dest) + e0 * p.elem_size);
    const std::size_t bytes = wire_bytes(i, 0, cnt);
    program.steps.push_back(
        {Phase::kPush, CopyBatch{{{slot, {Space::kInput, i, dest * p.slot_bytes() + e0 * p.elem_size}, bytes}}}});
    program.steps.push_back({Phase::kPush, NetSendOp{to, slot, bytes, ch}});
  };
  int sent = 0;
  if (net.rs_recursive_halving && (N & (N - 1)) == 0) {
    // Recursive halving per slice: a slice holds elements [e0, e0 + ce) of every block, one staging
    // slot per block (ce shrinks as 1/N so the staging stays (2 + ring_depth) chunks). At step k
    // (distance d = N >> (k + 1)) node n keeps the blocks whose bit d matches its own and sends the
    // others' partial sums to node n ^ d; after log2 N steps it holds its own block's full sum.
    const std::size_t acc_base = S(0);
    const int64_t ce = std::max<int64_t>(
        1, std::min<int64_t>(static_cast<int64_t>(cb / 4),
                             static_cast<int64_t>(net.ring_depth * cb / 4) / N));
    const std::size_t slot_stride = static_cast<std::size_t>(ce) * 4;
    auto acc = [&](int b) { return acc_base + b * slot_stride; };
    for (std::size_t ii = 0; ii < params.size(); ++ii) {
      const int i = static_cast<int>(ii);
      const ParamLayout& p = params[ii];
      for (int64_t e0 = 0; e0 < p.shard_numel; e0 += ce) {
        auto count_for = [&](int b) {
          return std::clamp<int64_t>(p.valid_numel(b * L + l) - e0, 0, ce);
        };
        std::vector<int> current;
        for (int b = 0; b < N; ++b) current.push_back(b);
        for (int d = N / 2, step = 0; d >= 1; d /= 2, ++step) {
          const int partner = (n ^ d) * L + l;
          const bool last = d == 1;
          std::vector<int> send, keep;
          for (int b : current)
            if (count_for(b) > 0) ((b & d) == (n & d) ? keep : send).push_back(b);
          auto do_send = [&](int b) {
            if (step == 0 && raw_first) return send_raw(i, b, e0, count_for(b), partner);
            if (step == 0) local_reduce(i, b, e0, count_for(b), std::nullopt, false, false, acc(b));
            program.steps.push_back({Phase::kPush, NetSendOp{partner, win(rank, acc(b)),
                                                             wire_bytes(i, step, count_for(b)), ch}});
          };
          auto do_recv = [&](int b) {
            const int64_t cnt = count_for(b);
            program.steps.push_back({Phase::kPush, NetRecvOp{partner, win(rank, R), wire_bytes(i, step, cnt), ch}});
            if (step == 0) {  // the local chunks onto what the partner sent, in one pass
              local_reduce(i, b, e0, cnt, R, raw_first, last, acc(b));
              return;
            }
            const Address dst = last ? Address{Space::kOutput, i,
                                               static_cast<std::size_t>(e0) * dtype_size(p.shard_dtype)}
                                     : win(rank, acc(b));
            program.steps.push_back(
                {Phase::kReduce, ReduceOp{i, {win(rank, acc(b)), win(rank, R)}, dst, cnt, wire,
                                          last ? p.shard_dtype : wire, 1.0f,
                                          last ? scale : 1.0f, last && options.accumulate}});
          };
          // Pairwise (send k, receive k): the partner mirrors it, so each pair is one exchange
          // under group semantics too (NCCL; see executor/net/group_schedule.hpp).
          for (std::size_t k = 0; k < std::max(send.size(), keep.size()); ++k) {
            if (k < send.size()) do_send(send[k]);
            if (k < keep.size()) do_recv(keep[k]);
          }
          std::vector<int> next_current;
          for (int b : current)
            if ((b & d) == (n & d)) next_current.push_back(b);
          current = std::move(next_current);
        }
      }
    }
    return program;
  }
  // The ring runs two lanes, each with a receive buffer, taking alternate chunks. A lane runs a
  // chunk's N steps one per round and starts its next chunk in the round of the last step, right
  // after the final reduce has read the buffer. The lanes interleave round by round, so one
  // lane's transfer is in flight while the other lane's chunk is reduced (the compute stream
  // waits only for the group whose bytes it reads), and a lane's next chunk starts as soon as its
  // own buffer is free, not when the other lane's chunk is done too. As in a one-chunk ring, a send and the receive of the
  // same chunk's next step are one run of network ops: the next node's matching group has the
  // same shape, which NCCL's group semantics need (group_schedule.hpp).
  struct Chunk {
    int i;
    int64_t e0;
  };
  std::vector<Chunk> chunks;
  for (std::size_t ii = 0; ii < params.size(); ++ii)
    for (int64_t e0 = 0; e0 < params[ii].shard_numel; e0 += chunk_elems)
      chunks.push_back({static_cast<int>(ii), e0});
  auto block_at = [&](int step) { return ((n - step - 1) % N + N) % N; };
  auto count_for = [&](const Chunk& c, int step) {
    return std::clamp<int64_t>(params[c.i].valid_numel(block_at(step) * L + l) - c.e0, 0, chunk_elems);
  };
  const std::size_t receive_buffer[2] = {R, R1};
  // Chunk c at ring step `step`, in lane c % 2.
  auto ring_step = [&](std::size_t ci, int step) {
    const Chunk& c = chunks[ci];
    const std::size_t rb = receive_buffer[ci % 2];
    const int b = block_at(step);
    const int64_t cnt = count_for(c, step);
    const bool raw = raw_first && step == 1;  // what arrived was the previous node's gradient
    if (cnt > 0 && step == 0 && raw_first) {  // own gradient, straight to the next node
      send_raw(c.i, b, c.e0, cnt, next);
    } else if (cnt > 0 && step < N - 1) {  // own partial (onto the received one), to the next node
      const std::size_t s = S(sent++ % net.ring_depth);
      local_reduce(c.i, b, c.e0, cnt, step == 0 ? std::nullopt : std::optional<std::size_t>(rb), raw,
                   false, s);
      program.steps.push_back({Phase::kPush, NetSendOp{next, win(rank, s), wire_bytes(c.i, step, cnt), ch}});
    } else if (cnt > 0) {  // the last step: the full sum of the own block, into the output
      local_reduce(c.i, b, c.e0, cnt, rb, raw, true);
    }
    const int64_t next_cnt = step + 1 < N ? count_for(c, step + 1) : 0;
    if (next_cnt > 0)
      program.steps.push_back({Phase::kPush, NetRecvOp{prev, win(rank, rb), wire_bytes(c.i, step, next_cnt), ch}});
  };
  // Lane k's j-th chunk (chunks[2 j + k]) takes step s in round j (N - 1) + s; in a round, the
  // lane's chunk that finishes (and frees the receive buffer) goes before the one that starts.
  const std::size_t span = N - 1, per_lane = (chunks.size() + 1) / 2;
  const std::size_t rounds = per_lane == 0 ? 0 : (per_lane - 1) * span + N;
  for (std::size_t round = 0; round < rounds; ++round) {
    const std::size_t last_j = round / span;
    const std::size_t first_j = round % span == 0 && last_j > 0 ? last_j - 1 : last_j;
    for (std::size_t k = 0; k < 2; ++k)
      for (std::size_t j = first_j; j <= last_j; ++j)
        if (2 * j + k < chunks.size()) ring_step(2 * j + k, static_cast<int>(round - j * span));
  }
  return program;
}

}  // namespace tide
