// tide_bench_cuda breakdown: where a small collective's fixed cost goes on the GPU (issue 57).
//
// Part 1, the operations one rank's 1 MiB all-gather or reduce-scatter puts on its stream, each
// timed alone on one stream with no peer (a flag the kernel waits on is one it signals itself, so
// the time is the operation's, not a peer's): 32 of one kind back to back on a stream (held behind
// an unmet stream wait, then released: no host in the way), the same 32 as one CUDA graph replayed,
// one alone on an idle stream between two events, and one as a graph of its own. Minus the
// "events only" row, the last two columns are what one such operation adds to a chain run by run
// and replayed.
//
// Part 2, the collectives themselves: W ranks as threads of this process sharing GPU 0 (the
// single-GPU emulation), 1 param x 1 MiB all-gather and reduce-scatter (cast-to-peers delivery)
// and a float8 amax exchange (an fp32 all-gather of 7 amaxes per rank, as tide.fsdp's
// AmaxExchange), with the slot-free handshake fused into the cast-to-peers kernel (the default)
// and as a memop call before it (TIDE_CUDA_FUSED_HANDSHAKE=0), alternating over --rounds rounds of
// fresh threads, streams and windows. A capture takes the memop head whatever the variant
// (lowering.cpp cast_to_peers_split), so both variants' replayed columns time the same graph.
// Per rank: run by run (events around each run), back-to-back
// runs (one event pair around --iters runs), replayed (events around each cudaGraphLaunch of the
// collective captured alone), back-to-back replays; the host's time per run() and per launch; how
// much later rank 1's run starts on the GPU than rank 0's (events on both streams of the one
// context: the rank that starts first waits for the other), and each rank's own run-by-run time.
// The last replay's result is checked on the device, bit for bit.
//
// Options: --world W (default 2), --iters N, --warmup N, --rounds R (default 3). One command:
//   CUDA_DEVICE_MAX_CONNECTIONS=32 tide_bench_cuda breakdown --world 2 --iters 200 --warmup 20
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_common.hpp"
#include "kernels.cuh"  // the executor's own kernels, timed here: tide_cuda_kernels_internal
#include "rank_runner.hpp"

namespace tide::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kOpsPerGraph = 32;
constexpr uint64_t kEpoch = uint64_t{3} << 62;  // the executor's kCapturedEpoch
constexpr uint64_t kTag = 7;

PFN_cuStreamBatchMemOp_v11070 batch_mem_op() {
  static const PFN_cuStreamBatchMemOp_v11070 fn = [] {
    void* pointer = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    BCHECK(cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &pointer, 12000, cudaEnableDefault,
                                            &status));
    if (status != cudaDriverEntryPointSuccess || pointer == nullptr)
      throw std::runtime_error("cuStreamBatchMemOp not found in the CUDA driver");
    return reinterpret_cast<PFN_cuStreamBatchMemOp_v11070>(pointer);
  }();
  return fn;
}

CUstreamBatchMemOpParams write_op(const void* word, uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(word);
  op.writeValue.value64 = value;
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;  // after a memory barrier, as the executor's
  return op;
}

CUstreamBatchMemOpParams wait_op(const void* word, uint64_t value, bool equal) {
  CUstreamBatchMemOpParams op{};
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  op.waitValue.address = reinterpret_cast<CUdeviceptr>(word);
  op.waitValue.value64 = value;
  op.waitValue.flags = equal ? CU_STREAM_WAIT_VALUE_EQ : CU_STREAM_WAIT_VALUE_GEQ;
  return op;
}

void mem_ops(cudaStream_t stream, std::vector<CUstreamBatchMemOpParams> ops) {
  if (batch_mem_op()(stream, static_cast<unsigned>(ops.size()), ops.data(), 0) != CUDA_SUCCESS)
    throw std::runtime_error("cuStreamBatchMemOp failed");
}

// ---- Part 1: one operation at a time, one stream, no peer. -----------------------------------

struct OpKind {
  std::string name;
  std::function<void(cudaStream_t)> enqueue;
};

struct OpRow {
  std::string name;
  double stream_us, graph_us, alone_us, graph_alone_us;
};

class OpBench {
 public:
  explicit OpBench(const Args& args) : args_(args) {
    BCHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    BCHECK(cudaStreamCreateWithFlags(&releaser_, cudaStreamNonBlocking));
    BCHECK(cudaEventCreate(&start_));
    BCHECK(cudaEventCreate(&end_));
    BCHECK(cudaMemset(words_.ptr, 0, kWordBytes));
    BCHECK(cudaHostAlloc(reinterpret_cast<void**>(&marks_host_), 64, cudaHostAllocMapped | cudaHostAllocPortable));
    BCHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&marks_), marks_host_, 0));
    launch_fill_random(src_.ptr, DType::kFP32, kShard, 1, stream_);
    launch_fill_random(grad_.ptr, DType::kBF16, 2 * kShard, 2, stream_);
    BCHECK(cudaStreamSynchronize(stream_));
  }
  ~OpBench() {
    (void)cudaFreeHost(marks_host_);
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(end_);
    (void)cudaStreamDestroy(releaser_);
    (void)cudaStreamDestroy(stream_);
  }

  std::vector<OpKind> kinds() {
    std::vector<OpKind> k;
    k.push_back({"events only (subtract)", [](cudaStream_t) {}});
    k.push_back({"event record", [this](cudaStream_t s) { BCHECK(cudaEventRecord(plain_event(), s)); }});
    k.push_back({"empty kernel, 1 CTA", [](cudaStream_t s) { launch_empty_kernel(1, s); }});
    k.push_back({"empty kernel, 64 CTAs", [](cudaStream_t s) { launch_empty_kernel(64, s); }});
    k.push_back({"c2p kernel, empty small table", [](cudaStream_t s) {
                   cuda_kernels::launch_cast_to_peers(cuda_kernels::CastToPeersSpec{}, s);
                 }});
    k.push_back({"c2p kernel, empty large table", [this](cudaStream_t s) {
                   // 9 casts of nothing: past the small table's 8, no tile to run.
                   std::array<cuda_kernels::CastSpec, 9> none;
                   none.fill({src_.ptr, dst_.ptr, 0, 0, cuda_kernels::kFP32, cuda_kernels::kBF16});
                   cuda_kernels::CastToPeersSpec spec;
                   spec.casts = none.data(), spec.num_casts = none.size();
                   cuda_kernels::launch_cast_to_peers(spec, s);
                 }});
    k.push_back({"c2p kernel, AG casts only", [this](cudaStream_t s) { ag(s, false, false); }});
    k.push_back({"c2p kernel, AG + self data-ready", [this](cudaStream_t s) { ag(s, true, false); }});
    k.push_back({"c2p kernel, AG + self both (fused)", [this](cudaStream_t s) { ag(s, true, true); }});
    k.push_back({"c2p kernel, RS copy+reduce only", [this](cudaStream_t s) { rs(s, false, false); }});
    k.push_back({"c2p kernel, RS + self data-ready", [this](cudaStream_t s) { rs(s, true, false); }});
    k.push_back({"c2p kernel, RS + self both (fused)", [this](cudaStream_t s) { rs(s, true, true); }});
    // The memop calls of the unfused slot-free handshake (lowering.cpp enqueue_flag_ops), their
    // waits met at once: run by run 6 operations, captured 7 (the clear).
    k.push_back({"memop head, run-by-run form (6 ops)", [this](cudaStream_t s) { head(s, false); }});
    k.push_back({"memop head, captured form (7 ops)", [this](cudaStream_t s) { head(s, true); }});
    k.push_back({"memop 2 writes, device (a signal)", [this](cudaStream_t s) {
                   mem_ops(s, {write_op(word(0), kTag), write_op(word(1), 1)});
                 }});
    k.push_back({"memop 1 write, device (a clear)", [this](cudaStream_t s) {
                   mem_ops(s, {write_op(word(2), 0)});
                 }});
    k.push_back({"memop 1 write, pinned host (a mark)", [this](cudaStream_t s) {
                   mem_ops(s, {write_op(marks_, 1)});
                 }});
    k.push_back({"memop 2 waits, met (a wait)", [this](cudaStream_t s) {
                   mem_ops(s, {wait_op(word(3), 0, false), wait_op(word(3), 0, true)});
                 }});
    k.push_back({"memop 1 wait, met", [this](cudaStream_t s) { mem_ops(s, {wait_op(word(3), 0, false)}); }});
    return k;
  }

  OpRow time(const OpKind& kind) {
    const int rounds = std::max(5, args_.iters / 10);
    std::vector<double> stream_us, graph_us, alone_us, graph_alone_us;
    for (int w = 0; w < kOpsPerGraph; ++w) kind.enqueue(stream_);
    BCHECK(cudaStreamSynchronize(stream_));
    cudaGraphExec_t many = capture(kind, kOpsPerGraph), one = capture(kind, 1);
    BCHECK(cudaGraphLaunch(many, stream_));
    BCHECK(cudaGraphLaunch(one, stream_));
    BCHECK(cudaStreamSynchronize(stream_));
    for (int r = 0; r < rounds; ++r) {
      block();
      BCHECK(cudaEventRecord(start_, stream_));
      for (int c = 0; c < kOpsPerGraph; ++c) kind.enqueue(stream_);
      BCHECK(cudaEventRecord(end_, stream_));
      release();
      stream_us.push_back(elapsed_us() / kOpsPerGraph);
      block();
      BCHECK(cudaEventRecord(start_, stream_));
      BCHECK(cudaGraphLaunch(many, stream_));
      BCHECK(cudaEventRecord(end_, stream_));
      release();
      graph_us.push_back(elapsed_us() / kOpsPerGraph);
      BCHECK(cudaEventRecord(start_, stream_));
      kind.enqueue(stream_);
      BCHECK(cudaEventRecord(end_, stream_));
      alone_us.push_back(elapsed_us());
      BCHECK(cudaEventRecord(start_, stream_));
      BCHECK(cudaGraphLaunch(one, stream_));
      BCHECK(cudaEventRecord(end_, stream_));
      graph_alone_us.push_back(elapsed_us());
    }
    BCHECK(cudaGraphExecDestroy(many));
    BCHECK(cudaGraphExecDestroy(one));
    return {kind.name, median(stream_us), median(graph_us), median(alone_us), median(graph_alone_us)};
  }

 private:
  static constexpr int64_t kShard = 262144;  // 1 MiB bf16 param / W = 2, elements
  static constexpr std::size_t kWordBytes = 4096;

  uint64_t* word(int k) { return static_cast<uint64_t*>(words_.ptr) + 8 * k; }  // 64 B apart
  unsigned int* counters() { return reinterpret_cast<unsigned int*>(word(40)); }

  cudaEvent_t plain_event() {
    if (!plain_) BCHECK(cudaEventCreateWithFlags(&plain_, cudaEventDisableTiming));
    return plain_;
  }

  cudaGraphExec_t capture(const OpKind& kind, int count) {
    cudaGraph_t graph = nullptr;
    BCHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < count; ++c) kind.enqueue(stream_);
    BCHECK(cudaStreamEndCapture(stream_, &graph));
    std::size_t nodes = 0;
    BCHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    if (nodes == 0) {  // "events only": a graph of one empty node
      cudaGraphNode_t node = nullptr;
      BCHECK(cudaGraphAddEmptyNode(&node, graph, nullptr, 0));
    }
    cudaGraphExec_t exec = nullptr;
    BCHECK(cudaGraphInstantiate(&exec, graph, 0));
    BCHECK(cudaGraphDestroy(graph));
    return exec;
  }

  // The kernel's flags: its data-ready signal goes to the word its CTAs wait on (and the fused
  // slot-free signal likewise): each launch waits for its own signal, never for a peer. Compared
  // on equality and reset by the kernel, as a captured run's; with the fused head, which only
  // runs run by run (lowering.cpp), as a run-by-run kernel's: an epoch one past the last launch's,
  // reached only by this launch's signal (a graph of it replays one epoch, met from then on).
  void flags(cuda_kernels::CastToPeersSpec& spec, bool handshake, bool fused) {
    spec.epoch = fused ? ++run_epoch_ : kEpoch, spec.tag = kTag, spec.equal = !fused;
    spec.arrivals = counters();
    spec.reached = marks_, spec.passed = marks_ + 1, spec.wait_id = 1;
    spec.ranks_on_gpu = 2;
    if (handshake) {
      spec.signals[0] = word(10), spec.waits[0] = word(10);
      spec.num_signals = spec.num_waits = 1;
    }
    if (fused) {
      spec.free_signals[0] = word(12), spec.free_waits[0] = word(12);
      spec.num_free_signals = spec.num_free_waits = 1;
    }
  }

  // The 1 MiB all-gather's kernel at W = 2: its shard (fp32) cast to bf16 into two blocks.
  void ag(cudaStream_t s, bool handshake, bool fused) {
    const cuda_kernels::CastSpec casts[2] = {
        {src_.ptr, dst_.ptr, kShard, 0, cuda_kernels::kFP32, cuda_kernels::kBF16},
        {src_.ptr, static_cast<std::byte*>(dst_.ptr) + 2 * kShard, kShard, 0, cuda_kernels::kFP32,
         cuda_kernels::kBF16}};
    cuda_kernels::CastToPeersSpec spec;
    spec.ranks_on_gpu = 2;
    spec.casts = casts, spec.num_casts = 2;
    flags(spec, handshake, fused);
    cuda_kernels::launch_cast_to_peers(spec, s);
  }

  // The 1 MiB reduce-scatter's kernel at W = 2: the peer's chunk (512 KiB bf16) copied, then the
  // two chunks reduced into the fp32 shard.
  void rs(cudaStream_t s, bool handshake, bool fused) {
    auto* grad = static_cast<std::byte*>(grad_.ptr);
    const cuda_kernels::CopySpec copy{grad + 2 * kShard, dst_.ptr, 2 * kShard};
    const void* sources[2] = {grad, dst_.ptr};
    const cuda_kernels::ReduceSpec reduce{sources, out_.ptr, nullptr, kShard, 1.0f, 0.5f, false,
                                          cuda_kernels::kBF16, cuda_kernels::kFP32};
    cuda_kernels::CastToPeersSpec spec;
    spec.copies = &copy, spec.num_copies = 1;
    spec.reduces = &reduce, spec.num_reduces = 1, spec.num_sources = 2;
    flags(spec, handshake, fused);
    cuda_kernels::launch_cast_to_peers(spec, s);
  }

  // The unfused slot-free handshake's memop call at W = 2: the signal (tag, epoch) into a word,
  // the reached mark, the two waits (met), the passed mark, and captured the clear.
  void head(cudaStream_t s, bool captured) {
    std::vector<CUstreamBatchMemOpParams> ops = {write_op(word(20), kTag), write_op(word(21), 1),
                                                 write_op(marks_ + 2, 1), wait_op(word(3), 0, false),
                                                 wait_op(word(3), 0, true), write_op(marks_ + 3, 1)};
    if (captured) ops.push_back(write_op(word(22), 0));
    mem_ops(s, ops);
  }

  void block() {
    ++gate_;
    mem_ops(stream_, {wait_op(word(30), gate_, false)});
  }
  void release() { mem_ops(releaser_, {write_op(word(30), gate_)}); }
  double elapsed_us() {
    BCHECK(cudaStreamSynchronize(stream_));
    float ms = 0;
    BCHECK(cudaEventElapsedTime(&ms, start_, end_));
    return 1000.0 * ms;
  }

  const Args& args_;
  cudaStream_t stream_ = nullptr, releaser_ = nullptr;
  cudaEvent_t start_ = nullptr, end_ = nullptr, plain_ = nullptr;
  DeviceMemory words_{kWordBytes};
  DeviceMemory src_{kShard * 4}, dst_{kShard * 4}, grad_{kShard * 4}, out_{kShard * 4};
  uint64_t* marks_host_ = nullptr;
  uint64_t* marks_ = nullptr;  // device address of marks_host_
  uint64_t gate_ = 0;
  uint64_t run_epoch_ = 0;  // the fused rows' epochs (flags)
};

void op_costs(const Args& args, std::vector<OpRow>& rows) {
  select_device(0);
  cuda_kernels::preload_kernels();
  OpBench bench(args);
  for (const OpKind& kind : bench.kinds()) {
    try {
      rows.push_back(bench.time(kind));
    } catch (const std::exception& e) {  // one operation the driver refuses: the others still run
      std::printf("# %s: %s\n", kind.name.c_str(), e.what());
      (void)cudaGetLastError();
      rows.push_back({kind.name + " (failed)", 0, 0, 0, 0});
    }
  }
}

// ---- Part 2: the collectives, ranks as threads. ------------------------------------------------

struct Case {
  std::string label;
  Collective collective;
  std::vector<ParamSpec> specs;
};

std::vector<Case> cases(int world) {
  return {{"AG 1 param x 1 MiB", Collective::kAllGather, single_param(std::size_t{1} << 20)},
          {"RS 1 param x 1 MiB", Collective::kReduceScatter, single_param(std::size_t{1} << 20)},
          {"amax exchange (7 fp32 per rank)", Collective::kAllGather,
           {{"float8 amaxes", {7 * static_cast<int64_t>(world)}, DType::kFP32, DType::kFP32}}}};
}

struct CollectiveRow {
  std::string label, variant;
  int round = 0;
  double run_us = 0, loop_us = 0, replay_us = 0, replay_loop_us = 0;  // slowest rank
  double host_us = 0, launch_host_us = 0;                              // slowest rank
  double own_us[2] = {0, 0};                                           // ranks 0 and 1, run by run
  double skew_us = 0;  // median of (rank 1's start - rank 0's start), run by run
  int memop_calls = 0, kernels = 0;
  unsigned long long wrong = 0;
};

// What the ranks' threads share: each rank's start events of the run-by-run runs.
struct Shared {
  std::mutex mutex;
  std::vector<cudaEvent_t> starts[2];
};

void collective_rank(int rank, Bootstrap& bootstrap, const Case& c, const Args& args, Shared& shared,
                     CollectiveRow& out) {
  select_device(rank);
  const int world = bootstrap.world();
  const BucketLayout layout(c.specs, Topology{1, world});
  const Delivery delivery = default_delivery(layout);
  const ReduceOptions options;
  const Program program = c.collective == Collective::kAllGather
                              ? plan_all_gather(layout, rank, 1, AcrossNodesOptions{}, delivery)
                              : plan_reduce_scatter(layout, rank, options, 2, AcrossNodesOptions{}, delivery);
  cudaStream_t stream = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<DeviceMemory> inputs, outputs;
  Bindings bindings;
  const ParamLayout& p = layout.param(0);
  if (c.collective == Collective::kAllGather) {
    inputs.emplace_back(p.valid_numel(rank) * dtype_size(p.shard_dtype));
    launch_fill_random(inputs.back().ptr, p.shard_dtype, p.valid_numel(rank), input_seed(kSeedBase, 0, rank), stream);
  } else {
    inputs.emplace_back(p.unsharded_bytes());
    launch_fill_random(inputs.back().ptr, p.dtype, p.numel(), input_seed(kSeedBase, 0, rank), stream);
    outputs.emplace_back(p.valid_numel(rank) * dtype_size(p.shard_dtype));
    bindings.outputs.push_back(outputs.back().ptr);
  }
  bindings.inputs.push_back(inputs.back().ptr);
  DeviceMemory mismatches(sizeof(unsigned long long));
  BCHECK(cudaStreamSynchronize(stream));
  auto window = CudaWindow::create(bootstrap, program.window_bytes, Topology{1, world});
  const int iters = args.iters;
  std::vector<cudaEvent_t> starts(iters), ends(iters);
  for (auto& e : starts) BCHECK(cudaEventCreate(&e));
  for (auto& e : ends) BCHECK(cudaEventCreate(&e));
  cudaEvent_t loop_start = nullptr, loop_end = nullptr;
  BCHECK(cudaEventCreate(&loop_start));
  BCHECK(cudaEventCreate(&loop_end));
  auto us = [](cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    BCHECK(cudaEventElapsedTime(&ms, a, b));
    return 1000.0 * ms;
  };
  double run_us = 0, loop_us = 0, replay_us = 0, replay_loop_us = 0, host_us = 0, launch_host_us = 0;
  unsigned long long wrong = 0;
  CudaExecutor::Stats stats;
  {
    CudaExecutor executor(*window, stream, default_timeout());
    const std::unique_ptr<PreparedProgram> prepared = executor.prepare(program);
    // `enqueue` iters times, events around each (starts kept for the skew), then iters times
    // between one pair; returns {median per run, loop per run, median host per call}.
    auto timed = [&](const std::function<void()>& enqueue, double& each, double& loop, double& host) {
      for (int w = 0; w < args.warmup; ++w) enqueue();
      BCHECK(cudaStreamSynchronize(stream));
      executor.synchronize();
      bootstrap.barrier();
      std::vector<double> host_times;
      for (int i = 0; i < iters; ++i) {
        BCHECK(cudaEventRecord(starts[i], stream));
        const auto start = Clock::now();
        enqueue();
        host_times.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
        BCHECK(cudaEventRecord(ends[i], stream));
      }
      BCHECK(cudaStreamSynchronize(stream));
      std::vector<double> times;
      for (int i = 0; i < iters; ++i) times.push_back(us(starts[i], ends[i]));
      each = median(times), host = median(host_times);
      bootstrap.barrier();
      BCHECK(cudaEventRecord(loop_start, stream));
      for (int i = 0; i < iters; ++i) enqueue();
      BCHECK(cudaEventRecord(loop_end, stream));
      BCHECK(cudaStreamSynchronize(stream));
      loop = us(loop_start, loop_end) / iters;
      bootstrap.barrier();
    };
    executor.run(*prepared, bindings);
    executor.synchronize();
    bootstrap.barrier();
    executor.reset_stats();
    executor.run(*prepared, bindings);
    stats = executor.stats();
    bootstrap.barrier();
    timed([&] { executor.run(*prepared, bindings); }, run_us, loop_us, host_us);
    // The skew: the run-by-run runs' starts, both ranks' (one context: comparable), kept for
    // rank 0; fresh events for the replays.
    if (rank < 2) {
      std::lock_guard<std::mutex> lock(shared.mutex);
      shared.starts[rank] = starts;
      out.own_us[rank] = run_us;
      for (auto& e : starts) BCHECK(cudaEventCreate(&e));
    }
    executor.synchronize();
    cudaGraphExec_t replay = capture_once(stream, [&] { executor.run(*prepared, bindings); });
    timed([&] { BCHECK(cudaGraphLaunch(replay, stream)); }, replay_us, replay_loop_us, launch_host_us);
    // The last replay's result, its destination poisoned before (a peer writes this rank's window
    // only after this rank's slot-free signal, which follows the poison on the stream).
    if (c.collective == Collective::kAllGather)
      BCHECK(cudaMemsetAsync(window->data(rank), 0x5A, layout.window_bytes(), stream));
    else
      BCHECK(cudaMemsetAsync(outputs[0].ptr, 0x77, p.valid_numel(rank) * dtype_size(p.shard_dtype), stream));
    BCHECK(cudaGraphLaunch(replay, stream));
    BCHECK(cudaStreamSynchronize(stream));
    BCHECK(cudaGraphExecDestroy(replay));
    bootstrap.barrier();  // threads: no pageable copy (below) while a peer's stream may wait
    BCHECK(cudaMemsetAsync(mismatches.ptr, 0, sizeof(unsigned long long), stream));
    const ParamGeometry g{p.shard_dim_size, p.row_numel, p.rows_per_rank, p.shard_numel, p.dtype, p.shard_dtype};
    auto* count = static_cast<unsigned long long*>(mismatches.ptr);
    if (c.collective == Collective::kAllGather)
      launch_check_all_gather(window->data(rank) + p.window_offset, g, world, kSeedBase, 0, count, stream);
    else
      launch_check_reduce_scatter(outputs[0].ptr, g, world, rank, kSeedBase, 0, options.prescale,
                                  options.postscale / float(world), 0.0f, count, stream);
    BCHECK(cudaMemcpyAsync(&wrong, mismatches.ptr, sizeof wrong, cudaMemcpyDeviceToHost, stream));
    BCHECK(cudaStreamSynchronize(stream));
  }
  bootstrap.barrier();  // every rank's starts are in `shared`
  {
    std::lock_guard<std::mutex> lock(shared.mutex);
    if (rank == 0 && world >= 2) {
      std::vector<double> skew;
      for (int i = 0; i < iters; ++i) skew.push_back(us(shared.starts[0][i], shared.starts[1][i]));
      // cudaEventElapsedTime is signed: positive when rank 1's run started later.
      out.skew_us = median(skew);
    }
    out.run_us = std::max(out.run_us, run_us), out.loop_us = std::max(out.loop_us, loop_us);
    out.replay_us = std::max(out.replay_us, replay_us);
    out.replay_loop_us = std::max(out.replay_loop_us, replay_loop_us);
    out.host_us = std::max(out.host_us, host_us);
    out.launch_host_us = std::max(out.launch_host_us, launch_host_us);
    out.wrong += wrong;
    if (rank == 0) out.memop_calls = stats.mem_op_calls, out.kernels = stats.kernel_launches;
  }
  bootstrap.barrier();  // rank 0 has read every rank's starts
  for (auto& e : starts) (void)cudaEventDestroy(e);
  for (auto& e : ends) (void)cudaEventDestroy(e);
  if (rank < 2)
    for (auto& e : shared.starts[rank]) (void)cudaEventDestroy(e);
  (void)cudaEventDestroy(loop_start);
  (void)cudaEventDestroy(loop_end);
  window.reset();
  BCHECK(cudaStreamDestroy(stream));
}

}  // namespace

void breakdown_child(const Args& args) {
  std::vector<OpRow> ops;
  op_costs(args, ops);
  cudaDeviceProp prop{};
  BCHECK(cudaGetDeviceProperties(&prop, 0));
  std::vector<CollectiveRow> rows;
  const int world = args.world;
  const char* variants[2] = {"fused", "memop head"};
  for (int round = 1; round <= args.rounds; ++round)
    for (const Case& c : cases(world))
      for (int v = 0; v < 2; ++v) {
        // Read by each executor when it is made (cuda_executor.cpp): set before the threads start.
        setenv("TIDE_CUDA_FUSED_HANDSHAKE", v == 0 ? "1" : "0", 1);
        CollectiveRow row;
        row.label = c.label, row.variant = variants[v], row.round = round;
        Shared shared;
        const std::vector<std::string> reports = harness::run_rank_threads(
            world,
            [&](int rank, Bootstrap& bootstrap) {
              ranks_are_threads = true;
              collective_rank(rank, bootstrap, c, args, shared, row);
            },
            std::chrono::milliseconds(300000));
        for (int rank = 0; rank < world; ++rank)
          if (reports[rank] != "ok")
            throw std::runtime_error(c.label + ", rank " + std::to_string(rank) + ": " + reports[rank]);
        rows.push_back(row);
        std::printf("# %-32s %-10s round %d: run %.1f us, replay %.1f us, %s\n", row.label.c_str(),
                    row.variant.c_str(), round, row.run_us, row.replay_us,
                    row.wrong == 0 ? "ok (bitwise)" : "FAIL");
        std::fflush(stdout);
      }
  unsetenv("TIDE_CUDA_FUSED_HANDSHAKE");

  std::printf("\n==== breakdown: %s, %d SMs; W = %d ranks as threads of one process sharing it ====\n",
              prop.name, prop.multiProcessorCount, world);
  std::printf("\n# One operation at a time, one stream, no peer (flags self-signalled): us per operation\n"
              "# (b2b: %d back to back; alone: between two events on an idle stream; graph: as a CUDA graph)\n"
              "%-40s %10s %10s %10s %12s\n", kOpsPerGraph, "operation", "stream b2b", "graph b2b",
              "alone", "graph alone");
  for (const OpRow& r : ops)
    std::printf("%-40s %10.2f %10.2f %10.2f %12.2f\n", r.name.c_str(), r.stream_us, r.graph_us, r.alone_us,
                r.graph_alone_us);
  std::printf("\n# The collectives (slowest rank's median, us; host: us per run() / per cudaGraphLaunch;\n"
              "# skew: rank 1's run-by-run start minus rank 0's on the GPU; own r0/r1: each rank's run by run)\n"
              "%-32s %-10s %2s %8s %8s %8s %8s %7s %7s %7s %7s %7s %6s %s\n", "collective", "variant", "rd",
              "run", "b2b run", "replay", "b2b rep", "host", "launch", "skew", "own r0", "own r1",
              "calls", "check");
  for (const CollectiveRow& r : rows)
    std::printf("%-32s %-10s %2d %8.1f %8.1f %8.1f %8.1f %7.1f %7.1f %7.1f %7.1f %7.1f %2d+%-3d %s\n",
                r.label.c_str(), r.variant.c_str(), r.round, r.run_us, r.loop_us, r.replay_us,
                r.replay_loop_us, r.host_us, r.launch_host_us, r.skew_us, r.own_us[0], r.own_us[1],
                r.memop_calls, r.kernels, r.wrong == 0 ? "ok (bitwise)" : "FAIL");
  std::fflush(stdout);
}

}  // namespace tide::bench
