// tide_bench_cuda compare: NCCL's own collectives on TIDE's buckets, beside TIDE.
#include "bench_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace tide::bench {

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
      launch_fill_random(in.ptr, dtype, ag ? shard : shard * world, seed, stream);
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
        const float v = random_value(sd, k);
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

}  // namespace tide::bench
