// Across-node plans (W = nodes x local, virtual nodes): paced recursive-doubling all-gather and the
// two-phase reduce-scatter, checked statically by verify_programs over random buckets; the verifier
// rejects broken sets; reduce-scatter staging is constant in W at fixed per-rank output.
#include <gtest/gtest.h>

#include <random>

#include "test_util.hpp"

namespace tide {
namespace {

const Topology kTopologies[] = {{2, 4}, {4, 2}, {8, 1}, {3, 2}, {3, 4}, {5, 1}, {6, 2}, {2, 1}};

std::vector<Program> plans(const BucketLayout& layout, Collective c, const AcrossNodesOptions& net,
                           const ReduceOptions& o = {}) {
  std::vector<Program> out;
  for (int r = 0; r < layout.world(); ++r)
    out.push_back(c == Collective::kAllGather ? plan_all_gather(layout, r, 7, net)
                                              : plan_reduce_scatter(layout, r, o, 7, net));
  return out;
}

TEST(MultinodePlan, VerifiesRandomBucketsOnEveryTopology) {
  std::mt19937_64 rng(2026);
  const AcrossNodesOptions nets[] = {{},           {256, 1, 1},       {64, 2, 3},       {1024, 16, 16},
                             {64, 2, 3, true}, {256, 1, 1, true},  // RS by recursive halving
                             {64, 2, 2, false, DType::kBF16}, {128, 2, 2, true, DType::kBF16}};
  int checked = 0;
  for (const Topology& t : kTopologies)
    for (int iter = 0; iter < 40; ++iter) {
      BucketLayout layout(test::random_specs(rng, t.world(), 4, 1 << 12), t);
      const AcrossNodesOptions& net = nets[iter % 8];
      for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
        const auto set = plans(layout, c, net);
        ASSERT_NO_THROW(verify_programs(layout, set))
            << t.nodes << "x" << t.local << " " << collective_name(c) << "\n" << layout.describe();
        ++checked;
      }
    }
  EXPECT_EQ(checked, 8 * 40 * 2);
}

TEST(MultinodePlan, AllGatherShape) {
  BucketLayout layout({{"w", {48, 8}}, {"b", {8}}}, Topology{3, 2});
  const AcrossNodesOptions net{64, 2, 2};
  const Program p = plan_all_gather(layout, 0, 1, net);
  const std::string s = p.to_string();
  EXPECT_NE(s.find("net send"), std::string::npos) << s;
  EXPECT_NE(s.find("net recv"), std::string::npos) << s;
  std::size_t max_chunk = 0;
  int sends = 0, recvs = 0;
  for (const Step& step : p.steps) {
    if (const auto* x = std::get_if<NetSendOp>(&step.op)) {
      ++sends, max_chunk = std::max(max_chunk, x->bytes);
      EXPECT_EQ(x->peer % 2, 0);  // rail peers of rank 0: ranks 2 and 4 (same local index)
    }
    if (const auto* x = std::get_if<NetRecvOp>(&step.op)) ++recvs, max_chunk = std::max(max_chunk, x->bytes);
    if (const auto* b = std::get_if<CopyBatch>(&step.op)) {
      for (const CopyOp& c : b->copies) EXPECT_EQ(c.dst.index, 1);  // node-local: only rank 1
    }
  }
  EXPECT_LE(max_chunk, 64u);  // paced: no transfer larger than chunk_bytes
  EXPECT_GT(sends, 0);
  EXPECT_GT(recvs, 0);
  // Node 0 of 3 (P = 2, node 2 folds into node 0): receives node 2's then node 1's shards.
  verify_programs(layout, plans(layout, Collective::kAllGather, net));
}

TEST(MultinodePlan, OneRankPerNodeSendsTheRawGradientFirst) {
  // With one rank per node a node's first partial is its own gradient: it goes on the wire in its
  // dtype (bf16: half of fp32's bytes), staged by a copy, with no reduce before the first send;
  // later ring steps carry fp32 partial sums. With two ranks per node every send is fp32.
  for (const bool halving : {false, true})
    for (const Topology t : {Topology{2, 1}, Topology{4, 1}, Topology{2, 2}}) {
      BucketLayout layout({{"w", {64, 32}, DType::kBF16}}, t);
      AcrossNodesOptions net{1024, 2, 2, halving};
      const Program p = plan_reduce_scatter(layout, 0, {}, 1, net);
      std::size_t first_send = 0, sent = 0, staged = 0, reduces_before_first_send = 0;
      for (const Step& step : p.steps) {
        if (const auto* x = std::get_if<NetSendOp>(&step.op)) {
          if (first_send == 0) first_send = x->bytes;
          sent += x->bytes;
        }
        if (first_send == 0) reduces_before_first_send += std::holds_alternative<ReduceOp>(step.op);
        if (const auto* b = std::get_if<CopyBatch>(&step.op))
          for (const CopyOp& c : b->copies) staged += c.dst.index == 0 ? c.bytes : 0;
      }
      const std::string where = p.to_string();
      const std::size_t shard = 64 * 32 / t.world();  // elements of one block
      if (t.local == 1) {
        EXPECT_EQ(reduces_before_first_send, 0u) << where;
        // One chunk of 1024 / 4 elements in bf16; halving's slices hold ring_depth chunks / N.
        EXPECT_EQ(first_send, 2u * (halving ? std::min(256, 2 * 256 / t.nodes) : 256)) << where;
        // Ring: the first of N - 1 steps is bf16; halving: the first step (half the blocks) is.
        const int N = t.nodes;
        const std::size_t expect = halving ? shard * 2 * (N / 2) + shard * 4 * (N / 2 - 1)
                                           : shard * 2 + shard * 4 * (N - 2);
        EXPECT_EQ(sent, expect) << where;
        EXPECT_EQ(staged, halving ? shard * 2 * (N / 2) : shard * 2);
      } else {
        EXPECT_GT(reduces_before_first_send, 0u);
        EXPECT_EQ(staged, 0u);
        EXPECT_EQ(sent, shard * 4) << where;  // N = 2: one fp32 partial per element of a block
      }
      verify_programs(layout, plans(layout, Collective::kReduceScatter, net));
    }
}

TEST(MultinodePlan, OneNodeIsTheSingleNodePlan) {
  BucketLayout layout({{"w", {16, 4}}}, Topology{1, 4});
  EXPECT_EQ(plan_all_gather(layout, 1, 0, AcrossNodesOptions{}).to_string(), plan_all_gather(layout, 1, 0).to_string());
  EXPECT_EQ(rs_staging_bytes(layout), 0u);
}

TEST(MultinodePlan, VerifierRejectsBrokenSets) {
  BucketLayout layout({{"w", {24, 8}}, {"b", {12}}}, Topology{3, 2});
  const AcrossNodesOptions net{64, 2, 2};
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
    const auto good = plans(layout, c, net);
    verify_programs(layout, good);
    auto find = [&](const std::vector<Program>& set, auto pred) -> std::pair<int, std::size_t> {
      for (int r = 0; r < int(set.size()); ++r)
        for (std::size_t s = 0; s < set[r].steps.size(); ++s)
          if (pred(set[r].steps[s])) return {r, s};
      return {-1, 0};
    };
    auto is_recv = [](const Step& s) { return std::holds_alternative<NetRecvOp>(s.op); };
    auto is_send = [](const Step& s) { return std::holds_alternative<NetSendOp>(s.op); };
    {  // a receive dropped: its send is never received
      auto bad = good;
      auto [r, s] = find(bad, is_recv);
      ASSERT_GE(r, 0);
      bad[r].steps.erase(bad[r].steps.begin() + s);
      EXPECT_THROW(verify_programs(layout, bad), Error) << collective_name(c);
    }
    {  // a send with other bytes than its receive
      auto bad = good;
      auto [r, s] = find(bad, is_send);
      std::get<NetSendOp>(bad[r].steps[s].op).bytes -= 16;
      EXPECT_THROW(verify_programs(layout, bad), Error) << collective_name(c);
    }
    {  // a receive moved before the handshakes that let its sender start: deadlock or bad data
      auto bad = good;
      auto [r, s] = find(bad, is_recv);
      Step step = bad[r].steps[s];
      bad[r].steps.erase(bad[r].steps.begin() + s);
      bad[r].steps.insert(bad[r].steps.begin(), step);
      for (auto& p : bad)  // and every rank's first send moved to its end
        for (std::size_t k = 0; k < p.steps.size(); ++k)
          if (is_send(p.steps[k])) {
            Step x = p.steps[k];
            p.steps.erase(p.steps.begin() + k);
            p.steps.push_back(x);
            break;
          }
      EXPECT_THROW(verify_programs(layout, bad), Error) << collective_name(c);
    }
    {  // a send from a wrong offset (all-gather: wrong shard; reduce-scatter: unwritten/wrong data)
      auto bad = good;
      auto [r, s] = find(bad, is_send);
      std::get<NetSendOp>(bad[r].steps[s].op).src.offset += 16;
      EXPECT_THROW(verify_programs(layout, bad), Error) << collective_name(c);
    }
  }
  // Reduce-scatters whose final reduce breaks the sum (it adds the local chunks onto the partial
  // received from the previous node).
  auto break_final_reduce = [&](auto&& mutate) {
    auto bad = plans(layout, Collective::kReduceScatter, net);
    for (Step& st : bad[0].steps)
      if (auto* r = std::get_if<ReduceOp>(&st.op); r && r->dst.space == Space::kOutput) {
        EXPECT_TRUE(r->partial.has_value());
        mutate(*r);
        return bad;
      }
    ADD_FAILURE() << "no final reduce";
    return bad;
  };
  // drops the received partial: not every rank summed
  EXPECT_THROW(verify_programs(layout, break_final_reduce([](ReduceOp& r) { r.partial.reset(); })), Error);
  // drops a local rank's chunk
  EXPECT_THROW(verify_programs(layout, break_final_reduce([](ReduceOp& r) { r.sources.pop_back(); })), Error);
  // takes a local slot's bf16 gradient as its fp32 partial
  EXPECT_THROW(verify_programs(layout, break_final_reduce([](ReduceOp& r) { r.partial = r.sources.back(); })),
               Error);

  // One rank per node: the raw gradient received from the previous node is the final reduce's
  // first source (it needs the prescale). Taken as a partial of the same dtype (fp32 gradients,
  // fp32 wire: the bytes would pass) it skips the prescale: the verifier tells them apart.
  BucketLayout raw_layout({{"w", {48, 8}, DType::kFP32}}, Topology{3, 1});
  auto raw = [&] {
    std::vector<Program> set;
    for (int r = 0; r < 3; ++r) set.push_back(plan_reduce_scatter(raw_layout, r, {}, 7, net));
    return set;
  };
  verify_programs(raw_layout, raw());
  int moved = 0;
  auto bad = raw();
  for (Step& st : bad[0].steps)
    if (auto* r = std::get_if<ReduceOp>(&st.op); r && r->sources.size() == 2 && !r->partial) {
      r->partial = r->sources.front();
      r->sources.erase(r->sources.begin());
      ++moved;
    }
  ASSERT_GT(moved, 0) << "no reduce adds a received raw gradient";
  EXPECT_THROW(verify_programs(raw_layout, bad), Error);
}

// Fixed per-rank output: every param has c rows per rank whatever W is.
BucketLayout fixed_output_layout(Topology t) {
  const int64_t c = 64, h = 1024;
  return BucketLayout({{"q", {c * t.world(), h}}, {"up", {2 * c * t.world(), h}}, {"n", {c * t.world()}}}, t);
}

TEST(MultinodePlan, StagingIsConstantInW) {
  const AcrossNodesOptions net;  // 1 MiB chunks, ring of 4
  std::size_t first = 0;
  for (int w : {16, 32, 64}) {
    const BucketLayout layout = fixed_output_layout(Topology{w / 8, 8});
    const std::size_t tide = rs_staging_bytes(layout, net);
    AcrossNodesOptions halving = net;
    halving.rs_recursive_halving = true;
    EXPECT_EQ(rs_staging_bytes(layout, halving), tide) << "W = " << w;
    EXPECT_EQ(plan_reduce_scatter(layout, 0, {}, 0, halving).window_bytes,
              plan_reduce_scatter(layout, 0, {}, 0, net).window_bytes);
    const std::size_t stock = stock_rs_buffer_bytes(layout);
    std::size_t shard_fp32 = 0;
    for (const ParamLayout& p : layout.params()) shard_fp32 += p.shard_numel * 4;
    EXPECT_EQ(stock, w * shard_fp32);
    if (first == 0) first = tide;
    EXPECT_EQ(tide, first) << "W = " << w;
    EXPECT_LT(tide * 4, stock) << "W = " << w;
    // The programs use exactly this staging beyond the bucket's window.
    EXPECT_EQ(plan_reduce_scatter(layout, 0, {}, 0, net).window_bytes,
              (layout.window_bytes() + 255) / 256 * 256 + tide);
  }
  // 2 + ring_depth chunks (two receive buffers, the send ring) of min(chunk_bytes, largest fp32
  // shard = 128 x 1024 x 4 B = 512 KiB).
  EXPECT_EQ(first, (2 + 4) * (std::size_t{512} << 10));
}

TEST(MultinodePlan, RejectsBadAcrossNodesOptions) {
  BucketLayout layout({{"w", {8}}}, Topology{2, 2});
  EXPECT_THROW(plan_all_gather(layout, 0, 0, AcrossNodesOptions{10, 1, 1}), InvalidArgument);
  EXPECT_THROW(plan_all_gather(layout, 0, 0, AcrossNodesOptions{64, 0, 1}), InvalidArgument);
  EXPECT_THROW(plan_reduce_scatter(layout, 0, {}, 0, AcrossNodesOptions{64, 1, kNetQueueDepth + 1}), InvalidArgument);
  try {
    plan_reduce_scatter(layout, 0, {}, 0, AcrossNodesOptions{64, 1, 1, false, DType::kFP16});
    FAIL() << "accepted an fp16 wire";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("wire_dtype"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fp32 or bf16"), std::string::npos) << e.what();
  }
}

// Executors without a network transport (a CUDA executor with neither an NcclComm nor a
// CudaWindowScope::kHost window: validate_run's default) reject network ops before anything runs, saying
// what would give them one.
TEST(MultinodePlan, ExecutorsWithoutTransportRejectNetworkOps) {
  BucketLayout layout({{"w", {16, 4}}}, Topology{2, 2});
  const Program p = plan_all_gather(layout, 0, 0, AcrossNodesOptions{});
  test::RankBuffers b(layout, Collective::kAllGather, 0, 1);
  alignas(256) static std::byte window[4096];
  try {
    validate_run(p, b.bindings, 0, 4, sizeof window, window);
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no network transport"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("NcclComm"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CudaWindowScope::kHost"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(validate_run(p, b.bindings, 0, 4, sizeof window, window, /*net_supported=*/true));
}

}  // namespace
}  // namespace tide
