// CudaExecutor runs captured into CUDA graphs: replays bitwise equal to run-by-run runs, in any
// interleaving with them and with another graph of the same window (ranks as processes: the
// stream path; as threads: the cast-to-peers kernel too); a peer that stops replaying ends the
// waiting process within the timeout, naming the peer; what cannot be captured is refused before
// anything moves. Without a GPU every test skips, saying so.
#include <cuda_runtime.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_harness.hpp"

namespace tide {
namespace {

using namespace gpu_test;
using namespace std::chrono_literals;

// `program` run on `stream` while it captures, as an executable graph.
cudaGraphExec_t capture(CudaExecutor& executor, cudaStream_t stream, const Program& program,
                        const Bindings& bindings) {
  cudaGraph_t graph = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    executor.run(program, bindings);
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &graph);
    if (graph) (void)cudaGraphDestroy(graph);
    throw;
  }
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return exec;
}

// One rank: an all-gather and a reduce-scatter of one window, each run once run-by-run (the
// reference), then captured into a graph of its own; then `rounds` rounds of both, each one
// replayed or run again run-by-run in alternation, its destination poisoned before. Returns the
// first difference from the reference, or "ok". Every rank runs every round, whatever it found: a
// rank that stopped early would leave its peers' replays waiting.
std::string replay_rank(const Scenario& s, int rank, Bootstrap& b, bool threads, int rounds) {
  CHECK_CUDA(cudaSetDevice(0));
  const BucketLayout layout = s.layout();
  std::vector<RankData> data;
  std::vector<std::vector<DeviceBuffer>> inputs(2), outputs(2);
  std::vector<Bindings> bindings(2);
  for (std::size_t j = 0; j < 2; ++j) {
    data.push_back(make_rank_data(layout, s.sequence[j], rank));
    for (const auto& in : data[j].inputs) {
      inputs[j].emplace_back(in.size());
      CHECK_CUDA(cudaMemcpy(inputs[j].back().ptr, in.data(), in.size(), cudaMemcpyHostToDevice));
      bindings[j].inputs.push_back(inputs[j].back().ptr);
    }
    for (const auto& out : data[j].outputs) {
      outputs[j].emplace_back(out.size());
      bindings[j].outputs.push_back(outputs[j].back().ptr);
    }
  }
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto window = CudaWindow::create(b, window_bytes(s));
  std::string verdict = "ok";
  {
    CudaExecutor executor(*window, stream, 30000ms);
    std::vector<Program> programs;
    for (const Invocation& inv : s.sequence) programs.push_back(plan(s, layout, inv, rank));
    std::vector<std::byte> host(layout.window_bytes());
    // Poisons invocation j's destination, runs it (replay or run-by-run), returns what it wrote.
    auto once = [&](std::size_t j, cudaGraphExec_t graph) {
      if (j == 0)
        CHECK_CUDA(cudaMemsetAsync(window->data(rank), 0x5A, layout.window_bytes(), stream));
      for (std::size_t i = 0; i < bindings[j].outputs.size(); ++i)
        CHECK_CUDA(cudaMemsetAsync(bindings[j].outputs[i], 0x77, data[j].outputs[i].size(), stream));
      if (threads) {  // ranks as threads: no pageable copy while a peer's stream waits
        CHECK_CUDA(cudaStreamSynchronize(stream));
        b.barrier();
      }
      if (graph)
        CHECK_CUDA(cudaGraphLaunch(graph, stream));
      else
        executor.run(programs[j], bindings[j]);
      executor.synchronize();
      CHECK_CUDA(cudaStreamSynchronize(stream));
      if (threads) b.barrier();
      RankData d = data[j];
      if (j == 0) {
        CHECK_CUDA(cudaMemcpy(host.data(), window->data(rank), host.size(), cudaMemcpyDeviceToHost));
        return capture_window(layout, host.data());
      }
      for (std::size_t i = 0; i < d.outputs.size(); ++i)
        CHECK_CUDA(cudaMemcpy(d.outputs[i].data(), bindings[j].outputs[i], d.outputs[i].size(),
                              cudaMemcpyDeviceToHost));
      return capture_outputs(layout, d, rank);
    };
    std::vector<std::vector<std::byte>> reference;
    for (std::size_t j = 0; j < 2; ++j) reference.push_back(once(j, nullptr));
    std::vector<cudaGraphExec_t> graphs;
    if (threads) b.barrier();  // no peer thread's copies beside the captures (doubt, not a rule)
    for (std::size_t j = 0; j < 2; ++j) graphs.push_back(capture(executor, stream, programs[j], bindings[j]));
    if (threads) b.barrier();
    for (int round = 0; round < rounds; ++round)
      for (std::size_t j = 0; j < 2; ++j) {
        const bool replay = (round + static_cast<int>(j)) % 3 != 2;  // replays, and runs between
        if (once(j, replay ? graphs[j] : nullptr) != reference[j] && verdict == "ok")
          verdict = detail::concat("round ", round, ": ", collective_name(s.sequence[j].collective),
                                   replay ? " replayed" : " run by run", " differs from its first run");
      }
    for (cudaGraphExec_t g : graphs) CHECK_CUDA(cudaGraphExecDestroy(g));
  }
  b.barrier();  // nobody frees memory while a peer may still use it
  window.reset();
  CHECK_CUDA(cudaStreamDestroy(stream));
  return verdict;
}

Scenario replay_scenario(int world, Delivery delivery) {
  Scenario s;
  s.specs = {{"w", {33, 16}, DType::kBF16, DType::kFP32},
             {"b", {70}, DType::kFP32, DType::kFP32},
             {"e", {12, 8}, DType::kBF16, DType::kBF16},
             // same dtype with a pad at W = 2 and 3: the pad is a memset node, into a peer's window
             // on the cast-to-peers stream path
             {"p", {13, 8}, DType::kBF16, DType::kBF16}};
  s.world = world;
  ReduceOptions avg;
  s.sequence = {{Collective::kAllGather, {}, 1, 11}, {Collective::kReduceScatter, avg, 2, 12}};
  s.delivery = delivery;
  return s;
}

void check_replays_as_processes(const Scenario& s) {
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(s.world, [&](int rank, Bootstrap& b) {
    return replay_rank(s, rank, b, /*threads=*/false, 6);
  }, gpu_ranks(dir)).reports;
  for (int r = 0; r < s.world; ++r) EXPECT_EQ(reports[r], "ok") << "rank " << r;
}

void check_replays_as_threads(const Scenario& s) {
  const harness::TempDir dir;
  EXPECT_EQ(run_thread_ranks_in_a_process(s.world, dir, [&](int rank, Bootstrap& b) {
    return replay_rank(s, rank, b, /*threads=*/true, 6);
  }), "ok");
}

TEST(CudaGraphs, ReplaysMatchRunByRunAsProcessesPushing) {
  TIDE_REQUIRE_GPU();
  check_replays_as_processes(replay_scenario(2, Delivery::kPush));
}

TEST(CudaGraphs, ReplaysMatchRunByRunAsProcessesCastingToPeers) {
  TIDE_REQUIRE_GPU();
  check_replays_as_processes(replay_scenario(2, Delivery::kCastToPeers));
}

TEST(CudaGraphs, ReplaysMatchRunByRunAsThreadsPushing) {
  TIDE_REQUIRE_GPU();
  check_replays_as_threads(replay_scenario(3, Delivery::kPush));
}

// Ranks as threads share a GPU's SMs: the cast-to-peers kernel runs (kernels.cuh), the slot-free
// handshake included, its waits on the captured value, its flags reset by the kernel itself.
TEST(CudaGraphs, ReplaysMatchRunByRunAsThreadsCastingToPeers) {
  TIDE_REQUIRE_GPU();
  check_replays_as_threads(replay_scenario(3, Delivery::kCastToPeers));
}

// Rank 1 replays twice and stops; rank 0's third replay waits for it, and its watchdog ends the
// process within the timeout, printing the wait: rank, peer, bucket, phase.
TEST(CudaGraphs, APeerThatStopsReplayingEndsTheWaitingProcess) {
  TIDE_REQUIRE_GPU();
  const auto timeout = 2000ms;
  const Scenario s = replay_scenario(2, Delivery::kPush);
  const BucketLayout layout = s.layout();
  const harness::TempDir dir;
  const std::string log = dir.path() + "/stderr.0", started = dir.path() + "/started.0";
  const auto reports = harness::run_rank_processes(2, [&](int rank, Bootstrap& b) {
    CHECK_CUDA(cudaSetDevice(0));
    const RankData d = make_rank_data(layout, s.sequence[0], rank);
    std::vector<DeviceBuffer> shards;
    Bindings bindings;
    for (const auto& in : d.inputs) {
      shards.emplace_back(in.size());
      CHECK_CUDA(cudaMemcpy(shards.back().ptr, in.data(), in.size(), cudaMemcpyHostToDevice));
      bindings.inputs.push_back(shards.back().ptr);
    }
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto window = CudaWindow::create(b, layout.window_bytes());
    CudaExecutor executor(*window, stream, timeout);
    cudaGraphExec_t graph = capture(executor, stream, plan(s, layout, s.sequence[0], rank), bindings);
    for (int replay = 0; replay < 2; ++replay) {
      CHECK_CUDA(cudaGraphLaunch(graph, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
    }
    b.barrier();
    if (rank == 1) {
      // Stops, its window left allocated until the process exits: freeing memory a peer still
      // has open through IPC is undefined, and rank 0's next replay signals into it first.
      (void)window.release();
      return std::string("stopped");
    }
    const rlimit no_core{0, 0};  // the abort below must not write a GPU process's core
    setrlimit(RLIMIT_CORE, &no_core);
    if (!std::freopen(log.c_str(), "w", stderr)) throw std::runtime_error("cannot redirect stderr");
    const auto now = std::chrono::steady_clock::now().time_since_epoch();
    std::ofstream(started) << std::chrono::duration_cast<std::chrono::milliseconds>(now).count();
    CHECK_CUDA(cudaGraphLaunch(graph, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));  // the watchdog ends the process before this returns
    return std::string("the third replay returned");
  }, gpu_ranks(dir, 60s)).reports;
  const auto ended = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::steady_clock::now().time_since_epoch()).count();
  EXPECT_EQ(reports[1], "stopped");
  EXPECT_TRUE(reports[0].rfind("no result", 0) == 0) << reports[0];
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  const std::string m = text.str();
  SCOPED_TRACE("rank 0 printed: " + m);
  EXPECT_NE(m.find("rank 0: timed out after 2000 ms waiting for slot_free from rank 1"), std::string::npos);
  EXPECT_NE(m.find("bucket 1 all_gather"), std::string::npos);
  EXPECT_NE(m.find("a replay of a CUDA graph"), std::string::npos);
  EXPECT_NE(m.find("the process ends here"), std::string::npos);
  long long start = 0;
  std::ifstream(started) >> start;
  ASSERT_GT(start, 0);
  EXPECT_GE(ended - start, timeout.count() - 100);
  EXPECT_LT(ended - start, timeout.count() + 10000) << "the error took too long to surface";
}

// Across-node programs count network sends on the host: refused at capture, naming why, before
// the window's epoch moves (both ranks then run it run by run).
TEST(CudaGraphs, AnAcrossNodeProgramIsRefusedAtCapture) {
  TIDE_REQUIRE_GPU();
  const BucketLayout layout({{"w", {8, 8}, DType::kBF16, DType::kFP32}}, Topology{2, 1});
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(2, [&](int rank, Bootstrap& b) {
    CHECK_CUDA(cudaSetDevice(0));
    DeviceBuffer shard(64 * sizeof(float));
    CHECK_CUDA(cudaMemset(shard.ptr, 0, 64 * sizeof(float)));
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const Program program = plan_all_gather(layout, rank, 0, AcrossNodesOptions{});
    auto window = CudaWindow::create(b, program.window_bytes, layout.topology(), CudaMemory::kMalloc,
                                     CudaWindowScope::kHost);
    CudaExecutor executor(*window, stream, 30000ms);
    Bindings bindings;
    bindings.inputs = {shard.ptr};
    std::string refused = "not refused";
    try {
      (void)capture(executor, stream, program, bindings);
    } catch (const InvalidArgument& e) {
      refused = e.what();
    }
    if (refused.find("an across-node program") == std::string::npos)
      return "capture: '" + refused + "'";
    if (!CudaExecutor::capture_refusal(plan_all_gather(BucketLayout({{"w", {8}, DType::kFP32, DType::kFP32}},
                                                                    Topology::single_node(2)), rank)).empty())
      return std::string("a single-node program is refused");
    executor.run(program, bindings);  // not failed: nothing was enqueued
    executor.synchronize();
    return std::string("ok");
  }, gpu_ranks(dir)).reports;
  EXPECT_EQ(reports[0], "ok");
  EXPECT_EQ(reports[1], "ok");
}

}  // namespace
}  // namespace tide
