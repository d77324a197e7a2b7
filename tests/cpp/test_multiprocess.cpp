// Ranks as real processes over POSIX shared memory, bootstrapped through a rendezvous directory;
// a rank killed mid-collective; no shared-memory segment left behind.
#include <gtest/gtest.h>

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "test_util.hpp"

namespace tide {
namespace {

using test::Buffer;

std::string make_temp_dir() {
  char tmpl[] = "/tmp/tide-test-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (!dir) throw std::runtime_error("mkdtemp failed");
  return dir;
}

std::set<std::string> shm_segments() {
  std::set<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, "tide.", 5) == 0) names.insert(e->d_name);
    ::closedir(d);
  }
  return names;
}

// Forks `world` ranks running body(rank, bootstrap); each writes its error (or "ok") to a file.
// Returns the messages. `killed` ranks are SIGKILLed by the parent after they reach the rendezvous.
std::vector<std::string> run_processes(int world,
                                       const std::function<void(int, Bootstrap&)>& body) {
  const std::string dir = make_temp_dir();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::string message = "ok";
      try {
        FileBootstrap bootstrap(dir, r, world, std::chrono::milliseconds(20000));
        body(r, bootstrap);
      } catch (const std::exception& e) {
        message = e.what();
      }
      std::ofstream(dir + "/result." + std::to_string(r)) << message;
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) ::waitpid(pid, nullptr, 0);
  std::vector<std::string> messages(world);
  for (int r = 0; r < world; ++r) {
    std::ifstream in(dir + "/result." + std::to_string(r));
    std::getline(in, messages[r], '\0');
  }
  std::filesystem::remove_all(dir);
  return messages;
}

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
  const auto before = shm_segments();
  const auto messages = run_processes(world, [&](int rank, Bootstrap& bootstrap) {
    std::mt19937_64 rng(500 + world);  // same sequence on every rank: same layouts
    auto window = HostWindow::create(bootstrap, 1 << 20);
    HostExecutor executor(*window, std::chrono::milliseconds(20000));
    for (int n = 0; n < 10; ++n) {
      BucketLayout layout(test::random_specs(rng, world, 4, 1 << 12), Topology::single_node(world));
      ag_rs_step(layout, rank, executor, *window, n);
    }
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(messages[r], "ok") << "rank " << r;
  EXPECT_EQ(shm_segments(), before) << "shared-memory segments leaked";
}
INSTANTIATE_TEST_SUITE_P(W, MultiProcess, ::testing::Values(2, 3, 4, 8));

TEST(MultiProcess, KilledRankMakesSurvivorsTimeOutAndLeavesNoSegments) {
  const int world = 4;
  const auto before = shm_segments();
  BucketLayout layout({{"w", {64, 16}}}, Topology::single_node(world));
  const auto messages = run_processes(world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, layout.window_bytes());
    HostExecutor executor(*window, std::chrono::milliseconds(500));
    ag_rs_step(layout, rank, executor, *window, 3);  // one good step first
    if (rank == 3) ::kill(::getpid(), SIGKILL);      // dies between collectives
    ag_rs_step(layout, rank, executor, *window, 4);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(messages[r].find("timed out after 500 ms"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("from rank 3"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("bucket 1 all_gather"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("epoch 3"), std::string::npos) << messages[r];
  }
  EXPECT_EQ(messages[3], "");  // killed: wrote nothing
  EXPECT_EQ(shm_segments(), before) << "shared-memory segments leaked";
}

}  // namespace
}  // namespace tide
