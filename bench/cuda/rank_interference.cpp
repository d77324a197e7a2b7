// tide_bench_cuda rank-interference: ONE rank of a W = 8 TIDE reduce-scatter, modelled on one GPU,
// beside the one-wave bf16 GEMM; and the SM budget of TIDE-RS's reduce (CudaReduceBudget) swept.
//
// What one rank's GPU does during a TIDE-RS at W = 8 on a bucket of G bytes of bf16 gradient:
//   (a) copy engines land the 7 peers' chunks (7 x G/8 bytes) in its slots while its own 7
//       outgoing chunks are read by the copies that push them to the peers. Modelled as
//       device-to-device copies (copy engines: cudaMemcpyBatchAsync, PreferOverlapWithCompute, as
//       the executor issues them) of the 7 outgoing chunks into 7 slots: on one GPU a D2D copy
//       reads and writes HBM; over NVLink this GPU writes the incoming chunks and serves reads of
//       its outgoing ones: the same HBM bytes. PACED at what NVLink delivers into one GPU
//       (--nvlink-gbps, default 380 GB/s in all): the copies are cut into pieces (--pace-chunk-kib)
//       each held by cuStreamWaitValue64 on a flag that a host thread releases on a timed
//       schedule (the flag in pinned mapped host memory if this GPU's stream waits see host
//       writes, else in device memory written by cuStreamWriteValue64 on another stream). No SMs.
//       --pace self: no flags; the pieces go back to back, and their size is chosen at the start
//       (a calibration table) so that alone they take the time NVLink's rate allows. Each piece's
//       fixed cost on the copy engine then sets the pace, with no wait for a host thread per
//       piece, which beside the GEMM was most of the flag pacing's stretch (BENCHMARKS.md, stop 20).
//   (b) then its own reduce of the 8 sources (own chunk + 7 slots, bf16) into the fp32 shard of
//       G/8 bf16 elements: the executor's reduce kernel (cuda_kernels::launch_reduces) under a
//       budget (ReduceGrid + stream priority, as CudaReduceBudget gives the executor).
// Against NCCL's reduce-scatter of the same rank: a persistent reduce kernel with NCCL's CTA count
// (--nccl-ctas, default 32: NCCL 2.28 runs up to 32 channels = CTAs for a large RS on an H200)
// run continuously, alone and with the paced copies (NCCL's peers also write into this GPU's HBM).
// NCCL itself cannot run here: a W = 8 communicator needs 8 GPUs (NCCL refuses two ranks on one
// GPU, and a one-rank reduce-scatter is a local copy).
//
// Streams: the GEMM on a default-priority stream (PyTorch's compute stream); the RS model on a
// stream of the greatest priority (FSDP2's reduce-scatter stream is high priority); a budget with
// priority=low moves the reduce kernel to a lowest-priority stream, fenced by events, as the
// executor does. Every case: the background alone (time per RS iteration), --gemms GEMMs alone
// (the case's baseline, taken next to it so the GPU's drift over a sweep cancels), then beside
// >= --gemms GEMMs timed one by one with events (median and mean), and the RS iterations that ran
// wholly inside the GEMMs' window (loaded). --repeats rounds over all cases, samples pooled.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "bench_common.hpp"
#include "cuda/driver_api.hpp"
#include "one_wave_gemm.hpp"

namespace tide::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kWorld = 8;

void cu_check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  cuda_detail::driver_api().get_error_name(r, &name);
  throw std::runtime_error(std::string(what) + " failed: " + (name ? name : "?"));
}

// ---- The pacing flag. --------------------------------------------------------------------------

// One counter per lane: piece n of the copies waits for counter >= n + 1 (a cyclic GEQ on 64 bits).
class PaceFlag {
 public:
  explicit PaceFlag(bool host_memory) : host_memory_(host_memory) {
    if (host_memory_) {
      BCHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), 64, cudaHostAllocMapped | cudaHostAllocPortable));
      void* dev = nullptr;
      BCHECK(cudaHostGetDevicePointer(&dev, host_, 0));
      address_ = reinterpret_cast<CUdeviceptr>(dev);
    } else {
      device_ = DeviceMemory(64);
      address_ = reinterpret_cast<CUdeviceptr>(device_.ptr);
      BCHECK(cudaStreamCreateWithFlags(&writer_, cudaStreamNonBlocking));
    }
    reset();
  }
  ~PaceFlag() {
    if (host_) (void)cudaFreeHost(host_);
    if (writer_) (void)cudaStreamDestroy(writer_);
  }
  PaceFlag(const PaceFlag&) = delete;
  PaceFlag& operator=(const PaceFlag&) = delete;

  // Only while no wait on it is pending.
  void reset() {
    if (host_memory_) {
      __atomic_store_n(host_, uint64_t{0}, __ATOMIC_SEQ_CST);
    } else {
      BCHECK(cudaMemsetAsync(device_.ptr, 0, 8, writer_));
      BCHECK(cudaStreamSynchronize(writer_));
    }
  }
  void release(uint64_t value) {
    if (host_memory_)
      __atomic_store_n(host_, value, __ATOMIC_SEQ_CST);
    else
      cu_check(cuda_detail::driver_api().stream_write_value64(writer_, address_, value,
                                                              CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue64 (pace flag)");
  }
  void wait(cudaStream_t stream, uint64_t value) const {
    cu_check(cuda_detail::driver_api().stream_wait_value64(stream, address_, value,
                                                           CU_STREAM_WAIT_VALUE_GEQ),
             "cuStreamWaitValue64 (pace flag)");
  }

 private:
  bool host_memory_;
  uint64_t* host_ = nullptr;
  DeviceMemory device_;
  cudaStream_t writer_ = nullptr;
  CUdeviceptr address_ = 0;
};

// Whether a stream wait on pinned mapped host memory sees a host write: tried, not assumed (CUDA
// 13 has no CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_MEM_OPS; the nearest attribute,
// ..._CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, is printed). A probe that never passes leaves its
// stream blocked; the benchmark then uses device-memory flags.
bool host_flags_work(std::string& why) {
  int device = 0, registered = -1;
  BCHECK(cudaGetDevice(&device));
  (void)cuda_detail::driver_api().device_get_attribute(
      &registered, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device);
  uint64_t* host = nullptr;
  BCHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), 64, cudaHostAllocMapped | cudaHostAllocPortable));
  void* dev = nullptr;
  BCHECK(cudaHostGetDevicePointer(&dev, host, 0));
  __atomic_store_n(host, uint64_t{0}, __ATOMIC_SEQ_CST);
  cudaStream_t s = nullptr;
  cudaEvent_t e = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BCHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  why = detail::concat("CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM=", registered, "; ");
  const CUresult r = cuda_detail::driver_api().stream_wait_value64(
      s, reinterpret_cast<CUdeviceptr>(dev), 1, CU_STREAM_WAIT_VALUE_GEQ);
  if (r != CUDA_SUCCESS) {
    why += detail::concat("cuStreamWaitValue64 on host memory returned ", static_cast<int>(r));
    (void)cudaGetLastError();
    return false;  // host memory leaked: 64 bytes
  }
  BCHECK(cudaEventRecord(e, s));
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (cudaEventQuery(e) != cudaErrorNotReady) {
    why += "a wait on host memory passed before the host wrote the flag";
    return false;
  }
  __atomic_store_n(host, uint64_t{1}, __ATOMIC_SEQ_CST);
  const auto deadline = Clock::now() + std::chrono::milliseconds(500);
  while (Clock::now() < deadline)
    if (cudaEventQuery(e) == cudaSuccess) {
      why += "a stream wait saw a host write";
      (void)cudaEventDestroy(e);
      (void)cudaStreamDestroy(s);
      (void)cudaFreeHost(host);
      return true;
    }
  why += "a stream wait on host memory did not see the host's write within 500 ms";
  return false;  // stream left blocked on purpose
}

// ---- The rank's buffers. -----------------------------------------------------------------------

struct RankModel {
  std::size_t grad_bytes;   // G
  std::size_t chunk_bytes;  // G / 8
  int64_t shard_numel;      // G / 8 / 2 bf16 elements
  DeviceMemory grad, slots, out;
  std::vector<const void*> sources;  // own chunk 0, then the 7 slots
  cuda_kernels::ReduceSpec spec{};

  RankModel(std::size_t g, cudaStream_t stream)
      : grad_bytes(g), chunk_bytes(g / kWorld), shard_numel(static_cast<int64_t>(g / kWorld / 2)),
        grad(g), slots(g / kWorld * (kWorld - 1)), out(g / kWorld / 2 * 4) {
    launch_fill_random(grad.ptr, cuda_kernels::kBF16, static_cast<int64_t>(g / 2), 90, stream);
    launch_fill_random(slots.ptr, cuda_kernels::kBF16, static_cast<int64_t>(chunk_bytes / 2 * (kWorld - 1)),
                       91, stream);
    sources.push_back(grad.ptr);
    for (int p = 0; p < kWorld - 1; ++p)
      sources.push_back(static_cast<const std::byte*>(slots.ptr) + p * chunk_bytes);
    spec = {sources.data(), out.ptr, nullptr, shard_numel, 1.0f, 1.0f / kWorld, false,
            cuda_kernels::kBF16, cuda_kernels::kFP32};
  }
  // The bytes the copies move: the 7 outgoing chunks (1..7 of the gradient) into the 7 slots.
  const std::byte* copy_src() const { return static_cast<const std::byte*>(grad.ptr) + chunk_bytes; }
  std::byte* copy_dst() const { return static_cast<std::byte*>(slots.ptr); }
  std::size_t copy_bytes() const { return chunk_bytes * (kWorld - 1); }
};

void copy_engine_copy(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  static std::atomic<bool> batch{true};
  if (batch.load()) {
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t index = 0;
    void* dsts[1] = {dst};
    const void* srcs[1] = {src};
    std::size_t sizes[1] = {bytes};
    if (cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attributes, &index, 1, stream) == cudaSuccess) return;
    (void)cudaGetLastError();
    batch = false;
  }
#endif
  BCHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}

// ---- A lane: one stream's background, iteration after iteration. -------------------------------

struct LaneSpec {
  bool copies = false;   // (a): the paced copies
  bool reduce = false;   // (b): the reduce, after the copies
  cuda_kernels::ReduceGrid grid;
  bool low_priority = false;
};

struct Streams {
  cudaStream_t high = nullptr;   // the RS stream (greatest priority)
  cudaStream_t high2 = nullptr;  // a second lane's (greatest priority)
  cudaStream_t low = nullptr;    // the budget's low-priority reduce stream (lowest priority)
};

struct PaceConfig {
  double gbps = 380;             // <= 0: unpaced (copy-engine speed)
  std::size_t piece_bytes = 2 << 20;
  bool self = false;             // pieces back to back, no flags (--pace self)
};

class Lane {
 public:
  Lane(const RankModel& model, const LaneSpec& spec, cudaStream_t stream, cudaStream_t low_stream,
       PaceFlag* flag, const PaceConfig& pace, int max_iters)
      : model_(model), spec_(spec), stream_(stream), low_(low_stream), flag_(flag), pace_(pace),
        max_iters_(max_iters) {
    starts_.resize(max_iters), ends_.resize(max_iters);
    for (int i = 0; i < max_iters; ++i) {
      BCHECK(cudaEventCreate(&starts_[i]));
      BCHECK(cudaEventCreate(&ends_[i]));
    }
    if (spec_.copies && spec_.reduce) {
      red_starts_.resize(max_iters), red_ends_.resize(max_iters);
      for (int i = 0; i < max_iters; ++i) {
        BCHECK(cudaEventCreate(&red_starts_[i]));
        BCHECK(cudaEventCreate(&red_ends_[i]));
      }
    }
    BCHECK(cudaEventCreateWithFlags(&fence_a_, cudaEventDisableTiming));
    BCHECK(cudaEventCreateWithFlags(&fence_b_, cudaEventDisableTiming));
    const std::size_t bytes = model_.copy_bytes();
    pieces_ = spec_.copies ? static_cast<int>((bytes + pace_.piece_bytes - 1) / pace_.piece_bytes) : 0;
    if (spec_.copies && !self_paced()) flag_->reset();
  }
  ~Lane() {
    for (auto* v : {&starts_, &ends_, &red_starts_, &red_ends_})
      for (cudaEvent_t e : *v) (void)cudaEventDestroy(e);
    (void)cudaEventDestroy(fence_a_);
    (void)cudaEventDestroy(fence_b_);
  }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  void start() {
    feeder_ = std::thread([this] { guarded([this] { feed(); }); feeder_done_ = true; });
    if (spec_.copies && !self_paced()) pacer_ = std::thread([this] { guarded([this] { pace(); }); });
  }
  void stop() { stop_ = true; }
  // Joins the threads and waits for the stream; rethrows a thread's error.
  void join() {
    if (feeder_.joinable()) feeder_.join();
    if (pacer_.joinable()) pacer_.join();
    BCHECK(cudaStreamSynchronize(stream_));
    if (low_) BCHECK(cudaStreamSynchronize(low_));
    if (!error_.empty()) throw std::runtime_error("background lane: " + error_);
  }
  int issued() const { return issued_.load(); }
  cudaEvent_t start_event(int i) const { return starts_[i]; }
  cudaEvent_t end_event(int i) const { return ends_[i]; }
  bool has_reduce_events() const { return !red_starts_.empty(); }
  cudaEvent_t reduce_start(int i) const { return red_starts_[i]; }
  cudaEvent_t reduce_end(int i) const { return red_ends_[i]; }
  bool failed() const { return abort_.load(); }
  bool started() const { return started_.load(); }  // starts_[0] is recorded

 private:
  bool self_paced() const { return pace_.self && pace_.gbps > 0; }
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      error_ = e.what();
      stop_ = true;
      abort_ = true;
    }
  }
  static void spin_until_done(cudaEvent_t e, const std::atomic<bool>* abort) {
    for (;;) {
      const cudaError_t s = cudaEventQuery(e);
      if (s == cudaSuccess) return;
      if (s != cudaErrorNotReady) BCHECK(s);
      if (abort && abort->load()) return;
      std::this_thread::yield();
    }
  }
  void feed() {
    const cudaStream_t reduce_on = spec_.low_priority ? low_ : stream_;
    for (int i = 0; i < max_iters_ && !stop_; ++i) {
      if (i >= 3) spin_until_done(ends_[i - 3], &abort_);  // at most 3 iterations in flight
      if (abort_) break;
      BCHECK(cudaEventRecord(starts_[i], stream_));
      if (i == 0) started_ = true;
      for (int k = 0; k < pieces_; ++k) {
        const uint64_t n = static_cast<uint64_t>(i) * pieces_ + k;
        const std::size_t offset = static_cast<std::size_t>(k) * pace_.piece_bytes;
        const std::size_t bytes = std::min(pace_.piece_bytes, model_.copy_bytes() - offset);
        if (!self_paced()) flag_->wait(stream_, n + 1);
        copy_engine_copy(model_.copy_dst() + offset, model_.copy_src() + offset, bytes, stream_);
        enqueued_.store(n + 1);
      }
      if (spec_.reduce) {
        if (reduce_on != stream_) {
          BCHECK(cudaEventRecord(fence_a_, stream_));
          BCHECK(cudaStreamWaitEvent(reduce_on, fence_a_, 0));
        }
        if (has_reduce_events()) BCHECK(cudaEventRecord(red_starts_[i], reduce_on));
        cuda_kernels::launch_reduces(&model_.spec, 1, kWorld, spec_.grid, reduce_on);
        if (has_reduce_events()) BCHECK(cudaEventRecord(red_ends_[i], reduce_on));
        if (reduce_on != stream_) {
          BCHECK(cudaEventRecord(fence_b_, reduce_on));
          BCHECK(cudaStreamWaitEvent(stream_, fence_b_, 0));
        }
      }
      BCHECK(cudaEventRecord(ends_[i], stream_));
      issued_.store(i + 1);
    }
  }
  // Releases iteration i's pieces at t0 + k x piece/rate, t0 = when iteration i - 1 ended (as
  // seen by this thread: a few microseconds late, alone and loaded alike), and never a piece not
  // yet enqueued.
  void pace() {
    const double piece_us = pace_.gbps > 0 ? pace_.piece_bytes / (pace_.gbps * 1e3) : 0.0;
    // Once the feeder is done, everything it enqueued is released at once (so the stream drains;
    // it stops between iterations unless it failed) and the pacer ends.
    auto wait_enqueued = [&](uint64_t n) {
      while (enqueued_.load() <= n) {
        if (feeder_done_.load() && enqueued_.load() <= n) {
          flag_->release(enqueued_.load());
          return false;
        }
        std::this_thread::yield();
      }
      return true;
    };
    for (int i = 0;; ++i) {
      // Iteration i's first piece enqueued: iteration i - 1 is wholly enqueued (ends_[i - 1]).
      if (!wait_enqueued(static_cast<uint64_t>(i) * pieces_)) return;
      if (i > 0) spin_until_done(ends_[i - 1], nullptr);
      const auto t0 = Clock::now();
      for (int k = 0; k < pieces_; ++k) {
        const uint64_t n = static_cast<uint64_t>(i) * pieces_ + k;
        const auto at = t0 + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double, std::micro>(k * piece_us));
        while (Clock::now() < at) {
        }
        if (!wait_enqueued(n)) return;
        flag_->release(n + 1);
      }
    }
  }

  const RankModel& model_;
  LaneSpec spec_;
  cudaStream_t stream_, low_;
  PaceFlag* flag_;
  PaceConfig pace_;
  int max_iters_;
  int pieces_ = 0;
  std::vector<cudaEvent_t> starts_, ends_, red_starts_, red_ends_;
  cudaEvent_t fence_a_ = nullptr, fence_b_ = nullptr;
  std::thread feeder_, pacer_;
  std::atomic<bool> stop_{false}, abort_{false}, feeder_done_{false}, started_{false};
  std::atomic<int> issued_{0};
  std::atomic<uint64_t> enqueued_{0};
  std::mutex error_mutex_;
  std::string error_;
};

double elapsed_us(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  BCHECK(cudaEventElapsedTime(&ms, a, b));
  return 1000.0 * ms;
}

double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

// ---- Cases. ------------------------------------------------------------------------------------

struct Case {
  std::string kind;    // copies | reduce | tide | nccl | nccl+copies | unpaced
  std::string budget;  // CudaReduceBudget::describe() of the reduce, or "-"
  std::string label;
  std::vector<LaneSpec> lanes;  // lane 0's iteration is "the RS"
  bool unpaced = false;
  // Pooled over repeats. gemm_alone_us: the GEMM alone right before each repeat's loaded GEMMs,
  // the baseline of this case's slowdown: the GPU's clock drifts over a sweep (88 -> 102 us for
  // the GEMM alone on an H200, 2026-12-02), as much as the effects compared.
  std::vector<double> gemm_us, gemm_alone_us, rs_alone_us, rs_loaded_us, red_alone_us, red_loaded_us;
  int not_overlapped = 0;
};

struct Sample {
  std::vector<double> rs, red;
};

class Runner {
 public:
  Runner(const Args& args, OneWaveGemm& gemm, RankModel& model, Streams streams, bool host_flags)
      : args_(args), gemm_(gemm), model_(model), streams_(streams),
        piece_bytes_(args.pace_chunk_kib << 10) {
    flags_.emplace_back(std::make_unique<PaceFlag>(host_flags));
    flags_.emplace_back(std::make_unique<PaceFlag>(host_flags));
    BCHECK(cudaEventCreate(&origin_));
  }
  ~Runner() { (void)cudaEventDestroy(origin_); }
  void set_piece_bytes(std::size_t bytes) { piece_bytes_ = bytes; }

  // The background alone: iterations' times (the first dropped: warm-up).
  Sample alone(const Case& c, int iters) {
    auto lanes = make_lanes(c, iters + 1);
    for (auto& l : lanes) l->start();
    for (auto& l : lanes) l->join();
    Sample s;
    const Lane& l0 = *lanes[0];
    for (int i = 1; i < l0.issued(); ++i) {
      s.rs.push_back(elapsed_us(l0.start_event(i), l0.end_event(i)));
      if (l0.has_reduce_events()) s.red.push_back(elapsed_us(l0.reduce_start(i), l0.reduce_end(i)));
    }
    return s;
  }

  // GEMMs timed beside the background; lane 0's iterations wholly inside the GEMMs' window.
  bool beside(const Case& c, int gemms, double iter_us, std::vector<double>& gemm_us, Sample& loaded) {
    const double window_us = gemms * gemm_.alone_us;
    const int max_iters = static_cast<int>(std::ceil(3.0 * window_us / std::max(iter_us, 1.0))) + 16;
    std::vector<cudaEvent_t> g(2 * gemms);
    for (auto& e : g) BCHECK(cudaEventCreate(&e));
    BCHECK(cudaEventRecord(origin_, gemm_.stream));
    BCHECK(cudaStreamSynchronize(gemm_.stream));
    auto lanes = make_lanes(c, max_iters);
    for (auto& l : lanes) l->start();
    // The GEMMs start once every lane's background has started.
    for (auto& l : lanes) {
      while (!l->started() && !l->failed()) std::this_thread::yield();
      if (l->failed()) break;
      while (cudaEventQuery(l->start_event(0)) == cudaErrorNotReady) std::this_thread::yield();
    }
    for (int j = 0; j < gemms; ++j) {
      BCHECK(cudaEventRecord(g[2 * j], gemm_.stream));
      gemm_.run();
      BCHECK(cudaEventRecord(g[2 * j + 1], gemm_.stream));
    }
    BCHECK(cudaStreamSynchronize(gemm_.stream));
    for (auto& l : lanes) l->stop();
    for (auto& l : lanes) l->join();
    for (int j = 0; j < gemms; ++j) gemm_us.push_back(elapsed_us(g[2 * j], g[2 * j + 1]));
    const double w0 = elapsed_us(origin_, g[0]), w1 = elapsed_us(origin_, g[2 * gemms - 1]);
    bool overlapped = true;
    for (auto& l : lanes) {
      const int n = l->issued();
      overlapped &= n > 0 && elapsed_us(origin_, l->start_event(0)) <= w0 &&
                    elapsed_us(origin_, l->end_event(n - 1)) >= w1;
    }
    const Lane& l0 = *lanes[0];
    for (int i = 0; i < l0.issued(); ++i) {
      const double s = elapsed_us(origin_, l0.start_event(i)), e = elapsed_us(origin_, l0.end_event(i));
      if (s >= w0 && e <= w1) {
        loaded.rs.push_back(e - s);
        if (l0.has_reduce_events()) loaded.red.push_back(elapsed_us(l0.reduce_start(i), l0.reduce_end(i)));
      }
    }
    for (auto& e : g) BCHECK(cudaEventDestroy(e));
    return overlapped;
  }

  void measure(Case& c) {
    const Sample a = alone(c, c.kind == "reduce" || c.kind == "nccl" ? 10 : 6);
    const double iter_us = median(a.rs);
    const int gemms = std::min(
        4000, std::max(args_.gemms, static_cast<int>(std::ceil(6.0 * iter_us / gemm_.alone_us))));
    const std::vector<double> gemm_alone = gemm_.time(args_.gemms);
    std::vector<double> gemm_us;
    Sample loaded;
    if (!beside(c, gemms, iter_us, gemm_us, loaded)) ++c.not_overlapped;
    c.gemm_alone_us.insert(c.gemm_alone_us.end(), gemm_alone.begin(), gemm_alone.end());
    c.gemm_us.insert(c.gemm_us.end(), gemm_us.begin(), gemm_us.end());
    c.rs_alone_us.insert(c.rs_alone_us.end(), a.rs.begin(), a.rs.end());
    c.red_alone_us.insert(c.red_alone_us.end(), a.red.begin(), a.red.end());
    c.rs_loaded_us.insert(c.rs_loaded_us.end(), loaded.rs.begin(), loaded.rs.end());
    c.red_loaded_us.insert(c.red_loaded_us.end(), loaded.red.begin(), loaded.red.end());
  }

 private:
  std::vector<std::unique_ptr<Lane>> make_lanes(const Case& c, int max_iters) {
    std::vector<std::unique_ptr<Lane>> lanes;
    PaceConfig pace{c.unpaced ? 0.0 : args_.nvlink_gbps, piece_bytes_, args_.pace == "self"};
    for (std::size_t k = 0; k < c.lanes.size(); ++k)
      lanes.push_back(std::make_unique<Lane>(model_, c.lanes[k], k == 0 ? streams_.high : streams_.high2,
                                             streams_.low, flags_[k].get(), pace, max_iters));
    return lanes;
  }

  const Args& args_;
  OneWaveGemm& gemm_;
  RankModel& model_;
  Streams streams_;
  std::vector<std::unique_ptr<PaceFlag>> flags_;
  cudaEvent_t origin_ = nullptr;
  std::size_t piece_bytes_;
};

std::string budget_name(const cuda_kernels::ReduceGrid& g, bool low) {
  CudaReduceBudget b;
  b.max_ctas = g.max_ctas, b.tiles_per_cta = g.tiles_per_cta, b.low_priority = low;
  return b.describe();
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// The sweep: --sweep-ctas x --sweep-tiles x --sweep-priority, each as the whole rank (tide) and
// as the reduce alone (reduce); and the fixed cases.
std::vector<Case> make_cases(const Args& args) {
  std::vector<Case> cases;
  auto add = [&](std::string kind, std::string budget, std::string label, std::vector<LaneSpec> lanes,
                 bool unpaced = false) {
    Case c;
    c.kind = std::move(kind), c.budget = std::move(budget), c.label = std::move(label);
    c.lanes = std::move(lanes), c.unpaced = unpaced;
    cases.push_back(std::move(c));
  };
  LaneSpec copies;
  copies.copies = true;
  LaneSpec reduce_default;
  reduce_default.reduce = true;
  LaneSpec tide_default = reduce_default;
  tide_default.copies = true;
  LaneSpec nccl;
  nccl.reduce = true, nccl.grid = {args.nccl_ctas, 0};
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.0f GB/s", args.nvlink_gbps);
  add("copies", "-", std::string("paced copies only (7 x G/8 at ") + rate + ")", {copies});
  add("reduce", "default", "reduce only, default budget (today)", {reduce_default});
  add("tide", "default", "TIDE-RS rank model, default budget (today)", {tide_default});
  add("nccl", budget_name(nccl.grid, false),
      detail::concat("NCCL stand-in: ", args.nccl_ctas, "-CTA persistent reduce"), {nccl});
  add("nccl+copies", budget_name(nccl.grid, false),
      detail::concat("NCCL stand-in ", args.nccl_ctas, " CTAs + paced copies"), {nccl, copies});
  if (args.unpaced) add("unpaced", "-", "UNPACED copies (HBM speed; not NVLink)", {copies}, true);
  for (const std::string& prio : split(args.sweep_priority, ','))
    for (const std::string& tiles : split(args.sweep_tiles, ','))
      for (const std::string& ctas : split(args.sweep_ctas, ',')) {
        const CudaReduceBudget b =
            CudaReduceBudget::parse("ctas=" + ctas + ",tiles=" + tiles + ",priority=" + prio);
        LaneSpec r;
        r.reduce = true, r.grid = {b.max_ctas, b.tiles_per_cta}, r.low_priority = b.low_priority;
        LaneSpec t = r;
        t.copies = true;
        // Labels carry the budget as TIDE_CUDA_REDUCE_BUDGET takes it.
        add("tide", b.describe(), "TIDE-RS " + b.describe(), {t});
        add("reduce", b.describe(), "reduce " + b.describe(), {r});
      }
  return cases;
}

struct Figures {
  double gemm_med = 0, gemm_mean = 0, slow_med = 0, slow_mean = 0;
  double rs_alone = 0, rs_loaded = 0, red_alone = 0, red_loaded = 0;
  double rs_vs_ref = 0;  // loaded RS / the default TIDE-RS model alone (same bytes)
  bool meets = false;
};

// Slowdowns against the case's own GEMM-alone baseline (taken next to it, every repeat).
Figures figures_of(const Case& c, double ref_rs) {
  Figures f;
  f.gemm_med = median(c.gemm_us), f.gemm_mean = mean_of(c.gemm_us);
  f.slow_med = 100.0 * (f.gemm_med / median(c.gemm_alone_us) - 1.0);
  f.slow_mean = 100.0 * (f.gemm_mean / mean_of(c.gemm_alone_us) - 1.0);
  f.rs_alone = median(c.rs_alone_us), f.rs_loaded = median(c.rs_loaded_us);
  f.red_alone = median(c.red_alone_us), f.red_loaded = median(c.red_loaded_us);
  f.rs_vs_ref = ref_rs > 0 && !c.rs_loaded_us.empty() ? f.rs_loaded / ref_rs : 0;
  f.meets = c.kind == "tide" && f.slow_mean <= 10.0 && f.rs_vs_ref > 0 && f.rs_vs_ref <= 1.2;
  return f;
}

std::string format_row(const Case& c, const Figures& f) {
  char line[400];
  char vs[16] = "-";
  if (c.kind == "tide" && f.rs_vs_ref > 0) std::snprintf(vs, sizeof vs, "%.2fx", f.rs_vs_ref);
  char red[40] = "-";
  if (!c.red_alone_us.empty())
    std::snprintf(red, sizeof red, "%.0f / %.0f", f.red_alone, c.red_loaded_us.empty() ? 0.0 : f.red_loaded);
  std::snprintf(line, sizeof line, "%-52s %+8.1f%% %+8.1f%% %9.0f %9.0f (%3zu) %7s %15s %s%s",
                c.label.c_str(), f.slow_med, f.slow_mean, f.rs_alone, f.rs_loaded,
                c.rs_loaded_us.size(), vs, red, f.meets ? "TARGET MET" : "",
                c.not_overlapped ? " WARNING: background did not cover every GEMM" : "");
  return line;
}

const char* kTableHeader =
    "%-52s %9s %9s %9s %9s %5s %7s %15s\n";

void print_table_header() {
  std::printf(kTableHeader, "case (budget of the reduce)", "GEMM med", "GEMM mean", "RS alone",
              "RS loaded", "(n)", "vs ref", "reduce a/l us");
}

void rank_interference_child(const Args& args) {
  select_device(0);
  cuda_kernels::preload_kernels();  // no lazy module load while a stream waits on a pace flag
  OneWaveGemm gemm;
  if (!gemm.init()) {
    std::printf("\n# rank-interference: skipped (libcublas.so.13 not found; set TIDE_CUBLAS_LIB)\n");
    append_row({"rank-final", "rank-interference: skipped, cuBLAS not found", 0, 0, 0, 0, 0, 0, 0, "-"});
    return;
  }
  const std::size_t g = static_cast<std::size_t>(args.g_mib) << 20;
  if (g % (std::size_t{kWorld} * 16) != 0) throw std::runtime_error("--g-mib: G/8 must be a multiple of 16 B");
  cudaStream_t fill = nullptr;
  BCHECK(cudaStreamCreateWithFlags(&fill, cudaStreamNonBlocking));
  RankModel model(g, fill);
  BCHECK(cudaStreamSynchronize(fill));
  int least = 0, greatest = 0;
  BCHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  Streams streams;
  BCHECK(cudaStreamCreateWithPriority(&streams.high, cudaStreamNonBlocking, greatest));
  BCHECK(cudaStreamCreateWithPriority(&streams.high2, cudaStreamNonBlocking, greatest));
  BCHECK(cudaStreamCreateWithPriority(&streams.low, cudaStreamNonBlocking, least));
  std::string why;
  const bool host_flags = host_flags_work(why);
  int device = 0, sms = 0;
  BCHECK(cudaGetDevice(&device));
  BCHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  BCHECK(cudaGetDeviceProperties(&prop, device));

  const int alone_gemms = std::max(args.gemms, 200);
  auto alone_times = gemm.time(alone_gemms);
  const double alone_med = median(alone_times), alone_mean = mean_of(alone_times);
  gemm.alone_us = alone_med;

  std::printf("\n# rank-interference: one rank of a W = 8 TIDE-RS on one GPU (%s, %d SMs), beside a "
              "bf16 GEMM %dx%dx%d (cuBLAS %s)\n",
              prop.name, sms, OneWaveGemm::M, OneWaveGemm::N, OneWaveGemm::K, gemm.cublas.where.c_str());
  std::printf("# bucket G = %zu MiB bf16 per rank; shard = %lld bf16 elements -> fp32; (a) copies of 7 x "
              "G/8 = %zu MiB paced at %.0f GB/s in %zu KiB pieces (--pace self: sized below), (b) reduce of 8 sources\n",
              args.g_mib, static_cast<long long>(model.shard_numel), model.copy_bytes() >> 20,
              args.nvlink_gbps, args.pace_chunk_kib);
  std::printf("# at that rate the copy phase takes >= %.0f us per RS (the 'paced copies only' row "
              "shows what the pacing achieved)\n",
              model.copy_bytes() / (args.nvlink_gbps * 1e3));
  std::printf("# the copies are D2D on this GPU: they read and write HBM; over NVLink this GPU writes "
              "the 7 incoming chunks and serves reads of its 7 outgoing ones: the same HBM bytes.\n");
  std::printf("# pace flags in pinned mapped host memory (a host thread writes them): %s (%s); else "
              "device memory written by cuStreamWriteValue64 on another stream\n",
              host_flags ? "usable" : "NOT usable", why.c_str());
  std::printf("# streams: GEMM default priority (%d); RS model priority %d (FSDP2's RS stream is high "
              "priority); priority=low puts the reduce on a priority-%d stream\n",
              0, greatest, least);
  std::printf("# NCCL itself is not run: a W = 8 ncclReduceScatter needs 8 GPUs (NCCL refuses two "
              "ranks on one GPU; one rank is a local copy). Stand-in: %d-CTA persistent reduce.\n",
              args.nccl_ctas);
  std::printf("# GEMM alone: median %.1f us, mean %.1f us (%d runs, %.0f TFLOP/s); >= %d GEMMs per "
              "case x %d repeats pooled\n",
              alone_med, alone_mean, alone_gemms, gemm.tflops(alone_med), args.gemms, args.repeats);
  std::fflush(stdout);

  std::vector<Case> cases = make_cases(args);
  // The pacing check: the paced copies alone must take about the expected time; host-memory flags
  // whose writes the GPU sees late would stretch them, then device-memory flags are tried.
  // --pace self: the piece size whose back-to-back copies alone come closest to that time.
  const double expected_us = model.copy_bytes() / (args.nvlink_gbps * 1e3);
  std::size_t piece_bytes = args.pace_chunk_kib << 10;
  auto paced_copy_us = [&](bool host) {
    Runner probe(args, gemm, model, streams, host);
    probe.set_piece_bytes(piece_bytes);
    return median(probe.alone(cases[0], 4).rs);  // cases[0]: the paced copies only
  };
  bool use_host_flags = host_flags;
  if (args.pace == "self") {
    double best = 0;
    std::size_t best_bytes = 0;
    std::printf("# self pacing: copy phase alone per piece size (expected %.0f us at %.0f GB/s)\n",
                expected_us, args.nvlink_gbps);
    for (std::size_t kib : {128, 256, 384, 512, 640, 768, 1024, 1536, 2048, 4096}) {
      piece_bytes = kib << 10;
      const double us = paced_copy_us(false);
      std::printf("#   %5zu KiB pieces: %7.0f us (%.0f GB/s)\n", kib, us, model.copy_bytes() / (us * 1e3));
      if (best_bytes == 0 || std::fabs(std::log(us / expected_us)) < std::fabs(std::log(best / expected_us)))
        best = us, best_bytes = piece_bytes;
    }
    piece_bytes = best_bytes;
    std::printf("# self pacing: %zu KiB pieces, back to back (%.0f us alone)\n", piece_bytes >> 10, best);
  } else {
    const double host_us = host_flags ? paced_copy_us(true) : 0.0;
    if (!host_flags || host_us > 1.1 * expected_us + 20) {
      const double device_us = paced_copy_us(false);
      std::printf("# pacing check: paced copy phase %.0f us with host flags%s, %.0f us with device flags "
                  "(expected %.0f us)\n",
                  host_us, host_flags ? "" : " (unusable)", device_us, expected_us);
      use_host_flags = host_flags && host_us <= device_us;
    } else {
      std::printf("# pacing check: paced copy phase %.0f us with host flags (expected %.0f us)\n", host_us,
                  expected_us);
    }
    std::printf("# pacing flags used: %s\n", use_host_flags ? "host memory" : "device memory");
  }
  std::fflush(stdout);
  Runner runner(args, gemm, model, streams, use_host_flags);
  runner.set_piece_bytes(piece_bytes);
  const auto t_begin = Clock::now();
  for (int rep = 0; rep < args.repeats; ++rep) {
    for (Case& c : cases) runner.measure(c);
    std::printf("# repeat %d/%d done (%.1f s)\n", rep + 1, args.repeats,
                std::chrono::duration<double>(Clock::now() - t_begin).count());
    std::fflush(stdout);
  }
  const auto alone_after = gemm.time(alone_gemms);

  // The reference: today's TIDE-RS rank model alone (same bytes).
  double ref_rs = 0;
  for (const Case& c : cases)
    if (c.kind == "tide" && c.budget == "default") ref_rs = median(c.rs_alone_us);

  std::vector<Figures> figs;
  for (const Case& c : cases) figs.push_back(figures_of(c, ref_rs));

  std::printf("\n# All cases. GEMM med/mean: slowdown vs the GEMM alone timed right before each "
              "repeat of the case. RS alone / loaded: median us per "
              "iteration of the background's first lane (tide: paced copies + reduce), loaded = "
              "iterations wholly inside the GEMMs' window (n of them). vs ref: loaded RS / today's "
              "TIDE-RS model alone (%.0f us). reduce a/l: the reduce part alone / loaded.\n",
              ref_rs);
  print_table_header();
  for (std::size_t i = 0; i < cases.size(); ++i) std::printf("%s\n", format_row(cases[i], figs[i]).c_str());
  std::printf("# GEMM alone after the sweep: median %.1f us, mean %.1f us (drift check)\n",
              median(alone_after), mean_of(alone_after));

  // TSV for plotting.
  {
    std::ofstream tsv(args.tsv);
    if (!tsv) std::printf("# WARNING: cannot write %s\n", args.tsv.c_str());
    tsv << "kind\tbudget\tctas\ttiles_per_cta\tpriority\tgemm_median_us\tgemm_mean_us\t"
           "gemm_alone_median_us\tgemm_alone_mean_us\tgemm_slowdown_median_pct\tgemm_slowdown_mean_pct\trs_alone_us\trs_loaded_us\t"
           "rs_loaded_n\trs_loaded_vs_ref\treduce_alone_us\treduce_loaded_us\tmeets_target\t"
           "not_overlapped\tlabel\n";
    for (std::size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      const Figures& f = figs[i];
      CudaReduceBudget b;
      if (c.budget != "-") b = CudaReduceBudget::parse(c.budget);
      tsv << c.kind << '\t' << c.budget << '\t' << b.max_ctas << '\t' << b.tiles_per_cta << '\t'
          << (b.low_priority ? "low" : "normal") << '\t' << f.gemm_med << '\t' << f.gemm_mean << '\t'
          << median(c.gemm_alone_us) << '\t' << mean_of(c.gemm_alone_us) << '\t'
          << f.slow_med << '\t' << f.slow_mean << '\t' << f.rs_alone << '\t' << f.rs_loaded << '\t'
          << c.rs_loaded_us.size() << '\t' << f.rs_vs_ref << '\t' << f.red_alone << '\t'
          << f.red_loaded << '\t' << (f.meets ? 1 : 0) << '\t' << c.not_overlapped << '\t' << c.label
          << '\n';
    }
    tsv << "# gemm_alone_median_us (before the sweep)=" << alone_med << " gemm_alone_mean_us=" << alone_mean
        << " ref_rs_alone_us=" << ref_rs << " G_MiB=" << args.g_mib << " nvlink_gbps="
        << args.nvlink_gbps << " device=" << prop.name << " pace=" << args.pace
        << " piece_KiB=" << (piece_bytes >> 10) << " flags="
        << (args.pace == "self" ? "none" : use_host_flags ? "host" : "device") << '\n';
  }
  std::printf("# wrote %s\n", args.tsv.c_str());

  // The short table the parent prints last: the separated contributions, then the budgets on the
  // trade-off front (no other budget has both a lower GEMM mean slowdown and a lower loaded RS).
  std::vector<std::string> final_lines;
  const double expected_copy_us = model.copy_bytes() / (args.nvlink_gbps * 1e3);
  final_lines.push_back(detail::concat(
      "GEMM alone ", static_cast<int>(std::lround(alone_med)), " us median / ",
      static_cast<int>(std::lround(alone_mean)), " us mean before the sweep, ",
      static_cast<int>(std::lround(median(alone_after))), " us median after (slowdowns: against each "
      "case's own baseline); G = ", args.g_mib,
      " MiB bf16/rank, copies paced at ", static_cast<int>(args.nvlink_gbps), " GB/s (copy phase >= ",
      static_cast<int>(std::lround(expected_copy_us)), " us), pace flags in ",
      use_host_flags ? "host" : "device", " memory; ", args.repeats, " repeats pooled"));
  char head[300];
  std::snprintf(head, sizeof head, kTableHeader, "case (budget of the reduce)", "GEMM med", "GEMM mean",
                "RS alone", "RS loaded", "(n)", "vs ref", "reduce a/l us");
  final_lines.push_back(std::string(head, std::strlen(head) - 1));
  for (std::size_t i = 0; i < cases.size(); ++i)
    if (cases[i].budget == "default" || (cases[i].kind != "tide" && cases[i].kind != "reduce"))
      final_lines.push_back(format_row(cases[i], figs[i]));
  final_lines.push_back("-- trade-off front of the swept budgets (TIDE-RS rank model), by GEMM mean slowdown:");
  std::vector<std::size_t> front;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    if (cases[i].kind != "tide" || cases[i].budget == "default" || cases[i].rs_loaded_us.empty()) continue;
    bool dominated = false;
    for (std::size_t j = 0; j < cases.size(); ++j)
      if (j != i && cases[j].kind == "tide" && !cases[j].rs_loaded_us.empty() &&
          figs[j].slow_mean <= figs[i].slow_mean && figs[j].rs_loaded <= figs[i].rs_loaded &&
          (figs[j].slow_mean < figs[i].slow_mean || figs[j].rs_loaded < figs[i].rs_loaded))
        dominated = true;
    if (!dominated) front.push_back(i);
  }
  std::sort(front.begin(), front.end(), [&](std::size_t a, std::size_t b) { return figs[a].slow_mean < figs[b].slow_mean; });
  // At most 14 rows, never dropping one that meets the target.
  std::vector<std::size_t> shown;
  std::size_t meeting = 0;
  for (std::size_t i : front) meeting += figs[i].meets;
  std::size_t others = meeting >= 14 ? 0 : 14 - meeting;
  for (std::size_t i : front)
    if (figs[i].meets || others > 0) {
      if (!figs[i].meets) --others;
      shown.push_back(i);
    }
  for (std::size_t i : shown) final_lines.push_back(format_row(cases[i], figs[i]));
  int met = 0, met_alone = 0;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    met += figs[i].meets;
    // The RS's own cost of the budget: its unloaded time against the default's.
    met_alone += cases[i].kind == "tide" && figs[i].slow_mean <= 10.0 && ref_rs > 0 &&
                 figs[i].rs_alone <= 1.2 * ref_rs;
  }
  final_lines.push_back(detail::concat(
      "-- target: GEMM mean slowdown <= 10 % and loaded RS <= 1.2 x today's unloaded (", static_cast<int>(ref_rs),
      " us): ", met, " budget(s) meet it (rows marked TARGET MET). Set one with "
      "TIDE_CUDA_REDUCE_BUDGET=<budget> or CudaExecutor::set_reduce_budget."));
  final_lines.push_back(detail::concat(
      "-- with the RS unloaded instead (its time alone <= 1.2 x the default's): ", met_alone,
      " case(s) keep the GEMM mean slowdown <= 10 % (the default's own row among them if it does)."));
  for (const std::string& l : final_lines) append_row({"rank-final", l, 0, 0, 0, 0, 0, 0, 0, "-"});
  BCHECK(cudaStreamDestroy(fill));
}

}  // namespace

void validate_rank_interference(const Args& args) {
  if (args.g_mib < 8) throw std::runtime_error("--g-mib: expected >= 8");
  if (args.nvlink_gbps <= 0) throw std::runtime_error("--nvlink-gbps: expected > 0");
  if (args.pace_chunk_kib < 64) throw std::runtime_error("--pace-chunk-kib: expected >= 64");
  if (args.pace != "flags" && args.pace != "self")
    throw std::runtime_error("--pace " + args.pace + ": expected flags or self");
  if (args.nccl_ctas < 1) throw std::runtime_error("--nccl-ctas: expected >= 1");
  if (args.gemms < 20) throw std::runtime_error("--gemms: expected >= 20");
  if (args.repeats < 1) throw std::runtime_error("--repeats: expected >= 1");
  (void)make_cases(args);  // the sweep lists, through CudaReduceBudget::parse
}

bool run_rank_interference(const Args& args) {
  validate_rank_interference(args);
  // ~30 s expected; a stuck run is killed well inside an 8-minute device call.
  return fork_ranks(1, [&](int, Bootstrap&) { rank_interference_child(args); }, std::chrono::seconds(300));
}

void print_rank_interference_final() {
  std::vector<std::string> lines;
  for (const Row& r : read_rows())
    if (r.section == "rank-final") lines.push_back(r.label);
  if (lines.empty()) return;
  std::printf("\n==== rank-interference: one rank of W = 8 TIDE-RS on one GPU, beside the one-wave GEMM ====\n");
  for (const std::string& l : lines) std::printf("%s\n", l.c_str());
}

}  // namespace tide::bench
