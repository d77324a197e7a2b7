// What every mode of tide_bench_cuda shares (bench_common.cpp): arguments, result rows passed
// between processes as tab-separated lines, ranks as processes (testing/rank_runner.hpp with the
// benchmark's timeouts; the parent never touches CUDA),
// device selection and timing, and the buckets measured. One file per mode: sweep.cpp (TIDE-AG/RS
// sweeps and buckets), nccl_baseline.cpp (NCCL's own collectives, compare), ceiling.cpp (copy and
// kernel ceilings), driver_calls.cpp (the host's and the GPU's time per driver call),
// interference.cpp (a GEMM beside TIDE-RS / NCCL / a reduce kernel; one_wave_gemm.hpp is that
// GEMM), breakdown.cpp (a small collective's fixed cost, operation by operation); the driver is
// bench_cuda.cpp.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_kernels.cuh"
#include "tide/cuda.hpp"
#include "tide/tide.hpp"

namespace tide::bench {

using namespace std::chrono_literals;

#define BCHECK(call)                                                                          \
  do {                                                                                        \
    const cudaError_t status_ = (call);                                                       \
    if (status_ != cudaSuccess)                                                               \
      throw std::runtime_error(std::string(#call) + " failed: " + cudaGetErrorName(status_) + \
                               " (" + cudaGetErrorString(status_) + ")");                     \
  } while (0)

constexpr uint64_t kSeedBase = 20251130;

struct Args {
  std::string mode = "all";
  std::string collective;  // ag | rs; "" = ag (sweep, bucket) or both (compare)
  std::string bucket = "llama";
  int world = 8;
  std::size_t min_mib = 1;
  std::size_t max_mib = 4096;
  int iters = 25;
  int warmup = 3;
  bool quick = false;
  int nodes = 1;  // > 1: every rank group of W/nodes its own (virtual) node
  std::string transport = "nccl";  // between nodes: nccl | ipc (CudaWindowScope::kHost windows)
  bool threads = false;          // ranks as threads of one process (GPU 0)
  bool prefixes = false;         // sweep/bucket: also time every prefix of the program (its chain)
  bool cuda_graphs = false;      // sweep/bucket: also the program captured in a CUDA graph, replayed
  std::string delivery = "default";  // sweep/bucket AG: default | push | cast_to_peers (plan.hpp)
  std::size_t chunk_mib = 16;  // across-node: AcrossNodesOptions::chunk_bytes (each chunk one send/recv)
  std::string wire = "fp32";   // across-node RS: AcrossNodesOptions::wire_dtype
  int rounds = 3;              // breakdown: rounds of fresh threads, streams and windows
};

// ---- Results: tab-separated lines appended by children, printed by the parent. -------------

struct Row {
  std::string section;  // "collective", "ceiling", "calls", "interference"
  std::string label;
  int world = 0;
  double bytes = 0;
  double time_us = 0;
  double algbw = 0;      // GB/s
  double busbw = 0;      // GB/s
  double sm_cta_us = 0;  // CTA-microseconds per run
  double staging = 0;    // bytes
  std::string note;      // correctness check, or remarks
};

std::string results_path();  // one file per run, created by the parent before any fork
void append_row(const Row& r);
std::vector<Row> read_rows();
std::string human_bytes(double b);
void print_collective_header();
void print_collective_row(const Row& r);

// ---- Processes. -----------------------------------------------------------------------------

// Forks `world` children running body(rank, bootstrap) over 300 s bootstrap waits; returns false
// (printing why) if any failed or was still running at `deadline`.
bool fork_ranks(int world, const std::function<void(int, Bootstrap&)>& body,
                std::chrono::seconds deadline = 570s);
bool run_single_child(const std::function<void()>& body);
// Ranks as threads share GPU 0 (CudaWindow refuses threads on different GPUs).
extern thread_local bool ranks_are_threads;
// The rank's GPU, made current, with the test-data kernels loaded.
void select_device(int rank);
double median(std::vector<double> v);

struct DeviceMemory {
  void* ptr = nullptr;
  DeviceMemory() = default;
  explicit DeviceMemory(std::size_t bytes);
  ~DeviceMemory();
  DeviceMemory(DeviceMemory&& o) noexcept : ptr(o.ptr) { o.ptr = nullptr; }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(ptr, o.ptr);
    return *this;
  }
};

// Times `iters` back-to-back calls of enqueue() on `stream` with events; returns microseconds each.
// Host-paced: when enqueue() costs the host more than the GPU takes, this is the host's pace.
std::vector<double> time_each(cudaStream_t stream, int iters, const std::function<void()>& enqueue);

// enqueue() captured once on `stream` (thread-local capture mode) as an executable graph; the
// caller destroys it (cudaGraphExecDestroy).
cudaGraphExec_t capture_once(cudaStream_t stream, const std::function<void()>& enqueue);

// ---- Buckets. -------------------------------------------------------------------------------

struct BucketCase {
  std::string label;
  std::vector<ParamSpec> specs;
};

std::vector<ParamSpec> llama_layer();  // one Llama-3.1-70B decoder layer
std::vector<ParamSpec> small_params();   // 512 params x 64 KiB
std::vector<ParamSpec> expert_params();  // 384 params x 3 MiB (one Qwen3-30B-A3B layer's experts)
std::vector<ParamSpec> single_param(std::size_t bytes);
std::size_t unsharded_bytes(const BucketLayout& layout);
// Device bytes one rank needs for the bucket (window, inputs, outputs), for the memory cap.
std::size_t rank_bytes(const BucketLayout& layout, Collective c);
std::vector<BucketCase> sweep_cases(const Args& args, std::size_t max_mib);
std::vector<BucketCase> bucket_case(const std::string& name);

// ---- The modes. -----------------------------------------------------------------------------

// sweep.cpp: TIDE-AG / TIDE-RS on `cases`, W ranks as processes (or threads: args.threads).
bool run_collective(Collective collective, int world, const std::vector<BucketCase>& cases,
                    const Args& args);
void bench_collective_rank(int rank, Bootstrap& bootstrap, Collective collective,
                           const std::vector<BucketCase>& cases, const Args& args);
// nccl_baseline.cpp: TIDE beside NCCL's own collective, one GPU per rank (>= 2 GPUs).
bool run_compare(const std::vector<BucketCase>& cases, const Args& args);
// ceiling.cpp, driver_calls.cpp (each in a child process).
void ceiling_child(const Args& args);
void driver_calls_child(const Args& args);
// copy_paths.cpp: a step's many copies on the copy engines vs one copy kernel, by copy size.
void copy_paths_child(const Args& args);
// interference.cpp.
bool run_interference(const Args& args);
// breakdown.cpp: a small collective's operations timed one by one, and the collectives with the
// slot-free handshake fused into the cast-to-peers kernel and not (in a child process).
void breakdown_child(const Args& args);

}  // namespace tide::bench
