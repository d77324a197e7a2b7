// The reduce kernel's SM budget (CudaReduceBudget, cuda_kernels::ReduceGrid): parsing and
// validation (no GPU needed), and on a GPU bitwise the same results as today's default schedule
// for several budgets and sizes (the reduce's summation order is fixed, whichever CTA computes a
// tile). The executor-level check (TIDE_CUDA_REDUCE_BUDGET through a W = 4 reduce-scatter against
// the host executor) is in test_cuda_collectives.cpp.
#include <cuda_runtime.h>

#include <cstring>
#include <random>

#include "gpu_harness.hpp"
#include "kernels.cuh"

namespace tide {
namespace {

using namespace gpu_test;
using namespace std::chrono_literals;

TEST(CudaReduceBudget, ParsesDescribesAndValidates) {
  EXPECT_TRUE(CudaReduceBudget::parse("").is_default());
  EXPECT_TRUE(CudaReduceBudget::parse("default").is_default());
  EXPECT_EQ(CudaReduceBudget::parse("").describe(), "default");
  const CudaReduceBudget b = CudaReduceBudget::parse("ctas=66,tiles=1,priority=low");
  EXPECT_EQ(b.max_ctas, 66);
  EXPECT_EQ(b.tiles_per_cta, 1);
  EXPECT_TRUE(b.low_priority);
  EXPECT_EQ(b.describe(), "ctas=66,tiles=1,priority=low");
  const CudaReduceBudget c = CudaReduceBudget::parse("priority=normal,tiles=persistent,ctas=16");
  EXPECT_EQ(c.max_ctas, 16);
  EXPECT_EQ(c.tiles_per_cta, 0);
  EXPECT_FALSE(c.low_priority);
  EXPECT_EQ(CudaReduceBudget::parse(c.describe()).describe(), c.describe());
  EXPECT_EQ(CudaReduceBudget::parse("tiles=4").tiles_per_cta, 4);
  EXPECT_EQ(CudaReduceBudget::parse("tiles=4").max_ctas, 0);
  for (const char* bad : {"ctas=-1", "ctas=65537", "ctas=", "ctas=1x", "tiles=-2", "tiles=1048577",
                          "tiles=fast", "priority=high", "foo=1", "ctas", "ctas=1,ctas=2",
                          "ctas=1,,tiles=1", "ctas=1,"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(CudaReduceBudget::parse(bad), InvalidArgument);
  }
  try {
    CudaReduceBudget::parse("priority=high");
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("priority"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("low or normal"), std::string::npos) << e.what();
  }
  CudaReduceBudget out_of_range;
  out_of_range.max_ctas = -3;
  EXPECT_THROW(out_of_range.validate(), InvalidArgument);
  out_of_range.max_ctas = 0, out_of_range.tiles_per_cta = CudaReduceBudget::kMaxTilesPerCta + 1;
  EXPECT_THROW(out_of_range.validate(), InvalidArgument);
  EXPECT_EQ(CudaReduceBudget::kMaxTilesPerCta, cuda_kernels::kMaxTilesPerCta);

  ::setenv("TIDE_CUDA_REDUCE_BUDGET", "ctas=8,tiles=4", 1);
  EXPECT_EQ(CudaReduceBudget::from_env().describe(), "ctas=8,tiles=4,priority=normal");
  ::setenv("TIDE_CUDA_REDUCE_BUDGET", "ctas=eight", 1);
  try {
    CudaReduceBudget::from_env();
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("TIDE_CUDA_REDUCE_BUDGET"), std::string::npos) << e.what();
  }
  ::unsetenv("TIDE_CUDA_REDUCE_BUDGET");
  EXPECT_EQ(CudaReduceBudget::from_env().describe(), CudaReduceBudget::initial().describe());
  ::setenv("TIDE_CUDA_REDUCE_BUDGET", "", 1);
  EXPECT_EQ(CudaReduceBudget::from_env().describe(), CudaReduceBudget::initial().describe());
  ::setenv("TIDE_CUDA_REDUCE_BUDGET", "default", 1);
  EXPECT_TRUE(CudaReduceBudget::from_env().is_default()) << "'default' is today's schedule";
  ::unsetenv("TIDE_CUDA_REDUCE_BUDGET");
  EXPECT_NO_THROW(CudaReduceBudget::initial().validate());
}

// One reduce problem: tasks of several sizes (tails, vector and scalar paths), sources of one
// dtype, optional partials and accumulation.
struct Problem {
  std::string name;
  std::vector<int64_t> counts;  // elements per task
  int sources = 8;
  cuda_kernels::ElementType src_type = cuda_kernels::kBF16;
  cuda_kernels::ElementType dst_type = cuda_kernels::kFP32;
  bool misalign = false;  // every second task's pointers 2 bytes off 16: the scalar path
  bool partial = false;   // an fp32 partial per task
  bool accumulate = false;
};

std::size_t element_size(cuda_kernels::ElementType t) { return t == cuda_kernels::kFP32 ? 4 : 2; }

// Host bytes of n finite values of type t (fp32 in (-1, 1); bf16/fp16: the top halves of such
// fp32 values, bf16 exactly, fp16 as small finite halves).
std::vector<std::byte> random_bytes(cuda_kernels::ElementType t, int64_t n, std::mt19937_64& rng) {
  std::vector<std::byte> out(static_cast<std::size_t>(n) * element_size(t));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t k = 0; k < n; ++k) {
    const float v = u(rng);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if (t == cuda_kernels::kFP32) {
      std::memcpy(out.data() + 4 * k, &bits, 4);
    } else if (t == cuda_kernels::kBF16) {
      const uint16_t h = static_cast<uint16_t>(bits >> 16);
      std::memcpy(out.data() + 2 * k, &h, 2);
    } else {
      const uint16_t h = static_cast<uint16_t>(rng() & 0x3BFF);  // |x| < 1, finite
      std::memcpy(out.data() + 2 * k, &h, 2);
    }
  }
  return out;
}

// Runs `problem` under `grid` on freshly initialised device buffers; returns every task's output
// bytes, and the launch info through *info.
std::vector<std::byte> run_problem(const Problem& problem, const cuda_kernels::ReduceGrid& grid,
                                   cudaStream_t stream, cuda_kernels::LaunchInfo* info) {
  std::mt19937_64 rng(12345);
  const std::size_t dst_size = element_size(problem.dst_type);
  std::vector<void*> allocations;
  auto device_copy = [&](const std::vector<std::byte>& host, std::size_t offset) -> std::byte* {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, host.size() + offset + 16));
    allocations.push_back(p);
    std::byte* at = static_cast<std::byte*>(p) + offset;
    CHECK_CUDA(cudaMemcpy(at, host.data(), host.size(), cudaMemcpyHostToDevice));
    return at;
  };
  std::vector<std::vector<const void*>> sources(problem.counts.size());
  std::vector<std::byte*> dsts;
  std::vector<cuda_kernels::ReduceSpec> specs;
  for (std::size_t i = 0; i < problem.counts.size(); ++i) {
    const int64_t n = problem.counts[i];
    const std::size_t offset = problem.misalign && i % 2 == 1 ? 2 : 0;
    for (int p = 0; p < problem.sources; ++p)
      sources[i].push_back(device_copy(random_bytes(problem.src_type, n, rng), offset));
    std::vector<std::byte> dst_init = problem.accumulate
                                          ? random_bytes(problem.dst_type, n, rng)
                                          : std::vector<std::byte>(n * dst_size, std::byte{0xFF});
    dsts.push_back(device_copy(dst_init, offset));
    const void* partial =
        problem.partial ? device_copy(random_bytes(cuda_kernels::kFP32, n, rng), offset * 2) : nullptr;
    specs.push_back({sources[i].data(), dsts.back(), partial, n, 0.5f, 0.125f, problem.accumulate,
                     problem.src_type, problem.dst_type, cuda_kernels::kFP32});
  }
  // A cudaMemcpy from pageable memory may return before its DMA lands, and `stream` (non-blocking)
  // does not wait for the legacy stream it ran on: without this the kernel raced the last copies
  // (the H200 once showed a tile of the last destination still 0xFF).
  CHECK_CUDA(cudaStreamSynchronize(cudaStreamLegacy));
  *info = cuda_kernels::launch_reduces(specs.data(), specs.size(), problem.sources, grid, stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<std::byte> out;
  for (std::size_t i = 0; i < problem.counts.size(); ++i) {
    std::vector<std::byte> host(problem.counts[i] * dst_size);
    CHECK_CUDA(cudaMemcpy(host.data(), dsts[i], host.size(), cudaMemcpyDeviceToHost));
    out.insert(out.end(), host.begin(), host.end());
  }
  for (void* p : allocations) CHECK_CUDA(cudaFree(p));
  return out;
}

int64_t tiles_of(const Problem& p) {
  int64_t tiles = 0;
  for (int64_t n : p.counts) tiles += (n + cuda_kernels::kTileElements - 1) / cuda_kernels::kTileElements;
  return tiles;
}

// Every budget's output equals today's (the default persistent grid) byte for byte, and its
// launches respect the budget: at most max_ctas CTAs each, ceil(tiles / (max_ctas x tiles)) waves.
TEST(CudaKernels, BudgetedReduceIsBitwiseTheDefault) {
  TIDE_REQUIRE_GPU();
  const int64_t tile = cuda_kernels::kTileElements;
  const std::vector<Problem> problems = {
      {"8 x bf16 -> fp32, one task of 3 tiles + 5", {3 * tile + 5}},
      {"8 x bf16 -> fp32, 2 Mi + 24 elements", {(int64_t{1} << 21) + 24}},
      {"8 x bf16 -> fp32, tasks 1 / 7 / tile / tile+1 / 300000", {1, 7, tile, tile + 1, 300000}},
      {"3 x bf16 -> bf16, misaligned, partial, accumulate", {5000, 2 * tile + 3, 77, 40000}, 3,
       cuda_kernels::kBF16, cuda_kernels::kBF16, true, true, true},
      {"8 x fp16 -> fp32, accumulate", {tile * 5 + 1, 19}, 8, cuda_kernels::kFP16, cuda_kernels::kFP32,
       false, false, true},
      {"4 x fp32 -> fp32, 20 tasks (large table)",
       {1000, 9000, 17, 8192, 3, 65536, 100, 2000, 8193, 1, 500, 600, 700, 800, 900, 1100, 1200, 1300,
        1400, 1500},
       4, cuda_kernels::kFP32, cuda_kernels::kFP32},
  };
  // {max_ctas, tiles_per_cta}: 0 = default grid / persistent.
  const std::vector<cuda_kernels::ReduceGrid> grids = {
      {1, 1}, {1, 0}, {8, 1}, {16, 4}, {7, 3}, {32, 0}, {132, 1}, {264, 0}, {264, 1}, {0, 2}, {66, 4}, {3, 1000}};
  const harness::TempDir dir;
  const auto reports = harness::run_rank_processes(1, [&](int, Bootstrap&) {
    CHECK_CUDA(cudaSetDevice(0));
    cuda_kernels::preload_kernels();
    cudaStream_t stream = nullptr;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (const Problem& problem : problems) {
      cuda_kernels::LaunchInfo info;
      const std::vector<std::byte> reference = run_problem(problem, {0, 0}, stream, &info);
      for (const cuda_kernels::ReduceGrid& grid : grids) {
        const std::string what = detail::concat(problem.name, ", ctas=", grid.max_ctas,
                                                " tiles=", grid.tiles_per_cta);
        const std::vector<std::byte> got = run_problem(problem, grid, stream, &info);
        if (got != reference) {
          std::size_t k = 0;
          while (k < got.size() && got[k] == reference[k]) ++k;
          throw std::runtime_error(what + ": differs from the default grid's result at byte " +
                                   std::to_string(k) + " of " + std::to_string(got.size()));
        }
        const int64_t cap = grid.max_ctas > 0 ? grid.max_ctas : cuda_kernels::default_max_ctas();
        const int64_t tiles = tiles_of(problem);
        // One table here (<= 16 tasks of <= 16 sources, or <= 128 tasks): waves per table.
        const int64_t launches =
            grid.tiles_per_cta <= 0 ? 1 : (tiles + cap * grid.tiles_per_cta - 1) / (cap * grid.tiles_per_cta);
        if (info.max_ctas > cap || info.launches != launches)
          throw std::runtime_error(detail::concat(what, ": ", info.launches, " launches of up to ",
                                                  info.max_ctas, " CTAs, expected ", launches,
                                                  " of up to ", cap));
      }
    }
    CHECK_CUDA(cudaStreamDestroy(stream));
  }, gpu_ranks(dir)).reports;
  ASSERT_EQ(reports[0], "ok");
}

}  // namespace
}  // namespace tide
