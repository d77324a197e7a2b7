// plan: the programs' addressing and handshakes, checked statically over >= 1000 random buckets
// for each W, plus mutations that the checker must catch (so the property test can fail).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "test_util.hpp"

namespace tide {
namespace {

using test::plan_all;  // pushed unless told otherwise

// u8 params (FSDP2 all-gather extensions' inputs: fp8, packed data): gathered as bytes, copied
// and never cast; a u8 param with a float shard, and any reduce-scatter of u8, are refused.
TEST(Plan, U8ParamsAreGatheredAsBytesAndNeverReduced) {
  for (int world : {2, 3, 4}) {
    BucketLayout layout({ParamSpec{"fp8_data", {world * 96}, DType::kU8, DType::kU8},
                         ParamSpec{"norm", {10, 3}, DType::kBF16, DType::kFP32},
                         ParamSpec{"scale", {world * 4}, DType::kU8, DType::kU8}},
                        Topology::single_node(world));
    for (const Delivery delivery : {Delivery::kPush, Delivery::kCastToPeers}) {
      const std::vector<Program> programs = plan_all(layout, Collective::kAllGather, {}, delivery);
      ASSERT_NO_THROW(verify_programs(layout, programs)) << delivery_name(delivery);
      for (const Program& program : programs)
        for (const Step& step : program.steps)
          if (const auto* cast = std::get_if<CastOp>(&step.op))
            EXPECT_EQ(cast->src_dtype == DType::kU8, cast->dst_dtype == DType::kU8);
    }
    EXPECT_THROW(plan_reduce_scatter(layout, 0, {}, 5), InvalidArgument);
  }
  EXPECT_THROW(BucketLayout({ParamSpec{"x", {8}, DType::kU8, DType::kFP32}}, Topology::single_node(2)),
               InvalidArgument);
  EXPECT_THROW(BucketLayout({ParamSpec{"x", {8}, DType::kBF16, DType::kU8}}, Topology::single_node(2)),
               InvalidArgument);
}

class PlanProperty : public ::testing::TestWithParam<int> {};

TEST_P(PlanProperty, ThousandRandomBucketsVerify) {
  const int world = GetParam();
  std::mt19937_64 rng(1000 + world);
  test::BucketShape shape{world >= 64 ? 3 : 6};
  shape.inner_shard_dims = true;  // params sharded on dims > 0 mixed in
  for (int n = 0; n < 1000; ++n) {
    BucketLayout layout(test::random_specs(rng, world, shape), Topology::single_node(world));
    for (const Delivery delivery : {Delivery::kPush, Delivery::kCastToPeers})
      ASSERT_NO_THROW(verify_programs(layout, plan_all(layout, Collective::kAllGather, {}, delivery)))
          << delivery_name(delivery) << "\n" << layout.describe();
    ReduceOptions o;
    o.kind = n % 2 ? ReduceKind::kAvg : ReduceKind::kSum;
    o.accumulate = n % 3 == 0;
    for (const Delivery delivery : {Delivery::kPush, Delivery::kCastToPeers})
      ASSERT_NO_THROW(verify_programs(layout, plan_all(layout, Collective::kReduceScatter, o, delivery)))
          << delivery_name(delivery) << "\n" << layout.describe();
  }
}
INSTANTIATE_TEST_SUITE_P(W, PlanProperty, ::testing::Values(1, 2, 3, 4, 5, 8, 64));

TEST(Plan, AllGatherPushesEverySlotOncePerPeer) {
  BucketLayout layout({{"a", {10, 4}}, {"b", {3}, DType::kFP32}}, Topology::single_node(4));
  const Program p = plan_all_gather(layout, 1, 9, AcrossNodesOptions{}, Delivery::kPush);
  // Own shards: 2 casts; to each of 3 peers a batch of 2 slots: total bytes = 3 * sum(slot bytes).
  EXPECT_EQ(p.bytes_pushed(), 3 * (layout.param(0).slot_bytes() + layout.param(1).slot_bytes()));
  const std::string text = p.to_string();
  EXPECT_NE(text.find("program all_gather rank 1/4 bucket 9"), std::string::npos) << text;
  EXPECT_NE(text.find("[cast_in] cast in[0]+0 -> win[1]+24 (fp32->bf16, 12 elems + 0 zero pad)"),
            std::string::npos) << text;
  // Param b: d0 = 3, c = 1: rank 1 owns row 1; its slot is at offset 256 + 1 * 4.
  EXPECT_NE(text.find("cast in[1]+0 -> win[1]+260 (fp32->fp32, 1 elems + 0 zero pad)"),
            std::string::npos) << text;
  EXPECT_NE(text.find("win[1]+24 -> win[2]+24 (24 B)"), std::string::npos) << text;
  // Staggered: the first peer rank 1 pushes to is rank 2.
  EXPECT_LT(text.find("wait slot_free <- rank 2"), text.find("wait slot_free <- rank 3"));
  EXPECT_LT(text.find("wait slot_free <- rank 3"), text.find("wait slot_free <- rank 0"));
}

// Delivery::kCastToPeers: every peer's slot-free first, then the casts of every param into every
// window (own first, then the peers in staggered order), then the data-ready handshake; no pushes.
TEST(Plan, AllGatherCastToPeersWritesEveryWindowInsideTheHandshake) {
  BucketLayout layout({{"a", {10, 4}}, {"b", {3}, DType::kFP32}}, Topology::single_node(4));
  const Program p = plan_all_gather(layout, 1, 9, AcrossNodesOptions{}, Delivery::kCastToPeers);
  EXPECT_EQ(p.bytes_pushed(), 0u);
  ASSERT_EQ(p.steps.size(), 3u + 3u + 2u * 4u + 3u + 3u);
  std::vector<int> cast_windows;
  for (std::size_t k = 0; k < p.steps.size(); ++k) {
    const Step& step = p.steps[k];
    const bool handshake_first = k < 6, handshake_last = k >= 14;
    if (handshake_first)
      EXPECT_EQ(step.phase, Phase::kSlotFree) << k;
    else if (handshake_last)
      EXPECT_EQ(step.phase, Phase::kDataReady) << k;
    else if (const auto* cast = std::get_if<CastOp>(&step.op))
      cast_windows.push_back(cast->dst.index);
    else
      ADD_FAILURE() << "step " << k << " is not a cast";
  }
  EXPECT_EQ(cast_windows, (std::vector<int>{1, 1, 2, 2, 3, 3, 0, 0}));
  const std::string text = p.to_string();
  EXPECT_NE(text.find("[cast_in] cast in[0]+0 -> win[1]+24 (fp32->bf16, 12 elems + 0 zero pad)"),
            std::string::npos) << text;
  EXPECT_NE(text.find("[push] cast in[0]+0 -> win[2]+24 (fp32->bf16, 12 elems + 0 zero pad)"),
            std::string::npos) << text;
  EXPECT_NE(text.find("[push] cast in[1]+0 -> win[0]+260 (fp32->fp32, 1 elems + 0 zero pad)"),
            std::string::npos) << text;
}

TEST(Plan, DefaultDeliveryCastsSmallSingleNodeBucketsToPeers) {
  const BucketLayout small({{"w", {256, 64}}}, Topology::single_node(2));  // 32 KiB
  EXPECT_EQ(default_delivery(small), Delivery::kCastToPeers);
  const int64_t rows = static_cast<int64_t>(kCastToPeersMaxBytes / 2 / 64);
  EXPECT_EQ(default_delivery(BucketLayout({{"w", {rows, 64}}}, Topology::single_node(2))),
            Delivery::kCastToPeers) << "exactly kCastToPeersMaxBytes";
  EXPECT_EQ(default_delivery(BucketLayout({{"w", {rows + 2, 64}}}, Topology::single_node(2))),
            Delivery::kPush) << "past kCastToPeersMaxBytes";
  EXPECT_EQ(default_delivery(BucketLayout({{"w", {256, 64}}}, Topology::single_node(1))),
            Delivery::kPush) << "W = 1 has no peers";
  const BucketLayout nodes({{"w", {256, 64}}}, Topology{2, 2});
  EXPECT_EQ(default_delivery(nodes), Delivery::kPush) << "across-node plans push";
  EXPECT_EQ(plan_all_gather(small, 0).bytes_pushed(), 0u) << "the 3-argument planner uses the default";
  try {
    plan_all_gather(nodes, 0, 1, AcrossNodesOptions{}, Delivery::kCastToPeers);
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("delivery = cast_to_peers, expected push with 2 nodes"),
              std::string::npos) << e.what();
  }
  // Ranks that deliver differently still hand over every block under the same flags.
  BucketLayout layout({{"a", {10, 4}}, {"b", {3}, DType::kFP32}}, Topology::single_node(3));
  std::vector<Program> mixed = plan_all(layout, Collective::kAllGather);
  mixed[1] = plan_all_gather(layout, 1, 5, AcrossNodesOptions{}, Delivery::kCastToPeers);
  EXPECT_NO_THROW(verify_programs(layout, mixed));
  std::vector<Program> mixed_rs = plan_all(layout, Collective::kReduceScatter);
  mixed_rs[2] = plan_reduce_scatter(layout, 2, {}, 5, AcrossNodesOptions{}, Delivery::kCastToPeers);
  EXPECT_NO_THROW(verify_programs(layout, mixed_rs));
  try {
    plan_reduce_scatter(nodes, 0, {}, 1, AcrossNodesOptions{}, Delivery::kCastToPeers);
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("delivery = cast_to_peers, expected push with 2 nodes"),
              std::string::npos) << e.what();
  }
}

// Delivery::kCastToPeers for the reduce-scatter: every slot-free wait before the first chunk
// copy, the copies as one run (no flag step between them: the CUDA executor's cast-to-peers kernel
// takes them with the signals, waits and reduces after them), the same bytes as with kPush.
TEST(Plan, ReduceScatterCastToPeersTakesTheHandshakeBeforeOneRunOfCopies) {
  BucketLayout layout({{"a", {10, 4}}, {"b", {3}, DType::kFP32}}, Topology::single_node(4));
  const Program push = plan_reduce_scatter(layout, 1, {}, 9, AcrossNodesOptions{}, Delivery::kPush);
  const Program cast = plan_reduce_scatter(layout, 1, {}, 9, AcrossNodesOptions{}, Delivery::kCastToPeers);
  EXPECT_EQ(cast.delivery, Delivery::kCastToPeers);
  EXPECT_EQ(cast.bytes_pushed(), push.bytes_pushed());
  EXPECT_EQ(cast.steps.size(), push.steps.size());
  std::vector<std::string> kinds;  // S signal, W wait, C copies, R reduce
  for (const Step& s : cast.steps)
    kinds.push_back(std::holds_alternative<SignalOp>(s.op) ? "S" : std::holds_alternative<WaitOp>(s.op) ? "W"
                    : std::holds_alternative<CopyBatch>(s.op) ? "C" : "R");
  std::string shape;
  for (const std::string& k : kinds) shape += k;
  EXPECT_EQ(shape, "SSSWWWCCCSSSWWWRR") << cast.to_string();
  EXPECT_EQ(plan_reduce_scatter(layout, 1, {}).delivery, Delivery::kCastToPeers)
      << "the default for a small single-node bucket";
}

TEST(Plan, ReduceScatterReadsOwnChunkInPlaceAndPeersFromVacatedSlots) {
  BucketLayout layout({{"w", {7, 2}}}, Topology::single_node(3));  // c = 3: rows 3,3,1
  ReduceOptions o;
  o.kind = ReduceKind::kAvg;
  o.prescale = 0.5f;
  o.accumulate = true;
  const Program p = plan_reduce_scatter(layout, 2, o, 1);
  const std::string text = p.to_string();
  // Rank 2 owns 1 row = 2 elems; sources: slot(0,0), slot(0,1) of its window, then its gradient.
  EXPECT_NE(text.find("reduce param 0: 2 elems (bf16->fp32), 3 sources in rank order, x0.5 then "
                      "x0.333333, += into out[0]+0"), std::string::npos) << text;
  EXPECT_NE(text.find("sources: win[2]+0 win[2]+12 in[0]+24"), std::string::npos) << text;
  // To rank 0 it pushes its gradient's chunk 0 (3 rows = 12 B) into rank 0's slot(0, 2).
  EXPECT_NE(text.find("in[0]+0 -> win[0]+24 (12 B)"), std::string::npos) << text;
}

TEST(Plan, WorldOfOneIsLocalOnly) {
  BucketLayout layout({{"w", {5, 3}}}, Topology::single_node(1));
  EXPECT_EQ(plan_all_gather(layout, 0).steps.size(), 1u);
  EXPECT_EQ(plan_reduce_scatter(layout, 0, {}).steps.size(), 1u);
}

// The checker must reject broken plans, or the property test proves nothing.
TEST(PlanVerifier, CatchesMutations) {
  BucketLayout layout({{"a", {9, 3}}, {"b", {4}}}, Topology::single_node(3));
  auto mutate_first_batch = [&](Collective c, auto&& edit) {
    auto programs = plan_all(layout, c);
    for (Step& s : programs[1].steps)
      if (auto* b = std::get_if<CopyBatch>(&s.op)) {
        edit(*b);
        break;
      }
    return programs;
  };
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
    EXPECT_THROW(verify_programs(layout, mutate_first_batch(c, [](CopyBatch& b) {
                   b.copies.pop_back();
                 })), Error) << "dropped copy";
    EXPECT_THROW(verify_programs(layout, mutate_first_batch(c, [](CopyBatch& b) {
                   b.copies.push_back(b.copies.front());
                 })), Error) << "duplicated copy";
    EXPECT_THROW(verify_programs(layout, mutate_first_batch(c, [](CopyBatch& b) {
                   b.copies.front().dst.offset += 2;
                 })), Error) << "shifted copy";
    EXPECT_THROW(verify_programs(layout, mutate_first_batch(c, [](CopyBatch& b) {
                   b.copies.front().bytes += 1 << 20;
                 })), Error) << "copy out of bounds";
    auto no_wait = plan_all(layout, c);
    for (auto it = no_wait[0].steps.begin(); it != no_wait[0].steps.end(); ++it)
      if (std::holds_alternative<WaitOp>(it->op)) {
        no_wait[0].steps.erase(it);
        break;
      }
    EXPECT_THROW(verify_programs(layout, no_wait), Error) << "missing wait";
  }
  // Right bytes from the wrong place: a reduce-scatter push of another gradient chunk (in bounds).
  auto wrong_chunk = mutate_first_batch(Collective::kReduceScatter, [&](CopyBatch& b) {
    b.copies.front().src.offset = 0;  // chunk 0 instead of the destination rank's chunk
  });
  EXPECT_THROW(verify_programs(layout, wrong_chunk), Error) << "wrong source chunk";
  // A data-ready wait moved before the slot-free signals: every handshake matched, but it hangs.
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
    auto hang = plan_all(layout, c);
    auto& steps = hang[0].steps;
    const auto wait = std::find_if(steps.begin(), steps.end(), [](const Step& s) {
      const auto* w = std::get_if<WaitOp>(&s.op);
      return w != nullptr && w->kind == FlagKind::kDataReady;
    });
    ASSERT_NE(wait, steps.end());
    std::rotate(steps.begin(), wait, wait + 1);
    try {
      verify_programs(layout, hang);
      ADD_FAILURE() << "deadlock accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos) << e.what();
    }
  }
  // Casts into peers' windows (Delivery::kCastToPeers) only inside the handshake, each block once.
  auto cast_edit = [&](auto&& edit) {
    auto programs = plan_all(layout, Collective::kAllGather, {}, Delivery::kCastToPeers);
    auto& steps = programs[1].steps;
    const auto peer_cast = std::find_if(steps.begin(), steps.end(), [](const Step& s) {
      const auto* c = std::get_if<CastOp>(&s.op);
      return c != nullptr && c->dst.index != 1;
    });
    EXPECT_NE(peer_cast, steps.end());
    edit(steps, peer_cast);
    return programs;
  };
  auto expect_rejected = [&](const std::vector<Program>& programs, const std::string& why) {
    try {
      verify_programs(layout, programs);
      ADD_FAILURE() << why << ": accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  expect_rejected(cast_edit([](auto& steps, auto it) { std::rotate(steps.begin(), it, it + 1); }),
                  "cast into rank 2's window before its slot-free wait");
  expect_rejected(cast_edit([](auto& steps, auto it) { std::rotate(it, it + 1, steps.end()); }),
                  "cast into rank 2's window after its data-ready signal");
  expect_rejected(cast_edit([](auto& steps, auto it) { steps.insert(it, *it); }), "overlap");
  expect_rejected(cast_edit([](auto& steps, auto it) { steps.erase(it); }),
                  "the bytes written are not exactly");
  expect_rejected(cast_edit([&](auto&, auto it) {
                    std::get<CastOp>(it->op).dst.offset = layout.param(0).block_offset(2);
                  }),
                  "cast must write the own block of a param");
  auto early_reduce = plan_all(layout, Collective::kReduceScatter);
  std::rotate(early_reduce[0].steps.begin(), early_reduce[0].steps.end() - 1,
              early_reduce[0].steps.end());  // the last reduce moves before the data waits
  EXPECT_THROW(verify_programs(layout, early_reduce), Error) << "reduce before data-ready";
}

}  // namespace
}  // namespace tide
