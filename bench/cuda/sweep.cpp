// tide_bench_cuda sweep / bucket: TIDE-AG and TIDE-RS timed per rank and checked on the device.
#include "bench_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "rank_runner.hpp"

namespace tide::bench {

namespace {

const char* op_name(const Step& step) {
  static constexpr const char* kNames[] = {"copy batch", "cast", "signal", "wait", "reduce",
                                           "net send", "net recv"};
  return kNames[step.op.index()];
}

// --prefixes: per prefix length k (the last is the whole program), the slowest rank's time and
// host time per run, what step k added to the prefix before it, and the loop's time per run (no
// timing event between runs). `per_rank`: each rank's "<time> <host> <loop>" triples for
// k = 1 .. n - 1.
void print_prefix_rows(const Program& program, const std::vector<std::string>& per_rank,
                       double full_us, double full_host_us, double full_loop_us) {
  const std::size_t n = program.steps.size();
  std::vector<double> time(n, 0.0), host(n, 0.0), loop(n, 0.0);
  for (const std::string& s : per_rank) {
    std::istringstream in(s);
    for (std::size_t k = 0; k + 1 < n; ++k) {
      double t = 0, h = 0, l = 0;
      in >> t >> h >> l;
      time[k] = std::max(time[k], t), host[k] = std::max(host[k], h), loop[k] = std::max(loop[k], l);
    }
  }
  time[n - 1] = full_us, host[n - 1] = full_host_us, loop[n - 1] = full_loop_us;
  std::printf("#   the chain, rank 0's program: its first k steps run back to back (slowest rank)\n"
              "#   %3s  %-24s %10s %10s %10s %10s\n", "k", "step k", "time us", "+ us", "host us",
              "loop us");
  for (std::size_t k = 0; k < n; ++k) {
    const Step& step = program.steps[k];
    const std::string what = std::string(phase_name(step.phase)) + " " + op_name(step);
    std::printf("#   %3zu  %-24s %10.1f %+10.1f %10.1f %10.1f\n", k + 1, what.c_str(), time[k],
                time[k] - (k > 0 ? time[k - 1] : 0.0), host[k], loop[k]);
  }
}

}  // namespace

// ---- Collective benchmark (one rank). ---------------------------------------------------------

void bench_collective_rank(int rank, Bootstrap& bootstrap, Collective collective,
                           const std::vector<BucketCase>& cases, const Args& args) {
  select_device(rank);
  const int world = bootstrap.world();
  const Topology topology{args.nodes, world / args.nodes};
  AcrossNodesOptions net;  // ring
  net.chunk_bytes = args.chunk_mib << 20;
  net.wire_dtype = args.wire == "bf16" ? DType::kBF16 : DType::kFP32;
  const bool lossy = net.wire_dtype == DType::kBF16;
  const bool ipc = args.transport == "ipc";
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
    const Delivery delivery = args.delivery == "push"            ? Delivery::kPush
                              : args.delivery == "cast_to_peers" ? Delivery::kCastToPeers
                                                                 : default_delivery(layout);
    const Program program = collective == Collective::kAllGather
                                ? plan_all_gather(layout, rank, 1, net, delivery)
                                : plan_reduce_scatter(layout, rank, options, 2, net, delivery);
    // Memory before the window, whose creation ends in a barrier: with ranks as threads,
    // cudaMalloc/cudaFree may wait for the whole device while a peer's stream waits on this rank.
    std::vector<DeviceMemory> inputs, outputs;
    Bindings bindings;
    for (std::size_t i = 0; i < layout.num_params(); ++i) {
      const ParamLayout& p = layout.param(i);
      const uint64_t seed = input_seed(kSeedBase, int(i), rank);
      if (collective == Collective::kAllGather) {
        inputs.emplace_back(p.valid_numel(rank) * dtype_size(p.shard_dtype));
        launch_fill_random(inputs.back().ptr, p.shard_dtype, p.valid_numel(rank), seed, stream);
      } else {
        inputs.emplace_back(p.unsharded_bytes());
        launch_fill_random(inputs.back().ptr, p.dtype, p.numel(), seed, stream);
        outputs.emplace_back(p.valid_numel(rank) * dtype_size(p.shard_dtype));
        bindings.outputs.push_back(outputs.back().ptr);
      }
      bindings.inputs.push_back(inputs.back().ptr);
    }
    BCHECK(cudaStreamSynchronize(stream));
    auto window = CudaWindow::create(bootstrap, program.window_bytes, topology, CudaMemory::kMalloc,
                                     ipc ? CudaWindowScope::kHost : CudaWindowScope::kNode);

    double median_us = 0, sm_cta_us = 0, host_us = 0, loop_us = 0, lowering_host_us = 0;
    double graph_us = 0, graph_host_us = 0, graph_loop_us = 0;  // --cuda-graphs: per replay
    bool batched = true;
    unsigned long long wrong = 0;
    std::string prefix_times;  // --prefixes: "<time> <host> <loop>" per prefix length 1..n
    {
      CudaExecutor executor(*window, stream, default_timeout(), network.get());
      // Median time per run of `p` back to back, and the host's median wall time in run()
      // (enqueueing, no waiting), `p` prepared once as tide.fsdp runs a bucket's programs: the
      // runs after the first reuse its checks and lowering.
      // And (run_loop_us) the same number of runs between one pair of events, divided by the count,
      // as nccl-tests times: no timing event between two runs.
      auto time_runs = [&](const Program& p, double& time_us, double& run_host_us, double& run_loop_us) {
        const std::unique_ptr<PreparedProgram> prepared = executor.prepare(p);
        for (int w = 0; w < args.warmup; ++w) executor.run(*prepared, bindings);
        executor.synchronize();
        bootstrap.barrier();
        std::vector<double> host_times;
        host_times.reserve(args.iters);
        const auto times = time_each(stream, args.iters, [&] {
          const auto start = std::chrono::steady_clock::now();
          executor.run(*prepared, bindings);
          host_times.push_back(std::chrono::duration<double, std::micro>(
                                   std::chrono::steady_clock::now() - start).count());
        });
        executor.synchronize();
        bootstrap.barrier();
        time_us = median(times), run_host_us = median(host_times);
        const auto loop = time_each(stream, 1, [&] {
          for (int i = 0; i < args.iters; ++i) executor.run(*prepared, bindings);
        });
        executor.synchronize();
        bootstrap.barrier();
        run_loop_us = loop[0] / args.iters;
      };
      // The host's median time in run() of the Program itself: checked and lowered every run.
      auto time_lowering_runs = [&](const Program& p) {
        std::vector<double> host_times;
        host_times.reserve(args.iters);
        for (int i = 0; i < args.iters; ++i) {
          const auto start = std::chrono::steady_clock::now();
          executor.run(p, bindings);
          host_times.push_back(std::chrono::duration<double, std::micro>(
                                   std::chrono::steady_clock::now() - start).count());
        }
        executor.synchronize();
        bootstrap.barrier();
        return median(host_times);
      };
      // A program's first k steps are a program every rank runs alike (the ranks' programs have
      // the same shape): what the chain's k-th step adds to a run is the difference of two rows.
      if (args.prefixes)
        for (std::size_t k = 1; k < program.steps.size(); ++k) {
          Program prefix = program;
          prefix.steps.resize(k);
          double t = 0, h = 0, l = 0;
          time_runs(prefix, t, h, l);
          char entry[64];
          std::snprintf(entry, sizeof entry, "%.3f %.3f %.3f ", t, h, l);
          prefix_times += entry;
        }
      time_runs(program, median_us, host_us, loop_us);
      lowering_host_us = time_lowering_runs(program);
      // The run checked below is a prepared program's reused run, as the timed ones.
      const std::unique_ptr<PreparedProgram> checked = executor.prepare(program);
      executor.run(*checked, bindings);
      executor.enable_stats(true);
      executor.reset_stats();
      executor.run(*checked, bindings);
      const CudaExecutor::Stats stats = executor.stats();
      sm_cta_us = stats.cast_cta_us + stats.reduce_cta_us + stats.cast_to_peers_cta_us;
      // No fallback to one cudaMemcpyAsync per copy (a program may have no copies at all: one
      // rank per node has no local peers to push to).
      batched = stats.single_copy_calls == 0;
      executor.enable_stats(false);
      // --cuda-graphs: the program captured once and replayed, timed as the runs above; the
      // result checked below is then the last replay's, its destination poisoned before it.
      if (args.cuda_graphs && args.nodes == 1) {
        cudaGraphExec_t replay = capture_once(stream, [&] { executor.run(*checked, bindings); });
        for (int w = 0; w < args.warmup; ++w) BCHECK(cudaGraphLaunch(replay, stream));
        BCHECK(cudaStreamSynchronize(stream));
        bootstrap.barrier();
        std::vector<double> host_times;
        host_times.reserve(args.iters);
        const auto times = time_each(stream, args.iters, [&] {
          const auto start = std::chrono::steady_clock::now();
          BCHECK(cudaGraphLaunch(replay, stream));
          host_times.push_back(std::chrono::duration<double, std::micro>(
                                   std::chrono::steady_clock::now() - start).count());
        });
        BCHECK(cudaStreamSynchronize(stream));
        bootstrap.barrier();
        graph_us = median(times), graph_host_us = median(host_times);
        const auto loop = time_each(stream, 1, [&] {
          for (int i = 0; i < args.iters; ++i) BCHECK(cudaGraphLaunch(replay, stream));
        });
        BCHECK(cudaStreamSynchronize(stream));
        bootstrap.barrier();
        graph_loop_us = loop[0] / args.iters;
        if (collective == Collective::kAllGather)  // peers push only after this rank's slot-free signal
          BCHECK(cudaMemsetAsync(window->data(rank), 0x5A, layout.window_bytes(), stream));
        else
          for (std::size_t i = 0; i < outputs.size(); ++i)
            BCHECK(cudaMemsetAsync(outputs[i].ptr, 0x77,
                                   layout.param(i).valid_numel(rank) * dtype_size(layout.param(i).shard_dtype),
                                   stream));
        BCHECK(cudaGraphLaunch(replay, stream));
        BCHECK(cudaStreamSynchronize(stream));
        BCHECK(cudaGraphExecDestroy(replay));
      }
      bootstrap.barrier();  // threads: no pageable copy (below) while a peer's stream may wait

      // Check the last run's result on the device, bit for bit.
      BCHECK(cudaMemsetAsync(mismatches.ptr, 0, sizeof(unsigned long long), stream));
      for (std::size_t i = 0; i < layout.num_params(); ++i) {
        const ParamLayout& p = layout.param(i);
        const ParamGeometry g{p.shard_dim_size, p.row_numel, p.rows_per_rank, p.shard_numel,
                              p.dtype, p.shard_dtype};
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
    char mine[200];
    std::snprintf(mine, sizeof mine, "%.3f %llu %.3f %.3f %.3f %.3f %.3f %.3f %.3f", median_us, wrong,
                  sm_cta_us, host_us, loop_us, lowering_host_us, graph_us, graph_host_us, graph_loop_us);
    const auto all = bootstrap.allgather(mine);
    const auto all_prefixes = bootstrap.allgather(prefix_times);
    if (rank == 0) {
      double slowest = 0, sm_sum = 0, host_slowest = 0, loop_slowest = 0, lowering_slowest = 0;
      double graph_slowest = 0, graph_host_slowest = 0, graph_loop_slowest = 0;
      unsigned long long wrong_total = 0;
      for (const std::string& s : all) {
        double t = 0, sm = 0, h = 0, l = 0, lh = 0, gt = 0, gh = 0, gl = 0;
        unsigned long long w = 0;
        std::sscanf(s.c_str(), "%lf %llu %lf %lf %lf %lf %lf %lf %lf", &t, &w, &sm, &h, &l, &lh, &gt,
                    &gh, &gl);
        graph_slowest = std::max(graph_slowest, gt), graph_host_slowest = std::max(graph_host_slowest, gh);
        graph_loop_slowest = std::max(graph_loop_slowest, gl);
        slowest = std::max(slowest, t), wrong_total += w, sm_sum += sm;
        loop_slowest = std::max(loop_slowest, l);
        host_slowest = std::max(host_slowest, h);
        lowering_slowest = std::max(lowering_slowest, lh);
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
      if (args.nodes == 1) r.label += std::string(" [") + delivery_name(delivery) + "]";
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
      // Back-to-back runs go at the pace of the slower of the GPU and the host's enqueueing: when
      // this is close to the time, the host's driver calls are the fixed cost.
      char host[160];
      std::snprintf(host, sizeof host,
                    "; host %.1f us/run in run() (%.1f lowering every run); loop %.1f us/run",
                    host_slowest, lowering_slowest, loop_slowest);
      r.note += host;
      if (args.cuda_graphs && args.nodes == 1) {
        char replayed[160];
        std::snprintf(replayed, sizeof replayed,
                      "; replayed (CUDA graph) %.1f us, host %.1f us/launch, loop %.1f us/replay",
                      graph_slowest, graph_host_slowest, graph_loop_slowest);
        r.note += replayed;
      }
      append_row(r);
      print_collective_row(r);
      if (args.prefixes) print_prefix_rows(program, all_prefixes, slowest, host_slowest, loop_slowest);
      std::fflush(stdout);
    }
    bootstrap.barrier();  // everyone done with the window before it is freed
  }
  network.reset();
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
    const std::vector<std::string> reports = harness::run_rank_threads(
        world,
        [&](int rank, Bootstrap& bootstrap) {
          ranks_are_threads = true;
          bench_collective_rank(rank, bootstrap, collective, cases, args);
        },
        300000ms);
    for (int rank = 0; rank < world; ++rank)
      if (reports[rank] != "ok")
        throw std::runtime_error("rank " + std::to_string(rank) + ": " + reports[rank]);
  });
}

}  // namespace tide::bench
