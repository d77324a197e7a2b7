// Bad input is rejected at the API boundary with an error naming the argument and what was expected.
#include <gtest/gtest.h>

#include <cstdlib>

#include "rank_runner.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

// Expects `fn` to throw E whose message contains every fragment.
template <class E = InvalidArgument, class Fn>
void expect_error(Fn&& fn, std::initializer_list<const char*> fragments) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one mentioning " << *fragments.begin();
  } catch (const E& e) {
    for (const char* f : fragments)
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos)
          << "message: " << e.what() << "\nmissing: " << f;
  }
}

TEST(ApiErrors, Layout) {
  const Topology t = Topology::single_node(4);
  expect_error([&] { BucketLayout({}, t); }, {"params", "at least one param"});
  expect_error([&] { BucketLayout({{"w", {4, 0}}}, t); }, {"param 0 ('w')", "shape[1] = 0", "> 0"});
  expect_error([&] { BucketLayout({{"w", {-3}}}, t); }, {"shape[0] = -3", "> 0"});
  expect_error([&] { BucketLayout({{"w", {4}}}, t, 128); }, {"alignment = 128", "power of two >= 256"});
  expect_error([&] { BucketLayout({{"w", {4}}}, t, 300); }, {"alignment = 300"});
  expect_error([&] { BucketLayout({{"w", {1 << 30, 1 << 30}}}, t); }, {"2^40 elements"});
  expect_error([&] { Topology::single_node(0); }, {"local = 0", ">= 1"});
  expect_error([&] { BucketLayout({{"w", {4}}}, Topology{0, 2}); }, {"nodes = 0"});
  expect_error([&] { BucketLayout({{"w", {4}}}, t).param(1); }, {"i = 1", "< 1"});
}

TEST(ApiErrors, Plan) {
  BucketLayout layout({{"w", {8, 2}}}, Topology::single_node(4));
  expect_error([&] { plan_all_gather(layout, 4); }, {"plan_all_gather", "rank = 4", "in [0, 4)"});
  expect_error([&] { plan_reduce_scatter(layout, -1, {}); }, {"rank = -1"});
  ReduceOptions bad;
  bad.kind = static_cast<ReduceKind>(9);
  expect_error([&] { plan_reduce_scatter(layout, 0, bad); }, {"options.kind = 9"});
  BucketLayout fp16_out({{"w", {8}, DType::kBF16, DType::kFP16}}, Topology::single_node(2));
  expect_error([&] { plan_reduce_scatter(fp16_out, 0, {}); },
               {"shard_dtype = fp16", "fp32 or the param's dtype bf16"});
}

TEST(ApiErrors, ExecutorRejectsMismatchedProgramsAndBindings) {
  BucketLayout small({{"w", {8, 2}}}, Topology::single_node(2));
  BucketLayout big({{"w", {4096, 64}}}, Topology::single_node(2));
  BucketLayout four({{"w", {8, 2}}}, Topology::single_node(4));
  harness::run_rank_threads_or_throw(2, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, small.window_bytes());
    HostExecutor executor(*window);
    std::vector<float> shard(8);
    const void* in = shard.data();
    expect_error([&] { AllGather(four, rank).run(executor, {&in, 1}); },
                 {"program.world = 4", "2 (the window's W)"});
    expect_error([&] { executor.run(plan_all_gather(small, 1 - rank), {{in}, {}}); },
                 {"program.rank", "(the window's rank)"});
    expect_error([&] { AllGather(big, rank).run(executor, {&in, 1}); },
                 {"window data bytes", "the bucket's window size"});
    expect_error([&] { executor.run(plan_all_gather(small, rank), {{}, {}}); },
                 {"inputs.size() = 0", "1 (one per param)"});
    expect_error([&] { executor.run(plan_all_gather(small, rank), {{nullptr}, {}}); },
                 {"inputs[0] = null", "a buffer"});
    expect_error([&] { executor.run(plan_reduce_scatter(small, rank, {}), {{in}, {}}); },
                 {"outputs.size() = 0", "1 (one per param)"});
    expect_error([&] { executor.run(plan_reduce_scatter(small, rank, {}), {{in}, {nullptr}}); },
                 {"outputs[0] = null"});
    EXPECT_EQ(window->epoch(), 0u) << "a rejected run must not consume an epoch";
  });
  const Program p = plan_all_gather(small, 0);
  alignas(512) static char buffer[1024];
  expect_error([&] { validate_run(p, {{buffer}, {}}, 0, 2, 1 << 20, buffer + 16); },
               {"window base", "aligned to 256 B"});
}

TEST(ApiErrors, ReducePartialsOnlyInTheOwnWindowOfMultiNodePrograms) {
  alignas(256) static char window[1 << 16];
  float grad[64] = {}, out[64] = {};
  const void* in = grad;
  auto reduces = [](Program& p) {
    std::vector<ReduceOp*> found;
    for (Step& s : p.steps)
      if (auto* r = std::get_if<ReduceOp>(&s.op)) found.push_back(r);
    return found;
  };
  BucketLayout one({{"w", {8, 2}}}, Topology::single_node(2));
  Program p = plan_reduce_scatter(one, 0, {});
  reduces(p).at(0)->partial = Address{Space::kWindow, 0, 0};
  expect_error([&] { validate_run(p, {{in}, {out}}, 0, 2, sizeof window, window, true); },
               {"partial", "unset (single node)"});
  // Two ranks per node: the ring sends partial sums (with one, the raw gradient).
  BucketLayout two({{"w", {8, 2}}}, Topology{2, 2});
  Program q = plan_reduce_scatter(two, 0, {}, 0);
  ReduceOp* fused = nullptr;
  for (ReduceOp* r : reduces(q))
    if (r->partial) fused = r;
  ASSERT_NE(fused, nullptr) << "the ring adds the local chunks onto the received partial";
  fused->partial_dtype = DType::kFP16;  // a dtype no wire carries: refused before anything runs
  expect_error([&] { validate_run(q, {{in}, {out}}, 0, 4, sizeof window, window, true); },
               {"partial_dtype = fp16", "fp32 or bf16"});
  fused->partial_dtype = DType::kFP32;
  fused->partial->offset = sizeof window - 4;
  expect_error([&] { validate_run(q, {{in}, {out}}, 0, 4, sizeof window, window, true); },
               {"partial", "inside the window"});
  fused->partial->offset = 2;
  expect_error([&] { validate_run(q, {{in}, {out}}, 0, 4, sizeof window, window, true); },
               {"partial.offset = 2", "a multiple of 4"});
  fused->partial = Address{Space::kWindow, 1, 0};
  expect_error([&] { validate_run(q, {{in}, {out}}, 0, 4, sizeof window, window, true); },
               {"partial", "in the own window"});
}

TEST(ApiErrors, WindowsAndBootstraps) {
  expect_error([&] { FileBootstrap("/nonexistent/dir", 0, 2, std::chrono::milliseconds(10)); },
               {"dir = '/nonexistent/dir'", "an existing directory"});
  expect_error([&] { FileBootstrap("/tmp", 2, 2, std::chrono::milliseconds(10)); },
               {"rank = 2", "in [0, 2)"});
  expect_error([&] { FileBootstrap("/tmp", 0, 0, std::chrono::milliseconds(10)); }, {"world = 0"});
  expect_error([&] { FileBootstrap("/tmp", 0, 1, std::chrono::milliseconds(0)); }, {"timeout_ms = 0"});
  expect_error([&] { make_thread_rendezvous(0); }, {"world = 0"});
  // Ranks asking for different window sizes.
  std::vector<std::string> messages(2);
  harness::run_rank_threads_or_throw(2, [&](int rank, Bootstrap& bootstrap) {
    try {
      HostWindow::create(bootstrap, rank == 0 ? 4096 : 8192);
    } catch (const InvalidArgument& e) {
      messages[rank] = e.what();
    }
  });
  EXPECT_NE(messages[0].find("data_bytes of rank 1 = 8192, expected 4096"), std::string::npos)
      << messages[0];
  harness::run_rank_threads_or_throw(1, [&](int, Bootstrap& bootstrap) {
    expect_error([&] { HostWindow::create(bootstrap, 0); }, {"data_bytes = 0", "> 0"});
  });
}

TEST(ApiErrors, BootstrapTimesOutNamingMissingRanks) {
  char tmpl[] = "/tmp/tide-boot-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  FileBootstrap bootstrap(dir, 0, 3, std::chrono::milliseconds(100));
  expect_error<TimeoutError>([&] { bootstrap.allgather("x"); },
                             {"rank 0 waited 100 ms in round 0 for rank(s) 1 2"});
}

TEST(ApiErrors, TimeoutEnvironmentVariable) {
  ::setenv("TIDE_TIMEOUT_MS", "abc", 1);
  expect_error([&] { default_timeout(); }, {"TIDE_TIMEOUT_MS = 'abc'", "a positive integer"});
  ::setenv("TIDE_TIMEOUT_MS", "250", 1);
  EXPECT_EQ(default_timeout().count(), 250);
  ::unsetenv("TIDE_TIMEOUT_MS");
  EXPECT_EQ(default_timeout().count(), 120000);
}

TEST(ApiErrors, DebugEnvironmentVariable) {
  ::setenv("TIDE_DEBUG", "yes", 1);
  expect_error([&] { debug_enabled(); }, {"TIDE_DEBUG = 'yes'", "0 or 1"});
  harness::run_rank_threads_or_throw(1, [&](int, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, 4096);
    expect_error([&] { HostExecutor executor(*window); }, {"TIDE_DEBUG = 'yes'"});
  });
  ::setenv("TIDE_DEBUG", "1", 1);
  EXPECT_TRUE(debug_enabled());
  ::setenv("TIDE_DEBUG", "0", 1);
  EXPECT_FALSE(debug_enabled());
  ::unsetenv("TIDE_DEBUG");
  EXPECT_FALSE(debug_enabled());
}

}  // namespace
}  // namespace tide
