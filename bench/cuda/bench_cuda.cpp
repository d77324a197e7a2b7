// tide_bench_cuda: TIDE-AG / TIDE-RS on GPUs, nccl-tests style, ranks as processes on one GPU (one
// per GPU where several exist), every timed configuration checked on the device afterwards.
//
//   tide_bench_cuda [all]              everything below, then a short summary table
//   tide_bench_cuda ceiling            HBM copy ceiling; reduce / cast kernel bandwidth against it
//   tide_bench_cuda calls              the host's time per driver call of each kind run() makes,
//                                      1 and 2 threads in one context (the fixed cost's ceiling)
//   tide_bench_cuda copy-paths         384 copies from as many allocations: one copy-engine batch
//                                      vs one copy kernel, host and GPU time, by copy size
//   tide_bench_cuda sweep  --collective ag|rs --world W [--min-mib N] [--max-mib N]
//   tide_bench_cuda bucket --bucket llama|small|experts --collective ag|rs --world W
//   tide_bench_cuda compare [--bucket llama|small] [--collective ag|rs]
//                                      >= 2 GPUs, one rank each: TIDE on one node (copy engines
//                                      over NVLink), TIDE with every GPU its own node (NCCL
//                                      send/recv between them) and NCCL's own collective, same buckets
//   tide_bench_cuda breakdown [--world 2] [--rounds R]
//                                      a small collective's fixed cost on the GPU: each operation
//                                      of the 1 MiB AG / RS timed alone, then the 1 MiB AG, RS and a
//                                      float8 amax exchange, ranks as threads, slot-free handshake
//                                      fused into the kernel or a memop call (breakdown.cpp)
//   tide_bench_cuda interference       one-wave bf16 GEMM alone / beside TIDE-RS / beside a 16-CTA
//                                      reduce kernel on one GPU (ranks as threads); with >= 2 GPUs
//                                      also one rank per GPU, beside ncclReduceScatter as well
//                                      (cuBLAS and NCCL loaded at run time; skipped without;
//                                      --quick: only the multi-GPU part)
// Options: --iters N (timed runs, >= 20; median reported), --warmup N, --quick (fewer sizes),
// --nodes N (sweep/bucket: W ranks as N nodes), --transport nccl|ipc (between those nodes: NCCL,
// one GPU per rank; or CUDA IPC, virtual nodes whose ranks may share GPUs: on one GPU the whole
// pipeline, network included, is bound by that GPU's HBM), --chunk-mib N (across-node chunk size,
// default 16), --wire fp32|bf16 (across-node RS: the dtype of partial sums between nodes; bf16 is
// lossy and checked within one bf16 rounding per node), --threads (sweep/bucket: the ranks as threads of one process on GPU 0, one CUDA
// context, instead of processes, whose contexts the GPU time-slices: every hand-off between
// ranks can then wait for a time slice), --cuda-graphs (sweep/bucket on one node: also the
// program captured once in a CUDA graph and replayed: time per replay, the host's time per
// cudaGraphLaunch, the last replay's result checked), --prefixes (sweep/bucket: also every prefix of the
// program, its first k steps run back to back, so each step's share of a run's time shows:
// the chain of a small collective), --delivery default|push|cast_to_peers (sweep/bucket on one node:
// how a rank's bytes reach the peers, plan.hpp's Delivery; default: default_delivery(layout)).
//
// Times: per rank, CUDA events around each of N back-to-back runs; the median per rank; the slowest
// rank's median reported. algbw = bytes / time, busbw = algbw * (W-1)/W (nccl-tests). SM time =
// CTAs x kernel time of the run's cast/reduce kernels (copies and flags use no SMs).
// The parent process never touches CUDA: every measurement runs in fork()ed children.
//
// This file: the driver (arguments, modes, summary); bench_common.hpp lists the others.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "bench_common.hpp"

namespace tide::bench {
namespace {

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
    if (r.section == "calls")
      std::printf("call      %-44s %8.2f us  %s\n", r.label.c_str(), r.time_us, r.note.c_str());
  for (const Row& r : rows)
    if (r.section == "interference")
      std::printf("gemm      %-44s %8.1f us  %s\n", r.label.c_str(), r.time_us, r.note.c_str());
}

int main_impl(int argc, char** argv) {
  Args args;
  bool world_given = false;
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
    else if (a == "--world") args.world = std::stoi(value()), world_given = true;
    else if (a == "--min-mib") args.min_mib = std::stoul(value());
    else if (a == "--max-mib") args.max_mib = std::stoul(value());
    else if (a == "--iters") args.iters = std::stoi(value());
    else if (a == "--warmup") args.warmup = std::stoi(value());
    else if (a == "--quick") args.quick = true;
    else if (a == "--nodes") args.nodes = std::stoi(value());
    else if (a == "--chunk-mib") args.chunk_mib = std::stoul(value());
    else if (a == "--transport") args.transport = value();
    else if (a == "--wire") args.wire = value();
    else if (a == "--threads") args.threads = true;
    else if (a == "--prefixes") args.prefixes = true;
    else if (a == "--cuda-graphs") args.cuda_graphs = true;
    else if (a == "--delivery") args.delivery = value();
    else if (a == "--rounds") args.rounds = std::stoi(value());
    else throw std::runtime_error("unknown option " + a + " (see the comment atop bench_cuda.cpp)");
  }
  (void)results_path();  // created here, before any fork, so every child appends to the same file
  if (args.iters < 20) throw std::runtime_error("--iters " + std::to_string(args.iters) + ": expected >= 20");
  if (args.nodes < 1 || args.world % args.nodes != 0)
    throw std::runtime_error("--nodes " + std::to_string(args.nodes) + ": expected a divisor of --world " +
                             std::to_string(args.world));
  if (args.transport != "nccl" && args.transport != "ipc")
    throw std::runtime_error("--transport " + args.transport + ": expected nccl or ipc");
  if (args.wire != "fp32" && args.wire != "bf16")
    throw std::runtime_error("--wire " + args.wire + ": expected fp32 or bf16");
  if (args.delivery != "default" && args.delivery != "push" && args.delivery != "cast_to_peers")
    throw std::runtime_error("--delivery " + args.delivery + ": expected default, push or cast_to_peers");
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
  } else if (args.mode == "calls") {
    ok = run_single_child([&] { driver_calls_child(args); });
  } else if (args.mode == "copy-paths") {
    ok = run_single_child([&] { copy_paths_child(args); });
  } else if (args.mode == "sweep") {
    ok = run_collective(collective_of(args.collective), args.world, sweep_cases(args, args.max_mib), args);
  } else if (args.mode == "bucket") {
    ok = run_collective(collective_of(args.collective), args.world, bucket_case(args.bucket), args);
  } else if (args.mode == "interference") {
    ok = run_interference(args);
  } else if (args.mode == "breakdown") {
    if (!world_given) args.world = 2;
    if (args.world < 2) throw std::runtime_error("breakdown: --world must be >= 2");
    // Its table is printed last by the child itself.
    return run_single_child([&] { breakdown_child(args); }) ? 0 : 1;
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
                             ": expected all, ceiling, calls, copy-paths, sweep, bucket, compare, interference or breakdown");
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
