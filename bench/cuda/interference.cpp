// tide_bench_cuda interference: a one-wave bf16 GEMM alone, beside TIDE-RS, beside NCCL's
// reduce-scatter and beside a 16-CTA reduce kernel (cuBLAS and NCCL loaded at run time).
#include "bench_common.hpp"
#include "one_wave_gemm.hpp"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <latch>
#include <thread>

#include "kernels.cuh"  // the executor's own kernels, timed here: tide_cuda_kernels_internal

namespace tide::bench {

namespace {

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
      launch_fill_random(sources.back().ptr, DType::kBF16, kElems, 80 + r, stream);
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
        launch_fill_random(grad.ptr, DType::kBF16, p.numel(), 50 + rank, stream);
        const Program program = plan_reduce_scatter(layout, rank, ReduceOptions{}, 3);
        const Bindings bindings{{grad.ptr}, {out.ptr}};
        {
          CudaExecutor executor(*window, stream);
          executor.enable_stats(true);
          executor.run(program, bindings);
          const auto stats = executor.stats();  // waits for the stream: call it once
          rs_cta_us[rank] = stats.reduce_cta_us + stats.cast_cta_us + stats.cast_to_peers_cta_us;
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
  launch_fill_random(grad.ptr, DType::kBF16, p.numel(), 50 + rank, background);
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
  launch_fill_random(fp32_in.ptr, DType::kFP32, shard * world, 60 + rank, background);
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

}  // namespace

bool run_interference(const Args& args) {
  bool ok = args.quick || fork_ranks(1, [&](int, Bootstrap&) { interference_one_gpu(args); });
  const int gpus = cuda_device_count();
  if (gpus >= 2)
    ok &= fork_ranks(std::min(gpus, 8), [&](int rank, Bootstrap& b) { interference_rank(rank, b, args); });
  return ok;
}

}  // namespace tide::bench
