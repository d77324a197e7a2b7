// Ranks that disagree on what they run: mismatched buckets, a rank one collective ahead, a rank
// that skipped a signal. Each must be an error naming both sides, long before the timeout (not a
// hang), and no rank may write into the window of a rank running something else. Also the
// debugging aids: published executor states, describe_group / describe_executor_state, TIDE_DEBUG.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "rank_runner.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

constexpr auto kTimeout = std::chrono::milliseconds(10000);
constexpr auto kFast = std::chrono::milliseconds(5000);  // every error here must come before this
constexpr std::byte kPoison{0xA5};

struct Outcome {
  std::string kind;  // "ok", "DesyncError", "TimeoutError", "other"
  std::string message;
  std::chrono::milliseconds elapsed{0};
};

Outcome run_and_catch(HostExecutor& executor, const Program& program, const Bindings& bindings) {
  const auto start = std::chrono::steady_clock::now();
  Outcome o{"ok", "", {}};
  try {
    executor.run(program, bindings);
  } catch (const DesyncError& e) {
    o = {"DesyncError", e.what(), {}};
  } catch (const TimeoutError& e) {
    o = {"TimeoutError", e.what(), {}};
  } catch (const std::exception& e) {
    o = {"other", e.what(), {}};
  }
  o.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  return o;
}

bool all_poison(const std::byte* p, std::size_t n) {
  for (std::size_t k = 0; k < n; ++k)
    if (p[k] != kPoison) return false;
  return true;
}

class Desync : public ::testing::TestWithParam<Collective> {};

// Ranks 0 and 1 run bucket 1; rank 2 runs bucket 2 (another layout) at the same epoch.
TEST_P(Desync, MismatchedBucketsFailOnEveryRankNamingBoth) {
  const Collective c = GetParam();
  const int world = 3;
  const BucketLayout a({{"a", {24, 8}}}, Topology::single_node(world));
  const BucketLayout b({{"b", {3 * 64, 8}, DType::kFP32}}, Topology::single_node(world));
  ASSERT_LE(a.window_bytes(), b.param(0).slot_offset(2));  // rank 2's B slot lies beyond A
  std::vector<Outcome> outcomes(world);
  std::vector<std::vector<std::byte>> windows(world);
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, b.window_bytes());
    HostExecutor executor(*window, kTimeout);
    std::memset(window->data(rank), 0xA5, b.window_bytes());
    bootstrap.barrier();
    const BucketLayout& mine = rank == 2 ? b : a;
    test::RankBuffers buffers(mine, c, rank, 3);
    outcomes[rank] = run_and_catch(executor, test::plan_for(c, mine, rank, rank == 2 ? 2 : 1),
                                   buffers.bindings);
    bootstrap.barrier();
    windows[rank].assign(window->data(rank), window->data(rank) + b.window_bytes());
    EXPECT_EQ(executor.state().status, ExecutorState::Status::kDesynced);
  });
  const std::string name = collective_name(c);
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + outcomes[r].message);
    EXPECT_EQ(outcomes[r].kind, "DesyncError");
    EXPECT_LT(outcomes[r].elapsed, kFast);
    EXPECT_NE(outcomes[r].message.find("bucket 1 " + name), std::string::npos);
    EXPECT_NE(outcomes[r].message.find("bucket 2 " + name), std::string::npos);
    EXPECT_NE(outcomes[r].message.find(r == 2 ? "rank 0" : "rank 2"), std::string::npos);
  }
  EXPECT_NE(outcomes[2].message.find("rank 2 runs bucket 2 " + name + " at epoch 1"),
            std::string::npos) << outcomes[2].message;
  // Nothing crossed between the buckets: rank 2's window holds at most its own cast-in (all-gather),
  // and no bucket-2 data reached ranks 0 and 1.
  const std::size_t own = b.param(0).slot_offset(2), own_bytes = b.param(0).slot_bytes();
  const auto& w2 = windows[2];
  EXPECT_TRUE(all_poison(w2.data(), own));
  EXPECT_TRUE(all_poison(w2.data() + own + own_bytes, w2.size() - own - own_bytes));
  if (c == Collective::kReduceScatter) {
    EXPECT_TRUE(all_poison(w2.data() + own, own_bytes));
  }
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(all_poison(windows[r].data() + a.window_bytes(),
                           windows[r].size() - a.window_bytes())) << "rank " << r;
}

// Rank 0 ran one collective more than its peers (an all-gather nobody joined, which timed out),
// so it is an epoch ahead when everyone runs the next one. Rank 0 learns from its peers' failure
// that it is ahead; the ranks behind see rank 0's signals of the wrong epoch or collective. When the
// next collective is another one (reduce-scatter) that is a DesyncError everywhere. When it is the
// same all-gather again, the ranks behind cannot tell it from arriving late to the all-gather rank 0
// gave up on, and may report rank 0's TimeoutError instead. Either way: an error on every rank,
// naming both sides, long before the timeout, and no data moved.
TEST_P(Desync, ARankThatRanOneExtraCollectiveIsAnErrorNotAHang) {
  const Collective next = GetParam();
  for (int world : {2, 3}) {
    SCOPED_TRACE("W = " + std::to_string(world));
    const BucketLayout layout({{"w", {20, 6}}, {"n", {6}, DType::kFP32}}, Topology::single_node(world));
    std::vector<Outcome> outcomes(world);
    Outcome extra;
    std::vector<char> window_unchanged(world, 0);  // not vector<bool>: ranks write it concurrently
    harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
      auto window = HostWindow::create(bootstrap, layout.window_bytes());
      HostExecutor executor(*window, kTimeout);
      {
        test::RankBuffers buffers(layout, Collective::kAllGather, rank, 5);
        executor.run(plan_all_gather(layout, rank, 1), buffers.bindings);  // epoch 1, everyone
      }
      if (rank == 0) {  // the extra collective: nobody joins it
        HostExecutor quick(*window, std::chrono::milliseconds(200));
        test::RankBuffers buffers(layout, Collective::kAllGather, rank, 6);
        extra = run_and_catch(quick, plan_all_gather(layout, rank, 1), buffers.bindings);
      }
      bootstrap.barrier();
      const std::vector<std::byte> before(window->data(rank), window->data(rank) + layout.window_bytes());
      test::RankBuffers buffers(layout, next, rank, 7);
      outcomes[rank] = run_and_catch(executor, test::plan_for(next, layout, rank, 1), buffers.bindings);
      bootstrap.barrier();
      // Unchanged but for the rank's own slots, which an all-gather's cast-in rewrites first.
      std::vector<std::byte> after(window->data(rank), window->data(rank) + layout.window_bytes());
      if (next == Collective::kAllGather)
        for (const ParamLayout& p : layout.params())
          std::memcpy(after.data() + p.slot_offset(rank), before.data() + p.slot_offset(rank),
                      p.slot_bytes());
      window_unchanged[rank] = after == before;
    });
    const std::string name = collective_name(next);
    EXPECT_EQ(extra.kind, "TimeoutError") << extra.message;
    EXPECT_NE(extra.message.find("from rank 1 (bucket 1 all_gather, phase slot_free, epoch 2)"),
              std::string::npos) << extra.message;
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + ": " + outcomes[r].message);
      if (next == Collective::kReduceScatter) {
        EXPECT_EQ(outcomes[r].kind, "DesyncError");
      } else {
        EXPECT_TRUE(outcomes[r].kind == "DesyncError" || outcomes[r].kind == "TimeoutError");
      }
      EXPECT_LT(outcomes[r].elapsed, kFast);
    }
    // Rank 0, ahead: learns it from its peer's failure; the ranks behind: from rank 0's signal.
    EXPECT_NE(outcomes[0].message.find("rank 0: rank 1 failed ("), std::string::npos)
        << outcomes[0].message;
    EXPECT_NE(outcomes[0].message.find("Rank 0 is 1 collective(s) ahead of rank 1"),
              std::string::npos) << outcomes[0].message;
    EXPECT_NE(outcomes[0].message.find("epoch 3"), std::string::npos) << outcomes[0].message;
    // The ranks behind: from rank 0's signal of epoch 3, or of the failed extra collective at
    // epoch 2 (withdrawn, "abandoned"), or from a peer behind that failed on one of those first
    // (whose state, quoted, names rank 0).
    for (int r = 1; r < world; ++r) {
      const std::string& m = outcomes[r].message;
      EXPECT_NE(m.find("bucket 1 " + name), std::string::npos) << m;
      EXPECT_NE(m.find("epoch 2"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
      if (next == Collective::kReduceScatter) {
        EXPECT_TRUE(m.find("but rank 0 signalled bucket 1 all_gather at epoch 2 (since withdrawn") !=
                        std::string::npos ||
                    m.find("but rank 0 signalled bucket 1 reduce_scatter at epoch 3") !=
                        std::string::npos ||
                    m.find("a failure that started at rank 0") != std::string::npos) << m;
      }
    }
    EXPECT_TRUE(window_unchanged[0]) << "a rank pushed into the window of the rank ahead";
    if (world == 2) {
      EXPECT_TRUE(window_unchanged[1]) << "the rank ahead pushed into its peer";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Collectives, Desync,
                         ::testing::Values(Collective::kAllGather, Collective::kReduceScatter),
                         [](const auto& info) {
                           return info.param == Collective::kAllGather ? "AllGather"
                                                                       : "ReduceScatter";
                         });

// Rank 0 runs a program that never signals data-ready to rank 1 and moves on: rank 1 can never
// complete, and rank 0's next collective can never start. Both fail fast, naming each other.
TEST(Desync, ARankThatSkippedASignalIsCaughtByBothSides) {
  const int world = 2;
  const BucketLayout layout({{"w", {8, 4}}}, Topology::single_node(world));
  std::vector<Outcome> outcomes(world);
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window, kTimeout);
    test::RankBuffers buffers(layout, Collective::kAllGather, rank, 8);
    Program program = plan_all_gather(layout, rank, 1);
    if (rank == 0) {
      std::erase_if(program.steps, [](const Step& s) {
        const auto* signal = std::get_if<SignalOp>(&s.op);
        return signal != nullptr && signal->kind == FlagKind::kDataReady;
      });
      executor.run(program, buffers.bindings);  // completes: rank 1 signalled everything
      outcomes[0] = run_and_catch(executor, plan_all_gather(layout, rank, 2), buffers.bindings);
    } else {
      outcomes[1] = run_and_catch(executor, program, buffers.bindings);
    }
  });
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + outcomes[r].message);
    EXPECT_EQ(outcomes[r].kind, "DesyncError");
    EXPECT_LT(outcomes[r].elapsed, kFast);
    EXPECT_NE(outcomes[r].message.find("rank 0"), std::string::npos);
    EXPECT_NE(outcomes[r].message.find("rank 1"), std::string::npos);
  }
  EXPECT_TRUE(outcomes[0].message.find("rank 1 still waits at epoch 1 for data_ready from rank 0") !=
                  std::string::npos ||
              outcomes[0].message.find("rank 1 failed (desynced)") != std::string::npos)
      << outcomes[0].message;
  EXPECT_TRUE(outcomes[1].message.find("rank 0 has moved on to epoch 2") != std::string::npos ||
              outcomes[1].message.find("rank 0 failed (desynced)") != std::string::npos)
      << outcomes[1].message;
}

// Every rank publishes what it does; any thread can read it. Ranks 0 and 1 wait for rank 2, which
// first checks what the group and the process report about them.
TEST(ExecutorStates, PublishedStatesShowWhoWaitsOnWhom) {
  const int world = 3;
  const BucketLayout layout({{"w", {12, 4}}}, Topology::single_node(world));
  std::string group_view, process_view;
  std::vector<ExecutorState> final_states(world);
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window, kTimeout);
    EXPECT_EQ(executor.state().status, ExecutorState::Status::kIdle);
    bootstrap.barrier();
    if (rank == 2) {
      const auto limit = std::chrono::steady_clock::now() + kFast;
      while (executor.state(0).status != ExecutorState::Status::kWaiting ||
             executor.state(1).status != ExecutorState::Status::kWaiting ||
             executor.state(0).waiting_on != 2 || executor.state(1).waiting_on != 2) {
        ASSERT_LT(std::chrono::steady_clock::now(), limit) << executor.describe_group();
        std::this_thread::yield();
      }
      group_view = executor.describe_group();
      process_view = describe_executor_state();
      EXPECT_THROW(executor.state(3), InvalidArgument);
    }
    test::RankBuffers ag(layout, Collective::kAllGather, rank, 9);
    executor.run(plan_all_gather(layout, rank, 4), ag.bindings);
    test::RankBuffers rs(layout, Collective::kReduceScatter, rank, 9);
    executor.run(plan_reduce_scatter(layout, rank, {}, 4), rs.bindings);
    bootstrap.barrier();
    final_states[rank] = executor.state((rank + 1) % world);  // a peer's, read from here
  });
  for (const std::string& view : {group_view, process_view}) {
    EXPECT_NE(view.find("rank 0 (pid " + std::to_string(::getpid()) + "): waiting "),
              std::string::npos) << view;
    EXPECT_NE(view.find("for slot_free from rank 2 at step"), std::string::npos) << view;
    EXPECT_NE(view.find("of bucket 4 all_gather, epoch 1"), std::string::npos) << view;
    EXPECT_NE(view.find("rank 2: idle (no collective run on this window yet)"), std::string::npos)
        << view;
  }
  EXPECT_EQ(group_view.rfind("  rank 0 ", 0), 0u) << group_view;
  for (int r = 0; r < world; ++r) {
    const ExecutorState& s = final_states[r];
    EXPECT_EQ(s.status, ExecutorState::Status::kDone) << s.to_string();
    EXPECT_EQ(s.epoch, 2u);
    EXPECT_EQ(s.bucket, 4u);
    EXPECT_EQ(s.collective, Collective::kReduceScatter);
    EXPECT_EQ(s.pid, ::getpid());
    EXPECT_FALSE(s.exited);
    EXPECT_TRUE(s.consistent);
  }
  EXPECT_EQ(describe_executor_state(), "no host executors in this process\n");
}

// TIDE_DEBUG=1: a wait past half its timeout prints every rank's state once, and still completes.
TEST(ExecutorStates, DebugPrintsTheGroupAtHalfTheTimeout) {
  const int world = 2;
  const BucketLayout layout({{"w", {6, 2}}}, Topology::single_node(world));
  ::setenv("TIDE_DEBUG", "1", 1);
  ::testing::internal::CaptureStderr();
  harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window, std::chrono::milliseconds(rank == 0 ? 1000 : 10000));
    bootstrap.barrier();
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(600));
    test::RankBuffers buffers(layout, Collective::kAllGather, rank, 1);
    executor.run(plan_all_gather(layout, rank, 6), buffers.bindings);
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  ::unsetenv("TIDE_DEBUG");
  EXPECT_NE(err.find("tide debug: rank 0 (pid "), std::string::npos) << err;
  EXPECT_NE(err.find("(half its 1000 ms timeout) for slot_free from rank 1 (bucket 6 all_gather, "
                     "phase slot_free, epoch 1)"), std::string::npos) << err;
  EXPECT_NE(err.find("States of the group:\n  rank 0 (pid "), std::string::npos) << err;
  EXPECT_NE(err.find("\n  rank 1: idle"), std::string::npos) << err;
  EXPECT_EQ(err.find("tide debug", 1), std::string::npos) << "printed more than once:\n" << err;
}

}  // namespace
}  // namespace tide
