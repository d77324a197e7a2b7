// Across-node collectives on the host executor, ranks as threads grouped into virtual nodes; the
// network ops run over the host network transport (shared-memory outboxes standing in for NCCL).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>

#include "process_util.hpp"
#include "rank_runner.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

struct Case {
  Topology topology;
  AcrossNodesOptions net;
};

// AG then RS `repeats` times over one window per rank; AG bitwise, RS within 1e-6 of fp64 (with
// bf16 partials on the wire: within one bf16 rounding per node of each element's magnitude);
// returns every rank's RS outputs of each repeat.
std::vector<std::vector<std::vector<std::byte>>> run_case(const BucketLayout& layout,
                                                          const AcrossNodesOptions& net, uint64_t seed,
                                                          int repeats, const ReduceOptions& o = {}) {
  const int world = layout.world();
  std::vector<std::vector<std::vector<std::byte>>> outs(world);
  std::size_t bytes = 0;
  for (int r = 0; r < world; ++r) {
    bytes = std::max(bytes, plan_reduce_scatter(layout, r, o, 1, net).window_bytes);
    bytes = std::max(bytes, plan_all_gather(layout, r, 1, net).window_bytes);
  }
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, bytes);
    HostExecutor executor(*window, std::chrono::milliseconds(20000));
    const Program ag = plan_all_gather(layout, rank, 1, net);
    const Program rs = plan_reduce_scatter(layout, rank, o, 1, net);
    test::RankBuffers agb(layout, Collective::kAllGather, rank, seed);
    test::RankBuffers rsb(layout, Collective::kReduceScatter, rank, seed);
    for (int rep = 0; rep < repeats; ++rep) {
      std::memset(window->data(rank), 0xA5, layout.window_bytes());
      executor.run(ag, agb.bindings);
      const std::string agerr = test::check_result(layout, Collective::kAllGather, rank, seed,
                                                   window->data(rank), agb, o);
      ASSERT_EQ(agerr, "") << layout.describe();
      for (auto& b : rsb.outputs) std::fill(b.bytes.begin(), b.bytes.end(), std::byte{0x7F});
      executor.run(rs, rsb.bindings);
      const std::string rserr = test::check_result(layout, Collective::kReduceScatter, rank, seed,
                                                   window->data(rank), rsb, o,
                                                   net.wire_dtype == DType::kBF16
                                                       ? layout.topology().nodes * std::ldexp(1.0, -8)
                                                       : 0);
      ASSERT_EQ(rserr, "") << layout.describe();
      std::vector<std::byte> all;
      for (auto& b : rsb.outputs) all.insert(all.end(), b.bytes.begin(), b.bytes.end());
      outs[rank].push_back(std::move(all));
    }
  });
  return outs;
}

TEST(MultinodeExec, VirtualNodesAgBitwiseRsToleranceAndReproducible) {
  const Case cases[] = {{{2, 4}, {}}, {{4, 2}, {256, 2, 2}}, {{8, 1}, {64, 1, 1}},
                        {{3, 2}, {128, 3, 2}}, {{3, 4}, {512, 4, 4}}, {{5, 1}, {96, 2, 3}},
                        // reduce-scatter phase 2 by recursive halving (power-of-two node counts)
                        {{2, 4}, {64, 2, 2, true}}, {{4, 2}, {256, 3, 1, true}}, {{8, 1}, {128, 1, 4, true}},
                        // bf16 partials on the wire (lossy)
                        {{4, 2}, {256, 2, 2, false, DType::kBF16}}, {{2, 4}, {64, 2, 2, true, DType::kBF16}},
                        {{5, 1}, {96, 2, 3, false, DType::kBF16}}};
  std::mt19937_64 rng(11);
  for (const Case& c : cases)
    for (int iter = 0; iter < 3; ++iter) {
      BucketLayout layout(test::random_specs(rng, c.topology.world(), 4, 1 << 11), c.topology);
      std::vector<Program> ag, rs;
      for (int r = 0; r < layout.world(); ++r) {
        ag.push_back(plan_all_gather(layout, r, 1, c.net));
        rs.push_back(plan_reduce_scatter(layout, r, {}, 1, c.net));
      }
      verify_programs(layout, ag);
      verify_programs(layout, rs);
      const auto outs = run_case(layout, c.net, 100 + iter, 2);
      for (int r = 0; r < layout.world(); ++r)
        EXPECT_EQ(outs[r][0], outs[r][1]) << "RS not bitwise reproducible, rank " << r << " of "
                                          << c.topology.nodes << "x" << c.topology.local;
    }
}

TEST(MultinodeExec, TwoNodesOfOneRankEqualOneNodeBitwise) {
  // W = 2: each output element is one fp32 addition of the two ranks' gradients, whether the
  // raw gradient crossed the network (2 x 1) or a copy engine (1 x 2), so the results are equal.
  std::mt19937_64 rng(5);
  for (const bool halving : {false, true})
    for (int iter = 0; iter < 3; ++iter) {
      const auto specs = test::random_specs(rng, 2, 4, 1 << 11);
      const AcrossNodesOptions net{256, 2, 2, halving};
      const auto two_nodes = run_case(BucketLayout(specs, Topology{2, 1}), net, 40 + iter, 1);
      const auto one_node = run_case(BucketLayout(specs, Topology::single_node(2)), net, 40 + iter, 1);
      for (int r = 0; r < 2; ++r) EXPECT_EQ(two_nodes[r][0], one_node[r][0]) << "rank " << r;
    }
}

TEST(MultinodeExec, OneRankPerNodeRingSumsInRingOrderBitwise) {
  // The ring's order with one rank per node: block d starts at node d + 1 (its raw gradient),
  // nodes d + 2, ... add theirs, node d adds its own last; every term prescaled, one fp32
  // rounding per operation; with a bf16 wire each intermediate partial is rounded to bf16. The
  // host executor's outputs equal this model bit for bit (prescale 0.3: a raw gradient taken as
  // an already-scaled partial would show).
  const ReduceOptions o{ReduceKind::kAvg, 0.3f, 1.0f, false};
  std::mt19937_64 rng(17);
  for (const int N : {3, 5})
    for (const DType wire : {DType::kFP32, DType::kBF16}) {
      const BucketLayout layout(test::random_specs(rng, N, 3, 1 << 10), Topology{N, 1});
      AcrossNodesOptions net{128, 2, 2};
      net.wire_dtype = wire;
      const uint64_t seed = 70 + N;
      const auto outs = run_case(layout, net, seed, 1, o);
      const float scale = 1.0f / static_cast<float>(N);
      for (int d = 0; d < N; ++d) {
        std::vector<std::byte> expected;
        for (std::size_t i = 0; i < layout.num_params(); ++i) {
          const ParamLayout& p = layout.param(i);
          std::vector<test::Buffer> grads;
          for (int r = 0; r < N; ++r) grads.push_back(test::rs_grad(p, int(i), r, seed));
          // as test::Buffer sizes it (at least one element), filled by run_case with 0x7F
          std::vector<std::byte> out(std::max<int64_t>(p.valid_numel(d), 1) * dtype_size(p.shard_dtype),
                                     std::byte{0x7F});
          for (int64_t k = 0; k < p.valid_numel(d); ++k) {
            float acc = 0.0f;
            for (int step = 1; step <= N; ++step) {
              acc = acc + grads[(d + step) % N].at(d * p.shard_numel + k) * o.prescale;
              if (step < N && step > 1 && wire == DType::kBF16) acc = bf16_to_float(float_to_bf16(acc));
            }
            store_from_float(out.data(), p.shard_dtype, k, acc * scale);
          }
          expected.insert(expected.end(), out.begin(), out.end());
        }
        EXPECT_EQ(outs[d][0], expected) << "rank " << d << " of " << N << "x1, wire " << dtype_name(wire);
      }
    }
}

TEST(MultinodeExec, Bf16WireHalvesThePartialBytesAndRoundsThem) {
  // Two ranks per node: every partial sum crosses the network; in bf16 they take half the bytes,
  // and the rounding shows in the result (lossy, as documented), within its bound (run_case).
  const std::vector<ParamSpec> specs = {{"w", {64, 48}, DType::kBF16}, {"b", {40}, DType::kBF16}};
  const BucketLayout layout(specs, Topology{2, 2});
  AcrossNodesOptions fp32{512, 2, 2}, bf16 = fp32;
  bf16.wire_dtype = DType::kBF16;
  auto wire = [&](const AcrossNodesOptions& net) {
    std::size_t bytes = 0;
    for (const Step& s : plan_reduce_scatter(layout, 0, {}, 1, net).steps)
      if (const auto* x = std::get_if<NetSendOp>(&s.op)) bytes += x->bytes;
    return bytes;
  };
  EXPECT_EQ(2 * wire(bf16), wire(fp32));
  const auto exact = run_case(layout, fp32, 9, 1), lossy = run_case(layout, bf16, 9, 1);
  int differing = 0;
  for (int r = 0; r < layout.world(); ++r) differing += exact[r][0] != lossy[r][0];
  EXPECT_GT(differing, 0) << "no rank's result shows the bf16 rounding";
}

TEST(MultinodeExec, LlamaLikeBucketFp32Within1e6) {
  // bf16 params with fp32 masters, several chunks per param, 3 x 4 virtual nodes.
  BucketLayout layout({{"q", {96, 40}}, {"norm", {40}}, {"up", {130, 24}}}, Topology{3, 4});
  run_case(layout, AcrossNodesOptions{1024, 4, 2}, 5, 1);
}

TEST(MultinodeExec, MissingRailPeerTimesOutNamingTheTransfer) {
  BucketLayout layout({{"w", {16, 4}}}, Topology{2, 2});
  const int world = 4;
  const std::size_t bytes = plan_all_gather(layout, 0, 4, AcrossNodesOptions{}).window_bytes;
  std::vector<std::unique_ptr<HostWindow>> windows(world);  // rank 3's outlives the others' waits
  const std::vector<std::string> reports = harness::run_rank_threads(
      world,
      [&](int r, Bootstrap& boot) {
        windows[r] = HostWindow::create(boot, bytes);
        boot.barrier();
        if (r == 3) return;  // rank 3 (node 1) never runs the collective
        HostExecutor ex(*windows[r], std::chrono::milliseconds(300));
        test::RankBuffers b(layout, Collective::kAllGather, r, 1);
        ex.run(plan_all_gather(layout, r, 4, AcrossNodesOptions{}), b.bindings);
      },
      std::chrono::seconds(10));
  // Rank 1 (node 0, local 1) has rail peer 3: its network wait times out and says where.
  EXPECT_NE(reports[1].find("rank 1: timed out"), std::string::npos) << reports[1];
  EXPECT_NE(reports[1].find("rank 3"), std::string::npos) << reports[1];
  EXPECT_NE(reports[1].find("bucket 4 all_gather"), std::string::npos) << reports[1];
  EXPECT_NE(reports[1].find("epoch 1"), std::string::npos) << reports[1];
  EXPECT_NE(reports[1].find("host network transport"), std::string::npos) << reports[1];
  for (int r : {0, 2}) EXPECT_NE(reports[r], "ok") << r;  // everyone else fails too, bounded
}

TEST(MultinodeExec, DesyncedBucketsOnTheNetworkFail) {
  BucketLayout layout({{"w", {16, 4}}}, Topology{2, 1});
  std::vector<std::string> errors(2);
  harness::run_rank_threads_or_throw(2, [&](int r, Bootstrap& boot) {
    auto window = HostWindow::create(boot, layout.window_bytes());
    HostExecutor ex(*window, std::chrono::milliseconds(2000));
    test::RankBuffers b(layout, Collective::kAllGather, r, 1);
    try {
      ex.run(plan_all_gather(layout, r, r == 0 ? 1 : 2, AcrossNodesOptions{}), b.bindings);
    } catch (const Error& e) {
      errors[r] = e.what();
    }
  });
  EXPECT_TRUE(errors[0].find("different orders") != std::string::npos ||
              errors[1].find("different orders") != std::string::npos)
      << errors[0] << "\n" << errors[1];
}

// Soundness of the across-node verifier: random corruptions of valid sets are rejected with
// tide::Error, and every set it accepts passes validate_run and runs to the right result on the host
// executor (a sample; a hang would show as a timeout).
void corrupt(std::mt19937_64& rng, std::vector<Program>& set) {
  Program& p = set[rng() % set.size()];
  if (p.steps.empty()) return;
  const std::size_t k = rng() % p.steps.size();
  auto nudge = [&](auto& v) {
    const int64_t d[] = {-1, 1, 16, -16, 64, 1 << 20};
    v = static_cast<std::remove_reference_t<decltype(v)>>(static_cast<int64_t>(v) + d[rng() % 6]);
  };
  switch (rng() % 8) {
    case 0: p.steps.erase(p.steps.begin() + k); return;
    case 1: p.steps.insert(p.steps.begin() + k, p.steps[rng() % p.steps.size()]); return;
    case 2: std::swap(p.steps[k], p.steps[rng() % p.steps.size()]); return;
    case 3: if (k + 1 < p.steps.size()) std::swap(p.steps[k], p.steps[k + 1]); return;
    default: break;
  }
  std::visit([&](auto& op) {
    using T = std::decay_t<decltype(op)>;
    if constexpr (std::is_same_v<T, NetSendOp> || std::is_same_v<T, NetRecvOp>) {
      switch (rng() % 4) {
        case 0: nudge(op.peer); break;
        case 1: nudge(op.bytes); break;
        case 2: op.channel = static_cast<int>(rng() % 3); break;
        default:
          if constexpr (std::is_same_v<T, NetSendOp>) nudge(op.src.offset); else nudge(op.dst.offset);
      }
    } else if constexpr (std::is_same_v<T, ReduceOp>) {
      switch (rng() % 4) {
        case 0: nudge(op.count); break;
        case 1: if (!op.sources.empty()) nudge(op.sources[rng() % op.sources.size()].offset); break;
        case 2: if (op.sources.size() > 1) std::swap(op.sources[0], op.sources.back()); break;
        default: nudge(op.dst.offset);
      }
    } else if constexpr (std::is_same_v<T, CopyBatch>) {
      if (op.copies.empty()) return;
      CopyOp& c = op.copies[rng() % op.copies.size()];
      if (rng() % 2) nudge(c.src.offset); else nudge(c.dst.offset);
    } else if constexpr (std::is_same_v<T, SignalOp> || std::is_same_v<T, WaitOp>) {
      nudge(op.peer);
    }
  }, p.steps[k].op);
}

TEST(MultinodeExec, VerifierAcceptsOnlySetsThatRunRight) {
  const char* env = std::getenv("TIDE_FUZZ_SEED");  // scripts/soak.sh-style reruns with a fresh seed
  std::mt19937_64 rng(env ? std::strtoull(env, nullptr, 10) : 4242);
  const Topology topologies[] = {{2, 2}, {3, 1}, {2, 3}, {3, 2}, {4, 1}};
  int accepted = 0, ran = 0, cases = 0;
  for (int i = 0; i < 3000; ++i, ++cases) {
    const Topology t = topologies[i % 5];
    BucketLayout layout(test::random_specs(rng, t.world(), 3, 1 << 9), t);
    const Collective c = i % 2 ? Collective::kAllGather : Collective::kReduceScatter;
    const AcrossNodesOptions net{64, static_cast<int>(1 + rng() % 3), static_cast<int>(1 + rng() % 3),
                         rng() % 2 == 0};
    std::vector<Program> set;
    for (int r = 0; r < t.world(); ++r)
      set.push_back(c == Collective::kAllGather ? plan_all_gather(layout, r, 2, net)
                                                : plan_reduce_scatter(layout, r, {}, 2, net));
    const int mutations = 1 + static_cast<int>(rng() % 2);
    for (int m = 0; m < mutations; ++m) corrupt(rng, set);
    try {
      verify_programs(layout, set);
    } catch (const Error&) {
      continue;
    }  // anything else escapes and fails the test
    ++accepted;
    std::size_t bytes = 0;
    for (const Program& p : set) bytes = std::max(bytes, p.window_bytes);
    if (ran >= 150) continue;
    ++ran;
    std::vector<std::string> wrong(layout.world());
    try {
      harness::run_rank_threads_or_throw(layout.world(), [&](int rank, Bootstrap& bootstrap) {
        auto window = HostWindow::create(bootstrap, bytes);
        HostExecutor executor(*window, std::chrono::milliseconds(3000));
        test::RankBuffers b(layout, c, rank, 9 + i);
        executor.run(set[rank], b.bindings);
        wrong[rank] = test::check_result(layout, c, rank, 9 + i, window->data(rank), b);
      });
    } catch (const std::exception& e) {
      wrong[0] = e.what();
    }
    for (const std::string& w : wrong) EXPECT_EQ(w, "") << "case " << i << ": accepted set ran wrong";
  }
  std::printf("[ MULTINODE ] corrupted sets accepted by the verifier: %d of %d (%d run)\n", accepted,
              cases, ran);
}

// Ranks as processes (virtual nodes across processes): the outboxes and futex wake-ups of the host
// network transport work between address spaces; a rail peer that dies is noticed at once.
std::string process_step(const BucketLayout& layout, int rank, HostExecutor& executor,
                         HostWindow& window, uint64_t seed, const AcrossNodesOptions& net) {
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
    test::RankBuffers b(layout, c, rank, seed);
    const Program p = c == Collective::kAllGather ? plan_all_gather(layout, rank, 1, net)
                                                  : plan_reduce_scatter(layout, rank, {}, 1, net);
    executor.run(p, b.bindings);
    const std::string err = test::check_result(layout, c, rank, seed, window.data(rank), b);
    if (!err.empty()) return err;
  }
  return "ok";
}

TEST(MultinodeExec, VirtualNodesAsProcesses) {
  for (const Topology t : {Topology{2, 2}, Topology{3, 1}}) {
    const int world = t.world();
    const harness::RankProcesses run = harness::run_rank_processes(world, [&](int rank, Bootstrap& bootstrap) {
      std::mt19937_64 rng(77 + world);  // same layouts on every rank
      auto window = HostWindow::create(bootstrap, 1 << 20);
      HostExecutor executor(*window, std::chrono::milliseconds(20000));
      for (int n = 0; n < 5; ++n) {
        BucketLayout layout(test::random_specs(rng, world, 4, 1 << 12), t);
        const std::string r = process_step(layout, rank, executor, *window, n, AcrossNodesOptions{256, 2, 2});
        if (r != "ok") return r;
      }
      return std::string("ok");
    });
    for (int r = 0; r < world; ++r) EXPECT_EQ(run.reports[r], "ok") << "rank " << r;
    EXPECT_EQ(test::shm_segments_of(run.pids), std::set<std::string>{});
  }
}

TEST(MultinodeExec, DeadRailPeerIsNoticedByTheNetworkWait) {
  const Topology t{2, 2};
  BucketLayout layout({{"w", {64, 16}}}, t);
  const harness::RankProcesses run = harness::run_rank_processes(4, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, 1 << 16);
    HostExecutor executor(*window, std::chrono::milliseconds(5000));
    std::string r = process_step(layout, rank, executor, *window, 1, AcrossNodesOptions{});
    if (r != "ok") return r;
    if (rank == 3) ::kill(::getpid(), SIGKILL);  // dies between collectives
    return process_step(layout, rank, executor, *window, 2, AcrossNodesOptions{});
  });
  // Rank 1 is rank 3's rail peer: it waits for rank 3 in the network part of the all-gather.
  const std::string& m = run.reports[1];
  EXPECT_EQ(m.rfind("TimeoutError: rank 1: ", 0), 0u) << m;
  EXPECT_NE(m.find("rank 3 (pid " + std::to_string(run.pids[3]) + ") has exited"), std::string::npos) << m;
  EXPECT_NE(m.find("net recv"), std::string::npos) << m;
  EXPECT_NE(m.find("(bucket 1 all_gather, phase push, epoch 3)"), std::string::npos) << m;
  for (int r = 0; r < 3; ++r) EXPECT_NE(run.reports[r], "ok") << r;
  EXPECT_EQ(test::shm_segments_of(run.pids), std::set<std::string>{});
}

}  // namespace
}  // namespace tide

namespace tide {
namespace {

// The public AllGather / ReduceScatter classes across nodes: they plan with the network, size the
// window from the program (the reduce-scatter's adds the staging ring), and run on the host.
TEST(MultinodeExec, ApiClassesSizeTheirWindowsAndRun) {
  const BucketLayout layout({{"w", {37, 24}}, {"b", {5}}}, Topology{2, 2});
  const AcrossNodesOptions net{256, 2, 2};
  const ReduceOptions options;
  EXPECT_EQ(AllGather(layout, 0, 1, net).window_bytes(), layout.window_bytes());
  EXPECT_GT(ReduceScatter(layout, 0, options, 2, net).window_bytes(), layout.window_bytes());
  std::vector<std::string> wrong(layout.world());
  harness::run_rank_threads_or_throw(layout.world(), [&](int rank, Bootstrap& bootstrap) {
    const AllGather ag(layout, rank, 1, net);
    const ReduceScatter rs(layout, rank, options, 2, net);
    auto window = HostWindow::create(bootstrap, std::max(ag.window_bytes(), rs.window_bytes()));
    HostExecutor executor(*window, std::chrono::milliseconds(20000));
    test::RankBuffers a(layout, Collective::kAllGather, rank, 31);
    ag.run(executor, a.bindings.inputs);
    wrong[rank] = test::check_result(layout, Collective::kAllGather, rank, 31, window->data(rank), a);
    test::RankBuffers r(layout, Collective::kReduceScatter, rank, 32);
    rs.run(executor, r.bindings.inputs, r.bindings.outputs);
    wrong[rank] += test::check_result(layout, Collective::kReduceScatter, rank, 32, window->data(rank), r);
  });
  for (int r = 0; r < layout.world(); ++r) EXPECT_EQ(wrong[r], "") << "rank " << r;
}

}  // namespace
}  // namespace tide
