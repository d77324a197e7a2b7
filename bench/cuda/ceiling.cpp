// tide_bench_cuda ceiling: the HBM copy ceiling, and the reduce / cast kernels' bandwidth against it.
#include "bench_common.hpp"

#include <algorithm>
#include <cstdio>

#include "kernels.cuh"  // the executor's own kernels, timed here: tide_cuda_kernels_internal

namespace tide::bench {

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
  launch_fill_random(src.ptr, DType::kBF16, copy_bytes / 2, 1, stream);
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
    launch_fill_random(sources.back().ptr, DType::kBF16, n, 100 + r, stream);
    source_ptrs.push_back(sources.back().ptr);
  }
  DeviceMemory out(n * 4);
  launch_fill_random(out.ptr, DType::kFP32, n, 7, stream);
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
  launch_fill_random(cast_src.ptr, DType::kFP32, m, 9, stream);
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

}  // namespace tide::bench
