#include "bench_common.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "rank_runner.hpp"

namespace tide::bench {

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

bool fork_ranks(int world, const std::function<void(int, Bootstrap&)>& body,
                std::chrono::seconds deadline) {
  const harness::RankProcesses run = harness::run_rank_processes(
      world,
      [&](int rank, Bootstrap& bootstrap) {
        try {
          body(rank, bootstrap);
        } catch (const std::exception& e) {
          // Said at once, beside the rank's own output, not when its peers are done.
          std::fprintf(stderr, "rank %d failed: %s\n", rank, e.what());
          throw;
        }
      },
      {.bootstrap_timeout = 300000ms, .deadline = deadline});
  if (run.hung)
    std::fprintf(stderr, "ranks still running after %lld s: killed\n",
                 static_cast<long long>(deadline.count()));
  return std::all_of(run.reports.begin(), run.reports.end(),
                     [](const std::string& report) { return report == "ok"; });
}

bool run_single_child(const std::function<void()>& body) {
  return fork_ranks(1, [&](int, Bootstrap&) { body(); });
}

thread_local bool ranks_are_threads = false;
void select_device(int rank) {
  int count = 0;
  BCHECK(cudaGetDeviceCount(&count));
  BCHECK(cudaSetDevice(ranks_are_threads ? 0 : rank % count));
  preload_test_data_kernels();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

DeviceMemory::DeviceMemory(std::size_t bytes) {
  BCHECK(cudaMalloc(&ptr, std::max<std::size_t>(bytes, 256)));
}
DeviceMemory::~DeviceMemory() {
  if (ptr) (void)cudaFree(ptr);
}

cudaGraphExec_t capture_once(cudaStream_t stream, const std::function<void()>& enqueue) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BCHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue();
  BCHECK(cudaStreamEndCapture(stream, &graph));
  BCHECK(cudaGraphInstantiate(&exec, graph, 0));
  BCHECK(cudaGraphDestroy(graph));
  return exec;
}

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

std::vector<ParamSpec> expert_params() {
  // One Qwen3-30B-A3B MoE layer's experts stored per expert: 128 x (gate, up, down), each
  // 768 x 2048 bf16 (3 MiB), 384 params: many copies and casts per collective.
  std::vector<ParamSpec> specs;
  for (int e = 0; e < 128; ++e)
    for (const char* m : {"gate", "up", "down"})
      specs.push_back({"e" + std::to_string(e) + "." + m, {768, 2048}, DType::kBF16, DType::kFP32});
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

std::size_t rank_bytes(const BucketLayout& layout, Collective c) {
  std::size_t total = layout.window_bytes();
  for (const ParamLayout& p : layout.params()) {
    const std::size_t shard = p.shard_numel * dtype_size(p.shard_dtype);
    total += c == Collective::kAllGather ? shard : p.unsharded_bytes() + shard;
  }
  return total;
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
  if (name == "experts") return {{"qwen3-moe experts (384 params x 3 MiB)", expert_params()}};
  throw std::runtime_error("--bucket " + name + ": expected llama, small or experts");
}

}  // namespace tide::bench
