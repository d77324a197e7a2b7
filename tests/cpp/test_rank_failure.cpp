// A rank (a process) that fails *inside* an all-gather or reduce-scatter: SIGKILLed by the parent
// while it waits mid-collective, dead after its pushes but before its data-ready signals, or stuck
// (SIGSTOPped). Every survivor must throw TimeoutError within its configured timeout naming the
// missing rank, bucket, phase and epoch (and the dead rank's last published state), and no
// shared-memory segment may be left behind.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <cstdlib>

#include "process_util.hpp"
#include "rank_runner.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

using harness::RankProcesses;

constexpr int kWorld = 4;
constexpr int kVictim = 3;
constexpr uint32_t kBucket = 5;
constexpr uint64_t kEpoch = 3;  // the failing collective: after one good AG (1) and RS (2)

const BucketLayout& layout() {
  static const BucketLayout l({{"w", {96, 40}}, {"b", {40}, DType::kFP32}, {"e", {7, 3}, DType::kFP16}},
                              Topology::single_node(kWorld));
  return l;
}

// One checked AG and RS (epochs 1 and 2), so the failure happens on a window in use.
void good_steps(int rank, HostExecutor& executor, HostWindow& window) {
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
    test::RankBuffers buffers(layout(), c, rank, 11);
    executor.run(test::plan_for(c, layout(), rank, kBucket), buffers.bindings);
    const std::string bad = test::check_result(layout(), c, rank, 11, window.data(rank), buffers);
    if (!bad.empty()) throw std::runtime_error(bad);
  }
}

// A survivor: waits until the victim's slot-free signal of the failing collective is in its window
// (the victim is inside it), tells the parent, waits for "go", runs the collective and reports
// what it threw and after how long.
std::string survivor(Collective c, int rank, HostExecutor& executor, HostWindow& window,
                     const std::string& dir, bool wait_for_victim) {
  if (wait_for_victim) {
    FlagWord& f = window.flags(rank)[flag_index(FlagKind::kSlotFree, kVictim, kWorld)];
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::atomic_ref<uint64_t>(f.epoch).load(std::memory_order_acquire) < kEpoch)
      if (std::chrono::steady_clock::now() > limit) return "the victim never entered";
    test::touch(dir + "/in." + std::to_string(rank));
    if (!test::wait_for_file(dir + "/go")) return "no go from the parent";
  }
  test::RankBuffers buffers(layout(), c, rank, 12);
  const auto start = std::chrono::steady_clock::now();
  try {
    executor.run(test::plan_for(c, layout(), rank, kBucket), buffers.bindings);
    return "no error";
  } catch (...) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - start).count();
    return "after " + std::to_string(ms) + " ms: " + harness::describe_exception(std::current_exception());
  }
}

long elapsed_ms(const std::string& report) { return std::atol(report.c_str() + 6); }

// What every survivor's report must say: a TimeoutError thrown within `timeout_ms`, naming the
// victim, the collective, the epoch and (when it waited on the victim itself) the data-ready phase
// it waited in plus `fragments`. A survivor may instead wait on another survivor that failed first
// (then its error propagates, naming the rank the failure started at), but at least one fails on
// the victim directly.
void expect_survivors_failed(const RankProcesses& run, Collective c, long timeout_ms,
                             const std::vector<std::string>& fragments) {
  ASSERT_FALSE(run.hung) << "a rank hung";
  const std::string coll = std::string("bucket 5 ") + collective_name(c);
  int direct = 0;
  for (int r = 0; r < kWorld; ++r) {
    if (r == kVictim) continue;
    const std::string& m = run.reports[r];
    SCOPED_TRACE("rank " + std::to_string(r) + " reported: " + m);
    ASSERT_EQ(m.rfind("after ", 0), 0u);
    EXPECT_NE(m.find(" ms: TimeoutError: rank " + std::to_string(r) + ": "), std::string::npos);
    EXPECT_LE(elapsed_ms(m), timeout_ms + 500);  // the bound, plus scheduling slack
    if (m.find("data_ready from rank 3 (" + coll + ", phase data_ready, epoch 3)") !=
        std::string::npos) {
      ++direct;
      for (const std::string& f : fragments) EXPECT_NE(m.find(f), std::string::npos) << f;
    } else {
      EXPECT_NE(m.find("a failure that started at rank 3"), std::string::npos);
      EXPECT_NE(m.find(coll), std::string::npos);
      EXPECT_NE(m.find("epoch 3"), std::string::npos);
    }
  }
  EXPECT_GE(direct, 1);
  EXPECT_EQ(test::shm_segments_of(run.pids), std::set<std::string>{})
      << "shared-memory segments leaked";
}

// A rank of the RankFailure tests: good collectives, then the victim enters one more (and is
// killed or stopped there by the parent) while the survivors wait for it (survivor()).
std::string victim_or_survivor(Collective c, int rank, Bootstrap& bootstrap, long timeout_ms,
                               const std::string& dir) {
  auto window = HostWindow::create(bootstrap, layout().window_bytes());
  HostExecutor executor(*window, std::chrono::milliseconds(rank == kVictim ? 60000 : timeout_ms));
  good_steps(rank, executor, *window);
  if (rank == kVictim) {
    test::RankBuffers buffers(layout(), c, rank, 12);
    executor.run(test::plan_for(c, layout(), rank, kBucket), buffers.bindings);
    return "the victim completed";
  }
  return survivor(c, rank, executor, *window, dir, /*wait_for_victim=*/true);
}

class RankFailure : public ::testing::TestWithParam<Collective> {};

// The victim enters the collective (signals slot-free to everyone) and blocks waiting for rank 0,
// which starts only after the parent has SIGKILLed and reaped the victim: the survivors push into
// the dead rank's window (still mapped) and wait for its data-ready signal, which never comes.
TEST_P(RankFailure, KilledByTheParentWhileWaitingInsideTheCollective) {
  const Collective c = GetParam();
  const long timeout_ms = 3000;
  int victim_status = 0;
  const harness::TempDir dir;
  const RankProcesses run = harness::run_rank_processes(
      kWorld,
      [&](int rank, Bootstrap& bootstrap) {
        return victim_or_survivor(c, rank, bootstrap, timeout_ms, dir.path());
      },
      {.dir = dir.path(), .while_running = [&](const std::vector<pid_t>& pids) {
         for (int r = 0; r < kWorld; ++r)
           if (r != kVictim) test::wait_for_file(dir.path() + "/in." + std::to_string(r));
         ::kill(pids[kVictim], SIGKILL);
         ::waitpid(pids[kVictim], &victim_status, 0);
         test::touch(dir.path() + "/go");
       }});
  EXPECT_TRUE(WIFSIGNALED(victim_status) && WTERMSIG(victim_status) == SIGKILL);
  EXPECT_EQ(run.reports[kVictim].rfind("no result", 0), 0u) << run.reports[kVictim];
  const std::string pid = std::to_string(run.pids[kVictim]);
  // Its process is gone, so the survivors need not wait for the timeout; its last published state
  // shows where it was: inside the collective, waiting for rank 0.
  expect_survivors_failed(run, c, timeout_ms,
                          {"rank 3 (pid " + pid + ") has exited",
                           "its last state: rank 3 (pid " + pid + ", exited): waiting",
                           "for slot_free from rank 0 at step",
                           std::string("of bucket 5 ") + collective_name(c) + ", epoch 3"});
}

// The victim runs the collective only up to its pushes (its program without the data-ready
// signals, waits and reduces) and then dies: its data is in the survivors' windows but they are
// never told, so they must not complete.
TEST_P(RankFailure, DiesAfterItsPushesBeforeItsSignals) {
  const Collective c = GetParam();
  const long timeout_ms = 3000;
  const harness::TempDir dir;
  const RankProcesses run = harness::run_rank_processes(
      kWorld, [&](int rank, Bootstrap& bootstrap) {
        auto window = HostWindow::create(bootstrap, layout().window_bytes());
        HostExecutor executor(*window, std::chrono::milliseconds(timeout_ms));
        good_steps(rank, executor, *window);
        if (rank == kVictim) {
          Program program = test::plan_for(c, layout(), rank, kBucket, {}, Delivery::kPush);
          std::erase_if(program.steps, [](const Step& s) {
            return s.phase == Phase::kDataReady || s.phase == Phase::kReduce;
          });
          bool pushes = false;
          for (const Step& s : program.steps) pushes |= std::holds_alternative<CopyBatch>(s.op);
          if (!pushes) return std::string("the truncated program pushes nothing");
          test::RankBuffers buffers(layout(), c, rank, 12);
          executor.run(program, buffers.bindings);
          ::kill(::getpid(), SIGKILL);
        }
        return survivor(c, rank, executor, *window, dir.path(), /*wait_for_victim=*/false);
      },
      {.dir = dir.path()});
  EXPECT_TRUE(WIFSIGNALED(run.statuses[kVictim]) && WTERMSIG(run.statuses[kVictim]) == SIGKILL);
  const std::string pid = std::to_string(run.pids[kVictim]);
  expect_survivors_failed(run, c, timeout_ms,
                          {"rank 3 (pid " + pid + ") has exited",
                           std::string("its last state: rank 3 (pid ") + pid +
                               ", exited): done with bucket 5 " + collective_name(c) +
                               ", epoch 3"});
}

// The victim is stopped (SIGSTOP) inside the collective: its process is alive, so the survivors
// must wait the full timeout and then fail, naming it and where it is stuck. With TIDE_DEBUG=1
// they print every rank's state at half the timeout.
TEST_P(RankFailure, StuckRankTimesOutAtTheConfiguredTimeout) {
  const Collective c = GetParam();
  const long timeout_ms = 1000;
  const harness::TempDir dir;
  const RankProcesses run = harness::run_rank_processes(
      kWorld,
      [&](int rank, Bootstrap& bootstrap) {
        const std::string log = dir.path() + "/stderr." + std::to_string(rank);
        if (rank != kVictim) {
          ::setenv("TIDE_DEBUG", "1", 1);
          if (!std::freopen(log.c_str(), "w", stderr)) return std::string("cannot redirect stderr");
        }
        std::string report = victim_or_survivor(c, rank, bootstrap, timeout_ms, dir.path());
        std::fflush(stderr);
        std::ifstream in(log);
        std::string debug;
        std::getline(in, debug, '\0');
        return report + "\nstderr: " + debug;
      },
      {.dir = dir.path(), .while_running = [&](const std::vector<pid_t>& pids) {
         for (int r = 0; r < kWorld; ++r)
           if (r != kVictim) test::wait_for_file(dir.path() + "/in." + std::to_string(r));
         ::kill(pids[kVictim], SIGSTOP);
         test::touch(dir.path() + "/go");
         for (int r = 0; r < kWorld; ++r)
           if (r != kVictim) test::wait_for_file(dir.path() + "/report." + std::to_string(r));
         ::kill(pids[kVictim], SIGKILL);
       }});
  const std::string pid = std::to_string(run.pids[kVictim]);
  expect_survivors_failed(
      run, c, timeout_ms,
      {"timed out after 1000 ms waiting for data_ready from rank 3",
       "its state: rank 3 (pid " + pid + "): waiting", "for slot_free from rank 0 at step",
       // TIDE_DEBUG's dump at half the timeout: every rank's line.
       "tide debug: rank ", "(half its 1000 ms timeout) for data_ready from rank 3",
       "States of the group:\n  rank 0 (pid ", "\n  rank 3 (pid " + pid + "): waiting"});
  for (int r = 0; r < kWorld; ++r) {
    if (r == kVictim) continue;
    EXPECT_GE(elapsed_ms(run.reports[r]), timeout_ms) << run.reports[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Collectives, RankFailure,
                         ::testing::Values(Collective::kAllGather, Collective::kReduceScatter),
                         [](const auto& info) {
                           return info.param == Collective::kAllGather ? "AllGather"
                                                                       : "ReduceScatter";
                         });

}  // namespace
}  // namespace tide
