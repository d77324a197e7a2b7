// Ranks as real processes over POSIX shared memory, bootstrapped through a rendezvous directory;
// a rank killed mid-collective; no shared-memory segment left behind.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "process_util.hpp"
#include "rank_runner.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

using test::Buffer;
using harness::RankProcesses;

void ag_rs_step(const BucketLayout& layout, int rank, HostExecutor& executor, HostWindow& window,
                uint64_t seed) {
  const int world = layout.world();
  std::vector<Buffer> shards, grads, outs;
  std::vector<const void*> sp, gp;
  std::vector<void*> op;
  for (std::size_t i = 0; i < layout.num_params(); ++i) {
    shards.push_back(test::ag_shard(layout.param(i), int(i), rank, seed));
    grads.push_back(test::rs_grad(layout.param(i), int(i), rank, seed));
    outs.emplace_back(layout.param(i).shard_dtype, layout.param(i).valid_numel(rank));
  }
  for (auto& x : shards) sp.push_back(x.data());
  for (auto& x : grads) gp.push_back(x.data());
  for (auto& x : outs) op.push_back(x.data());
  AllGather(layout, rank, 1).run(executor, sp);
  for (std::size_t i = 0; i < layout.num_params(); ++i) {
    const ParamLayout& p = layout.param(i);
    const auto expected = test::ag_expected(p, int(i), world, seed);
    if (std::memcmp(window.data(rank) + p.window_offset, expected.data(), expected.size()) != 0)
      throw std::runtime_error("AG mismatch on param " + std::to_string(i));
  }
  ReduceScatter(layout, rank, {}, 1).run(executor, gp, op);
  for (std::size_t i = 0; i < layout.num_params(); ++i) {
    const auto ref = test::rs_reference(layout.param(i), int(i), rank, world, seed, {});
    std::vector<double> got(ref.size());
    for (std::size_t k = 0; k < ref.size(); ++k) got[k] = outs[i].at(k);
    const double tol = layout.param(i).shard_dtype == DType::kFP32 ? 1e-6 : 1e-2;
    if (test::relative_error(got, ref) > tol)
      throw std::runtime_error("RS mismatch on param " + std::to_string(i));
  }
}

class MultiProcess : public ::testing::TestWithParam<int> {};

TEST_P(MultiProcess, RandomBucketsAcrossProcesses) {
  const int world = GetParam();
  const RankProcesses run = harness::run_rank_processes(world, [&](int rank, Bootstrap& bootstrap) {
    std::mt19937_64 rng(500 + world);  // same sequence on every rank: same layouts
    auto window = HostWindow::create(bootstrap, 1 << 20);
    HostExecutor executor(*window, std::chrono::milliseconds(20000));
    for (int n = 0; n < 10; ++n) {
      BucketLayout layout(test::random_specs(rng, world, 4, 1 << 12), Topology::single_node(world));
      ag_rs_step(layout, rank, executor, *window, n);
    }
    return std::string("ok");
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(run.reports[r], "ok") << "rank " << r;
  EXPECT_EQ(test::shm_segments_of(run.pids), std::set<std::string>{})
      << "shared-memory segments leaked";
}
INSTANTIATE_TEST_SUITE_P(W, MultiProcess, ::testing::Values(2, 3, 4, 8));

// A rank that dies between collectives: every survivor's next wait on it fails, naming it. Its
// process is seen to be gone (a zombie here: the parent reaps it last), so they fail at once rather
// than at the timeout; test_rank_failure.cpp covers deaths inside a collective.
TEST(MultiProcess, KilledRankMakesSurvivorsTimeOutAndLeavesNoSegments) {
  const int world = 4;
  BucketLayout layout({{"w", {64, 16}}}, Topology::single_node(world));
  const RankProcesses run = harness::run_rank_processes(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window, std::chrono::milliseconds(500));
    ag_rs_step(layout, rank, executor, *window, 3);  // one good step first
    if (rank == 3) ::kill(::getpid(), SIGKILL);      // dies between collectives
    ag_rs_step(layout, rank, executor, *window, 4);
    return std::string("ok");
  });
  int direct = 0;  // the others may fail on a survivor that failed first (see test_rank_failure)
  for (int r = 0; r < 3; ++r) {
    const std::string& m = run.reports[r];
    EXPECT_EQ(m.rfind("TimeoutError: rank " + std::to_string(r) + ": ", 0), 0u) << m;
    if (m.find("from rank 3 (bucket 1 all_gather, phase slot_free, epoch 3)") != std::string::npos) {
      ++direct;
      EXPECT_TRUE(m.find("timed out after 500 ms") != std::string::npos ||
                  m.find("rank 3 (pid " + std::to_string(run.pids[3]) + ") has exited") !=
                      std::string::npos) << m;
    } else {
      EXPECT_NE(m.find("a failure that started at rank 3"), std::string::npos) << m;
    }
  }
  EXPECT_GE(direct, 1);
  EXPECT_EQ(run.reports[3].rfind("no result", 0), 0u) << run.reports[3];  // killed: reported nothing
  EXPECT_TRUE(WIFSIGNALED(run.statuses[3]) && WTERMSIG(run.statuses[3]) == SIGKILL);
  EXPECT_EQ(test::shm_segments_of(run.pids), std::set<std::string>{})
      << "shared-memory segments leaked";
}

}  // namespace
}  // namespace tide
