// Host executor with ranks as threads: data-level correctness of TIDE-AG / TIDE-RS, slot reuse
// across buckets sharing one window, reproducibility, timeouts and desync detection.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "rank_runner.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

using test::Buffer;

// Runs AG then RS of `layout` on every rank (threads) `repeats` times over one window, checking
// AG bitwise against the reference and RS against fp64; returns every rank's RS outputs (bytes).
std::vector<std::vector<std::byte>> ag_then_rs(const BucketLayout& layout, uint64_t seed,
                                               const ReduceOptions& o, int repeats = 1,
                                               bool jitter = false,
                                               std::optional<Delivery> delivery = {}) {
  const int world = layout.world();
  std::vector<std::vector<std::byte>> results(world);
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    std::mt19937 rng(seed * 31 + rank);
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window, std::chrono::milliseconds(20000));
    AllGather ag(layout, rank, 3, AcrossNodesOptions{}, delivery);
    ReduceScatter rs(layout, rank, o, 3);
    std::vector<Buffer> shards, grads, outs;
    std::vector<const void*> shard_ptrs, grad_ptrs;
    std::vector<void*> out_ptrs;
    for (std::size_t i = 0; i < layout.num_params(); ++i) {
      const ParamLayout& p = layout.param(i);
      shards.push_back(test::ag_shard(p, int(i), rank, seed));
      grads.push_back(test::rs_grad(p, int(i), rank, seed));
      outs.emplace_back(p.shard_dtype, p.valid_numel(rank));
    }
    for (auto& b : shards) shard_ptrs.push_back(b.data());
    for (auto& b : grads) grad_ptrs.push_back(b.data());
    for (auto& b : outs) out_ptrs.push_back(b.data());
    std::vector<std::byte> first;
    for (int rep = 0; rep < repeats; ++rep) {
      if (jitter) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
      std::memset(window->data(rank), 0xA5, layout.window_bytes());  // poison: must be overwritten
      ag.run(executor, shard_ptrs);
      for (std::size_t i = 0; i < layout.num_params(); ++i) {
        const ParamLayout& p = layout.param(i);
        const auto expected = test::ag_expected(p, int(i), world, seed);
        ASSERT_EQ(std::memcmp(window->data(rank) + p.window_offset, expected.data(), expected.size()), 0)
            << "AG param " << i << " rank " << rank << "\n" << layout.describe();
      }
      // Every rank must be done reading its params before peers overwrite the slots: the plan's
      // slot-free handshake guarantees it, so the check above could run before any peer's RS push.
      for (auto& b : outs) std::fill(b.bytes.begin(), b.bytes.end(), std::byte{0});
      rs.run(executor, grad_ptrs, out_ptrs);
      std::vector<std::byte> all;
      for (std::size_t i = 0; i < layout.num_params(); ++i) {
        const ParamLayout& p = layout.param(i);
        const auto ref = test::rs_reference(p, int(i), rank, world, seed, o);
        std::vector<double> got(ref.size());
        for (std::size_t k = 0; k < ref.size(); ++k) got[k] = outs[i].at(k);
        const double tol = p.shard_dtype == DType::kFP32 ? 1e-6 : 1e-2;  // bf16/fp16 outputs round
        ASSERT_LE(test::relative_error(got, ref), tol) << "RS param " << i << " rank " << rank;
        all.insert(all.end(), outs[i].bytes.begin(), outs[i].bytes.end());
      }
      if (rep == 0) first = all;
      ASSERT_EQ(all, first) << "RS not bitwise reproducible on rank " << rank;
    }
    results[rank] = first;
  });
  return results;
}

class HostExecutorProperty : public ::testing::TestWithParam<int> {};

TEST_P(HostExecutorProperty, RandomBucketsAllGatherAndReduceScatter) {
  const int world = GetParam();
  std::mt19937_64 rng(77 + world);
  const int cases = world >= 8 ? 25 : 60;
  test::BucketShape shape{5, 1 << 13};
  shape.inner_shard_dims = true;  // params sharded on dims > 0 mixed in
  for (int n = 0; n < cases; ++n) {
    BucketLayout layout(test::random_specs(rng, world, shape), Topology::single_node(world));
    ReduceOptions o;
    o.kind = n % 2 ? ReduceKind::kAvg : ReduceKind::kSum;
    o.prescale = n % 3 == 0 ? 0.25f : 1.0f;
    o.postscale = n % 5 == 0 ? 3.0f : 1.0f;
    // Both deliveries (the buckets are small: the default would cast into the peers' windows).
    const Delivery delivery = (n / 2) % 2 ? Delivery::kPush : Delivery::kCastToPeers;
    ag_then_rs(layout, 1000 + n, o, /*repeats=*/2, /*jitter=*/false, delivery);
    if (HasFatalFailure()) return;
  }
}
INSTANTIATE_TEST_SUITE_P(W, HostExecutorProperty, ::testing::Values(1, 2, 3, 4, 5, 8));

TEST(HostExecutor, ReduceScatterIsBitwiseReproducibleUnderDifferentTimings) {
  BucketLayout layout({{"w", {37, 19}}, {"n", {19}, DType::kFP32}}, Topology::single_node(5));
  const auto a = ag_then_rs(layout, 5, {}, 3, /*jitter=*/true);
  const auto b = ag_then_rs(layout, 5, {}, 3, /*jitter=*/true);
  EXPECT_EQ(a, b);
}

TEST(HostExecutor, AccumulateAddsIntoExistingGradient) {
  const int world = 3;
  BucketLayout layout({{"w", {8, 5}}}, Topology::single_node(world));
  ReduceOptions o;
  o.accumulate = true;
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window);
    const ParamLayout& p = layout.param(0);
    Buffer grad = test::rs_grad(p, 0, rank, 9);
    std::vector<float> out(p.valid_numel(rank), 0.5f);
    const void* in = grad.data();
    void* dst = out.data();
    ReduceScatter rs(layout, rank, o);
    rs.run(executor, {&in, 1}, {&dst, 1});
    rs.run(executor, {&in, 1}, {&dst, 1});
    const auto ref = test::rs_reference(p, 0, rank, world, 9, o);
    for (std::size_t k = 0; k < ref.size(); ++k) ASSERT_NEAR(out[k], 0.5 + 2 * ref[k], 1e-5);
  });
}

// Slot-Reuse across buckets: a pool window shared by two buckets of different layouts, used
// AG(A), AG(B), RS(B), RS(A) in an interleaved order, several steps.
TEST(HostExecutor, TwoBucketsShareOnePoolWindow) {
  const int world = 4;
  BucketLayout a({{"a0", {33, 7}}, {"a1", {7}}}, Topology::single_node(world));
  BucketLayout b({{"b0", {5, 64}, DType::kFP16}}, Topology::single_node(world));
  const std::size_t pool_bytes = std::max(a.window_bytes(), b.window_bytes());
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, pool_bytes);
    HostExecutor executor(*window);
    for (int step = 0; step < 4; ++step) {
      for (const BucketLayout* layout : {&a, &b}) {
        const uint32_t id = layout == &a ? 1 : 2;
        std::vector<Buffer> shards, grads, outs;
        std::vector<const void*> sp, gp;
        std::vector<void*> op;
        for (std::size_t i = 0; i < layout->num_params(); ++i) {
          shards.push_back(test::ag_shard(layout->param(i), int(i), rank, step * 10 + id));
          grads.push_back(test::rs_grad(layout->param(i), int(i), rank, step * 10 + id));
          outs.emplace_back(layout->param(i).shard_dtype, layout->param(i).valid_numel(rank));
        }
        for (auto& x : shards) sp.push_back(x.data());
        for (auto& x : grads) gp.push_back(x.data());
        for (auto& x : outs) op.push_back(x.data());
        AllGather(*layout, rank, id).run(executor, sp);
        for (std::size_t i = 0; i < layout->num_params(); ++i) {
          const ParamLayout& p = layout->param(i);
          const auto expected = test::ag_expected(p, int(i), world, step * 10 + id);
          ASSERT_EQ(std::memcmp(window->data(rank) + p.window_offset, expected.data(), expected.size()), 0);
        }
        ReduceScatter(*layout, rank, {}, id).run(executor, gp, op);
        for (std::size_t i = 0; i < layout->num_params(); ++i) {
          const auto ref = test::rs_reference(layout->param(i), int(i), rank, world, step * 10 + id, {});
          std::vector<double> got(ref.size());
          for (std::size_t k = 0; k < ref.size(); ++k) got[k] = outs[i].at(k);
          ASSERT_LE(test::relative_error(got, ref), 1e-6);
        }
      }
    }
    EXPECT_EQ(window->epoch(), 16u);
  });
}

// torchao's float8 all-gather, cast by TIDE: an e4m3 param is cast from its fp32 or bf16 shard as
// e4m3(x * scale), its bound scale, saturated; every rank's window holds the same bytes. Its
// neighbour in the bucket is a plain param. Both deliveries; W = 2 and 3 (3: padded shards).
TEST(HostExecutor, E4M3ParamsAreCastWithTheirScaleIntoEveryWindow) {
  for (const int world : {2, 3})
    for (const DType shard_dtype : {DType::kFP32, DType::kBF16})
      for (const Delivery delivery : {Delivery::kPush, Delivery::kCastToPeers}) {
        SCOPED_TRACE(detail::concat("W = ", world, ", ", dtype_name(shard_dtype), ", ", delivery_name(delivery)));
        const BucketLayout layout({{"w", {7, 24}, DType::kE4M3, shard_dtype}, {"b", {7}, DType::kBF16, DType::kFP32}},
                                  Topology::single_node(world));
        const ParamLayout& w = layout.param(0);
        const float scale = 37.25f;  // a product that rounds, values past 448 that saturate
        auto value = [](int64_t global) { return std::sin(0.7f * float(global)) * 13.0f; };
        std::vector<uint8_t> expected(w.slot_bytes() * world, 0);
        for (int r = 0; r < world; ++r)
          for (int64_t k = 0; k < w.valid_numel(r); ++k) {
            const float x = value(r * w.shard_numel + k);
            const float rounded = shard_dtype == DType::kBF16 ? bf16_to_float(float_to_bf16(x)) : x;
            expected[r * w.slot_bytes() + k] = float_to_e4m3(rounded * scale);
          }
        harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
          auto window = HostWindow::create(bootstrap, layout.window_bytes());
          HostExecutor executor(*window, std::chrono::milliseconds(20000));
          Buffer shard(shard_dtype, w.valid_numel(rank));
          for (int64_t k = 0; k < w.valid_numel(rank); ++k)
            store_from_float(shard.data(), shard_dtype, k, value(rank * w.shard_numel + k));
          Buffer bias = test::ag_shard(layout.param(1), 1, rank, 5);
          const std::vector<const void*> shards = {shard.data(), bias.data()};
          const std::vector<const float*> scales = {&scale, nullptr};
          std::memset(window->data(rank), 0xA5, layout.window_bytes());
          AllGather(layout, rank, 1, {}, delivery).run(executor, shards, scales);
          ASSERT_EQ(std::memcmp(window->data(rank) + w.window_offset, expected.data(), expected.size()), 0);
          const auto bias_expected = test::ag_expected(layout.param(1), 1, world, 5);
          ASSERT_EQ(std::memcmp(window->data(rank) + layout.param(1).window_offset, bias_expected.data(),
                                bias_expected.size()), 0);
          // Without its scale the run is refused before anything moves, naming what is missing.
          try {
            AllGather(layout, rank, 2, {}, delivery).run(executor, shards);
            ADD_FAILURE() << "an e4m3 cast ran without its scale";
          } catch (const InvalidArgument& e) {
            EXPECT_NE(std::string(e.what()).find("scales[0]"), std::string::npos) << e.what();
          }
        });
      }
}

TEST(HostExecutor, E4M3ParamsAreNotReduced) {
  const BucketLayout layout({{"w", {8, 8}, DType::kE4M3, DType::kFP32}}, Topology::single_node(2));
  try {
    plan_reduce_scatter(layout, 0, {});
    FAIL() << "an e4m3 param was planned for a reduce-scatter";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("e4m3"), std::string::npos) << e.what();
  }
}

TEST(HostExecutor, MissingPeerTimesOutNamingRankBucketPhaseEpoch) {
  const int world = 3;
  BucketLayout layout({{"w", {6, 2}}}, Topology::single_node(world));
  std::vector<std::string> messages(world);
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window, std::chrono::milliseconds(300));
    if (rank == 2) return;  // never arrives
    Buffer shard = test::ag_shard(layout.param(0), 0, rank, 1);
    const void* in = shard.data();
    const auto start = std::chrono::steady_clock::now();
    try {
      AllGather(layout, rank, 42).run(executor, {&in, 1});
      messages[rank] = "no error";
    } catch (const TimeoutError& e) {
      messages[rank] = e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  });
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& m = messages[rank];
    EXPECT_NE(m.find("rank " + std::to_string(rank) + ": timed out after 300 ms"), std::string::npos) << m;
    EXPECT_NE(m.find("from rank 2"), std::string::npos) << m;
    EXPECT_NE(m.find("bucket 42 all_gather"), std::string::npos) << m;
    EXPECT_NE(m.find("phase slot_free"), std::string::npos) << m;
    EXPECT_NE(m.find("epoch 1"), std::string::npos) << m;
  }
}

TEST(HostExecutor, MismatchedCallOrderIsADesyncErrorNamingBothSides) {
  const int world = 2;
  BucketLayout layout({{"w", {4, 4}}}, Topology::single_node(world));
  std::vector<std::string> messages(world);
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window, std::chrono::milliseconds(2000));
    Buffer shard = test::ag_shard(layout.param(0), 0, rank, 1);
    Buffer grad = test::rs_grad(layout.param(0), 0, rank, 1);
    std::vector<float> out(layout.param(0).valid_numel(rank));
    const void* in = rank == 0 ? shard.data() : grad.data();
    void* dst = out.data();
    try {
      if (rank == 0) AllGather(layout, rank, 7).run(executor, {&in, 1});
      else ReduceScatter(layout, rank, {}, 7).run(executor, {&in, 1}, {&dst, 1});
      messages[rank] = "no error";
    } catch (const DesyncError& e) {
      messages[rank] = e.what();
    }
  });
  EXPECT_NE(messages[0].find("rank 0 runs bucket 7 all_gather at epoch 1"), std::string::npos)
      << messages[0];
  EXPECT_NE(messages[0].find("rank 1 signalled bucket 7 reduce_scatter at epoch 1"),
            std::string::npos) << messages[0];
  EXPECT_NE(messages[1].find("rank 1 runs bucket 7 reduce_scatter"), std::string::npos) << messages[1];
}

}  // namespace
}  // namespace tide

namespace tide {
namespace {

// A fixed address range backed in turn by two pooled windows: what lets a bucket's parameters keep
// one address (and autograd's saved views stay valid) while their memory comes from a pool.
TEST(HostAddressRange, AliasesWhicheverWindowIsMappedIntoIt) {
  harness::run_rank_threads_or_throw(1, [&](int, Bootstrap& bootstrap) {
    auto a = HostWindow::create(bootstrap, 10000);
    auto b = HostWindow::create(bootstrap, 10000);
    HostAddressRange range(10000);
    range.map_data_of(*a);
    std::memset(a->data(0), 1, 10000);
    EXPECT_EQ(range.base()[9999], std::byte{1});
    range.base()[5] = std::byte{7};
    EXPECT_EQ(a->data(0)[5], std::byte{7});
    range.map_data_of(*b);
    std::memset(b->data(0), 2, 10000);
    EXPECT_EQ(range.base()[0], std::byte{2});
    EXPECT_EQ(a->data(0)[0], std::byte{1});  // a untouched
    HostAddressRange small(100);
    EXPECT_THROW(small.map_data_of(*a), InvalidArgument);
  });
}

}  // namespace
}  // namespace tide
