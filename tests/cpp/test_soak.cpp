// Soak: a long random sequence of all-gathers and reduce-scatters of many buckets (random sizes and
// dtypes) over a small pool of windows shared by the buckets (Slot-Reuse), on W rank threads, with
// windows re-created now and then. Every result is checked against a reference (all-gather bitwise,
// reduce-scatter against fp64), and between the end of the first quarter and the end the process
// must not grow: no more open file descriptors, no shared-memory segments left, and (outside
// AddressSanitizer, whose quarantine holds freed memory) no more resident memory.
// TIDE_SOAK_ITERATIONS sets the number of collectives (default 2000; scripts/soak.sh runs 10^4).
#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <random>

#include "process_util.hpp"
#include "rank_runner.hpp"
#include "test_util.hpp"

#if defined(__SANITIZE_ADDRESS__)
#define TIDE_SOAK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TIDE_SOAK_ASAN 1
#endif
#endif

namespace tide {
namespace {

constexpr int kWorld = 4;
constexpr int kLayouts = 12;  // random ones, plus two large
constexpr int kSeeds = 2;  // two data sets per layout, so a stale result cannot pass
constexpr int kPool = 3;   // windows shared by all buckets
constexpr long kRssSlackBytes = 8 << 20;

long soak_iterations() {
  const char* env = std::getenv("TIDE_SOAK_ITERATIONS");
  const long n = env && *env ? std::atol(env) : 2000;
  return std::max(8L, n);
}

struct Usage {
  long rss_bytes = 0;
  long fds = 0;
};

Usage usage() {
  Usage u;
  long pages = 0, resident = 0;
  std::ifstream("/proc/self/statm") >> pages >> resident;
  u.rss_bytes = resident * ::sysconf(_SC_PAGESIZE);
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++u.fds;
    ::closedir(d);
  }
  return u;
}

// One bucket's data set: the references every rank checks against.
struct Case {
  BucketLayout layout;
  uint64_t seed;
  std::vector<std::vector<std::byte>> ag_expected;      // [param]
  std::vector<std::vector<std::vector<double>>> rs_ref;  // [rank][param]
};

TEST(Soak, RandomCollectivesOverPooledWindowsStayCorrectAndDoNotLeak) {
  const long iterations = soak_iterations();
  std::mt19937_64 rng(2024);
  std::vector<Case> cases;
  std::size_t pool_bytes = 0;
  std::vector<BucketLayout> layouts;
  for (int l = 0; l < kLayouts; ++l)
    layouts.emplace_back(test::random_specs(rng, kWorld, 6, 1 << 14), Topology::single_node(kWorld));
  // Two large ones, so windows range from a few hundred bytes to a few MiB.
  layouts.emplace_back(std::vector<ParamSpec>{{"q", {1024, 1024}}, {"norm", {1024}, DType::kFP32}},
                       Topology::single_node(kWorld));
  layouts.emplace_back(std::vector<ParamSpec>{{"emb", {5003, 96}, DType::kFP16, DType::kFP16}},
                       Topology::single_node(kWorld));
  for (std::size_t l = 0; l < layouts.size(); ++l) {
    const BucketLayout& layout = layouts[l];
    pool_bytes = std::max(pool_bytes, layout.window_bytes());
    for (int s = 0; s < kSeeds; ++s) {
      Case c{layout, static_cast<uint64_t>(100 * l + s), {}, {}};
      for (std::size_t i = 0; i < layout.num_params(); ++i)
        c.ag_expected.push_back(test::ag_expected(layout.param(i), int(i), kWorld, c.seed));
      c.rs_ref.resize(kWorld);
      for (int r = 0; r < kWorld; ++r)
        for (std::size_t i = 0; i < layout.num_params(); ++i)
          c.rs_ref[r].push_back(test::rs_reference(layout.param(i), int(i), r, kWorld, c.seed, {}));
      cases.push_back(std::move(c));
    }
  }

  Usage early, late;
  std::vector<std::string> errors(kWorld);
  std::vector<long> collectives(kWorld, 0);
  const auto start = std::chrono::steady_clock::now();
  harness::run_rank_threads_or_throw(kWorld, [&](int rank, Bootstrap& bootstrap) {
    // This rank's inputs and outputs for every case, made once.
    std::vector<test::RankBuffers> ag, rs;
    for (const Case& c : cases) {
      ag.emplace_back(c.layout, Collective::kAllGather, rank, c.seed);
      rs.emplace_back(c.layout, Collective::kReduceScatter, rank, c.seed);
    }
    std::vector<std::unique_ptr<HostWindow>> windows;
    std::vector<std::unique_ptr<HostExecutor>> executors;
    for (int w = 0; w < kPool; ++w) {
      windows.push_back(HostWindow::create(bootstrap, pool_bytes + w * 4096));
      executors.push_back(std::make_unique<HostExecutor>(*windows[w], std::chrono::seconds(20)));
    }
    std::mt19937_64 sequence(7);  // the same choices on every rank
    for (long n = 0; n < iterations; ++n) {
      if (n == iterations / 4 || n == iterations - 1) {  // measure with every rank at this point
        bootstrap.barrier();
        if (rank == 0) (n == iterations / 4 ? early : late) = usage();
        bootstrap.barrier();
      }
      const std::size_t k = sequence() % cases.size();
      const Case& c = cases[k];
      const Collective coll = sequence() % 2 ? Collective::kAllGather : Collective::kReduceScatter;
      const int w = static_cast<int>(sequence() % kPool);
      if (sequence() % std::max(1L, iterations / 8) == 0) {  // re-create this window now and then
        executors[w].reset();
        windows[w].reset();
        windows[w] = HostWindow::create(bootstrap, pool_bytes + w * 4096);
        executors[w] = std::make_unique<HostExecutor>(*windows[w], std::chrono::seconds(20));
      }
      HostWindow& window = *windows[w];
      const uint32_t bucket = static_cast<uint32_t>(k / kSeeds);  // one bucket id per layout
      try {
        if (coll == Collective::kAllGather) {
          // Nobody writes into this rank's window between its collectives: poison it, so a
          // result left by an earlier bucket cannot pass.
          std::memset(window.data(rank), 0xA5, c.layout.window_bytes());
          executors[w]->run(plan_all_gather(c.layout, rank, bucket), ag[k].bindings);
          for (std::size_t i = 0; i < c.layout.num_params(); ++i) {
            const ParamLayout& p = c.layout.param(i);
            if (std::memcmp(window.data(rank) + p.window_offset, c.ag_expected[i].data(),
                            c.ag_expected[i].size()) != 0)
              throw std::runtime_error("all-gather mismatch, param " + std::to_string(i));
          }
        } else {
          for (auto& b : rs[k].outputs) std::fill(b.bytes.begin(), b.bytes.end(), std::byte{0x7F});
          executors[w]->run(plan_reduce_scatter(c.layout, rank, {}, bucket), rs[k].bindings);
          for (std::size_t i = 0; i < c.layout.num_params(); ++i) {
            const auto& ref = c.rs_ref[rank][i];
            std::vector<double> got(ref.size());
            for (std::size_t e = 0; e < ref.size(); ++e) got[e] = rs[k].outputs[i].at(e);
            const double tol = c.layout.param(i).shard_dtype == DType::kFP32 ? 1e-6 : 1e-2;
            if (test::relative_error(got, ref) > tol)
              throw std::runtime_error("reduce-scatter mismatch, param " + std::to_string(i));
          }
        }
      } catch (const std::exception& e) {
        errors[rank] = "collective " + std::to_string(n) + " (" + collective_name(coll) +
                       " of bucket " + std::to_string(bucket) + " on window " + std::to_string(w) +
                       "): " + e.what();
        return;
      }
      ++collectives[rank];
    }
    for (const auto& e : executors) {
      const ExecutorState s = e->state();
      if (s.status != ExecutorState::Status::kDone && s.status != ExecutorState::Status::kIdle)
        errors[rank] = "executor not done at the end: " + s.to_string();
    }
  }, std::chrono::seconds(120));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(collectives[r], iterations) << "rank " << r;
  }
  std::size_t smallest = SIZE_MAX, largest = 0;
  for (const Case& c : cases)
    smallest = std::min(smallest, c.layout.window_bytes()), largest = std::max(largest, c.layout.window_bytes());
  std::printf("[   SOAK   ] %ld collectives x %d ranks (windows of %zu B to %zu B) in %.1f s; "
              "fds %ld -> %ld; RSS %.1f -> %.1f MiB\n", iterations, kWorld, smallest, largest,
              seconds, early.fds, late.fds, early.rss_bytes / 1048576.0, late.rss_bytes / 1048576.0);
  EXPECT_LE(late.fds, early.fds) << "open file descriptors grew";
  EXPECT_EQ(test::shm_segments_of({::getpid()}), std::set<std::string>{})
      << "shared-memory segments left in /dev/shm";
#ifndef TIDE_SOAK_ASAN
  EXPECT_LE(late.rss_bytes - early.rss_bytes, kRssSlackBytes) << "resident memory grew";
#endif
}

}  // namespace
}  // namespace tide
