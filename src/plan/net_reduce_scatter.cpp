// The across-node reduce-scatter (W = nodes x local), in two phases: node-local accumulation (every
// rank pushes the chunks destined to rail q into local rank q's window), then, between rail peers,
// a chunked ring of partial sums (the default) or recursive halving (an option, power-of-two
// nodes), fp32 or bf16 on the wire, through a fixed staging area after the window's data. See
// plan.hpp and docs/DESIGN.md §2; docs/across_nodes.md says why the ring is the default.
#include <algorithm>
#include <optional>

#include "common/round_up.hpp"
#include "planner_internal.hpp"
#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide {
namespace {

using detail::win;

// One rank's reduce-scatter program under construction, and what its steps are made of.
class NetReduceScatterPlanner {
 public:
  NetReduceScatterPlanner(Program& program, const BucketLayout& layout,
                          const ReduceOptions& options, const AcrossNodesOptions& net)
      : program_(program), params_(layout.params()), options_(options), net_(net),
        t_(layout.topology()), N_(t_.nodes), L_(t_.local), rank_(program.rank),
        n_(t_.node_of(rank_)), l_(t_.local_rank_of(rank_)),
        base_(detail::round_up(layout.window_bytes(), detail::kStagingAlign)),
        chunk_elems_(detail::rs_chunk_elems(layout, net)),
        cb_(detail::round_up(chunk_elems_ * 4, detail::kStagingAlign)),
        R_(base_), R1_(base_ + cb_), wire_(net.wire_dtype), wire_size_(dtype_size(wire_)),
        scale_(options.kind == ReduceKind::kAvg
                   ? options.postscale / static_cast<float>(layout.world())
                   : options.postscale),
        raw_first_(L_ == 1) {}

  // Phase 1: chunks destined to rail q go to local rank q's slot(i, m * L + l), m = every node.
  void add_local_phase();
  // Phase 2, one of the two.
  void add_recursive_halving();
  void add_ring();

 private:
  // Staging: two receive buffers (R, R1), then the send ring S(j).
  std::size_t S(int j) const { return base_ + (2 + j) * cb_; }
  void add_local_reduce(int i, int b, int64_t e0, int64_t cnt, std::optional<std::size_t> received,
                        bool raw, bool final_sum, std::size_t dst = 0);
  std::size_t wire_bytes(int i, int step, int64_t cnt) const {
    return static_cast<std::size_t>(cnt) * (raw_first_ && step == 0 ? params_[i].elem_size : wire_size_);
  }
  void add_send_raw(int i, int b, int64_t e0, int64_t cnt, int to);

  static constexpr int ch = 1;  // the reduce-scatter's network channel
  Program& program_;
  const std::vector<ParamLayout>& params_;
  const ReduceOptions& options_;
  const AcrossNodesOptions& net_;
  const Topology& t_;
  const int N_, L_, rank_, n_, l_;
  const std::size_t base_;
  const int64_t chunk_elems_;
  const std::size_t cb_;
  const std::size_t R_, R1_;
  const DType wire_;  // of partial sums between nodes
  const std::size_t wire_size_;
  const float scale_;
  // With one rank per node the partial a node sends first is its own gradient alone: it goes on
  // the wire as is (lossless, half of fp32's bytes for bf16 gradients, no reduce kernel), staged
  // by a copy engine in the own slot of block b, which is vacated and which no peer writes.
  const bool raw_first_;
  int sent_ = 0;  // ring: sends so far, cycling through the send ring
};

void NetReduceScatterPlanner::add_local_phase() {
  const std::vector<int> locals = detail::local_peers(t_, rank_);
  for (int q : locals) program_.steps.push_back({Phase::kSlotFree, SignalOp{q, FlagKind::kSlotFree}});
  for (int q : locals) {
    const int lq = t_.local_rank_of(q);
    program_.steps.push_back({Phase::kSlotFree, WaitOp{q, FlagKind::kSlotFree}});
    CopyBatch batch;
    for (int m = 0; m < N_; ++m)
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const ParamLayout& p = params_[i];
        const int dest = m * L_ + lq;
        const int64_t cnt = p.valid_numel(dest);
        if (cnt == 0) continue;
        batch.copies.push_back({win(q, p.slot_offset(m * L_ + l_)),
                                {Space::kInput, static_cast<int>(i), dest * p.slot_bytes()},
                                static_cast<std::size_t>(cnt) * p.elem_size});
      }
    if (!batch.copies.empty()) program_.steps.push_back({Phase::kPush, std::move(batch)});
    program_.steps.push_back({Phase::kDataReady, SignalOp{q, FlagKind::kDataReady}});
  }
  for (int q : locals) program_.steps.push_back({Phase::kDataReady, WaitOp{q, FlagKind::kDataReady}});
}

// The node's chunks [e0, e0 + cnt) of block b (the own gradient and the local ranks' slots), in
// local rank order, added onto what another node sent (`received`: a partial sum in the wire
// dtype, or with `raw` that node's gradient in its own dtype, then the first source, so the sum
// runs in the same order and is bitwise the same), into a staging buffer in the wire dtype or,
// for the final sum, the output.
void NetReduceScatterPlanner::add_local_reduce(int i, int b, int64_t e0, int64_t cnt,
                                               std::optional<std::size_t> received, bool raw,
                                               bool final_sum, std::size_t dst) {
  const ParamLayout& p = params_[i];
  const Address out = final_sum ? Address{Space::kOutput, i, static_cast<std::size_t>(e0) * dtype_size(p.shard_dtype)}
                                : win(rank_, dst);
  ReduceOp op{i, {}, out, cnt, p.dtype, final_sum ? p.shard_dtype : wire_, options_.prescale,
              final_sum ? scale_ : 1.0f, final_sum && options_.accumulate};
  if (received && raw) op.sources.push_back(win(rank_, *received));
  for (int q = 0; q < L_; ++q)
    op.sources.push_back(q == l_ ? Address{Space::kInput, i, (b * L_ + l_) * p.slot_bytes() + e0 * p.elem_size}
                                 : win(rank_, p.slot_offset(b * L_ + q) + e0 * p.elem_size));
  if (received && !raw) op.partial = win(rank_, *received), op.partial_dtype = wire_;
  program_.steps.push_back({Phase::kReduce, std::move(op)});
}

void NetReduceScatterPlanner::add_send_raw(int i, int b, int64_t e0, int64_t cnt, int to) {
  const ParamLayout& p = params_[i];
  const int dest = b * L_ + l_;  // = b: only with one rank per node
  const Address slot = win(rank_, p.slot_offset(dest) + e0 * p.elem_size);
  const std::size_t bytes = wire_bytes(i, 0, cnt);
  program_.steps.push_back(
      {Phase::kPush, CopyBatch{{{slot, {Space::kInput, i, dest * p.slot_bytes() + e0 * p.elem_size}, bytes}}}});
  program_.steps.push_back({Phase::kPush, NetSendOp{to, slot, bytes, ch}});
}

// Recursive halving per slice: a slice holds elements [e0, e0 + ce) of every block, one staging
// slot per block (ce shrinks as 1/N so the staging stays (2 + ring_depth) chunks). At step k
// (distance d = N >> (k + 1)) node n keeps the blocks whose bit d matches its own and sends the
// others' partial sums to node n ^ d; after log2 N steps it holds its own block's full sum.
void NetReduceScatterPlanner::add_recursive_halving() {
  const int N = N_, L = L_, n = n_, l = l_, rank = rank_;
  const std::size_t acc_base = S(0);
  const int64_t ce = std::max<int64_t>(
      1, std::min<int64_t>(static_cast<int64_t>(cb_ / 4),
                           static_cast<int64_t>(net_.ring_depth * cb_ / 4) / N));
  const std::size_t slot_stride = static_cast<std::size_t>(ce) * 4;
  auto acc = [&](int b) { return acc_base + b * slot_stride; };
  for (std::size_t ii = 0; ii < params_.size(); ++ii) {
    const int i = static_cast<int>(ii);
    const ParamLayout& p = params_[ii];
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
          if (step == 0 && raw_first_) return add_send_raw(i, b, e0, count_for(b), partner);
          if (step == 0) add_local_reduce(i, b, e0, count_for(b), std::nullopt, false, false, acc(b));
          program_.steps.push_back({Phase::kPush, NetSendOp{partner, win(rank, acc(b)),
                                                            wire_bytes(i, step, count_for(b)), ch}});
        };
        auto do_recv = [&](int b) {
          const int64_t cnt = count_for(b);
          program_.steps.push_back({Phase::kPush, NetRecvOp{partner, win(rank, R_), wire_bytes(i, step, cnt), ch}});
          if (step == 0) {  // the local chunks onto what the partner sent, in one pass
            add_local_reduce(i, b, e0, cnt, R_, raw_first_, last, acc(b));
            return;
          }
          const Address dst = last ? Address{Space::kOutput, i,
                                             static_cast<std::size_t>(e0) * dtype_size(p.shard_dtype)}
                                   : win(rank, acc(b));
          program_.steps.push_back(
              {Phase::kReduce, ReduceOp{i, {win(rank, acc(b)), win(rank, R_)}, dst, cnt, wire_,
                                        last ? p.shard_dtype : wire_, 1.0f,
                                        last ? scale_ : 1.0f, last && options_.accumulate}});
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
}

// The ring runs two lanes, each with a receive buffer, taking alternate chunks. A lane runs a
// chunk's N steps one per round and starts its next chunk in the round of the last step, right
// after the final reduce has read the buffer. The lanes interleave round by round, so one lane's
// transfer is in flight while the other lane's chunk is reduced (the compute stream waits only for
// the group whose bytes it reads), and a lane's next chunk starts as soon as its own buffer is
// free, not when the other lane's chunk is done too. As in a one-chunk ring, a send and the
// receive of the same chunk's next step are one run of network ops: the next node's matching group
// has the same shape, which NCCL's group semantics need (group_schedule.hpp).
void NetReduceScatterPlanner::add_ring() {
  const int N = N_, L = L_, n = n_, l = l_, rank = rank_;
  // Block b = the chunk destined to rank b * L + l.
  const int next = ((n + 1) % N) * L + l, prev = ((n + N - 1) % N) * L + l;
  struct Chunk {
    int i;
    int64_t e0;
  };
  std::vector<Chunk> chunks;
  for (std::size_t ii = 0; ii < params_.size(); ++ii)
    for (int64_t e0 = 0; e0 < params_[ii].shard_numel; e0 += chunk_elems_)
      chunks.push_back({static_cast<int>(ii), e0});
  auto block_at = [&](int step) { return ((n - step - 1) % N + N) % N; };
  auto count_for = [&](const Chunk& c, int step) {
    return std::clamp<int64_t>(params_[c.i].valid_numel(block_at(step) * L + l) - c.e0, 0, chunk_elems_);
  };
  const std::size_t receive_buffer[2] = {R_, R1_};
  // Chunk c at ring step `step`, in lane c % 2.
  auto ring_step = [&](std::size_t ci, int step) {
    const Chunk& c = chunks[ci];
    const std::size_t rb = receive_buffer[ci % 2];
    const int b = block_at(step);
    const int64_t cnt = count_for(c, step);
    const bool raw = raw_first_ && step == 1;  // what arrived was the previous node's gradient
    if (cnt > 0 && step == 0 && raw_first_) {  // own gradient, straight to the next node
      add_send_raw(c.i, b, c.e0, cnt, next);
    } else if (cnt > 0 && step < N - 1) {  // own partial (onto the received one), to the next node
      const std::size_t s = S(sent_++ % net_.ring_depth);
      add_local_reduce(c.i, b, c.e0, cnt, step == 0 ? std::nullopt : std::optional<std::size_t>(rb),
                       raw, false, s);
      program_.steps.push_back({Phase::kPush, NetSendOp{next, win(rank, s), wire_bytes(c.i, step, cnt), ch}});
    } else if (cnt > 0) {  // the last step: the full sum of the own block, into the output
      add_local_reduce(c.i, b, c.e0, cnt, rb, raw, true);
    }
    const int64_t next_cnt = step + 1 < N ? count_for(c, step + 1) : 0;
    if (next_cnt > 0)
      program_.steps.push_back({Phase::kPush, NetRecvOp{prev, win(rank, rb), wire_bytes(c.i, step, next_cnt), ch}});
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
}

}  // namespace

Program plan_reduce_scatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                            uint32_t bucket, const AcrossNodesOptions& net) {
  return plan_reduce_scatter(layout, rank, options, bucket, net, default_delivery(layout));
}

Program plan_reduce_scatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                            uint32_t bucket, const AcrossNodesOptions& net, Delivery delivery) {
  const Topology& t = layout.topology();
  detail::check_delivery(layout, delivery, "plan_reduce_scatter");
  if (t.nodes <= 1)
    return detail::plan_reduce_scatter_one_node(layout, rank, options, bucket, delivery);
  detail::check_net(net, "plan_reduce_scatter");
  detail::check_dim0_sharding(layout, "plan_reduce_scatter");
  detail::check_reduce_options(layout, options);
  Program program =
      detail::empty_program(Collective::kReduceScatter, layout, rank, bucket, "plan_reduce_scatter");
  program.window_bytes = detail::round_up(layout.window_bytes(), detail::kStagingAlign) +
                         rs_staging_bytes(layout, net);
  NetReduceScatterPlanner planner(program, layout, options, net);
  planner.add_local_phase();
  if (net.rs_recursive_halving && (t.nodes & (t.nodes - 1)) == 0)
    planner.add_recursive_halving();
  else
    planner.add_ring();
  return program;
}

}  // namespace tide
