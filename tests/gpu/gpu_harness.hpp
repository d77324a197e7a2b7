// Harness of the GPU tests: ranks as processes forked before this (parent) process touches CUDA
// (testing/rank_runner.hpp, with the GPU tests' options), scenarios (a sequence of collectives on
// one window) run identically by the host executor (the reference, ranks as threads) and by the
// CUDA executor, and byte captures to compare.
#pragma once

#include <optional>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "rank_runner.hpp"
#include "test_util.hpp"
#include "tide/cuda.hpp"
#include "tide/tide.hpp"

// A CUDA runtime call in a test: throws with the call and the error text.
#define CHECK_CUDA(call)                                                                      \
  do {                                                                                        \
    const cudaError_t status_ = (call);                                                       \
    if (status_ != cudaSuccess)                                                               \
      throw std::runtime_error(std::string(#call) + " failed: " + cudaGetErrorString(status_)); \
  } while (0)

// Visible in the test log: CI (no GPU) must show why nothing ran.
#define TIDE_REQUIRE_GPU()                                                                  \
  do {                                                                                      \
    if (!::tide::gpu_test::gpu_available())                                                 \
      GTEST_SKIP() << "no usable CUDA device (tide::cuda_device_available() is false): "     \
                      "GPU test skipped";                                                   \
  } while (0)

namespace tide::gpu_test {

// TIDE_GPU_TEST_IN_PROCESS=1: compute-sanitizer runs, where a fork()ed child that starts CUDA
// hangs; single-rank tests then run in this process.
inline bool in_process_requested() {
  const char* env = std::getenv("TIDE_GPU_TEST_IN_PROCESS");
  return env && *env == '1';
}

// cuda_device_available(), or in_process_requested() asked in this process.
inline bool gpu_available() {
  if (in_process_requested()) {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }
  return cuda_device_available();
}

// ---- Ranks as processes (testing/rank_runner.hpp). --------------------------------------------

// How long a rank may run: 100 s, or TIDE_GPU_TEST_DEADLINE_S (compute-sanitizer runs are slow).
inline std::chrono::seconds default_rank_deadline() {
  const char* env = std::getenv("TIDE_GPU_TEST_DEADLINE_S");
  return std::chrono::seconds(env && *env ? std::atoi(env) : 100);
}

// The GPU tests' ranks as processes: their rendezvous (and whatever they write) in `dir`, 60 s
// bootstrap waits, killed after `deadline`; a single rank in this process under
// TIDE_GPU_TEST_IN_PROCESS=1. The parent never calls CUDA (a fork()ed child of a CUDA process
// cannot use CUDA).
inline harness::RankProcessOptions gpu_ranks(const harness::TempDir& dir,
                                             std::chrono::seconds deadline = default_rank_deadline()) {
  return {.dir = dir.path(),
          .bootstrap_timeout = std::chrono::seconds(60),
          .deadline = deadline,
          .single_rank_in_process = in_process_requested()};
}

// ThreadBootstrap waits of the GPU tests' ranks as threads.
inline constexpr std::chrono::seconds kThreadRankTimeout{120};

// body(rank, bootstrap) on `world` ranks that are threads of one forked process (one CUDA
// context; killed after 120 s). Returns that process's report: "ok", or the first thread rank that
// threw or reported anything but "ok".
inline std::string run_thread_ranks_in_a_process(int world, const harness::TempDir& dir,
                                                 const harness::ReportingRankBody& body) {
  return harness::run_rank_processes(1, [&](int, Bootstrap&) {
    const auto reports = harness::run_rank_threads(world, [&](int rank, Bootstrap& b) {
      const std::string report = body(rank, b);
      if (report != "ok") throw std::runtime_error(report);
    }, kThreadRankTimeout);
    for (int r = 0; r < world; ++r)
      if (reports[r] != "ok") throw std::runtime_error("thread rank " + std::to_string(r) + ": " + reports[r]);
  }, gpu_ranks(dir, std::chrono::seconds(120))).reports[0];
}

// ---- Device memory. --------------------------------------------------------------------------

// A test's device allocation (at least 16 bytes), freed with it; movable, so vectors hold them.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(std::size_t bytes) { CHECK_CUDA(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 16))); }
  ~DeviceBuffer() { (void)cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr) { o.ptr = nullptr; }
};

// ---- Deterministic data (never zeros). -------------------------------------------------------

inline float value_at(uint64_t seed, int param, int rank, int64_t k) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t(param) << 40) ^
               (uint64_t(rank + 1) << 20) ^ uint64_t(k) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<float>(2 * (static_cast<int64_t>(x >> 40) - (1 << 23)) + 1) /
         float(1 << 24);
}

inline std::vector<std::byte> make_values(DType dtype, int64_t n, uint64_t seed, int param,
                                          int rank) {
  std::vector<std::byte> bytes(std::max<int64_t>(n, 1) * dtype_size(dtype));
  for (int64_t k = 0; k < n; ++k)
    store_from_float(bytes.data(), dtype, k, value_at(seed, param, rank, k));
  return bytes;
}

// A random bucket (tests/cpp/test_util.hpp), with longer and more often wide rows than the host
// tests use, so the kernels' vector, scalar and tail paths all run.
inline std::vector<ParamSpec> random_specs(std::mt19937_64& rng, int world, int max_params = 6,
                                           int64_t max_numel = 1 << 16) {
  return test::random_specs(rng, world,
                            test::BucketShape{max_params, max_numel, 64, 300, 4, 256, 40});
}

// ---- Scenarios. ------------------------------------------------------------------------------

struct Invocation {
  Collective collective;
  ReduceOptions options;  // reduce-scatter only
  uint32_t bucket;
  uint64_t seed;          // of its inputs (and of the outputs' prior values when accumulating)
};

struct Scenario {
  std::vector<ParamSpec> specs;
  int world;
  std::vector<Invocation> sequence;  // run in order on one window, `repeats` times
  int repeats = 2;
  int nodes = 1;       // > 1: across-node plans, the CUDA executor's network over NCCL or IPC
  AcrossNodesOptions net = {};
  CudaMemory memory = CudaMemory::kMalloc;  // of the CUDA windows
  CudaWindowScope scope = CudaWindowScope::kNode;       // kHost: virtual nodes, network over CUDA IPC
  std::optional<Delivery> delivery = std::nullopt;  // both collectives; unset: default_delivery(layout)

  Topology topology() const { return Topology{nodes, world / nodes}; }
  BucketLayout layout() const { return BucketLayout(specs, topology()); }
};

// Per rank, the inputs of one invocation (AG: valid shard rows in shard_dtype; RS: the full
// gradient in dtype), the outputs' prior contents (RS), and per param the scale of an e4m3 cast
// (AG; 0 for other params).
struct RankData {
  std::vector<std::vector<std::byte>> inputs;
  std::vector<std::vector<std::byte>> outputs;
  std::vector<float> scales;
};

inline RankData make_rank_data(const BucketLayout& layout, const Invocation& inv, int rank) {
  RankData d;
  for (std::size_t i = 0; i < layout.num_params(); ++i) {
    const ParamLayout& p = layout.param(i);
    if (inv.collective == Collective::kAllGather) {
      d.inputs.push_back(make_values(p.shard_dtype, p.valid_numel(rank), inv.seed, int(i), rank));
      // Scales that round the products and saturate the largest of them (every rank the same,
      // as an all-reduced amax makes them).
      d.scales.push_back(is_scaled(p.dtype) ? 250.0f + 13.0f * float(i) + float(inv.seed % 7) : 0.0f);
    } else {
      d.inputs.push_back(make_values(p.dtype, p.numel(), inv.seed, int(i), rank));
      d.outputs.push_back(
          make_values(p.shard_dtype, p.valid_numel(rank), inv.seed ^ 0xACCu, int(i), rank));
    }
  }
  return d;
}

inline Program plan(const Scenario& s, const BucketLayout& layout, const Invocation& inv, int rank) {
  const Delivery delivery = s.delivery.value_or(default_delivery(layout));
  if (inv.collective == Collective::kReduceScatter)
    return plan_reduce_scatter(layout, rank, inv.options, inv.bucket, s.net, delivery);
  return plan_all_gather(layout, rank, inv.bucket, s.net, delivery);
}

// The window every invocation of the scenario fits in (across-node reduce-scatters add staging).
inline std::size_t window_bytes(const Scenario& s) {
  const BucketLayout layout = s.layout();
  std::size_t bytes = layout.window_bytes();
  for (const Invocation& inv : s.sequence) bytes = std::max(bytes, plan(s, layout, inv, 0).window_bytes);
  return bytes;
}

// What is compared after an invocation: AG, the window's param regions (all W slots of each
// param, padding included); RS, the outputs.
inline std::vector<std::byte> capture_window(const BucketLayout& layout, const std::byte* window) {
  std::vector<std::byte> out;
  for (const ParamLayout& p : layout.params())
    out.insert(out.end(), window + p.window_offset,
               window + p.window_offset + layout.world() * p.slot_bytes());
  return out;
}

inline std::vector<std::byte> capture_outputs(const BucketLayout& layout, const RankData& d,
                                              int rank) {
  std::vector<std::byte> out;
  for (std::size_t i = 0; i < layout.num_params(); ++i) {
    const ParamLayout& p = layout.param(i);
    out.insert(out.end(), d.outputs[i].begin(),
               d.outputs[i].begin() + p.valid_numel(rank) * dtype_size(p.shard_dtype));
  }
  return out;
}

// The reference: captures[rank][invocation] from the host executor, ranks as threads.
inline std::vector<std::vector<std::vector<std::byte>>> host_reference(const Scenario& s) {
  const BucketLayout layout = s.layout();
  std::vector<std::vector<std::vector<std::byte>>> captures(s.world);
  const auto reports = harness::run_rank_threads(s.world, [&](int rank, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, window_bytes(s));
    HostExecutor executor(*window, std::chrono::milliseconds(60000));
    for (const Invocation& inv : s.sequence) {
      RankData d = make_rank_data(layout, inv, rank);
      Bindings b;
      for (auto& in : d.inputs) b.inputs.push_back(in.data());
      for (auto& out : d.outputs) b.outputs.push_back(out.data());
      for (const float& scale : d.scales) b.scales.push_back(scale != 0.0f ? &scale : nullptr);
      executor.run(plan(s, layout, inv, rank), b);
      captures[rank].push_back(inv.collective == Collective::kAllGather
                                   ? capture_window(layout, window->data(rank))
                                   : capture_outputs(layout, d, rank));
    }
  }, kThreadRankTimeout);
  for (int r = 0; r < s.world; ++r)
    if (reports[r] != "ok") throw std::runtime_error("host reference rank " + std::to_string(r) +
                                                     ": " + reports[r]);
  return captures;
}

// fp64 reference of one rank's reduce-scatter outputs (prior values included when accumulating),
// and per element the magnitude the fp32 arithmetic worked at: |scale| * sum |prescale * x| + |old|.
struct Fp64Reference {
  std::vector<double> value;
  std::vector<double> magnitude;
};

inline std::vector<Fp64Reference> fp64_reduce_scatter(const BucketLayout& layout,
                                                      const Invocation& inv, int rank) {
  const int world = layout.world();
  const RankData mine = make_rank_data(layout, inv, rank);
  std::vector<RankData> all;
  for (int r = 0; r < world; ++r) all.push_back(make_rank_data(layout, inv, r));
  const ReduceOptions& o = inv.options;
  const double scale = o.kind == ReduceKind::kAvg ? double(o.postscale) / world : o.postscale;
  std::vector<Fp64Reference> out;
  for (std::size_t i = 0; i < layout.num_params(); ++i) {
    const ParamLayout& p = layout.param(i);
    Fp64Reference ref{std::vector<double>(p.valid_numel(rank)),
                      std::vector<double>(p.valid_numel(rank))};
    // Element k of rank's shard: row k / run of dim k's outer rows, at rank's block of that row
    // (the gradient is the unsharded param; for dim 0 this is rank * shard_numel + k).
    const int64_t run = p.valid_rows(rank) * p.row_numel;
    const int64_t row_numel = p.shard_dim_size * p.row_numel;
    for (int64_t k = 0; k < p.valid_numel(rank); ++k) {
      const int64_t at = (k / run) * row_numel + rank * p.rows_per_rank * p.row_numel + k % run;
      double sum = 0, magnitude = 0;
      for (int r = 0; r < world; ++r) {
        const double term = double(o.prescale) * load_as_float(all[r].inputs[i].data(), p.dtype, at);
        sum += term, magnitude += std::abs(term);
      }
      ref.value[k] = sum * scale;
      ref.magnitude[k] = magnitude * std::abs(scale);
      if (o.accumulate) {
        const double old = load_as_float(mine.outputs[i].data(), p.shard_dtype, k);
        ref.value[k] += old;
        ref.magnitude[k] += std::abs(old);
      }
    }
    out.push_back(std::move(ref));
  }
  return out;
}

// Unit roundoff of results stored in `dtype`.
inline double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kFP32: return std::ldexp(1.0, -24);
    case DType::kFP16: return std::ldexp(1.0, -11);
    case DType::kBF16: return std::ldexp(1.0, -8);
    case DType::kU8:
    case DType::kE4M3: break;  // never a reduce-scatter's result
  }
  return 0;
}

// Checks one param's reduce-scatter result against fp64: element by element within the textbook
// bound of W+3 fp32 roundings at the working magnitude plus the output's rounding (never fails
// spuriously, also under cancellation), plus `wire_roundings` bf16 roundings of partial sums on
// the network (AcrossNodesOptions::wire_dtype, lossy); and, for fp32 results of >= 256 elements, within
// 1e-6 relative in norm (1e-2 with a bf16 wire). Returns "" or what failed.
inline std::string check_against_fp64(const std::vector<double>& got, const Fp64Reference& ref,
                                      int world, DType out_dtype, int wire_roundings = 0) {
  const double u32 = std::ldexp(1.0, -24);
  for (std::size_t k = 0; k < got.size(); ++k) {
    const double bound = ((world + 3) * u32 + wire_roundings * std::ldexp(1.0, -8)) * ref.magnitude[k] +
                         unit_roundoff(out_dtype) * std::abs(ref.value[k]) + 1e-30;
    if (!(std::abs(got[k] - ref.value[k]) <= bound)) {
      std::ostringstream os;
      os << "element " << k << ": got " << got[k] << ", fp64 " << ref.value[k] << ", |diff| "
         << std::abs(got[k] - ref.value[k]) << " > bound " << bound;
      return os.str();
    }
  }
  if (out_dtype == DType::kFP32 && got.size() >= 256) {
    double num = 0, den = 0;
    for (std::size_t k = 0; k < got.size(); ++k)
      num += (got[k] - ref.value[k]) * (got[k] - ref.value[k]), den += ref.value[k] * ref.value[k];
    const double relative = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
    const double limit = wire_roundings > 0 ? 1e-2 : 1e-6;
    if (!(relative <= limit))
      return "norm-wise relative error " + std::to_string(relative) + " > " + std::to_string(limit);
  }
  return "";
}

// The first differing byte of two captures, by param, for a readable failure.
inline std::string first_difference(const BucketLayout& layout, const Invocation& inv, int rank,
                                    const std::vector<std::byte>& got,
                                    const std::vector<std::byte>& want) {
  if (got.size() != want.size())
    return "capture size " + std::to_string(got.size()) + " B, expected " +
           std::to_string(want.size()) + " B";
  std::size_t base = 0;
  for (std::size_t i = 0; i < layout.num_params(); ++i) {
    const ParamLayout& p = layout.param(i);
    const std::size_t bytes = inv.collective == Collective::kAllGather
                                  ? layout.world() * p.slot_bytes()
                                  : p.valid_numel(rank) * dtype_size(p.shard_dtype);
    for (std::size_t b = 0; b < bytes; ++b)
      if (got[base + b] != want[base + b]) {
        std::ostringstream os;
        os << "param " << i << " (" << p.name << ", " << dtype_name(p.dtype) << "/"
           << dtype_name(p.shard_dtype) << ") byte " << b << ": got 0x" << std::hex
           << int(got[base + b]) << ", expected 0x" << int(want[base + b]);
        return os.str();
      }
    base += bytes;
  }
  return "none";
}

}  // namespace tide::gpu_test
