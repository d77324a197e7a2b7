// tide_bench_cuda calls: the host's time per driver call, for each kind of call a CudaExecutor
// run() makes (lowering.cpp), by 1 and by 2 threads at once in one CUDA context (ranks as threads,
// as `sweep --threads` runs them). The fixed cost of a small collective is the sum of its calls
// (BENCHMARKS.md, "Small buckets"): this is that sum's ceiling, measured rather than assumed.
//
// Each kind: `--iters` rounds of 64 calls on the thread's own stream, timed on the host; the
// stream is drained between rounds (untimed), so no call waits for room in the stream's queue.
// Reported: the median over rounds of (round time / 64), per kind and thread count. The launches
// are timed on an idle stream and, as a run's reduce is (it follows the data_ready wait, usually
// not yet met when the host enqueues it), behind a stream wait that is released after the round.
// And the GPU's time per call, by 1 and by 2 threads at once: 64 calls enqueued behind an unmet
// stream wait between two events, then released, so the GPU runs them back to back with no host
// in the way: the part of a collective's chain that each call adds on the device.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>

#include "bench_common.hpp"
#include "kernels.cuh"  // the executor's own kernels, timed here: tide_cuda_kernels_internal

namespace tide::bench {
namespace {

constexpr int kCallsPerRound = 64;

// The stream memory operations the executor's signals and waits are, from the driver (this
// process links no libcuda): the entry points of CUDA 12.0's ABI, as the executor asks for them.
struct StreamMemOps {
  PFN_cuStreamWaitValue64_v11070 stream_wait_value64 = nullptr;
  PFN_cuStreamWriteValue64_v11070 stream_write_value64 = nullptr;
  PFN_cuStreamBatchMemOp_v11070 stream_batch_mem_op = nullptr;
};

const StreamMemOps& stream_mem_ops() {
  static const StreamMemOps ops = [] {
    StreamMemOps o;
    auto resolve = [](const char* symbol, auto& fn) {
      void* pointer = nullptr;
      cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
      BCHECK(cudaGetDriverEntryPointByVersion(symbol, &pointer, 12000, cudaEnableDefault, &status));
      if (status != cudaDriverEntryPointSuccess || pointer == nullptr)
        throw std::runtime_error(std::string(symbol) + " not found in the CUDA driver");
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(pointer);
    };
    resolve("cuStreamWaitValue64", o.stream_wait_value64);
    resolve("cuStreamWriteValue64", o.stream_write_value64);
    resolve("cuStreamBatchMemOp", o.stream_batch_mem_op);
    return o;
  }();
  return ops;
}
constexpr std::size_t kCopyBytes = 4096;  // the copy's size does not change the call's host time

struct CallKind {
  const char* name;
  const char* what;
  bool behind_wait = false;  // enqueued behind a stream wait that is not met yet
};

constexpr std::array<CallKind, 14> kKinds{{
    {"event record", "cudaEventRecord (the watchdog's events)"},
    {"memop signal", "cuStreamBatchMemOp, 2 writes (one signal)"},
    {"memop 1 write", "cuStreamBatchMemOp, 1 write (half a signal)"},
    {"memop wait", "cuStreamBatchMemOp, 2 waits, already met (one wait)"},
    {"memop signal+wait", "cuStreamBatchMemOp, 2 writes + 2 waits (merged)"},
    {"copy batch", "cudaMemcpyBatchAsync, 1 copy (a push)"},
    {"copy async", "cudaMemcpyAsync, 1 copy"},
    {"cast launch", "launch_casts, 1 cast (AG's first step)"},
    {"reduce launch", "launch_reduces, 1 reduce of 2 sources, default grid (RS's last step)"},
    {"cast, blocked", "launch_casts, behind an unmet stream wait", true},
    {"reduce, blocked", "launch_reduces, behind an unmet stream wait (as in a run)", true},
    {"timed event+signal", "cudaEventRecord of a timing event, then a memop signal (a bench's run of one signal)"},
    {"timed event+cast", "cudaEventRecord of a timing event, then a cast launch"},
    {"timed event", "cudaEventRecord of a timing event"},
}};

// One thread's resources: its stream, flag words (word 2 holds the blocked kinds' stream, and a
// second stream releases it), copy buffers, an event.
struct Lane {
  cudaStream_t stream = nullptr, releaser = nullptr;
  cudaEvent_t event = nullptr, timed = nullptr;
  cudaEvent_t start = nullptr, end = nullptr;  // the GPU columns' timing
  DeviceMemory word{64};
  DeviceMemory src{kCopyBytes}, dst{kCopyBytes};
  uint64_t gate = 0;  // the blocking wait's value: word 2 >= gate
  Lane() {
    BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    BCHECK(cudaStreamCreateWithFlags(&releaser, cudaStreamNonBlocking));
    BCHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    BCHECK(cudaEventCreate(&timed));
    BCHECK(cudaEventCreate(&start));
    BCHECK(cudaEventCreate(&end));
    BCHECK(cudaMemset(word.ptr, 0, 64));
  }
  ~Lane() {
    (void)cudaEventDestroy(event);
    (void)cudaEventDestroy(timed);
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(end);
    (void)cudaStreamDestroy(releaser);
    (void)cudaStreamDestroy(stream);
  }
  CUdeviceptr gate_word() { return reinterpret_cast<CUdeviceptr>(static_cast<uint64_t*>(word.ptr) + 2); }
  // Blocks the stream until release().
  void block() {
    if (stream_mem_ops().stream_wait_value64(stream, gate_word(), ++gate, CU_STREAM_WAIT_VALUE_GEQ) !=
        CUDA_SUCCESS)
      throw std::runtime_error("cuStreamWaitValue64 failed");
  }
  // µs from `start` to `end`, once the stream has drained.
  double elapsed_us() {
    BCHECK(cudaStreamSynchronize(stream));
    float ms = 0;
    BCHECK(cudaEventElapsedTime(&ms, start, end));
    return 1000.0 * ms;
  }
  void release() {
    if (stream_mem_ops().stream_write_value64(releaser, gate_word(), gate,
                                              CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS)
      throw std::runtime_error("cuStreamWriteValue64 failed");
  }
};

CUstreamBatchMemOpParams mem_op(bool wait, void* word) {
  CUstreamBatchMemOpParams op{};
  if (wait) {
    op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    op.waitValue.address = reinterpret_cast<CUdeviceptr>(word);
    op.waitValue.value64 = 0;
    op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;  // the word is 0: met at once
  } else {
    op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    op.writeValue.address = reinterpret_cast<CUdeviceptr>(word);
    op.writeValue.value64 = 0;
    op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  return op;
}

void call_once(int kind, Lane& lane) {
  const auto& api = stream_mem_ops();
  auto* word = static_cast<uint64_t*>(lane.word.ptr);
  switch (kind) {
    case 0: BCHECK(cudaEventRecord(lane.event, lane.stream)); break;
    case 1:
    case 2:
    case 3:
    case 4: {
      std::array<CUstreamBatchMemOpParams, 4> ops;
      unsigned n = 0;
      const unsigned writes = kind == 1 || kind == 4 ? 2 : kind == 2 ? 1 : 0;
      for (unsigned w = 0; w < writes; ++w) ops[n++] = mem_op(false, word + 1);
      if (kind >= 3) ops[n++] = mem_op(true, word), ops[n++] = mem_op(true, word);
      if (api.stream_batch_mem_op(lane.stream, n, ops.data(), 0) != CUDA_SUCCESS)
        throw std::runtime_error("cuStreamBatchMemOp failed");
      break;
    }
    case 5: {
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      std::size_t attribute_index = 0, bytes = kCopyBytes;
      void* dst = lane.dst.ptr;
      const void* src = lane.src.ptr;
      BCHECK(cudaMemcpyBatchAsync(&dst, &src, &bytes, 1, &attributes, &attribute_index, 1,
                                  lane.stream));
      break;
    }
    case 6:
      BCHECK(cudaMemcpyAsync(lane.dst.ptr, lane.src.ptr, kCopyBytes, cudaMemcpyDeviceToDevice,
                             lane.stream));
      break;
    case 7:
    case 9: {
      const cuda_kernels::CastSpec spec{lane.src.ptr, lane.dst.ptr, kCopyBytes / 4, 0,
                                        cuda_kernels::kFP32, cuda_kernels::kBF16};
      cuda_kernels::launch_casts(&spec, 1, 0, lane.stream);
      break;
    }
    case 8:
    case 10: {  // bf16 sources (the src buffer twice) -> fp32, as the RS's reduce
      const void* sources[2] = {lane.src.ptr, lane.src.ptr};
      const cuda_kernels::ReduceSpec spec{sources, lane.dst.ptr, nullptr, kCopyBytes / 4, 1.0f, 0.5f,
                                          false, cuda_kernels::kBF16, cuda_kernels::kFP32};
      cuda_kernels::launch_reduces(&spec, 1, 2, 0, lane.stream);
      break;
    }
    case 11:
    case 12:
    case 13:
      BCHECK(cudaEventRecord(lane.timed, lane.stream));
      if (kind != 13) call_once(kind == 11 ? 1 : 7, lane);
      break;
  }
}

// The slowest of `threads` threads' medians: each thread runs `warm_up` (if any) once, then
// `round` `rounds` times on its own Lane (the barrier lets rounds start together), which reports
// a µs figure per round.
using Round = std::function<double(Lane&, std::barrier<>&)>;
double slowest_median(int threads, int rounds, const Round& round,
                      const std::function<void(Lane&)>& warm_up = {}) {
  std::vector<double> per_thread(threads);
  std::barrier sync(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      BCHECK(cudaSetDevice(0));
      Lane lane;
      if (warm_up) warm_up(lane);
      std::vector<double> us;
      for (int r = 0; r < rounds; ++r) us.push_back(round(lane, sync));
      per_thread[t] = median(us);
    });
  for (auto& th : pool) th.join();
  return *std::max_element(per_thread.begin(), per_thread.end());
}

// Host µs per call of `kind`, on each of `threads` threads at once.
double time_kind(int kind, int threads, int rounds) {
  const bool blocked = kKinds[kind].behind_wait;
  const auto warm_up = [&](Lane& lane) {
    for (int w = 0; w < kCallsPerRound; ++w) call_once(kind, lane);
    BCHECK(cudaStreamSynchronize(lane.stream));
  };
  return slowest_median(threads, rounds, [&](Lane& lane, std::barrier<>& sync) {
    if (blocked) lane.block();
    sync.arrive_and_wait();
    const auto start = std::chrono::steady_clock::now();
    for (int c = 0; c < kCallsPerRound; ++c) call_once(kind, lane);
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    if (blocked) lane.release();
    BCHECK(cudaStreamSynchronize(lane.stream));
    return us / kCallsPerRound;
  }, warm_up);
}

// GPU µs per call of `kind`, on each of `threads` threads at once: each thread's 64 calls wait
// behind an unmet stream wait between two events, and every thread releases its stream at the
// same moment, so the GPU runs all of them back to back, side by side.
double gpu_time_kind(int kind, int threads, int rounds) {
  return slowest_median(threads, rounds, [&](Lane& lane, std::barrier<>& sync) {
    lane.block();
    BCHECK(cudaEventRecord(lane.start, lane.stream));
    for (int c = 0; c < kCallsPerRound; ++c) call_once(kind, lane);
    BCHECK(cudaEventRecord(lane.end, lane.stream));
    sync.arrive_and_wait();
    lane.release();
    return lane.elapsed_us() / kCallsPerRound;
  });
}

// GPU µs from an event to the next one with one call between, on an idle stream (drained before
// each): what one call costs a chain whose host enqueues each step only just in time.
double idle_gpu_time_kind(int kind, int rounds) {
  return slowest_median(1, rounds, [&](Lane& lane, std::barrier<>&) {
    BCHECK(cudaStreamSynchronize(lane.stream));
    BCHECK(cudaEventRecord(lane.start, lane.stream));
    call_once(kind, lane);
    BCHECK(cudaEventRecord(lane.end, lane.stream));
    return lane.elapsed_us();
  });
}

}  // namespace

void driver_calls_child(const Args& args) {
  select_device(0);
  cuda_kernels::preload_kernels();
  std::printf("\n# Host time per driver call (one context; 1 thread, and 2 threads at once, each on its own stream),\n"
              "# and the GPU's time per call run back to back (1 thread, and 2 threads' streams at once)\n"
              "%-20s %12s %12s %10s %10s %10s  %s\n", "call", "1 thread us", "2 threads us", "GPU 1 us",
              "GPU 2 us", "idle us", "what");
  for (int kind = 0; kind < static_cast<int>(kKinds.size()); ++kind) {
    const double one = time_kind(kind, 1, args.iters), two = time_kind(kind, 2, args.iters);
    const double gpu = gpu_time_kind(kind, 1, args.iters), gpu2 = gpu_time_kind(kind, 2, args.iters);
    const double idle = kKinds[kind].behind_wait ? 0.0 : idle_gpu_time_kind(kind, args.iters);
    std::printf("%-20s %12.2f %12.2f %10.2f %10.2f %10.2f  %s\n", kKinds[kind].name, one, two, gpu,
                gpu2, idle, kKinds[kind].what);
    Row r;
    r.section = "calls";
    r.label = kKinds[kind].name;
    r.time_us = one;
    char note[96];
    std::snprintf(note, sizeof note, "2 threads: %.2f us; GPU %.2f us, 2 threads %.2f us", two, gpu, gpu2);
    r.note = note;
    append_row(r);
  }
  std::fflush(stdout);
}

}  // namespace tide::bench
