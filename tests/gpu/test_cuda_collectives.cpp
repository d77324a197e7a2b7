// The CUDA executor against the host executor (bitwise) and fp64 (reduce-scatter), with ranks as
// processes on one GPU (one per GPU where several exist) and as threads of one process; killed
// and mismatched ranks; bad bindings. Without a GPU every test skips, saying so.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpu_harness.hpp"

namespace tide {
namespace {

using namespace gpu_test;
using namespace std::chrono_literals;

// One rank per GPU where several exist; ranks that are threads of one process all on GPU 0
// (CudaWindow refuses threads on different GPUs).
thread_local bool ranks_are_threads = false;
void select_device(int rank) {
  int count = 0;
  CHECK_CUDA(cudaGetDeviceCount(&count));
  CHECK_CUDA(cudaSetDevice(ranks_are_threads ? 0 : rank % count));
}

std::string capture_name(const std::string& dir, int rank, int rep, std::size_t j) {
  return dir + "/cap." + std::to_string(rank) + "." + std::to_string(rep) + "." + std::to_string(j);
}

// Rank `rank` of scenario `s` on the GPU; each invocation's capture goes to a file. All device
// memory is allocated before the window and freed after the last barrier: cudaMalloc/cudaFree may
// wait for the whole device, which would deadlock ranks that are threads of this process while
// another rank's stream waits on this one.
void run_scenario_on_gpu(const Scenario& s, int rank, Bootstrap& bootstrap, const std::string& dir) {
  select_device(rank);
  const BucketLayout layout = s.layout();
  std::vector<RankData> data;
  std::vector<std::vector<DeviceBuffer>> inputs(s.sequence.size()), outputs(s.sequence.size());
  std::vector<DeviceBuffer> scales;  // per invocation, its params' scales
  for (std::size_t j = 0; j < s.sequence.size(); ++j) {
    data.push_back(make_rank_data(layout, s.sequence[j], rank));
    for (auto& in : data[j].inputs) inputs[j].emplace_back(in.size());
    for (auto& out : data[j].outputs) outputs[j].emplace_back(out.size());
    scales.emplace_back(std::max<std::size_t>(data[j].scales.size(), 1) * sizeof(float));
    CHECK_CUDA(cudaMemcpy(scales[j].ptr, data[j].scales.data(), data[j].scales.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
  }
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto window = CudaWindow::create(bootstrap, window_bytes(s), s.topology(), s.memory, s.scope);
  std::unique_ptr<NcclComm> network;
  if (s.nodes > 1 && s.scope == CudaWindowScope::kNode) network = NcclComm::create(bootstrap);
  {
    CudaExecutor executor(*window, stream, 30000ms, network.get());
    std::vector<std::byte> window_bytes(layout.window_bytes());
    for (int rep = 0; rep < s.repeats; ++rep) {
      for (std::size_t j = 0; j < s.sequence.size(); ++j) {
        const Invocation& inv = s.sequence[j];
        RankData d = data[j];
        Bindings bindings;
        // Poison: every byte compared must be written by this run (0x5A.. are finite non-zero
        // values in every dtype).
        CHECK_CUDA(cudaMemsetAsync(window->data(rank), 0x5A + rep, layout.window_bytes(), stream));
        for (std::size_t i = 0; i < d.inputs.size(); ++i) {
          CHECK_CUDA(cudaMemcpyAsync(inputs[j][i].ptr, d.inputs[i].data(), d.inputs[i].size(),
                                     cudaMemcpyHostToDevice, stream));
          bindings.inputs.push_back(inputs[j][i].ptr);
        }
        for (std::size_t i = 0; i < d.outputs.size(); ++i) {
          if (inv.options.accumulate)
            CHECK_CUDA(cudaMemcpyAsync(outputs[j][i].ptr, d.outputs[i].data(), d.outputs[i].size(),
                                       cudaMemcpyHostToDevice, stream));
          else
            CHECK_CUDA(cudaMemsetAsync(outputs[j][i].ptr, 0x77, d.outputs[i].size(), stream));
          bindings.outputs.push_back(outputs[j][i].ptr);
        }
        for (std::size_t i = 0; i < d.scales.size(); ++i)
          bindings.scales.push_back(d.scales[i] != 0.0f ? static_cast<const float*>(scales[j].ptr) + i : nullptr);
        // Ranks as threads: no pageable copy while a peer's stream waits. A pageable copy blocks
        // its thread inside the driver until its stream gets there, and (as seen on an H200,
        // mechanism unconfirmed) another thread's pageable copy then waits for it, so a rank that
        // has not signalled yet never does. Barriers keep copies and collectives apart.
        if (ranks_are_threads) {
          CHECK_CUDA(cudaStreamSynchronize(stream));
          bootstrap.barrier();
        }
        executor.run(plan(s, layout, inv, rank), bindings);
        if (ranks_are_threads) {
          executor.synchronize();
          bootstrap.barrier();
        }
        std::vector<std::byte> capture;
        if (inv.collective == Collective::kAllGather) {
          CHECK_CUDA(cudaMemcpyAsync(window_bytes.data(), window->data(rank), window_bytes.size(),
                                     cudaMemcpyDeviceToHost, stream));
          executor.synchronize();
          CHECK_CUDA(cudaStreamSynchronize(stream));
          capture = capture_window(layout, window_bytes.data());
        } else {
          for (std::size_t i = 0; i < d.outputs.size(); ++i)
            CHECK_CUDA(cudaMemcpyAsync(d.outputs[i].data(), outputs[j][i].ptr, d.outputs[i].size(),
                                       cudaMemcpyDeviceToHost, stream));
          executor.synchronize();
          CHECK_CUDA(cudaStreamSynchronize(stream));
          capture = capture_outputs(layout, d, rank);
        }
        harness::write_file(capture_name(dir, rank, rep, j), capture.data(), capture.size());
      }
    }
  }
  bootstrap.barrier();  // nobody frees memory while a peer may still use it
  network.reset();
  window.reset();
  CHECK_CUDA(cudaStreamDestroy(stream));
}

// Compares every rank's GPU captures with the host executor's, and reduce-scatters with fp64.
void check_scenario(const Scenario& s, const std::string& dir) {
  const BucketLayout layout = s.layout();
  const auto reference = host_reference(s);
  for (int r = 0; r < s.world; ++r)
    for (std::size_t j = 0; j < s.sequence.size(); ++j) {
      const Invocation& inv = s.sequence[j];
      for (int rep = 0; rep < s.repeats; ++rep) {
        std::string got;
        ASSERT_TRUE(harness::read_file(capture_name(dir, r, rep, j), got))
            << "rank " << r << " wrote no capture of invocation " << j << " repeat " << rep;
        std::vector<std::byte> bytes(got.size());
        std::memcpy(bytes.data(), got.data(), got.size());
        EXPECT_TRUE(bytes == reference[r][j])
            << "W=" << s.world << " rank " << r << " invocation " << j << " ("
            << collective_name(inv.collective) << ") repeat " << rep
            << " differs from the host executor: "
            << first_difference(layout, inv, r, bytes, reference[r][j]) << "\n"
            << layout.describe();
      }
      if (inv.collective == Collective::kReduceScatter) {
        const auto ref = fp64_reduce_scatter(layout, inv, r);
        std::size_t offset = 0;
        for (std::size_t i = 0; i < layout.num_params(); ++i) {
          const ParamLayout& p = layout.param(i);
          std::vector<double> got(p.valid_numel(r));
          for (int64_t k = 0; k < p.valid_numel(r); ++k)
            got[k] = load_as_float(reference[r][j].data() + offset, p.shard_dtype, k);
          offset += p.valid_numel(r) * dtype_size(p.shard_dtype);
          const int wire_roundings = s.net.wire_dtype == DType::kBF16 ? s.nodes : 0;
          EXPECT_EQ(check_against_fp64(got, ref[i], s.world, p.shard_dtype, wire_roundings), "")
              << "W=" << s.world << " rank " << r << " invocation " << j << " param " << i
              << " (" << p.name << ", " << dtype_name(p.dtype) << " -> "
              << dtype_name(p.shard_dtype) << ", " << got.size() << " elements)";
        }
      }
    }
}

void run_and_check(const Scenario& s) {
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(s.world, [&](int rank, Bootstrap& b) {
    run_scenario_on_gpu(s, rank, b, dir.path());
  }, gpu_ranks(dir)).reports;
  for (int r = 0; r < s.world; ++r) ASSERT_EQ(reports[r], "ok") << "rank " << r;
  check_scenario(s, dir.path());
}

// The scenario's ranks as threads of one (forked) process, one CUDA context.
void run_and_check_as_threads(const Scenario& s) {
  const harness::TempDir dir;
  ASSERT_EQ(run_thread_ranks_in_a_process(s.world, dir, [&](int rank, Bootstrap& b) {
    ranks_are_threads = true;
    run_scenario_on_gpu(s, rank, b, dir.path());
    return std::string("ok");
  }), "ok");
  check_scenario(s, dir.path());
}

ReduceOptions options(ReduceKind kind, float prescale, float postscale, bool accumulate) {
  ReduceOptions o;
  o.kind = kind, o.prescale = prescale, o.postscale = postscale, o.accumulate = accumulate;
  return o;
}

TEST(CudaDevice, ProbeLeavesThisProcessFreeOfCuda) {
  const bool available = cuda_device_available();
  EXPECT_EQ(cuda_device_available(), available) << "the answer is cached";
  // The parent must still be able to fork() ranks that use CUDA: the driver was never loaded.
  void* driver = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  EXPECT_EQ(driver, nullptr) << "cuda_device_available() loaded libcuda into the test process";
  if (driver) ::dlclose(driver);
  if (!available) GTEST_SKIP() << "no usable CUDA device: only the probe was checked";
}

constexpr Delivery kDeliveries[] = {Delivery::kPush, Delivery::kCastToPeers};

// Both deliveries: copy-engine pushes, and one cast kernel storing into every peer's window.
TEST(CudaCollectives, AllGatherMatchesHostExecutorBitwise) {
  TIDE_REQUIRE_GPU();
  for (const Delivery delivery : kDeliveries)
    for (int world : {2, 3, 4, 8}) {
      std::mt19937_64 rng(1000 + world);
      Scenario s{random_specs(rng, world), world,
                 {{Collective::kAllGather, {}, 3, 11}, {Collective::kAllGather, {}, 4, 12}}, 2};
      s.delivery = delivery;
      SCOPED_TRACE(detail::concat("W=", world, " ", delivery_name(delivery)));
      run_and_check(s);
    }
}

TEST(CudaCollectives, ReduceScatterMatchesHostExecutorAndFp64) {
  TIDE_REQUIRE_GPU();
  for (int world : {2, 3, 4, 8}) {
    std::mt19937_64 rng(2000 + world);
    Scenario s{random_specs(rng, world),
               world,
               {{Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, false), 5, 21},
                {Collective::kReduceScatter, options(ReduceKind::kSum, 0.5f, 3.0f, false), 5, 22},
                {Collective::kReduceScatter, options(ReduceKind::kAvg, 0.25f, 1.0f, true), 5, 23},
                {Collective::kReduceScatter, options(ReduceKind::kSum, 1.0f, 1.0f, true), 6, 24}},
               2};
    SCOPED_TRACE("W=" + std::to_string(world));
    run_and_check(s);
  }
}

// AG then RS reuse the same window (RS stages in the slots AG filled), across two buckets.
TEST(CudaCollectives, AllGatherThenReduceScatterReuseSlots) {
  TIDE_REQUIRE_GPU();
  std::mt19937_64 rng(3000);
  const int world = 4;
  Scenario s{random_specs(rng, world, 8),
             world,
             {{Collective::kAllGather, {}, 1, 31},
              {Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, false), 1, 32},
              {Collective::kAllGather, {}, 2, 33},
              {Collective::kReduceScatter, options(ReduceKind::kSum, 0.5f, 2.0f, true), 2, 34}},
             3};
  run_and_check(s);
}

// Large, 16-byte aligned params take the vectorised kernel paths (tails too); an odd-sized param
// between them misaligns its neighbours' shards and takes the scalar paths.
TEST(CudaCollectives, LargeBucketVectorAndScalarPaths) {
  TIDE_REQUIRE_GPU();
  const int world = 4;
  std::vector<ParamSpec> specs = {
      {"w", {1024, 1000}, DType::kBF16, DType::kFP32},
      {"odd", {37, 3}, DType::kFP16, DType::kFP32},
      {"b", {65539}, DType::kBF16, DType::kFP32},
      {"h", {300, 257}, DType::kFP16, DType::kFP16},
      {"f", {2048, 64}, DType::kFP32, DType::kFP32},
  };
  Scenario s{specs,
             world,
             {{Collective::kAllGather, {}, 7, 41},
              {Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, false), 7, 42},
              {Collective::kReduceScatter, options(ReduceKind::kSum, 0.125f, 1.0f, true), 7, 43}},
             2};
  run_and_check(s);
}

// Params sharded on dims > 0 (shard_placement_fn): 2-D copies (cudaMemcpy2DAsync), strided casts
// (the kernel's vector path when rows are multiples of 8 elements, its scalar path otherwise, and
// cudaMemcpy2DAsync for equal dtypes), mixed with dim-0 params, AG and RS over one window.
TEST(CudaCollectives, InnerShardDimsMatchHostExecutorBitwise) {
  TIDE_REQUIRE_GPU();
  for (int world : {2, 3, 4}) {
    std::vector<ParamSpec> specs = {
        {"experts", {8, 64 * world, 512}, DType::kBF16, DType::kFP32, 1},   // I = 64 x 512: vectors
        {"w2", {96, 16 * world}, DType::kBF16, DType::kFP32, 1},          // I = 16: vectors per row
        {"odd", {5, 3 * world, 3}, DType::kFP16, DType::kFP32, 1},         // I = 9: scalar
        {"same", {7, 5, 8 * world}, DType::kBF16, DType::kBF16, 2},        // equal dtypes: 2-D copy
        {"embed", {67, 32}, DType::kBF16, DType::kFP32},                   // dim 0, padded
        {"f", {3, 4 * world}, DType::kFP32, DType::kFP32, 1},
    };
    std::mt19937_64 rng(4000 + world);
    test::BucketShape shape{4, 1 << 14, 64, 300, 4, 256, 40};
    shape.inner_shard_dims = true;
    for (const ParamSpec& extra : test::random_specs(rng, world, shape)) specs.push_back(extra);
    Scenario s{specs,
               world,
               {{Collective::kAllGather, {}, 8, 51},
                {Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, false), 8, 52},
                {Collective::kAllGather, {}, 8, 53},
                {Collective::kReduceScatter, options(ReduceKind::kSum, 0.5f, 2.0f, true), 8, 54}},
               2};
    for (const Delivery delivery : kDeliveries) {
      s.delivery = delivery;
      SCOPED_TRACE(detail::concat("W=", world, " ", delivery_name(delivery)));
      run_and_check(s);
    }
  }
}

// One rank: no signals or waits, only the kernels (cast, reduce; vector, scalar and tail paths)
// and the copies. The case compute-sanitizer checks (scripts/gpu_suite.sh): the sanitizer
// serialises work, which would deadlock ranks whose streams wait on each other.
TEST(CudaKernels, SingleRankCastAndReduce) {
  TIDE_REQUIRE_GPU();
  std::vector<ParamSpec> specs = {
      {"w", {96, 1000}, DType::kBF16, DType::kFP32},
      {"odd", {37, 3}, DType::kFP16, DType::kFP32},
      {"b", {16387}, DType::kBF16, DType::kFP32},
      {"h", {30, 257}, DType::kFP16, DType::kFP16},
      {"f", {64, 64}, DType::kFP32, DType::kFP32},
      {"s", {}, DType::kBF16, DType::kFP32},
  };
  Scenario s{specs,
             1,
             {{Collective::kAllGather, {}, 1, 61},
              {Collective::kReduceScatter, options(ReduceKind::kAvg, 0.5f, 1.0f, true), 1, 62},
              {Collective::kReduceScatter, options(ReduceKind::kSum, 1.0f, 1.0f, false), 1, 63}},
             2};
  run_and_check(s);
}

// torchao's float8 all-gather cast by TIDE: e4m3 params cast from fp32 and bf16 shards with their
// scales (vector and scalar paths, padded shards), beside plain params; both deliveries, ranks as
// processes and as threads (the cast-to-peers kernel): bitwise the host executor's.
TEST(CudaCollectives, E4M3AllGatherMatchesTheHost) {
  TIDE_REQUIRE_GPU();
  const std::vector<ParamSpec> specs = {
      {"w", {64, 96}, DType::kE4M3, DType::kFP32},   {"odd", {37, 5}, DType::kE4M3, DType::kBF16},
      {"b", {96}, DType::kBF16, DType::kFP32},       {"v", {1000, 24}, DType::kE4M3, DType::kBF16},
  };
  for (const bool threads : {false, true})
    for (const Delivery delivery : kDeliveries) {
      Scenario s{specs, 2, {{Collective::kAllGather, {}, 1, 71}, {Collective::kAllGather, {}, 1, 72}}, 2};
      s.delivery = delivery;
      SCOPED_TRACE(detail::concat(threads ? "threads " : "processes ", delivery_name(delivery)));
      if (threads)
        run_and_check_as_threads(s);
      else
        run_and_check(s);
    }
}

// Ranks as threads of one process share a CUDA context (their windows are used directly, not
// through IPC). This hung on the H200 until CudaExecutor preloaded its kernels: under lazy module
// loading a kernel's first launch waited for the whole context while another thread's stream sat
// in a wait for it (cuda_kernels::preload_kernels). The child is killed after 120 s, so a
// regression fails instead of eating the GPU run. Threads run Delivery::kCastToPeers's tail as the
// cast-to-peers kernel (processes sharing a GPU do not): bitwise the host executor's as well.
TEST(CudaCollectives, RanksAsThreadsOfOneProcess) {
  TIDE_REQUIRE_GPU();
  for (const int world : {2, 4}) {
    for (const Delivery delivery : kDeliveries) {
      std::mt19937_64 rng(4000 + world);
      Scenario s{random_specs(rng, world, 4, 1 << 14),
                 world,
                 {{Collective::kAllGather, {}, 1, 51},
                  {Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, true), 1, 52}},
                 2};
      s.delivery = delivery;
      SCOPED_TRACE(detail::concat("W=", world, " ", delivery_name(delivery)));
      run_and_check_as_threads(s);
    }
  }
}

// Across nodes over NCCL: every GPU its own node (NCCL refuses two ranks on one GPU), rail
// exchanges as grouped ncclSend/ncclRecv. Paced recursive-doubling all-gather and the two-phase
// reduce-scatter (ring and recursive halving), small chunks so each bucket takes many network
// steps: bitwise equal to the host executor running the same programs over its host transport,
// and within 1e-6 of fp64.
TEST(CudaCollectives, AcrossNodesOverNccl) {
  TIDE_REQUIRE_GPU();
  const int gpus = cuda_device_count();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs (one node each); this machine has " << gpus;
  const int world = std::min(gpus, 8);
  std::mt19937_64 rng(6000);
  int cases = 0;
  for (const AcrossNodesOptions& net : {AcrossNodesOptions{4096, 2, 2, false}, AcrossNodesOptions{1024, 4, 3, true},
                                AcrossNodesOptions{}}) {
    Scenario s{random_specs(rng, world, 5, 1 << 15),
               world,
               {{Collective::kAllGather, {}, 1, 61},
                {Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, false), 1, 62},
                {Collective::kReduceScatter, options(ReduceKind::kSum, 0.5f, 2.0f, true), 2, 63}},
               2,
               world,
               net};
    SCOPED_TRACE(testing::Message() << "W=" << world << " as " << world << " nodes, chunk "
                                    << net.chunk_bytes << ", halving " << net.rs_recursive_halving);
    run_and_check(s);
    ++cases;
  }
  EXPECT_EQ(cases, 3);
}

// Virtual nodes on one GPU (issue 6's one-GPU check): ranks as processes sharing GPU 0 (all GPUs
// where several exist), windows mapped by every rank, network ops over CUDA IPC. The shapes of
// the CPU suite (W = 8 as 2x4, 4x2, 8x1; W = 6 as 3x2; W = 12 as 3x4; W = 2 as 2x1) and both reduce-scatter
// algorithms, fp32 and bf16 partials on the wire, small chunks and pacing so each bucket takes many
// network steps: bitwise equal to the host executor running the same programs over its host
// transport, and within 1e-6 of fp64 (a bf16 wire: within its roundings).
TEST(CudaCollectives, VirtualNodesOverIpc) {
  TIDE_REQUIRE_GPU();
  std::mt19937_64 rng(6500);
  struct Shape {
    int nodes, local;
    AcrossNodesOptions net;
  };
  int cases = 0;
  for (const Shape& shape : {Shape{2, 4, AcrossNodesOptions{4096, 2, 2, false}},
                             Shape{4, 2, AcrossNodesOptions{1024, 4, 3, true}},
                             Shape{8, 1, AcrossNodesOptions{2048, 1, 2, false}},
                             Shape{3, 2, AcrossNodesOptions{4096, 2, 2, true}},
                             Shape{3, 4, AcrossNodesOptions{}},
                             // bf16 partials on the wire (lossy), ring and halving
                             Shape{4, 2, AcrossNodesOptions{1024, 2, 2, false, DType::kBF16}},
                             Shape{2, 4, AcrossNodesOptions{4096, 2, 2, true, DType::kBF16}},
                             // 256 B chunks: one network group carries more sends to a peer
                             // than a mailbox holds (kNetQueueDepth)
                             Shape{2, 1, AcrossNodesOptions{256, 4, 2, false}}}) {
    const int world = shape.nodes * shape.local;
    Scenario s{random_specs(rng, world, 4, 1 << 14),
               world,
               {{Collective::kAllGather, {}, 1, 71},
                {Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, false), 1, 72},
                {Collective::kReduceScatter, options(ReduceKind::kSum, 0.5f, 2.0f, true), 2, 73}},
               2,
               shape.nodes,
               shape.net};
    s.scope = CudaWindowScope::kHost;
    SCOPED_TRACE(testing::Message() << "W=" << world << " as " << shape.nodes << "x" << shape.local
                                    << ", chunk " << shape.net.chunk_bytes << ", halving "
                                    << shape.net.rs_recursive_halving << ", wire "
                                    << dtype_name(shape.net.wire_dtype));
    run_and_check(s);
    ++cases;
  }
  EXPECT_EQ(cases, 8);
}

// VMM windows (cuMemCreate, descriptors passed between processes): the same collectives, bitwise.
TEST(CudaCollectives, VmmWindowsMatchHostExecutor) {
  TIDE_REQUIRE_GPU();
  std::mt19937_64 rng(7000);
  for (int world : {2, 3}) {
    Scenario s{random_specs(rng, world, 5, 1 << 15),
               world,
               {{Collective::kAllGather, {}, 1, 71},
                {Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, true), 1, 72}},
               2};
    s.memory = CudaMemory::kVmm;
    SCOPED_TRACE(testing::Message() << "W=" << world << " VMM windows");
    run_and_check(s);
  }
}

// A CudaAddressRange shows the data of whichever VMM window is mapped into it, at one fixed
// address: what tide.fsdp's unsharded params view (a bucket's range, pooled windows behind it).
TEST(CudaCollectives, AddressRangeShowsTheMappedWindowAtAFixedAddress) {
  TIDE_REQUIRE_GPU();
  const int world = 2;
  const BucketLayout layout({{"w", {300, 70}, DType::kBF16, DType::kFP32}, {"b", {33}, DType::kBF16, DType::kFP32}},
                            Topology::single_node(world));
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(world, [&](int rank, Bootstrap& b) {
    select_device(rank);
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<std::unique_ptr<CudaWindow>> windows;
    for (int k = 0; k < 2; ++k)
      windows.push_back(CudaWindow::create(b, layout.window_bytes(), layout.topology(), CudaMemory::kVmm));
    CudaAddressRange range(layout.window_bytes());
    std::byte* fixed = nullptr;  // reserved at the first mapping
    const std::size_t bytes = layout.window_bytes();
    std::vector<std::vector<std::byte>> expected(2);
    {
      CudaExecutor executor(*windows[0], stream);
      CudaExecutor executor1(*windows[1], stream);
      for (int k = 0; k < 2; ++k) {  // a different all-gather in each window
        const Invocation inv{Collective::kAllGather, {}, 1, 80u + k};
        RankData d = make_rank_data(layout, inv, rank);
        std::vector<DeviceBuffer> inputs;
        Bindings bindings;
        for (auto& in : d.inputs) {
          inputs.emplace_back(in.size());
          CHECK_CUDA(cudaMemcpy(inputs.back().ptr, in.data(), in.size(), cudaMemcpyHostToDevice));
          bindings.inputs.push_back(inputs.back().ptr);
        }
        // A cudaMemcpy from pageable memory may return before its DMA lands, and the executor's
        // non-blocking stream does not wait for the legacy stream it ran on.
        CHECK_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
        (k == 0 ? executor : executor1).run(plan_all_gather(layout, rank, 1), bindings);
        (k == 0 ? executor : executor1).synchronize();
        expected[k].resize(bytes);
        CHECK_CUDA(cudaMemcpy(expected[k].data(), windows[k]->data(rank), bytes, cudaMemcpyDeviceToHost));
      }
    }
    std::vector<std::byte> seen(bytes);
    for (int k : {0, 1, 0}) {
      range.map_data_of(*windows[k]);
      if (!fixed) fixed = range.data();
      if (range.data() != fixed) throw std::runtime_error("the range moved");
      CHECK_CUDA(cudaMemcpy(seen.data(), range.data(), bytes, cudaMemcpyDeviceToHost));
      if (seen != expected[k])
        throw std::runtime_error("range mapped to window " + std::to_string(k) + " shows other bytes");
    }
    // Writes through the range land in the window (one memory, two addresses).
    CHECK_CUDA(cudaMemset(range.data(), 0x3C, 4096));
    CHECK_CUDA(cudaMemcpy(seen.data(), windows[0]->data(rank), 4096, cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < 4096; ++i)
      if (seen[i] != std::byte{0x3C}) throw std::runtime_error("a write through the range was lost");
    range.unmap();
    b.barrier();
    windows.clear();
    CHECK_CUDA(cudaStreamDestroy(stream));
  }, gpu_ranks(dir)).reports;
  for (int r = 0; r < world; ++r) EXPECT_EQ(reports[r], "ok") << "rank " << r;
}

// A rank that dies before its collective: the survivors' waits time out and name it.
TEST(CudaCollectives, KilledRankMakesSurvivorsTimeOut) {
  TIDE_REQUIRE_GPU();
  const int world = 3, killed = 2;
  const auto timeout = 3000ms;
  const BucketLayout layout({{"w", {64, 64}, DType::kBF16, DType::kFP32}},
                            Topology::single_node(world));
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(world, [&](int rank, Bootstrap& b) {
    select_device(rank);
    auto window = CudaWindow::create(b, layout.window_bytes());
    if (rank == killed) ::_exit(0);  // dies before its collective, window mapped everywhere
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DeviceBuffer shard(layout.param(0).valid_numel(rank) * 4);
    const auto start = std::chrono::steady_clock::now();
    std::string outcome = "no error";
    {
      CudaExecutor executor(*window, stream, timeout);
      try {
        executor.run(plan_all_gather(layout, rank, 9), Bindings{{shard.ptr}, {}});
        executor.synchronize();
      } catch (const TimeoutError& e) {
        outcome = std::string("TimeoutError: ") + e.what();
      }
      // The error is sticky: the next call reports it too, before enqueuing anything.
      try {
        executor.synchronize();
        outcome += " | second synchronize() did not throw";
      } catch (const TimeoutError&) {
      }
    }
    const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    outcome += " | elapsed_ms=" + std::to_string(elapsed.count());
    throw std::runtime_error(outcome);  // reported as "std::exception: <outcome>"
  }, gpu_ranks(dir)).reports;
  EXPECT_TRUE(reports[killed].rfind("no result", 0) == 0) << reports[killed];
  for (int r = 0; r < world; ++r) {
    if (r == killed) continue;
    const std::string& m = reports[r];
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + m);
    EXPECT_NE(m.find("TimeoutError: rank " + std::to_string(r)), std::string::npos);
    EXPECT_NE(m.find("from rank 2"), std::string::npos);
    EXPECT_NE(m.find("bucket 9 all_gather"), std::string::npos);
    EXPECT_NE(m.find("phase slot_free"), std::string::npos);
    EXPECT_NE(m.find("epoch 1"), std::string::npos);
    EXPECT_EQ(m.find("did not throw"), std::string::npos);
    const auto at = m.find("elapsed_ms=");
    ASSERT_NE(at, std::string::npos);
    const long elapsed = std::stol(m.substr(at + 11));
    EXPECT_GE(elapsed, timeout.count() - 100);
    EXPECT_LT(elapsed, timeout.count() + 5000) << "the error took too long to surface";
  }
}

// Ranks that run different buckets at the same epoch: the tag check stops both streams and the
// watchdog reports DesyncError naming both collectives.
TEST(CudaCollectives, MismatchedBucketsRaiseDesyncError) {
  TIDE_REQUIRE_GPU();
  const int world = 2;
  const BucketLayout layout({{"w", {32, 16}, DType::kBF16, DType::kFP32}},
                            Topology::single_node(world));
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(world, [&](int rank, Bootstrap& b) {
    select_device(rank);
    auto window = CudaWindow::create(b, layout.window_bytes());
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DeviceBuffer shard(layout.param(0).valid_numel(rank) * 4);
    {
      CudaExecutor executor(*window, stream, 2000ms);
      executor.run(plan_all_gather(layout, rank, rank == 0 ? 1 : 2), Bindings{{shard.ptr}, {}});
      try {
        executor.synchronize();
      } catch (...) {
        b.barrier();  // both drained before either window goes away
        throw;
      }
    }
    b.barrier();
  }, gpu_ranks(dir)).reports;
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + reports[r]);
    EXPECT_EQ(reports[r].rfind("DesyncError: rank " + std::to_string(r), 0), 0u);
    EXPECT_NE(reports[r].find("bucket 1 all_gather"), std::string::npos);
    EXPECT_NE(reports[r].find("bucket 2 all_gather"), std::string::npos);
  }
}

// `body`'s result on each of `world` ranks that are threads of one child process (one CUDA
// context), which is killed after 120 s.
std::vector<std::string> thread_ranks_in_a_child(
    int world, const harness::TempDir& dir,
    const std::function<std::string(int, Bootstrap&)>& body) {
  const auto joined = harness::run_rank_processes(1, [&](int, Bootstrap&) {
    const auto reports = harness::run_rank_threads(world, [&](int rank, Bootstrap& b) {
      ranks_are_threads = true;
      throw std::runtime_error(body(rank, b));  // a thread rank reports what it throws
    }, kThreadRankTimeout);
    std::string all;
    for (const std::string& r : reports) all += r + "\n";
    return all;
  }, gpu_ranks(dir, 120s)).reports;
  std::vector<std::string> results;
  std::size_t begin = 0;
  for (std::size_t end; (end = joined[0].find('\n', begin)) != std::string::npos; begin = end + 1) {
    const std::string line = joined[0].substr(begin, end - begin);
    const std::string thrown = "std::exception: ";
    results.push_back(line.rfind(thrown, 0) == 0 ? line.substr(thrown.size()) : line);
  }
  return results;
}

// What one rank's collectives cost in driver calls: "beside <0|1>" (whether the cast-to-peers kernel may
// run: CudaWindow::peers_run_beside_own), then per collective and delivery its cuStreamBatchMemOp
// calls, kernels, copies and cast-to-peers kernels. The calls are the fixed cost (BENCHMARKS.md); the
// other tests check the results.
std::string driver_call_counts(int world, int rank, Bootstrap& b) {
  select_device(rank);
  const BucketLayout layout({{"w", {256, 64}, DType::kBF16, DType::kFP32}},
                            Topology::single_node(world));
  const ParamLayout& p = layout.param(0);
  DeviceBuffer shard(p.valid_numel(rank) * 4), grad(p.unsharded_bytes());
  CHECK_CUDA(cudaMemset(shard.ptr, 0, p.valid_numel(rank) * 4));
  CHECK_CUDA(cudaMemset(grad.ptr, 0, p.unsharded_bytes()));
  auto window = CudaWindow::create(b, layout.window_bytes());
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::string counts = detail::concat("beside ", window->peers_run_beside_own() ? 1 : 0);
  {
    CudaExecutor executor(*window, stream, 20000ms);
    const auto count = [&](const char* collective, Delivery delivery, const Program& program,
                           const Bindings& bindings) {
      executor.reset_stats();
      executor.run(program, bindings);
      executor.synchronize();  // ranks as threads: no run overtakes a peer's
      b.barrier();
      const CudaExecutor::Stats st = executor.stats();
      counts += detail::concat(" | ", collective, " ", delivery_name(delivery), " ", st.mem_op_calls,
                               " ", st.kernel_launches, " ", st.copies, " ", st.cast_to_peers_kernels);
    };
    for (const Delivery delivery : kDeliveries)
      count("ag", delivery, plan_all_gather(layout, rank, 1, AcrossNodesOptions{}, delivery),
            Bindings{{shard.ptr}, {}});
    for (const Delivery delivery : kDeliveries)
      count("rs", delivery, plan_reduce_scatter(layout, rank, ReduceOptions{}, 2, AcrossNodesOptions{}, delivery),
            Bindings{{grad.ptr}, {shard.ptr}});
  }
  b.barrier();
  window.reset();
  CHECK_CUDA(cudaStreamDestroy(stream));
  return counts;
}

// Push: W memop calls (the slot-free signals with the first wait, then per peer its data-ready
// signal with the next wait), the cast or reduce, W - 1 copies. Cast to peers: the cast-to-peers
// kernel alone, the slot-free handshake included (no memop call); without it (peers that
// time-slice this GPU) the slot-free handshake in one memop call, a second one, the cast (AG) or
// the W - 1 copies and the reduce (RS).
std::string expected_driver_calls(int world, bool beside) {
  const std::string cast = beside ? "0 1 0 1" : "2 1 0 0";
  const std::string rs_cast = beside ? "0 1 0 1" : detail::concat("2 1 ", world - 1, " 0");
  const std::string push = detail::concat(world, " 1 ", world - 1, " 0");
  return detail::concat("beside ", beside ? 1 : 0, " | ag push ", push, " | ag cast_to_peers ", cast,
                        " | rs push ", push, " | rs cast_to_peers ", rs_cast);
}

TEST(CudaCollectives, ARunsFlagOpsShareDriverCalls) {
  TIDE_REQUIRE_GPU();
  const int gpus = cuda_device_count();  // without CUDA in this process: the ranks fork from it
  for (const int world : {2, 4}) {
    SCOPED_TRACE("W = " + std::to_string(world));
    const harness::TempDir dir;
    const auto processes = harness::run_rank_processes(world, [&](int rank, Bootstrap& b) {
      return driver_call_counts(world, rank, b);
    }, gpu_ranks(dir)).reports;
    // Processes share a GPU unless there is one per rank.
    const std::string expected = expected_driver_calls(world, gpus >= world);
    for (int r = 0; r < world; ++r) EXPECT_EQ(processes[r], expected) << "rank " << r << " (processes)";
    // Threads of one process: the cast-to-peers kernel runs.
    const auto threads = thread_ranks_in_a_child(world, dir, [&](int rank, Bootstrap& b) {
      return driver_call_counts(world, rank, b);
    });
    ASSERT_EQ(threads.size(), static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(threads[r], expected_driver_calls(world, true)) << "rank " << r << " (threads)";
  }
}

// Equal params: a peer's pushes are copies of one size at one pitch (W slots apart in both windows),
// sent as one 2-D copy per peer. Bitwise against the host executor (all-gather, and reduce-scatter,
// whose pushes read the gradients wherever they are), then the all-gather's counts at W = 2: its
// 8 pushes are one 2-D copy.
TEST(CudaCollectives, EqualParamsPushAsOne2dCopyPerPeer) {
  TIDE_REQUIRE_GPU();
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 8; ++i) specs.push_back({"w" + std::to_string(i), {48, 40}, DType::kBF16, DType::kFP32});
  for (int i = 0; i < 4; ++i) specs.push_back({"n" + std::to_string(i), {64, 32}, DType::kBF16, DType::kBF16});
  for (const int world : {2, 4}) {
    SCOPED_TRACE("W=" + std::to_string(world));
    Scenario s{specs, world,
               {{Collective::kAllGather, {}, 3, 61},
                {Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, false), 4, 62}},
               2};
    s.delivery = Delivery::kPush;
    run_and_check(s);
  }
  const BucketLayout layout(std::vector<ParamSpec>(specs.begin(), specs.begin() + 8),
                            Topology::single_node(2));
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(2, [&](int rank, Bootstrap& b) {
    select_device(rank);
    std::vector<DeviceBuffer> shards;
    Bindings bindings;
    for (const ParamLayout& p : layout.params()) {
      shards.emplace_back(p.valid_numel(rank) * 4);
      CHECK_CUDA(cudaMemset(shards.back().ptr, 0, p.valid_numel(rank) * 4));
      bindings.inputs.push_back(shards.back().ptr);
    }
    auto window = CudaWindow::create(b, layout.window_bytes());
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::string counts;
    {
      CudaExecutor executor(*window, stream, 20000ms);
      executor.run(plan_all_gather(layout, rank, 1, AcrossNodesOptions{}, Delivery::kPush), bindings);
      const CudaExecutor::Stats st = executor.stats();
      counts = detail::concat("copies ", st.copies, " 2d ", st.copies_2d, " coalesced ",
                              st.copies_coalesced);
    }
    b.barrier();
    window.reset();
    CHECK_CUDA(cudaStreamDestroy(stream));
    throw std::runtime_error(counts);
  }, gpu_ranks(dir)).reports;
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(reports[r], "std::exception: copies 1 2d 1 coalesced 8") << "rank " << r;
}

// Many params (a mixture-of-experts layer's experts as modules, LoRA adapters): 600 gradients, each
// its own allocation, odd and aligned sizes, three dtype pairs. The reduce-scatter's pushes go as
// copy kernels and its reduces as two launches (584 tasks of 2 sources fit one): bitwise the host
// executor's, pushes and cast-to-peers, processes and threads (the run_and_check harness).
std::vector<ParamSpec> many_params(int n) {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < n; ++i) {
    const std::string name = "p" + std::to_string(i);
    if (i % 3 == 0) specs.push_back({name, {16, 24}, DType::kBF16, DType::kFP32});
    else if (i % 3 == 1) specs.push_back({name, {37}, DType::kFP16, DType::kFP32});
    else specs.push_back({name, {8, 64}, DType::kBF16, DType::kBF16});
  }
  return specs;
}

TEST(CudaCollectives, ManyParamsMatchHostExecutorBitwise) {
  TIDE_REQUIRE_GPU();
  for (const Delivery delivery : kDeliveries) {
    Scenario s{many_params(600), 2,
               {{Collective::kReduceScatter, options(ReduceKind::kAvg, 1.0f, 1.0f, false), 3, 81},
                {Collective::kAllGather, {}, 3, 82},
                {Collective::kReduceScatter, options(ReduceKind::kSum, 0.5f, 2.0f, true), 3, 83}},
               2};
    s.delivery = delivery;
    SCOPED_TRACE(delivery_name(delivery));
    run_and_check(s);
  }
}

// A reduce-scatter's driver calls do not grow with its param count: 48 and 512 gradients (each its
// own allocation) at W = 2 both take the slot-free handshake (one memop call), one copy kernel for
// the pushes, the data-ready handshake (one memop call) and one reduce kernel; no copy-engine
// copy. (Before, the pushes were one copy-engine operation per param, ~7 us of host time each.)
std::string reduce_scatter_calls(int num_params, int rank, Bootstrap& b) {
  select_device(rank);
  std::vector<ParamSpec> specs;
  for (int i = 0; i < num_params; ++i)
    specs.push_back({"p" + std::to_string(i), {64, 32}, DType::kBF16, DType::kFP32});
  const BucketLayout layout(specs, Topology::single_node(2));
  std::vector<DeviceBuffer> grads, shards;
  Bindings bindings;
  for (const ParamLayout& p : layout.params()) {
    grads.emplace_back(p.unsharded_bytes());
    shards.emplace_back(p.valid_numel(rank) * 4);
    CHECK_CUDA(cudaMemset(grads.back().ptr, 0, p.unsharded_bytes()));
    bindings.inputs.push_back(grads.back().ptr);
    bindings.outputs.push_back(shards.back().ptr);
  }
  auto window = CudaWindow::create(b, layout.window_bytes());
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::string counts;
  {
    CudaExecutor executor(*window, stream, 20000ms);
    executor.run(plan_reduce_scatter(layout, rank, ReduceOptions{}, 1), bindings);
    const CudaExecutor::Stats st = executor.stats();
    counts = detail::concat("memops ", st.mem_op_calls, " kernels ", st.kernel_launches,
                            " engine copies ", st.copies, " kernel copies ", st.copies_by_kernel);
  }
  b.barrier();
  window.reset();
  CHECK_CUDA(cudaStreamDestroy(stream));
  return counts;
}

TEST(CudaCollectives, ReduceScatterDriverCallsDoNotGrowWithParams) {
  TIDE_REQUIRE_GPU();
  for (const int num_params : {48, 512}) {
    SCOPED_TRACE(detail::concat(num_params, " params"));
    const harness::TempDir dir;
    const auto reports = harness::run_rank_processes(2, [&](int rank, Bootstrap& b) {
      return reduce_scatter_calls(num_params, rank, b);
    }, gpu_ranks(dir)).reports;
    for (int r = 0; r < 2; ++r)
      EXPECT_EQ(reports[r], detail::concat("memops 2 kernels 2 engine copies 0 kernel copies ",
                                           num_params))
          << "rank " << r;
  }
}

// A prepared program checks and lowers once per set of pointers, and a reused lowering reads the
// gradients' current bytes. Per delivery: two runs on bindings A lower once; new gradient bytes, a
// third run on A (reused); a one-shot run of the Program on B (its own lowering) must give the same
// shards bitwise; then B, A, B through the prepared program lower each time (one kept lowering);
// and a prepared all-gather runs twice on one lowering. The report: the lowering counts, then
// whether the reused run's shards equal the one-shot run's and changed with the gradients.
std::string prepared_runs(int rank, Bootstrap& b, Delivery delivery) {
  select_device(rank);
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 64; ++i)
    specs.push_back({"p" + std::to_string(i), {64, 32}, DType::kBF16, DType::kFP32});
  const BucketLayout layout(specs, Topology::single_node(2));
  std::vector<DeviceBuffer> grads, first, second, params;
  Bindings bound_a, bound_b, gather;
  for (const ParamLayout& p : layout.params()) {
    grads.emplace_back(p.unsharded_bytes());
    first.emplace_back(p.valid_numel(rank) * 4);
    second.emplace_back(p.valid_numel(rank) * 4);
    bound_a.inputs.push_back(grads.back().ptr), bound_a.outputs.push_back(first.back().ptr);
    bound_b.inputs.push_back(grads.back().ptr), bound_b.outputs.push_back(second.back().ptr);
    gather.inputs.push_back(first.back().ptr);  // fp32 shards
  }
  auto fill = [&](int value) {
    for (std::size_t i = 0; i < grads.size(); ++i)
      CHECK_CUDA(cudaMemset(grads[i].ptr, value + int(i % 7) + rank, layout.param(i).unsharded_bytes()));
    // cudaMemset runs on the legacy stream, which the executor's non-blocking stream does not wait
    // for: without this the next run may read the gradients before they are set.
    CHECK_CUDA(cudaDeviceSynchronize());
  };
  auto shards = [&](const std::vector<DeviceBuffer>& out) {
    std::vector<float> all;
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::vector<float> one(layout.param(i).valid_numel(rank));
      CHECK_CUDA(cudaMemcpy(one.data(), out[i].ptr, one.size() * 4, cudaMemcpyDeviceToHost));
      all.insert(all.end(), one.begin(), one.end());
    }
    return all;
  };
  auto window = CudaWindow::create(b, layout.window_bytes());
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::string report = detail::concat(delivery_name(delivery), ": lowerings");
  {
    CudaExecutor executor(*window, stream, 20000ms);
    const Program rs = plan_reduce_scatter(layout, rank, ReduceOptions{}, 1, {}, delivery);
    const std::unique_ptr<PreparedProgram> prepared = executor.prepare(rs);
    auto lowerings = [&] { report += detail::concat(" ", executor.stats().lowerings); };
    fill(0x3f);
    executor.run(*prepared, bound_a);
    executor.run(*prepared, bound_a);
    lowerings();
    executor.synchronize();
    const std::vector<float> before = shards(first);
    fill(0x41);
    executor.run(*prepared, bound_a);
    lowerings();
    executor.run(rs, bound_b);
    lowerings();
    executor.synchronize();
    const std::vector<float> reused = shards(first), one_shot = shards(second);
    for (const Bindings* bound : {&bound_b, &bound_a, &bound_b}) executor.run(*prepared, *bound);
    lowerings();
    const std::unique_ptr<PreparedProgram> ag =
        executor.prepare(plan_all_gather(layout, rank, 2, {}, delivery));
    executor.run(*ag, gather);
    executor.run(*ag, gather);
    lowerings();
    executor.synchronize();
    const bool equal = std::memcmp(reused.data(), one_shot.data(), reused.size() * 4) == 0;
    const bool changed = std::memcmp(reused.data(), before.data(), reused.size() * 4) != 0;
    report += equal && changed ? ", reused = one-shot, changed" : ", reused DIFFERS or unchanged";
  }
  b.barrier();
  window.reset();
  CHECK_CUDA(cudaStreamDestroy(stream));
  return report;
}

TEST(CudaCollectives, PreparedProgramLowersOncePerPointerSet) {
  TIDE_REQUIRE_GPU();
  for (const Delivery delivery : kDeliveries) {
    const harness::TempDir dir;
    const auto reports = harness::run_rank_processes(2, [&](int rank, Bootstrap& b) {
      return prepared_runs(rank, b, delivery);
    }, gpu_ranks(dir)).reports;
    for (int r = 0; r < 2; ++r)
      EXPECT_EQ(reports[r], detail::concat(delivery_name(delivery),
                                           ": lowerings 1 1 2 5 6, reused = one-shot, changed"))
          << "rank " << r;
  }
}

TEST(CudaCollectives, PreparedProgramRunsOnItsOwnExecutorOnly) {
  TIDE_REQUIRE_GPU();
  const BucketLayout layout({{"w", {8, 8}, DType::kBF16, DType::kFP32}}, Topology::single_node(1));
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(1, [&](int rank, Bootstrap& b) {
    select_device(rank);
    auto window = CudaWindow::create(b, layout.window_bytes());
    auto other_window = CudaWindow::create(b, layout.window_bytes());
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CudaExecutor executor(*window, stream, 1000ms), other(*other_window, stream, 1000ms);
    const auto prepared = other.prepare(plan_all_gather(layout, 0));
    executor.run(*prepared, Bindings{});
  }, gpu_ranks(dir)).reports;
  EXPECT_EQ(reports[0].rfind("InvalidArgument: CudaExecutor::run: prepared = a program prepared by "
                             "another executor", 0), 0u)
      << reports[0];
}

// A prepared e4m3 all-gather reused on the same pointers skips the run's checks, but not its
// scale: a run without one is refused before anything is enqueued, naming it.
TEST(CudaCollectives, ReusedE4M3ProgramStillNeedsItsScale) {
  TIDE_REQUIRE_GPU();
  const BucketLayout layout({{"w", {64, 8}, DType::kE4M3, DType::kFP32}}, Topology::single_node(1));
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(1, [&](int rank, Bootstrap& b) {
    select_device(rank);
    auto window = CudaWindow::create(b, layout.window_bytes());
    DeviceBuffer shard(64 * 8 * 4), scale(4);
    CHECK_CUDA(cudaMemset(shard.ptr, 0, 64 * 8 * 4));
    CHECK_CUDA(cudaMemset(scale.ptr, 0, 4));
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::string outcome = "no error";
    {
      CudaExecutor executor(*window, stream, 1000ms);
      const auto prepared = executor.prepare(plan_all_gather(layout, 0));
      Bindings bound{{shard.ptr}, {}, {static_cast<const float*>(scale.ptr)}};
      executor.run(*prepared, bound);
      bound.scales.clear();
      try {
        executor.run(*prepared, bound);
      } catch (const InvalidArgument& e) {
        outcome = e.what();
      }
      executor.synchronize();
    }
    CHECK_CUDA(cudaStreamDestroy(stream));
    return outcome;
  }, gpu_ranks(dir)).reports;
  EXPECT_NE(reports[0].find("scales[0]"), std::string::npos) << reports[0];
}

// One stuck-wait rank, in a process or a thread: rank 0 waits for data_ready from ranks 1 and 2;
// rank 1 signals it; rank 2 signals another bucket's (rank2_signals) or nothing. `in_kernel`:
// rank 0's program is a kCastToPeers tail (its signals, then the waits), which ranks as threads
// run as one cast-to-peers kernel. The outcome is the error's text or "no error", then the cast-to-peers kernel
// kernels the executor launched (stats() does not rethrow the error: the barrier must be reached).
std::string stuck_wait_outcome(int world, int rank, Bootstrap& b, bool in_kernel, bool rank2_signals) {
  auto program = [&](uint32_t bucket, std::vector<Step> steps) {
    Program p;
    p.collective = Collective::kAllGather, p.rank = rank, p.world = world, p.bucket = bucket;
    p.window_bytes = 4096, p.alignment = 256, p.steps = std::move(steps);
    if (in_kernel) p.delivery = Delivery::kCastToPeers;
    return p;
  };
  select_device(rank);
  auto window = CudaWindow::create(b, 4096);
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Program mine;
  if (rank == 0) {
    std::vector<Step> steps;
    if (in_kernel)
      steps = {{Phase::kDataReady, SignalOp{1, FlagKind::kDataReady}},
               {Phase::kDataReady, SignalOp{2, FlagKind::kDataReady}}};
    steps.push_back({Phase::kDataReady, WaitOp{1, FlagKind::kDataReady}});
    steps.push_back({Phase::kDataReady, WaitOp{2, FlagKind::kDataReady}});
    mine = program(7, std::move(steps));
  } else {
    const Step signal{Phase::kDataReady, SignalOp{0, FlagKind::kDataReady}};
    mine = program(rank == 1 ? 7 : 8, rank == 2 && !rank2_signals ? std::vector<Step>{}
                                                                  : std::vector<Step>{signal});
  }
  std::string outcome = "no error";
  {
    CudaExecutor executor(*window, stream, 2000ms);
    try {
      executor.run(mine, Bindings{});
      executor.synchronize();
    } catch (const Error& e) {
      outcome = e.what();
    }
    outcome += detail::concat(" [cast-to-peers kernels ", executor.stats().cast_to_peers_kernels, "]");
  }
  b.barrier();  // every stream drained before any window goes away
  window.reset();
  CHECK_CUDA(cudaStreamDestroy(stream));
  return outcome;
}

// Ranks 1 and 2 pass; rank 0's error names rank 2: DesyncError when it signalled bucket 8,
// TimeoutError when it signalled nothing.
void expect_stuck_wait_outcomes(const std::vector<std::string>& outcomes, bool rank2_signals,
                                int rank0_cast_to_peers_kernels) {
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_EQ(outcomes[1], "no error [cast-to-peers kernels 0]");
  EXPECT_EQ(outcomes[2], "no error [cast-to-peers kernels 0]");
  const std::string& m = outcomes[0];
  EXPECT_NE(m.find(rank2_signals ? "rank 0 runs bucket 7 all_gather at epoch 1 (phase data_ready) "
                                   "but rank 2 signalled bucket 8 all_gather"
                                 : "rank 0: timed out after 2000 ms waiting for data_ready from rank 2"),
            std::string::npos) << m;
  EXPECT_NE(m.find(detail::concat("[cast-to-peers kernels ", rank0_cast_to_peers_kernels, "]")), std::string::npos) << m;
}

// Both stuck-wait cases, with and without rank 2's signal: the waits as one memop batch (ranks as
// processes) or inside a cast-to-peers kernel (ranks as threads, one context, so the kernel runs).
void run_stuck_wait_cases(bool in_kernel) {
  const int world = 3;
  for (const bool rank2_signals : {true, false}) {
    SCOPED_TRACE(rank2_signals ? "rank 2 signals bucket 8" : "rank 2 signals nothing");
    const harness::TempDir dir;
    const auto body = [&](int rank, Bootstrap& b) {
      return stuck_wait_outcome(world, rank, b, in_kernel, rank2_signals);
    };
    const auto outcomes = in_kernel ? thread_ranks_in_a_child(world, dir, body)
                                    : harness::run_rank_processes(world, body, gpu_ranks(dir)).reports;
    expect_stuck_wait_outcomes(outcomes, rank2_signals, in_kernel ? 1 : 0);
  }
}

// A batch's waits are one watched record: when it is stuck, the watchdog names the first wait whose
// flag does not meet it (rank 0's two waits in one cuStreamBatchMemOp).
TEST(CudaCollectives, AStuckFlagBatchNamesItsFirstUnmetWait) {
  TIDE_REQUIRE_GPU();
  run_stuck_wait_cases(/*in_kernel=*/false);
}

// The same with the waits inside a cast-to-peers kernel: rank 0's kernel spins until the watchdog
// diagnoses the stuck wait as a stream wait's and releases it through the flags (the kernel then
// ends: no hang).
TEST(CudaCollectives, AStuckCastToPeersKernelTimesOutLikeAStreamWait) {
  TIDE_REQUIRE_GPU();
  run_stuck_wait_cases(/*in_kernel=*/true);
}

// The IPC network's failures: two virtual nodes (one rank each, so the first wait is a network
// receive). A peer that runs another bucket makes both ranks' receives stop on the entry's tag
// check: DesyncError naming both collectives. A peer that dies after mapping its window leaves the
// survivor's receive waiting for a post: TimeoutError naming peer, transfer, bucket and epoch.
TEST(CudaCollectives, IpcNetworkDesyncAndDeadPeer) {
  TIDE_REQUIRE_GPU();
  const int world = 2;
  const BucketLayout layout({{"w", {32, 16}, DType::kBF16, DType::kFP32}}, Topology{2, 1});
  for (const bool dies : {false, true}) {
    SCOPED_TRACE(dies ? "rank 1 dies" : "rank 1 runs bucket 2");
    const harness::TempDir dir;
    const auto reports = harness::run_rank_processes(world, [&](int rank, Bootstrap& b) {
      select_device(rank);
      auto window = CudaWindow::create(b, layout.window_bytes(), layout.topology(),
                                       CudaMemory::kMalloc, CudaWindowScope::kHost);
      if (dies && rank == 1) ::_exit(0);
      cudaStream_t stream = nullptr;
      CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      DeviceBuffer shard(layout.param(0).valid_numel(rank) * 4);
      {
        CudaExecutor executor(*window, stream, 2000ms);
        executor.run(plan_all_gather(layout, rank, rank == 0 ? 1 : 2, AcrossNodesOptions{}),
                     Bindings{{shard.ptr}, {}});
        try {
          executor.synchronize();
        } catch (...) {
          if (!dies) b.barrier();  // both drained before either window goes away
          throw;
        }
      }
      if (!dies) b.barrier();
    }, gpu_ranks(dir)).reports;
    if (dies) {
      const std::string& m = reports[0];
      SCOPED_TRACE(m);
      EXPECT_EQ(m.rfind("TimeoutError: rank 0", 0), 0u);
      EXPECT_NE(m.find("net receive #1"), std::string::npos);
      EXPECT_NE(m.find("from rank 1"), std::string::npos);
      EXPECT_NE(m.find("bucket 1 all_gather"), std::string::npos);
      EXPECT_NE(m.find("epoch 1"), std::string::npos);
      EXPECT_NE(m.find("[CUDA IPC network]"), std::string::npos);
      continue;
    }
    for (int r = 0; r < world; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + ": " + reports[r]);
      EXPECT_EQ(reports[r].rfind("DesyncError: rank " + std::to_string(r), 0), 0u);
      EXPECT_NE(reports[r].find("bucket 1 all_gather"), std::string::npos);
      EXPECT_NE(reports[r].find("bucket 2 all_gather"), std::string::npos);
      EXPECT_NE(reports[r].find("[CUDA IPC network]"), std::string::npos);
    }
  }
}

TEST(CudaCollectives, OneExecutorPerWindow) {
  TIDE_REQUIRE_GPU();
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(1, [&](int rank, Bootstrap& b) {
    select_device(rank);
    auto window = CudaWindow::create(b, 4096);
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {
      CudaExecutor first(*window, stream, 1000ms);
      std::string second;
      try {
        CudaExecutor executor(*window, stream, 1000ms);
      } catch (const InvalidArgument& e) {
        second = e.what();
      }
      if (second.rfind("CudaExecutor: window = rank 0's window, which has an executor", 0) != 0)
        throw std::runtime_error("second executor: '" + second + "'");
    }
    CudaExecutor after_the_first(*window, stream, 1000ms);  // the first one's destructor let go
  }, gpu_ranks(dir)).reports;
  EXPECT_EQ(reports[0], "ok");
}

TEST(CudaCollectives, RejectsBadBindingsBeforeEnqueuing) {
  TIDE_REQUIRE_GPU();
  const BucketLayout layout({{"w", {8, 8}, DType::kBF16, DType::kFP32}}, Topology::single_node(1));
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(1, [&](int rank, Bootstrap& b) {
    select_device(rank);
    auto window = CudaWindow::create(b, layout.window_bytes());
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CudaExecutor executor(*window, stream, 1000ms);
    executor.run(plan_all_gather(layout, 0), Bindings{});  // no input bound
  }, gpu_ranks(dir)).reports;
  EXPECT_EQ(reports[0].rfind("InvalidArgument: Executor::run: inputs.size() = 0", 0), 0u)
      << reports[0];
}
}  // namespace
}  // namespace tide
