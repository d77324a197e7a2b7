// tide_bench_cuda: TIDE-AG / TIDE-RS on GPUs, nccl-tests style, ranks as processes on one GPU (one
// per GPU where several exist), every timed configuration checked on the device afterwards.
//
//   tide_bench_cuda [all]              everything below, then a short summary table
//   tide_bench_cuda ceiling            HBM copy ceiling; reduce / cast kernel bandwidth against it
//   tide_bench_cuda sweep  --collective ag|rs --world W [--min-mib N] [--max-mib N]
//   tide_bench_cuda bucket --bucket llama|small --collective ag|rs --world W
//   tide_bench_cuda compare [--bucket llama|small] [--collective ag|rs]
//                                      >= 2 GPUs, one rank each: TIDE on one node (copy engines
//                                      over NVLink), TIDE with every GPU its own node (NCCL
//                                      send/recv between them) and NCCL's own collective, same buckets
//   tide_bench_cuda interference       one-wave bf16 GEMM alone / beside TIDE-RS / beside a 16-CTA
//                                      reduce kernel on one GPU (ranks as threads); with >= 2 GPUs
//                                      also one rank per GPU, beside ncclReduceScatter as well
//                                      (cuBLAS and NCCL loaded at run time; skipped without;
//                                      --quick: only the multi-GPU part)
// Options: --iters N (timed runs, >= 20; median reported), --warmup N, --quick (fewer sizes),
// --nodes N (sweep/bucket: W ranks as N nodes), --network nccl|ipc (between those nodes: NCCL,
// one GPU per rank; or CUDA IPC, virtual nodes whose ranks may share GPUs: on one GPU the whole
// pipeline, network included, is bound by that GPU's HBM), --chunk-mib N (multi-node chunk size,
// default 16), --wire fp32|bf16 (multi-node RS: the dtype of partial sums between nodes; bf16 is
// lossy and checked within one bf16 rounding per node), --threads (sweep/bucket: the ranks as threads of one process on GPU 0, one CUDA
// context, instead of processes, whose contexts the GPU time-slices: every hand-off between
// ranks can then wait for a time slice).
//
// Times: per rank, CUDA events around each of N back-to-back runs; the median per rank; the slowest
// rank's median reported. algbw = bytes / time, busbw = algbw * (W-1)/W (nccl-tests). SM time =
// CTAs x kernel time of the run's cast/reduce kernels (copies and flags use no SMs).
// The parent process never touches CUDA: every measurement runs in fork()ed children.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <latch>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_kernels.cuh"
#include "kernels.cuh"
#include "tide/cuda.hpp"
#include "tide/tide.hpp"

namespace tide::bench {
namespace {

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
  std::string network = "nccl";  // between nodes: nccl | ipc (CudaReach::kHost windows)
  bool threads = false;          // ranks as threads of one process (GPU 0)
  std::size_t chunk_mib = 16;  // multi-node: NetOptions::chunk_bytes (each chunk one send/recv)
  std::string wire = "fp32";   // multi-node RS: NetOptions::wire_dtype
};

// ---- Results: tab-separated lines appended by children, printed by the parent. -------------

struct Row {
  std::string section;  // "collective", "ceiling", "interference"
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

std::string results_path() {
  static const std::string path = [] {
    char pattern[] = "/tmp/tide-bench-XXXXXX";
    if (!::mkdtemp(pattern)) throw std::runtime_error("mkdtemp failed");
    return std::string(pattern) + "/results.tsv";
  }();
  return path;
}

void append_row(const Row& r) {
  std::ofstream out(results_path(), std::ios::app);
  out << r.section << '\t' << r.label << '\t' << r.world << '\t' << r.bytes << '\t' << r.time_us
      << '\t' << r.algbw << '\t' << r.busbw << '\t' << r.sm_cta_us << '\t' << r.staging << '\t'
      << r.note << '\n';
}

std::vector<Row> read_rows() {
  std::vector<Row> rows;
  std::ifstream in(results_path());
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ss(line);
    Row r;
    std::string field;
    std::vector<std::string> f;
    while (std::getline(ss, field, '\t')) f.push_back(field);
    if (f.size() < 10) continue;
    r.section = f[0], r.label = f[1], r.world = std::stoi(f[2]), r.bytes = std::stod(f[3]);
    r.time_us = std::stod(f[4]), r.algbw = std::stod(f[5]), r.busbw = std::stod(f[6]);
    r.sm_cta_us = std::stod(f[7]), r.staging = std::stod(f[8]), r.note = f[9];
    rows.push_back(r);
  }
  return rows;
}

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%.0f B", b);
  return buf;
}

void print_collective_header() {
  std::printf("%-28s %3s %12s %11s %9s %9s %12s %11s  %s\n", "bucket", "W", "bytes", "time(us)",
              "algbw", "busbw", "SM(CTA*us)", "staged", "check");
  std::printf("%-28s %3s %12s %11s %9s %9s %12s %11s\n", "", "", "", "", "(GB/s)", "(GB/s)", "",
              "");
}

void print_collective_row(const Row& r) {
  std::printf("%-28s %3d %12s %11.1f %9.1f %9.1f %12.0f %11s  %s\n", r.label.c_str(), r.world,
              human_bytes(r.bytes).c_str(), r.time_us, r.algbw, r.busbw, r.sm_cta_us,
              human_bytes(r.staging).c_str(), r.note.c_str());
}

// ---- Processes. -----------------------------------------------------------------------------

// Forks `world` children running body(rank, bootstrap); returns false (printing why) if any failed.
bool fork_ranks(int world, const std::function<void(int, Bootstrap&)>& body,
                std::chrono::seconds deadline = 570s) {
  char pattern[] = "/tmp/tide-bench-ranks-XXXXXX";
  if (!::mkdtemp(pattern)) throw std::runtime_error("mkdtemp failed");
  const std::string dir = pattern;
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Before CUDA starts in this child: enough hardware queues that no two ranks' streams share
      // one (ranks as threads in the interference mode; see CudaExecutor in tide/cuda.hpp).
      ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
      int code = 0;
      try {
        // Never destroyed: ~FileBootstrap removes this rank's file of the last round, which a
        // slower peer may not have read yet.
        auto* bootstrap = new FileBootstrap(dir, r, world, 300000ms);
        body(r, *bootstrap);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d failed: %s\n", r, e.what());
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  const auto end = std::chrono::steady_clock::now() + deadline;
  std::vector<bool> done(world, false);
  for (int remaining = world; remaining > 0;) {
    for (int r = 0; r < world; ++r) {
      int status = 0;
      if (!done[r] && ::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true, --remaining;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = false;
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > end) {
      std::fprintf(stderr, "ranks still running after %lld s: killed\n",
                   static_cast<long long>(deadline.count()));
      for (int r = 0; r < world; ++r)
        if (!done[r]) ::kill(pids[r], SIGKILL), ::waitpid(pids[r], nullptr, 0);
      ok = false;
      break;
    }
    std::this_thread::sleep_for(5ms);
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return ok;
}

bool run_single_child(const std::function<void()>& body) {
  return fork_ranks(1, [&](int, Bootstrap&) { body(); });
}

// Ranks as threads share GPU 0 (CudaWindow refuses threads on different GPUs).
thread_local bool ranks_are_threads = false;
void select_device(int rank) {
  int count = 0;
  BCHECK(cudaGetDeviceCount(&count));
  BCHECK(cudaSetDevice(ranks_are_threads ? 0 : rank % count));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

cuda_kernels::ElementType element_type(DType d) {
  return static_cast<cuda_kernels::ElementType>(static_cast<int>(d));
}

struct DeviceMemory {
  void* ptr = nullptr;
  DeviceMemory() = default;
  explicit DeviceMemory(std::size_t bytes) { BCHECK(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 256))); }
  ~DeviceMemory() {
    if (ptr) (void)cudaFree(ptr);
  }
  DeviceMemory(DeviceMemory&& o) noexcept : ptr(o.ptr) { o.ptr = nullptr; }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(ptr, o.ptr);
    return *this;
  }
};

// Times `iters` back-to-back calls of enqueue() on `stream` with events; returns microseconds each.
std::vector<double> time_each(cudaStream_t stream, int iters, const std::function<void()>& enqueue) {
  std::vector<cudaEvent_t> events(2 * iters);
  for (auto& e : events) BCHECK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    BCHECK(cudaEventRecord(events[2 * i], stream));
    enqueue();
    BCHECK(cudaEventRecord(events[2 * i + 1], stream));
  }
  BCHECK(cudaStreamSynchronize(stream));
  std::vector<double> us(iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    BCHECK(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
    us[i] = 1000.0 * ms;
  }
  for (auto& e : events) BCHECK(cudaEventDestroy(e));
  return us;
}

// ---- Buckets. -------------------------------------------------------------------------------

struct BucketCase {
  std::string label;
  std::vector<ParamSpec> specs;
};

std::vector<ParamSpec> llama_layer() {
  // One Llama-3.1-70B decoder layer: attention (GQA, 8 KV heads), SwiGLU MLP, two RMSNorms.
  const DType b = DType::kBF16, f = DType::kFP32;
  return {{"q_proj", {8192, 8192}, b, f},   {"k_proj", {1024, 8192}, b, f},
          {"v_proj", {1024, 8192}, b, f},   {"o_proj", {8192, 8192}, b, f},
          {"gate_proj", {28672, 8192}, b, f}, {"up_proj", {28672, 8192}, b, f},
          {"down_proj", {8192, 28672}, b, f}, {"input_norm", {8192}, b, f},
          {"post_attn_norm", {8192}, b, f}};
}

std::vector<ParamSpec> small_params() {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 512; ++i)  // 64 KiB of bf16 each
    specs.push_back({"p" + std::to_string(i), {256, 128}, DType::kBF16, DType::kFP32});
  return specs;
}

std::vector<ParamSpec> single_param(std::size_t bytes) {
  const int64_t cols = 1024;
  const int64_t rows = static_cast<int64_t>(bytes / 2 / cols);
  return {{"w", {rows, cols}, DType::kBF16, DType::kFP32}};
}

std::size_t unsharded_bytes(const BucketLayout& layout) {
  std::size_t total = 0;
  for (const ParamLayout& p : layout.params()) total += p.unsharded_bytes();
  return total;
}

// Device bytes one rank needs for the bucket (window, inputs, outputs), for the memory cap.
std::size_t rank_bytes(const BucketLayout& layout, Collective c) {
  std::size_t total = layout.window_bytes();
  for (const ParamLayout& p : layout.params()) {
    const std::size_t shard = p.shard_numel * dtype_size(p.shard_dtype);
    total += c == Collective::kAllGather ? shard : p.unsharded_bytes() + shard;
  }
  return total;
}

// ---- Collective benchmark (one rank). ---------------------------------------------------------

void bench_collective_rank(int rank, Bootstrap& bootstrap, Collective collective,
                           const std::vector<BucketCase>& cases, const Args& args) {
  select_device(rank);
  const int world = bootstrap.world();
  const Topology topology{args.nodes, world / args.nodes};
  NetOptions net;  // ring
  net.chunk_bytes = args.chunk_mib << 20;
  net.wire_dtype = args.wire == "bf16" ? DType::kBF16 : DType::kFP32;
  const bool lossy = net.wire_dtype == DType::kBF16;
  const bool ipc = args.network == "ipc";
  std::unique_ptr<NcclComm> network;
  if (args.nodes > 1 && !ipc) network = NcclComm::create(bootstrap);
  cudaStream_t stream = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::size_t free_bytes = 0, total_bytes = 0;
  BCHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  int devices = 1;
  BCHECK(cudaGetDeviceCount(&devices));
  const int ranks_per_device = (world + devices - 1) / devices;
  DeviceMemory mismatches(sizeof(unsigned long long));

  for (const BucketCase& bc : cases) {
    const BucketLayout layout(bc.specs, topology);
    // Decided from the device's total memory (the same on every rank), not from free memory,
    // which changes while the other ranks allocate.
    const std::size_t need = rank_bytes(layout, collective) + (512u << 20);
    if (need * ranks_per_device > total_bytes * 0.85) {
      if (rank == 0) {
        Row r{"collective", bc.label, world, double(unsharded_bytes(layout)), 0, 0, 0, 0, 0,
              "skipped: needs " + human_bytes(double(need) * ranks_per_device) + " per GPU"};
        append_row(r);
      }
      continue;
    }
    const ReduceOptions options;  // kAvg
    const Program program = collective == Collective::kAllGather
                                ? plan_all_gather(layout, rank, 1, net)
                                : plan_reduce_scatter(layout, rank, options, 2, net);
    // Memory before the window, whose creation ends in a barrier: with ranks as threads,
    // cudaMalloc/cudaFree may wait for the whole device while a peer's stream waits on this rank.
    std::vector<DeviceMemory> inputs, outputs;
    Bindings bindings;
    for (std::size_t i = 0; i < layout.num_params(); ++i) {
      const ParamLayout& p = layout.param(i);
      const uint64_t seed = input_seed(kSeedBase, int(i), rank);
      if (collective == Collective::kAllGather) {
        inputs.emplace_back(p.valid_numel(rank) * dtype_size(p.shard_dtype));
        cuda_kernels::launch_fill_random(inputs.back().ptr, element_type(p.shard_dtype),
                                         p.valid_numel(rank), seed, stream);
      } else {
        inputs.emplace_back(p.unsharded_bytes());
        cuda_kernels::launch_fill_random(inputs.back().ptr, element_type(p.dtype), p.numel(), seed,
                                         stream);
        outputs.emplace_back(p.valid_numel(rank) * dtype_size(p.shard_dtype));
        bindings.outputs.push_back(outputs.back().ptr);
      }
      bindings.inputs.push_back(inputs.back().ptr);
    }
    BCHECK(cudaStreamSynchronize(stream));
    auto window = CudaWindow::create(bootstrap, program.window_bytes, topology, CudaMemory::kMalloc,
                                     ipc ? CudaReach::kHost : CudaReach::kNode);

    double median_us = 0, sm_cta_us = 0;
    bool batched = true;
    unsigned long long wrong = 0;
    {
      CudaExecutor executor(*window, stream, default_timeout(), network.get());
      for (int w = 0; w < args.warmup; ++w) executor.run(program, bindings);
      executor.synchronize();
      bootstrap.barrier();
      const auto times = time_each(stream, args.iters, [&] { executor.run(program, bindings); });
      executor.synchronize();
      median_us = median(times);
      executor.enable_stats(true);
      executor.reset_stats();
      executor.run(program, bindings);
      const CudaExecutor::Stats stats = executor.stats();
      sm_cta_us = stats.cast_cta_us + stats.reduce_cta_us;
      // No fallback to one cudaMemcpyAsync per copy (a program may have no copies at all: one
      // rank per node has no local peers to push to).
      batched = stats.single_copy_calls == 0;
      executor.enable_stats(false);
      bootstrap.barrier();  // threads: no pageable copy (below) while a peer's stream may wait

      // Check the last run's result on the device, bit for bit.
      BCHECK(cudaMemsetAsync(mismatches.ptr, 0, sizeof(unsigned long long), stream));
      for (std::size_t i = 0; i < layout.num_params(); ++i) {
        const ParamLayout& p = layout.param(i);
        const ParamGeometry g{p.dim0, p.row_numel, p.rows_per_rank, p.shard_numel,
                              element_type(p.dtype), element_type(p.shard_dtype)};
        if (collective == Collective::kAllGather)
          launch_check_all_gather(window->data(rank) + p.window_offset, g, world, kSeedBase,
                                  int(i), static_cast<unsigned long long*>(mismatches.ptr), stream);
        else
          launch_check_reduce_scatter(outputs[i].ptr, g, world, rank, kSeedBase, int(i),
                                      options.prescale, options.postscale / float(world),
                                      args.nodes <= 1 ? 0.0f
                                      : lossy         ? args.nodes * std::ldexp(1.0f, -8)
                                                      : 1e-6f,
                                      static_cast<unsigned long long*>(mismatches.ptr), stream);
      }
      BCHECK(cudaMemcpyAsync(&wrong, mismatches.ptr, sizeof wrong, cudaMemcpyDeviceToHost, stream));
      BCHECK(cudaStreamSynchronize(stream));
    }
    char mine[128];
    std::snprintf(mine, sizeof mine, "%.3f %llu %.3f", median_us, wrong, sm_cta_us);
    const auto all = bootstrap.allgather(mine);
    if (rank == 0) {
      double slowest = 0, sm_sum = 0;
      unsigned long long wrong_total = 0;
      for (const std::string& s : all) {
        double t = 0, sm = 0;
        unsigned long long w = 0;
        std::sscanf(s.c_str(), "%lf %llu %lf", &t, &w, &sm);
        slowest = std::max(slowest, t), wrong_total += w, sm_sum += sm;
      }
      Row r;
      r.section = "collective";
      r.label = bc.label;
      r.world = world;
      r.bytes = double(unsharded_bytes(layout));
      r.time_us = slowest;
      r.algbw = r.bytes / (slowest * 1e-6) / 1e9;
      r.busbw = r.algbw * (world - 1) / world;
      r.sm_cta_us = sm_sum / world;
      r.staging = collective == Collective::kReduceScatter
                      ? double(program.bytes_pushed() + rs_staging_bytes(layout, net))
                      : 0.0;
      if (args.nodes > 1)
        r.label += " [" + std::to_string(topology.nodes) + "x" + std::to_string(topology.local) +
                   " nodes, " + (ipc ? "IPC" : "NCCL") + ", " + std::to_string(args.chunk_mib) +
                   " MiB chunks" + (lossy && collective == Collective::kReduceScatter ? ", bf16 wire" : "") +
                   "]";
      r.note = wrong_total == 0 ? (args.nodes > 1 && collective == Collective::kReduceScatter
                                       ? (lossy ? "ok (within the bf16 wire's roundings)" : "ok (within 1e-6)")
                                       : "ok (bitwise)")
                                : "FAIL: " + std::to_string(wrong_total) + " wrong elements";
      if (!batched) r.note += ", copies NOT batched (cudaMemcpyAsync fallback)";
      append_row(r);
      print_collective_row(r);
      std::fflush(stdout);
    }
    bootstrap.barrier();  // everyone done with the window before it is freed
  }
  network.reset();
  BCHECK(cudaStreamDestroy(stream));
}

// ---- NCCL's own collectives on the same buckets (the stock FSDP2 path's communication). ------
//
// All-gather: ncclAllGather of the bucket's bf16 shards (rank-major, as FSDP2's flat buffer);
// reduce-scatter: ncclReduceScatter (avg) of a full-group buffer in fp32 (FSDP2 with an fp32
// reduce dtype) and in bf16. Bytes = the full-group buffer in its dtype (nccl-tests' size). Every
// run is checked: samples of the result against what the inputs must give.
void bench_nccl_rank(int rank, Bootstrap& bootstrap, Collective collective,
                     const std::vector<BucketCase>& cases, const Args& args) {
  select_device(rank);
  const int world = bootstrap.world();
  const NcclLibrary& nccl = NcclLibrary::get();
  auto comm = NcclComm::create(bootstrap);
  cudaStream_t stream = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const BucketCase& bc : cases) {
    const BucketLayout layout(bc.specs, Topology::single_node(world));
    int64_t shard = 0;  // elements per rank (padded shards, as FSDP2's flat buffers)
    for (const ParamLayout& p : layout.params()) shard += p.shard_numel;
    const std::vector<DType> dtypes = collective == Collective::kAllGather
                                          ? std::vector<DType>{DType::kBF16}
                                          : std::vector<DType>{DType::kFP32, DType::kBF16};
    for (DType dtype : dtypes) {
      const std::size_t esize = dtype_size(dtype);
      const int nccl_type = dtype == DType::kBF16 ? NcclLibrary::kBfloat16 : NcclLibrary::kFloat32;
      const bool ag = collective == Collective::kAllGather;
      DeviceMemory in((ag ? shard : shard * world) * esize), out((ag ? shard * world : shard) * esize);
      const uint64_t seed = 7000 + rank;
      cuda_kernels::launch_fill_random(in.ptr, element_type(dtype), ag ? shard : shard * world, seed,
                                       stream);
      auto once = [&] {
        if (ag)
          nccl.check(nccl.all_gather(in.ptr, out.ptr, shard, nccl_type, comm->get(), stream),
                     "ncclAllGather");
        else
          nccl.check(nccl.reduce_scatter(in.ptr, out.ptr, shard, nccl_type, NcclLibrary::kAvg,
                                         comm->get(), stream),
                     "ncclReduceScatter");
      };
      for (int w = 0; w < args.warmup; ++w) once();
      BCHECK(cudaStreamSynchronize(stream));
      bootstrap.barrier();
      const double median_us = median(time_each(stream, args.iters, once));
      // Check: every 4099th element of the result (and the last).
      std::vector<std::byte> host((ag ? shard * world : shard) * esize);
      BCHECK(cudaMemcpy(host.data(), out.ptr, host.size(), cudaMemcpyDeviceToHost));
      const int64_t n = static_cast<int64_t>(host.size() / esize);
      long long wrong = 0;
      auto rounded = [&](uint64_t sd, int64_t k) {
        const float v = cuda_kernels::random_value(sd, k);
        return dtype == DType::kBF16 ? bf16_to_float(float_to_bf16(v)) : v;
      };
      for (int64_t k = 0; k < n; k = (k + 4099 < n || k == n - 1) ? k + 4099 : n - 1) {
        const float got = load_as_float(host.data(), dtype, static_cast<std::size_t>(k));
        if (ag) {
          wrong += got != rounded(7000 + k / shard, k % shard);
        } else {
          double sum = 0, magnitude = 0;
          for (int r = 0; r < world; ++r) {
            const double v = rounded(7000 + r, rank * shard + k);
            sum += v, magnitude += std::abs(v);
          }
          const double tolerance = (dtype == DType::kBF16 ? 1e-2 : 1e-6) * magnitude / world;
          wrong += !(std::abs(got - sum / world) <= tolerance);
        }
        if (k == n - 1) break;
      }
      char mine[96];
      std::snprintf(mine, sizeof mine, "%.3f %lld", median_us, wrong);
      const auto all = bootstrap.allgather(mine);
      if (rank == 0) {
        double slowest = 0;
        long long wrong_total = 0;
        for (const std::string& x : all) {
          double t = 0;
          long long w = 0;
          std::sscanf(x.c_str(), "%lf %lld", &t, &w);
          slowest = std::max(slowest, t), wrong_total += w;
        }
        Row r;
        r.section = "collective";
        r.label = std::string("NCCL ") + (ag ? "all_gather " : "reduce_scatter ") + dtype_name(dtype) +
                  ": " + bc.label;
        r.world = world;
        r.bytes = double(shard) * world * esize;
        r.time_us = slowest;
        r.algbw = r.bytes / (slowest * 1e-6) / 1e9;
        r.busbw = r.algbw * (world - 1) / world;
        r.note = wrong_total == 0 ? "ok (sampled)" : "FAIL: " + std::to_string(wrong_total) + " wrong samples";
        r.note += ", NCCL " + nccl.version_string() + "; SM time not measured (NCCL's own CTAs)";
        append_row(r);
        print_collective_row(r);
        std::fflush(stdout);
      }
    }
  }
  BCHECK(cudaStreamDestroy(stream));
}

bool run_collective(Collective collective, int world, const std::vector<BucketCase>& cases,
                    const Args& args) {
  std::printf("\n# %s, W=%d ranks as %s (%d timed runs, median of the slowest rank)\n",
              collective == Collective::kAllGather ? "TIDE-AG (fp32 shards -> bf16 params)"
                                                   : "TIDE-RS (bf16 grads -> fp32 shards, avg)",
              world, args.threads ? "threads of one process" : "processes", args.iters);
  print_collective_header();
  if (!args.threads)
    return fork_ranks(world, [&](int rank, Bootstrap& b) {
      bench_collective_rank(rank, b, collective, cases, args);
    });
  return run_single_child([&] {
    auto rendezvous = make_thread_rendezvous(world);
    std::vector<std::string> errors(world);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < world; ++rank)
      ranks.emplace_back([&, rank] {
        ranks_are_threads = true;
        try {
          ThreadBootstrap bootstrap(rendezvous, rank, 300000ms);
          bench_collective_rank(rank, bootstrap, collective, cases, args);
        } catch (const std::exception& e) {
          errors[rank] = e.what();
        }
      });
    for (std::thread& t : ranks) t.join();
    for (int rank = 0; rank < world; ++rank)
      if (!errors[rank].empty())
        throw std::runtime_error("rank " + std::to_string(rank) + ": " + errors[rank]);
  });
}

// TIDE (one node: copy engines over NVLink; W nodes: NCCL between GPUs) beside NCCL's own
// collective, on the same buckets, one GPU per rank. Needs >= 2 GPUs.
bool run_compare(const std::vector<BucketCase>& cases, const Args& args) {
  const int gpus = cuda_device_count();
  if (gpus < 2) {
    std::printf("\n# compare: needs >= 2 GPUs (one rank per GPU); this machine has %d\n", gpus);
    append_row({"collective", "compare skipped: fewer than 2 GPUs", 0, 0, 0, 0, 0, 0, 0, ""});
    return true;
  }
  const int world = std::min(gpus, 8);
  bool ok = true;
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
    if (!args.collective.empty() && args.collective != "both" &&
        (args.collective == "ag") != (c == Collective::kAllGather))
      continue;
    ok &= run_collective(c, world, cases, args);
    Args across = args;
    across.nodes = world;
    std::printf("# the same, every GPU its own node (rail exchanges over NCCL send/recv)\n");
    ok &= fork_ranks(world, [&](int rank, Bootstrap& b) {
      bench_collective_rank(rank, b, c, cases, across);
    });
    std::printf("# NCCL's own %s on the same buckets\n",
                c == Collective::kAllGather ? "ncclAllGather" : "ncclReduceScatter");
    ok &= fork_ranks(world, [&](int rank, Bootstrap& b) { bench_nccl_rank(rank, b, c, cases, args); });
  }
  return ok;
}

std::vector<BucketCase> sweep_cases(const Args& args, std::size_t max_mib) {
  std::vector<std::size_t> sizes_mib = args.quick ? std::vector<std::size_t>{1, 64, 1024}
                                                  : std::vector<std::size_t>{1, 4, 16, 64, 256, 1024, 4096};
  std::vector<BucketCase> cases;
  for (std::size_t mib : sizes_mib)
    if (mib >= args.min_mib && mib <= max_mib)
      cases.push_back({"1 param " + std::to_string(mib) + " MiB", single_param(mib << 20)});
  return cases;
}

std::vector<BucketCase> bucket_case(const std::string& name) {
  if (name == "llama") return {{"llama-70B layer (9 params)", llama_layer()}};
  if (name == "small") return {{"512 params x 64 KiB", small_params()}};
  throw std::runtime_error("--bucket " + name + ": expected llama or small");
}

// ---- Ceiling: copy bandwidth and the kernels' bandwidth against it. -------------------------

void ceiling_child(const Args& args) {
  select_device(0);
  cudaStream_t stream = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int iters = std::max(args.iters, 20);
  auto row = [&](const std::string& label, double bytes, const std::vector<double>& us, double ctas,
                 double ceiling_gbs) {
    Row r;
    r.section = "ceiling";
    r.label = label;
    r.bytes = bytes;
    r.time_us = median(us);
    r.algbw = bytes / (r.time_us * 1e-6) / 1e9;  // read + write bytes per second
    r.sm_cta_us = ctas * r.time_us;
    char note[64];
    std::snprintf(note, sizeof note, "%.0f%% of copy", ceiling_gbs > 0 ? 100 * r.algbw / ceiling_gbs : 100.0);
    r.note = note;
    append_row(r);
    std::printf("%-44s %12s %10.1f %10.0f %12.0f  %s\n", label.c_str(), human_bytes(bytes).c_str(),
                r.time_us, r.algbw, r.sm_cta_us, r.note.c_str());
    std::fflush(stdout);
    return r.algbw;
  };
  std::printf("\n# Ceilings (one process; bytes = read + written)\n%-44s %12s %10s %10s %12s\n",
              "kernel", "bytes", "time(us)", "GB/s", "SM(CTA*us)");

  // Plain device-to-device copy, 1 GiB (copy engines).
  const std::size_t copy_bytes = std::size_t{1} << 30;
  DeviceMemory src(copy_bytes), dst(copy_bytes);
  cuda_kernels::launch_fill_random(src.ptr, cuda_kernels::kBF16, copy_bytes / 2, 1, stream);
  for (int w = 0; w < 3; ++w)
    BCHECK(cudaMemcpyAsync(dst.ptr, src.ptr, copy_bytes, cudaMemcpyDeviceToDevice, stream));
  const double ceiling = row("cudaMemcpyAsync D2D 1 GiB (HBM ceiling)", 2.0 * copy_bytes,
                             time_each(stream, iters, [&] {
                               BCHECK(cudaMemcpyAsync(dst.ptr, src.ptr, copy_bytes,
                                                      cudaMemcpyDeviceToDevice, stream));
                             }),
                             0, 0);

  // Reduce: 8 bf16 sources of 64 MiB (512 MiB) -> fp32 (the RS accumulate of W=8).
  const int world = 8;
  const int64_t n = int64_t{32} << 20;
  std::vector<DeviceMemory> sources;
  std::vector<const void*> source_ptrs;
  for (int r = 0; r < world; ++r) {
    sources.emplace_back(n * 2);
    cuda_kernels::launch_fill_random(sources.back().ptr, cuda_kernels::kBF16, n, 100 + r, stream);
    source_ptrs.push_back(sources.back().ptr);
  }
  DeviceMemory out(n * 4);
  cuda_kernels::launch_fill_random(out.ptr, cuda_kernels::kFP32, n, 7, stream);
  auto reduce = [&](int max_ctas, bool accumulate) {
    cuda_kernels::ReduceSpec spec{source_ptrs.data(), out.ptr, nullptr, n, 1.0f, 1.0f / world, accumulate,
                                  cuda_kernels::kBF16, cuda_kernels::kFP32, cuda_kernels::kFP32};
    return cuda_kernels::launch_reduces(&spec, 1, world, max_ctas, stream);
  };
  const int full = cuda_kernels::default_max_ctas();
  reduce(0, false);
  for (int ctas : {2 * full, full, 32, 16}) {  // full: the default grid (2 CTAs per SM)
    const double bytes = double(n) * (2 * world + 4);
    row("reduce 8x bf16 -> fp32, " + std::to_string(ctas) + " CTAs", bytes,
        time_each(stream, iters, [&] { reduce(ctas, false); }), ctas, ceiling);
  }
  row("reduce 8x bf16 -> fp32 +=, " + std::to_string(full) + " CTAs", double(n) * (2 * world + 8),
      time_each(stream, iters, [&] { reduce(full, true); }), full, ceiling);

  // Cast: fp32 -> bf16, 256 MiB of fp32 (the AG cast-in).
  const int64_t m = int64_t{64} << 20;
  DeviceMemory cast_src(m * 4), cast_dst(m * 2);
  cuda_kernels::launch_fill_random(cast_src.ptr, cuda_kernels::kFP32, m, 9, stream);
  cuda_kernels::CastSpec cast{cast_src.ptr, cast_dst.ptr, m, 0, cuda_kernels::kFP32,
                              cuda_kernels::kBF16};
  cuda_kernels::launch_casts(&cast, 1, 0, stream);
  for (int ctas : {2 * full, full})  // 2 * full: the casts' default grid
    row("cast fp32 -> bf16 256 MiB, " + std::to_string(ctas) + " CTAs", double(m) * 6,
        time_each(stream, iters, [&] { cuda_kernels::launch_casts(&cast, 1, ctas, stream); }), ctas,
        ceiling);
  BCHECK(cudaStreamSynchronize(stream));
  BCHECK(cudaStreamDestroy(stream));
}

// ---- Interference: a one-wave GEMM beside TIDE-RS and beside a 16-CTA reduce kernel. ----------

// cuBLAS through dlopen: no link-time dependency (the binary builds and runs where cuBLAS is
// absent; the mode then says so). Enum values are cuBLAS's stable ABI.
struct Cublas {
  using Create = int (*)(void**);
  using Destroy = int (*)(void*);
  using SetStream = int (*)(void*, cudaStream_t);
  using GemmEx = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int,
                         const void*, int, int, const void*, void*, int, int, int, int);
  static constexpr int kOpN = 0, kR16BF = 14, kCompute32F = 68, kGemmDefault = -1;
  void* lib = nullptr;
  Create create = nullptr;
  Destroy destroy = nullptr;
  SetStream set_stream = nullptr;
  GemmEx gemm_ex = nullptr;
  std::string where;

  bool load() {
    std::vector<std::string> names = {"libcublas.so.13", "libcublas.so"};
    if (const char* env = std::getenv("TIDE_CUBLAS_LIB")) names.insert(names.begin(), env);
    for (const char* dir : {"/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"})
      names.push_back(std::string(dir) + "/libcublas.so.13");
    for (const std::string& name : names) {
      lib = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib) {
        where = name;
        break;
      }
    }
    if (!lib) return false;
    create = reinterpret_cast<Create>(::dlsym(lib, "cublasCreate_v2"));
    destroy = reinterpret_cast<Destroy>(::dlsym(lib, "cublasDestroy_v2"));
    set_stream = reinterpret_cast<SetStream>(::dlsym(lib, "cublasSetStream_v2"));
    gemm_ex = reinterpret_cast<GemmEx>(::dlsym(lib, "cublasGemmEx"));
    return create && destroy && set_stream && gemm_ex;
  }
};

// The one-wave bf16 GEMM every interference figure is about, on its own stream.
struct OneWaveGemm {
  static constexpr int M = 2048, N = 1024, K = 16384;
  Cublas cublas;
  void* handle = nullptr;
  cudaStream_t stream = nullptr;
  DeviceMemory a, b, c;
  double alone_us = 0;

  // False (and nothing allocated) when cuBLAS cannot be loaded.
  bool init() {
    if (!cublas.load()) return false;
    BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    a = DeviceMemory(std::size_t{2} * M * K), b = DeviceMemory(std::size_t{2} * K * N);
    c = DeviceMemory(std::size_t{2} * M * N);
    cuda_kernels::launch_fill_random(a.ptr, cuda_kernels::kBF16, int64_t{M} * K, 11, stream);
    cuda_kernels::launch_fill_random(b.ptr, cuda_kernels::kBF16, int64_t{K} * N, 12, stream);
    if (cublas.create(&handle) != 0) throw std::runtime_error("cublasCreate failed");
    cublas.set_stream(handle, stream);
    for (int w = 0; w < 10; ++w) run();
    BCHECK(cudaStreamSynchronize(stream));
    return true;
  }
  void run() {
    const float alpha = 1.0f, beta = 0.0f;
    const int status = cublas.gemm_ex(handle, Cublas::kOpN, Cublas::kOpN, M, N, K, &alpha, a.ptr,
                                      Cublas::kR16BF, M, b.ptr, Cublas::kR16BF, K, &beta, c.ptr,
                                      Cublas::kR16BF, M, Cublas::kCompute32F, Cublas::kGemmDefault);
    if (status != 0) throw std::runtime_error("cublasGemmEx failed: status " + std::to_string(status));
  }
  std::vector<double> time(int iters) { return time_each(stream, iters, [&] { run(); }); }
  double tflops(double us) const { return 2.0 * M * N * K / (us * 1e-6) / 1e12; }
  ~OneWaveGemm() {
    if (handle) cublas.destroy(handle);
  }
};

// Times the GEMM while `background` work, enqueued by enqueue_background() (which records
// `done` on its stream after it), runs; returns the median and whether the background was still
// running when the last timed GEMM ended (otherwise the figure would partly be the GEMM alone).
double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / v.size();
}

// GEMM times beside a background: the median (the figure) and the mean (a background
// busy only part of the time, like TIDE-RS's reduce kernel between copy phases, slows some GEMMs
// and not others: the median alone can hide it).
struct Beside {
  double median_us = 0, mean_us = 0;
  bool overlapped = false;
};

Beside gemm_beside(OneWaveGemm& gemm, int iters, cudaEvent_t done,
                   const std::function<void()>& enqueue_background) {
  enqueue_background();
  const auto times = gemm.time(iters);
  cudaEvent_t gemm_done = nullptr;
  BCHECK(cudaEventCreate(&gemm_done));
  BCHECK(cudaEventRecord(gemm_done, gemm.stream));
  BCHECK(cudaEventSynchronize(gemm_done));
  BCHECK(cudaEventSynchronize(done));
  float tail_ms = 0;
  BCHECK(cudaEventElapsedTime(&tail_ms, gemm_done, done));
  BCHECK(cudaEventDestroy(gemm_done));
  return {median(times), mean(times), tail_ms > 0};
}

// The 16-CTA persistent reduce kernel standing in for NCCL's: 8 bf16 sources of 32 MiB -> fp32.
struct StandIn {
  static constexpr int kSources = 8;
  static constexpr int64_t kElems = int64_t{16} << 20;
  std::vector<DeviceMemory> sources;
  std::vector<const void*> pointers;
  DeviceMemory out;
  cuda_kernels::ReduceSpec spec{};
  explicit StandIn(cudaStream_t stream) : out(kElems * 4) {
    for (int r = 0; r < kSources; ++r) {
      sources.emplace_back(kElems * 2);
      cuda_kernels::launch_fill_random(sources.back().ptr, cuda_kernels::kBF16, kElems, 80 + r, stream);
      pointers.push_back(sources.back().ptr);
    }
    spec = {pointers.data(), out.ptr, nullptr, kElems, 1.0f, 1.0f / kSources, false, cuda_kernels::kBF16,
            cuda_kernels::kFP32};
  }
  void launch(cudaStream_t stream) { cuda_kernels::launch_reduces(&spec, 1, kSources, 16, stream); }
};

void print_interference_header(const OneWaveGemm& gemm, int iters, const std::string& where) {
  std::printf("\n# Interference%s: bf16 GEMM %dx%dx%d via cuBLAS (%s), %d timed runs each\n",
              where.c_str(), OneWaveGemm::M, OneWaveGemm::N, OneWaveGemm::K,
              gemm.cublas.where.c_str(), iters);
  std::printf("%-48s %10s %9s %9s  %s\n", "GEMM", "median us", "slowdown", "mean", "background");
}

// One row: the median time and its slowdown against `alone`'s, and the mean's against its mean.
void print_interference_row(const std::string& label, const Beside& b, const Beside& alone,
                            const std::string& note) {
  char slow[32], slow_mean[32];
  std::snprintf(slow, sizeof slow, "%+.1f%%", 100.0 * (b.median_us / alone.median_us - 1.0));
  std::snprintf(slow_mean, sizeof slow_mean, "%+.1f%%", 100.0 * (b.mean_us / alone.mean_us - 1.0));
  std::printf("%-48s %10.1f %9s %9s  %s\n", label.c_str(), b.median_us, slow, slow_mean, note.c_str());
  std::fflush(stdout);
  append_row({"interference", label, 0, 0, b.median_us, 0, 0, 0, 0,
              std::string(slow) + " (mean " + slow_mean + ") " + note});
}

// One GPU: TIDE-RS with W=8 ranks as threads of this process (one context, so they really run
// beside the GEMM; processes would be time-sliced), and the stand-in.
void interference_one_gpu(const Args& args) {
  select_device(0);
  OneWaveGemm gemm;
  if (!gemm.init()) {
    std::printf("\n# Interference: skipped (libcublas.so.13 not found; set TIDE_CUBLAS_LIB)\n");
    append_row({"interference", "skipped: cuBLAS not found", 0, 0, 0, 0, 0, 0, 0, ""});
    return;
  }
  const int iters = std::max(args.iters, 30);
  const auto alone_times = gemm.time(iters);
  const Beside alone{median(alone_times), mean(alone_times), true};
  gemm.alone_us = alone.median_us;

  // Background A: TIDE-RS, 256 MiB bf16 gradient per rank, enqueued well past the GEMMs' end.
  const int world = 8, rs_runs = 40;
  const BucketLayout layout(single_param(std::size_t{256} << 20), Topology::single_node(world));
  auto rendezvous = make_thread_rendezvous(world);
  std::latch ready(world + 1), go(1), enqueued(world + 1);
  std::vector<double> rs_cta_us(world, 0);
  std::vector<cudaEvent_t> rs_done(world);
  std::vector<std::string> errors(world);
  std::atomic<bool> abort{false};
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.emplace_back([&, rank] {
      bool counted_ready = false, counted_enqueued = false;
      try {
        BCHECK(cudaSetDevice(0));
        ThreadBootstrap bootstrap(rendezvous, rank, 120000ms);
        // Memory before the window (whose creation ends in a barrier): cudaMalloc/cudaFree may
        // wait for the whole device, and another rank's stream may already wait on this one.
        const ParamLayout& p = layout.param(0);
        DeviceMemory grad(p.unsharded_bytes()), out(p.valid_numel(rank) * 4);
        auto window = CudaWindow::create(bootstrap, layout.window_bytes());
        cudaStream_t stream = nullptr;
        BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        BCHECK(cudaEventCreate(&rs_done[rank]));
        cuda_kernels::launch_fill_random(grad.ptr, cuda_kernels::kBF16, p.numel(), 50 + rank, stream);
        const Program program = plan_reduce_scatter(layout, rank, ReduceOptions{}, 3);
        const Bindings bindings{{grad.ptr}, {out.ptr}};
        {
          CudaExecutor executor(*window, stream);
          executor.enable_stats(true);
          executor.run(program, bindings);
          rs_cta_us[rank] = executor.stats().reduce_cta_us + executor.stats().cast_cta_us;
          executor.enable_stats(false);
          ready.count_down(), counted_ready = true;
          go.wait();
          for (int i = 0; i < rs_runs && !abort; ++i) executor.run(program, bindings);
          BCHECK(cudaEventRecord(rs_done[rank], stream));
          enqueued.count_down(), counted_enqueued = true;
          executor.synchronize();
        }
        bootstrap.barrier();
        window.reset();
        BCHECK(cudaStreamDestroy(stream));
      } catch (const std::exception& e) {
        errors[rank] = e.what();
        abort = true;
        if (!counted_ready) ready.count_down();
        if (!counted_enqueued) enqueued.count_down();
      }
    });
  ready.arrive_and_wait();
  go.count_down();
  enqueued.arrive_and_wait();
  const auto beside_rs_times = gemm.time(iters);
  cudaEvent_t gemm_done = nullptr;
  BCHECK(cudaEventCreate(&gemm_done));
  BCHECK(cudaEventRecord(gemm_done, gemm.stream));
  for (auto& t : ranks) t.join();
  for (int r = 0; r < world; ++r)
    if (!errors[r].empty()) throw std::runtime_error("TIDE-RS rank " + std::to_string(r) + ": " + errors[r]);
  BCHECK(cudaDeviceSynchronize());
  float rs_tail_ms = 0;  // > 0: the RS streams were still busy when the last GEMM ended
  BCHECK(cudaEventElapsedTime(&rs_tail_ms, gemm_done, rs_done[0]));

  // Background B: the stand-in, launched back to back past the GEMMs' end.
  cudaStream_t background = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&background, cudaStreamNonBlocking));
  StandIn stand_in(background);
  BCHECK(cudaStreamSynchronize(background));
  const double reduce16_us = median(time_each(background, 5, [&] { stand_in.launch(background); }));
  const int launches = static_cast<int>(std::ceil(3.0 * iters * gemm.alone_us / reduce16_us)) + 4;
  cudaEvent_t reduce_done = nullptr;
  BCHECK(cudaEventCreate(&reduce_done));
  const Beside beside_reduce = gemm_beside(gemm, iters, reduce_done, [&] {
    for (int i = 0; i < launches; ++i) stand_in.launch(background);
    BCHECK(cudaEventRecord(reduce_done, background));
  });

  double rs_sm = 0;
  for (double v : rs_cta_us) rs_sm += v;
  print_interference_header(gemm, iters, " (one GPU)");
  char note[200];
  std::snprintf(note, sizeof note, "%.0f TFLOP/s", gemm.tflops(gemm.alone_us));
  print_interference_row("alone", alone, alone, note);
  std::snprintf(note, sizeof note,
                "W=8 RS of 256 MiB/rank, reduce %.0f CTA*us per RS (all ranks); %s", rs_sm,
                rs_tail_ms > 0 ? "overlapped" : "WARNING: RS ended before the GEMMs");
  print_interference_row("beside TIDE-RS (8 ranks as threads, 1 GPU)",
                         {median(beside_rs_times), mean(beside_rs_times), rs_tail_ms > 0}, alone,
                         note);
  std::snprintf(note, sizeof note, "%.0f us per launch = %.0f CTA*us; %s", reduce16_us,
                16 * reduce16_us,
                beside_reduce.overlapped ? "overlapped" : "WARNING: reduce ended before the GEMMs");
  print_interference_row("beside 16-CTA reduce kernel", beside_reduce, alone, note);
  BCHECK(cudaStreamDestroy(background));
}

// Several GPUs, one rank per GPU (the real setting): on every GPU the GEMM alone, beside TIDE-RS
// (copy engines over NVLink + the reduce kernel), beside ncclReduceScatter of the same bucket in
// fp32 (stock FSDP2's reduce-scatter; NCCL_NVLS_ENABLE=0), and beside the stand-in. The slowest
// rank's median is reported.
void interference_rank(int rank, Bootstrap& bootstrap, const Args& args) {
  select_device(rank);
  const int world = bootstrap.world();
  OneWaveGemm gemm;
  const bool have_cublas = gemm.init();
  const auto all_have = bootstrap.allgather(have_cublas ? "1" : "0");
  for (const std::string& h : all_have)
    if (h != "1") {
      if (rank == 0) append_row({"interference", "skipped: cuBLAS not found", 0, 0, 0, 0, 0, 0, 0, ""});
      return;
    }
  const int iters = std::max(args.iters, 30);
  const auto alone_times = gemm.time(iters);
  const Beside alone{median(alone_times), mean(alone_times), true};
  gemm.alone_us = alone.median_us;
  cudaStream_t background = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&background, cudaStreamNonBlocking));
  cudaEvent_t done = nullptr;
  BCHECK(cudaEventCreate(&done));
  // How many back-to-back runs of `once` outlast the timed GEMMs three times over: the largest
  // any rank computes (collectives must run as often on every rank).
  auto runs_to_cover = [&](const std::function<void()>& once) {
    once();
    BCHECK(cudaStreamSynchronize(background));
    bootstrap.barrier();
    const double us = median(time_each(background, 3, once));
    const int mine = static_cast<int>(std::ceil(3.0 * iters * gemm.alone_us / us)) + 2;
    int runs = 0;
    for (const std::string& r : bootstrap.allgather(std::to_string(mine))) runs = std::max(runs, std::stoi(r));
    return runs;
  };

  // TIDE-RS: a 256 MiB bf16 gradient per rank (W ranks, one node).
  const BucketLayout layout(single_param(std::size_t{256} << 20), Topology::single_node(world));
  const ParamLayout& p = layout.param(0);
  DeviceMemory grad(p.unsharded_bytes()), out(p.valid_numel(rank) * 4);
  cuda_kernels::launch_fill_random(grad.ptr, cuda_kernels::kBF16, p.numel(), 50 + rank, background);
  auto window = CudaWindow::create(bootstrap, layout.window_bytes());
  const Program program = plan_reduce_scatter(layout, rank, ReduceOptions{}, 3);
  const Bindings bindings{{grad.ptr}, {out.ptr}};
  double tide_sm = 0;
  Beside beside_tide;
  {
    CudaExecutor executor(*window, background);
    executor.enable_stats(true);
    executor.run(program, bindings);
    tide_sm = executor.stats().reduce_cta_us;
    executor.enable_stats(false);
    const int runs = runs_to_cover([&] { executor.run(program, bindings); });
    beside_tide = gemm_beside(gemm, iters, done, [&] {
      for (int i = 0; i < runs; ++i) executor.run(program, bindings);
      BCHECK(cudaEventRecord(done, background));
    });
    executor.synchronize();
  }
  bootstrap.barrier();
  window.reset();

  // NCCL reduce-scatter of the same gradient in fp32 (FSDP2's stock buffer), avg.
  const NcclLibrary& nccl = NcclLibrary::get();
  auto comm = NcclComm::create(bootstrap);
  const int64_t shard = p.shard_numel;
  DeviceMemory fp32_in(shard * world * 4), fp32_out(shard * 4);
  cuda_kernels::launch_fill_random(fp32_in.ptr, cuda_kernels::kFP32, shard * world, 60 + rank, background);
  auto nccl_once = [&] {
    nccl.check(nccl.reduce_scatter(fp32_in.ptr, fp32_out.ptr, shard, NcclLibrary::kFloat32,
                                   NcclLibrary::kAvg, comm->get(), background),
               "ncclReduceScatter");
  };
  const int nccl_runs = runs_to_cover(nccl_once);
  const Beside beside_nccl = gemm_beside(gemm, iters, done, [&] {
    for (int i = 0; i < nccl_runs; ++i) nccl_once();
    BCHECK(cudaEventRecord(done, background));
  });
  BCHECK(cudaStreamSynchronize(background));
  bootstrap.barrier();
  comm.reset();

  StandIn stand_in(background);
  const int launches = runs_to_cover([&] { stand_in.launch(background); });
  const Beside beside_stand_in = gemm_beside(gemm, iters, done, [&] {
    for (int i = 0; i < launches; ++i) stand_in.launch(background);
    BCHECK(cudaEventRecord(done, background));
  });
  BCHECK(cudaStreamSynchronize(background));

  // Every rank's figures; the slowest rank's (per background, by median) are reported.
  char mine[256];
  std::snprintf(mine, sizeof mine, "%.1f", tide_sm);
  for (const Beside& b : {alone, beside_tide, beside_nccl, beside_stand_in})
    std::snprintf(mine + std::strlen(mine), sizeof mine - std::strlen(mine), " %.3f %.3f %d",
                  b.median_us, b.mean_us, int(b.overlapped));
  const auto all = bootstrap.allgather(mine);
  BCHECK(cudaStreamDestroy(background));
  if (rank != 0) return;
  double sm = 0;
  std::vector<Beside> worst(4);
  for (const std::string& x : all) {
    std::istringstream in(x);
    double m = 0;
    in >> m;
    sm += m;
    for (Beside& w : worst) {
      Beside b;
      int overlapped = 0;
      in >> b.median_us >> b.mean_us >> overlapped;
      b.overlapped = overlapped != 0;
      if (b.median_us > w.median_us) w = b;
    }
  }
  auto overlap = [](bool ok) { return ok ? "overlapped" : "WARNING: background ended before the GEMMs"; };
  print_interference_header(gemm, iters, detail::concat(" (", world, " GPUs, one rank each)"));
  char note[200];
  std::snprintf(note, sizeof note, "%.0f TFLOP/s (slowest rank)", gemm.tflops(worst[0].median_us));
  print_interference_row("alone", worst[0], worst[0], note);
  std::snprintf(note, sizeof note, "RS of 256 MiB bf16/rank -> fp32, reduce %.0f CTA*us per RS (all ranks); %s",
                sm, overlap(worst[1].overlapped));
  print_interference_row(detail::concat("beside TIDE-RS (W=", world, ", NVLink)"), worst[1], worst[0], note);
  std::snprintf(note, sizeof note, "same gradient as an fp32 buffer, avg, NCCL %s; %s",
                nccl.version_string().c_str(), overlap(worst[2].overlapped));
  print_interference_row(detail::concat("beside ncclReduceScatter fp32 (W=", world, ")"), worst[2],
                         worst[0], note);
  print_interference_row("beside 16-CTA reduce kernel", worst[3], worst[0], overlap(worst[3].overlapped));
}

bool run_interference(const Args& args) {
  bool ok = args.quick || fork_ranks(1, [&](int, Bootstrap&) { interference_one_gpu(args); });
  const int gpus = cuda_device_count();
  if (gpus >= 2)
    ok &= fork_ranks(std::min(gpus, 8), [&](int rank, Bootstrap& b) { interference_rank(rank, b, args); });
  return ok;
}

// ---- Driver. --------------------------------------------------------------------------------


void print_summary() {
  const std::vector<Row> rows = read_rows();
  // Ranks share a GPU only when there are more ranks than GPUs (every mode on a one-GPU machine);
  // compare and the multi-GPU interference rows run one rank per GPU.
  std::printf("\n==== Summary (%d GPU(s); ranks sharing a GPU are HBM-bound, not NVLink-bound) ====\n",
              cuda_device_count());
  for (const Row& r : rows)
    if (r.section == "ceiling")
      std::printf("ceiling   %-44s %8.0f GB/s  %s\n", r.label.c_str(), r.algbw, r.note.c_str());
  for (const Row& r : rows)
    if (r.section == "collective" && r.time_us > 0)
      std::printf("coll      %-28s W=%d %10s %9.1f us  busbw %7.1f GB/s  SM %8.0f CTA*us  %s\n",
                  r.label.c_str(), r.world, human_bytes(r.bytes).c_str(), r.time_us, r.busbw,
                  r.sm_cta_us, r.note.c_str());
  for (const Row& r : rows)
    if (r.section == "interference")
      std::printf("gemm      %-44s %8.1f us  %s\n", r.label.c_str(), r.time_us, r.note.c_str());
}

int main_impl(int argc, char** argv) {
  Args args;
  int i = 1;
  if (i < argc && argv[i][0] != '-') args.mode = argv[i++];
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + ": expected a value");
      return argv[++i];
    };
    if (a == "--collective") args.collective = value();
    else if (a == "--bucket") args.bucket = value();
    else if (a == "--world") args.world = std::stoi(value());
    else if (a == "--min-mib") args.min_mib = std::stoul(value());
    else if (a == "--max-mib") args.max_mib = std::stoul(value());
    else if (a == "--iters") args.iters = std::stoi(value());
    else if (a == "--warmup") args.warmup = std::stoi(value());
    else if (a == "--quick") args.quick = true;
    else if (a == "--nodes") args.nodes = std::stoi(value());
    else if (a == "--chunk-mib") args.chunk_mib = std::stoul(value());
    else if (a == "--network") args.network = value();
    else if (a == "--wire") args.wire = value();
    else if (a == "--threads") args.threads = true;
    else throw std::runtime_error("unknown option " + a + " (see the comment atop bench_cuda.cpp)");
  }
  (void)results_path();  // created here, before any fork, so every child appends to the same file
  if (args.iters < 20) throw std::runtime_error("--iters " + std::to_string(args.iters) + ": expected >= 20");
  if (args.nodes < 1 || args.world % args.nodes != 0)
    throw std::runtime_error("--nodes " + std::to_string(args.nodes) + ": expected a divisor of --world " +
                             std::to_string(args.world));
  if (args.network != "nccl" && args.network != "ipc")
    throw std::runtime_error("--network " + args.network + ": expected nccl or ipc");
  if (args.wire != "fp32" && args.wire != "bf16")
    throw std::runtime_error("--wire " + args.wire + ": expected fp32 or bf16");
  if (!cuda_device_available()) {
    std::printf("tide_bench_cuda: no usable CUDA device; nothing to measure\n");
    return 0;
  }
  auto collective_of = [](const std::string& s) {
    if (s == "ag" || s.empty()) return Collective::kAllGather;
    if (s == "rs") return Collective::kReduceScatter;
    throw std::runtime_error("--collective " + s + ": expected ag or rs");
  };
  bool ok = true;
  if (args.mode == "ceiling") {
    ok = run_single_child([&] { ceiling_child(args); });
  } else if (args.mode == "sweep") {
    ok = run_collective(collective_of(args.collective), args.world, sweep_cases(args, args.max_mib), args);
  } else if (args.mode == "bucket") {
    ok = run_collective(collective_of(args.collective), args.world, bucket_case(args.bucket), args);
  } else if (args.mode == "interference") {
    ok = run_interference(args);
  } else if (args.mode == "compare") {
    std::vector<BucketCase> cases = bucket_case(args.bucket);
    const auto sweep = sweep_cases(args, std::min<std::size_t>(args.max_mib, 1024));
    cases.insert(cases.end(), sweep.begin(), sweep.end());
    ok = run_compare(cases, args);
  } else if (args.mode == "all") {
    ok &= run_single_child([&] { ceiling_child(args); });
    for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
      ok &= run_collective(c, 8, sweep_cases(args, args.max_mib), args);
      if (!args.quick)
        for (int w : {2, 4}) ok &= run_collective(c, w, sweep_cases(args, std::min<std::size_t>(args.max_mib, 1024)), args);
      std::vector<BucketCase> buckets = bucket_case("llama");
      const auto small = bucket_case("small");
      buckets.insert(buckets.end(), small.begin(), small.end());
      ok &= run_collective(c, 8, buckets, args);
    }
    ok &= run_interference(args);
  } else {
    throw std::runtime_error("mode " + args.mode +
                             ": expected all, ceiling, sweep, bucket, compare or interference");
  }
  print_summary();
  std::error_code ignored;
  std::filesystem::remove_all(std::filesystem::path(results_path()).parent_path(), ignored);
  if (!ok) std::printf("\nFAILED: a benchmark process failed (see its error above)\n");
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace tide::bench

int main(int argc, char** argv) {
  try {
    return tide::bench::main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tide_bench_cuda: %s\n", e.what());
    return 2;
  }
}
