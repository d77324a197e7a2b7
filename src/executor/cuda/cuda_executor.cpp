// The CUDA executor: the host executor's step semantics, enqueued on a stream. This file: the
// public API, the executor's life cycle, and the events, watched waits, streams and errors every
// part shares;
// cuda_executor_impl.hpp lists the files of the other parts (lowering, transports, watchdog).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <variant>

#include "cuda_executor_impl.hpp"
#include "tide/error.hpp"

namespace tide {

static_assert(static_cast<int>(DType::kBF16) == cuda_kernels::kBF16 &&
                  static_cast<int>(DType::kFP16) == cuda_kernels::kFP16 &&
                  static_cast<int>(DType::kFP32) == cuda_kernels::kFP32 &&
                  static_cast<int>(DType::kE4M3) == cuda_kernels::kE4M3,
              "kernel element types must be numbered as tide::DType");

using namespace cuda_executor_detail;

// ---- The executor. -------------------------------------------------------------------------

CudaExecutor::Impl::Impl(CudaWindow& w, void* s, std::chrono::milliseconds t, NcclComm* n)
    : window(w), stream(static_cast<cudaStream_t>(s)), timeout(t), network(n),
      api(cuda_detail::driver_api()) {
  const char* batch = std::getenv("TIDE_CUDA_BATCH_COPY");
  if (batch && std::string(batch) == "0") batch_copies = false;
  const char* fuse = std::getenv("TIDE_CUDA_FUSED_HANDSHAKE");
  if (fuse && std::string(fuse) == "0") fuse_handshake = false;
}

cudaEvent_t CudaExecutor::Impl::take_event() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void CudaExecutor::Impl::recycle_events(const std::vector<cudaEvent_t>& events) {
  std::lock_guard<std::mutex> lock(mutex);
  free_events.insert(free_events.end(), events.begin(), events.end());
}

void CudaExecutor::Impl::use_stream(cudaStream_t s) {
  if (std::find(streams_used.begin(), streams_used.end(), s) == streams_used.end())
    streams_used.push_back(s);
}

PendingWait CudaExecutor::Impl::new_wait(PendingWait::Kind kind, cudaStream_t on, uint64_t epoch,
                                         uint64_t tag, int peer, Phase phase, bool captured) {
  PendingWait record;
  record.id = WaitMarks::next_id();
  {
    std::lock_guard<std::mutex> lock(mutex);
    record.slot = marks->slot_of(on, captured);
    if (captured) hold_captured_slot(record.slot);
  }
  record.kind = kind, record.epoch = epoch, record.tag = tag, record.peer = peer;
  record.phase = phase, record.captured = captured, record.graph = captured ? capture : 0;
  return record;
}

CUstreamBatchMemOpParams CudaExecutor::Impl::mark(const PendingWait& w, bool passed) const {
  return write_value(passed ? marks->passed_address(w.slot) : marks->reached_address(w.slot), w.id);
}

void CudaExecutor::Impl::enqueue_mark(cudaStream_t on, const PendingWait& w, bool passed) {
  CUstreamBatchMemOpParams op = mark(w, passed);
  TIDE_CU_CHECK(api.stream_batch_mem_op(on, 1, &op, 0));
}

void CudaExecutor::Impl::watch(PendingWait&& record) {
  bool asleep = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (record.captured) {
      const int slot = record.slot;
      if (std::none_of(captured_slots.begin(), captured_slots.end(),
                       [&](const CapturedSlot& c) { return c.slot == slot; }))
        captured_slots.push_back({slot, 0, 0, cuda_executor_detail::Clock::now()});
      captured.push_back(std::move(record));
    } else {
      marks->hold(record.slot);
      pending.push_back(std::move(record));
    }
    asleep = watchdog_asleep;
  }
  // A watchdog that is still polling finds the record within 1 ms: no futex wake on every run.
  if (asleep) wake.notify_one();
}

void CudaExecutor::Impl::retire(const PendingWait& w) { marks->release(w.slot); }

void CudaExecutor::Impl::throw_if_failed() {
  if (watchdog_dead.load() || failed.load()) {
    std::lock_guard<std::mutex> lock(mutex);
    if (error) std::rethrow_exception(error);
  }
}

// Waits for `s` without blocking in the driver, so a dead watchdog cannot leave us hanging.
void CudaExecutor::Impl::wait_stream(cudaStream_t s) {
  for (int spin = 0;; ++spin) {
    const cudaError_t status = cudaStreamQuery(s);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) TIDE_CUDA_CHECK(status);
    if (watchdog_dead.load()) throw_if_failed();
    if (spin < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void CudaExecutor::Impl::collect_timings() {
  for (const KernelTiming& t : timings) {
    float ms = 0;
    TIDE_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.end));
    double& cta_us = t.kind == KernelKind::kCast      ? stats.cast_cta_us
                     : t.kind == KernelKind::kReduce  ? stats.reduce_cta_us
                     : t.kind == KernelKind::kCopy    ? stats.copy_cta_us
                     : t.kind == KernelKind::kCastToPeers ? stats.cast_to_peers_cta_us
                                                      : stats.network_cta_us;
    cta_us += 1000.0 * ms * t.ctas;
    (void)cudaEventDestroy(t.start);
    (void)cudaEventDestroy(t.end);
  }
  timings.clear();
}

CudaExecutor::CudaExecutor(CudaWindow& window, void* stream, std::chrono::milliseconds timeout,
                           NcclComm* network)
    : impl_(std::make_unique<Impl>(window, stream, timeout, network)) {
  TIDE_CHECK_ARG(!window.has_executor_.exchange(true), "CudaExecutor", "window",
                 detail::concat("rank ", window.rank(), "'s window, which has an executor"),
                 "a window without one (one executor per window: its collectives share the "
                 "window's slots and flags, so they run one at a time)");
  try {
    TIDE_CHECK_ARG(timeout.count() > 0, "CudaExecutor", "timeout_ms", timeout.count(), "> 0");
    if (network) {
      TIDE_CHECK_ARG(network->world() == window.world() && network->rank() == window.rank(),
                     "CudaExecutor", "network",
                     detail::concat("rank ", network->rank(), " of ", network->world()),
                     detail::concat("rank ", window.rank(), " of ", window.world(),
                                    " (the window's: NCCL rank i must be TIDE rank i)"));
      TIDE_CHECK_ARG(network->device() == window.device(), "CudaExecutor", "network device",
                     network->device(), detail::concat(window.device(), " (the window's device)"));
    }
    int device = 0;
    TIDE_CUDA_CHECK(cudaGetDevice(&device));
    TIDE_CHECK_ARG(device == window.device(), "CudaExecutor", "current device", device,
                   detail::concat(window.device(), " (the window's device)"));
    cuda_kernels::preload_kernels();
    // Reads TIDE_CUDA_CTAS_PER_SM now: a bad value must not first throw mid-collective.
    cuda_kernels::default_max_ctas();
    impl_->marks.emplace();
    TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&impl_->side_stream, cudaStreamNonBlocking));
    impl_->staging.resize(static_cast<std::size_t>(kNumFlagKinds) * window.world());
    impl_->streams_used.push_back(impl_->stream);
    impl_->watchdog = std::thread([impl = impl_.get()] { impl->watchdog_loop(); });
  } catch (...) {
    window.has_executor_ = false;
    throw;
  }
}

CudaExecutor::~CudaExecutor() {
  Impl& d = *impl_;
  bool drained = true;
  for (cudaStream_t s : d.streams_used) {
    try {
      d.wait_stream(s);
    } catch (...) {
      // Destructors do not throw; synchronize() is where errors are reported.
      drained = false;
    }
  }
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    d.stop = true;
  }
  d.wake.notify_all();
  d.watchdog.join();
  for (const PendingWait& w : d.pending) d.retire(w);
  // A stream that did not drain may still write its marks: that block must not serve another
  // executor, whose waits would read this one's late (smaller) ids.
  if (!drained || d.watchdog_dead) d.marks->abandon();
  for (cudaEvent_t e : d.free_events) (void)cudaEventDestroy(e);
  if (d.net_ready) (void)cudaEventDestroy(d.net_ready);
  if (d.net_stream) (void)cudaStreamDestroy(d.net_stream);
  for (cudaStream_t s : d.peer_streams) (void)cudaStreamDestroy(s);
  for (const KernelTiming& t : d.timings) {
    (void)cudaEventDestroy(t.start);
    (void)cudaEventDestroy(t.end);
  }
  (void)cudaStreamDestroy(d.side_stream);
  (void)cudaGetLastError();
  d.window.has_executor_ = false;
}

int CudaExecutor::rank() const { return impl_->window.rank(); }
int CudaExecutor::world() const { return impl_->window.world(); }
void* CudaExecutor::stream() const { return impl_->stream; }

void CudaExecutor::set_stream(void* stream) {
  impl_->stream = static_cast<cudaStream_t>(stream);
  impl_->use_stream(impl_->stream);
}

std::string CudaExecutor::capture_refusal(const Program& program) {
  for (const Step& step : program.steps)
    if (std::holds_alternative<NetSendOp>(step.op) || std::holds_alternative<NetRecvOp>(step.op))
      return "an across-node program (its network transfers count sends on the host, and NCCL "
             "groups and IPC mailboxes run on streams of their own): run it uncaptured";
  return "";
}

uint64_t cuda_capture_id(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  const cudaError_t error =
      cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &id);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // the legacy stream answers an error while another stream captures
    throw InvalidArgument(detail::concat(
        "cuda_capture_id: stream: the legacy stream while another stream captures (",
        cudaGetErrorString(error), "); expected a stream of its own"));
  }
  return status == cudaStreamCaptureStatusActive ? static_cast<uint64_t>(id) : 0;
}

void CudaExecutor::run(const Program& program, const Bindings& bindings) {
  impl_->run(program, bindings, impl_->one_shot, /*reuse=*/false);
}

PreparedProgram::PreparedProgram(uint64_t owner, Program program)
    : owner_(owner), program_(std::move(program)), lowered_(std::make_unique<Lowered>()) {}

PreparedProgram::~PreparedProgram() = default;

std::unique_ptr<PreparedProgram> CudaExecutor::prepare(const Program& program) const {
  return std::unique_ptr<PreparedProgram>(new PreparedProgram(impl_->serial, program));
}

void CudaExecutor::run(PreparedProgram& prepared, const Bindings& bindings) {
  TIDE_CHECK_ARG(prepared.owner_ == impl_->serial, "CudaExecutor::run", "prepared",
                 "a program prepared by another executor",
                 "one of this executor's (its lowering holds this executor's window addresses)");
  PreparedProgram::Lowered& lowered = *prepared.lowered_;
  const bool reuse = lowered.valid && lowered.bindings.inputs == bindings.inputs &&
                     lowered.bindings.outputs == bindings.outputs;
  if (reuse)  // validate_run is skipped: the scales, which the pointers above do not cover
    for (const int param : lowered.scaled_params)
      TIDE_CHECK_ARG(static_cast<std::size_t>(param) < bindings.scales.size() && bindings.scales[param],
                     "Executor::run", detail::concat("scales[", param, "]"), "missing",
                     "the fp32 scale of the param's e4m3 cast");
  impl_->run(prepared.program_, bindings, lowered, reuse);
}

void CudaExecutor::synchronize() {
  Impl& d = *impl_;
  try {
    for (cudaStream_t s : d.streams_used) d.wait_stream(s);
  } catch (const SystemError&) {
    // A CUDA error after a wait timed out (say, a copy into a dead peer's memory) is a
    // consequence; the watchdog's error names the cause.
    d.throw_if_failed();
    throw;
  }
  d.streams_used.assign(1, d.stream);
  d.collect_timings();
  d.throw_if_failed();
  if (d.network) d.network->check_async();
}

void CudaExecutor::enable_stats(bool enabled) { impl_->stats_enabled = enabled; }

CudaExecutor::Stats CudaExecutor::stats() {
  Impl& d = *impl_;
  for (cudaStream_t s : d.streams_used) d.wait_stream(s);
  d.collect_timings();
  return d.stats;
}

void CudaExecutor::reset_stats() { impl_->stats = Stats{}; }

}  // namespace tide
