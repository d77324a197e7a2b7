// The CUDA executor's lowering: a program's steps -> operations on the compute stream. Which steps
// share a driver call, and which copies go where, is decided without CUDA by lowering::lower
// (command_list.cpp, testable on CPU); this file issues its commands.
//
//   CopyBatch  -> cudaMemcpyBatchAsync (copy engines preferred, source in stream order);
//                 one cudaMemcpyAsync per copy where batches are unavailable; 2-D copies (rows > 1)
//                 one cudaMemcpy2DAsync each (copy engines; the batch API is 1-D only), and so
//                 runs of equal copies at one pitch (equal params: one operation, not one each).
//                 More 1-D copies under kMinEngineCopyBytes than kMaxEngineCopies left after
//                 that: one copy kernel (SM stores), as the copy engines cost the host
//                 microseconds per copy; the larger ones stay on the engines.
//   CastOp     -> equal types: copies placed as a CopyBatch's + cudaMemsetAsync of the pad (no kernel), or a
//                 cudaMemcpy2DAsync for a strided destination; otherwise one cast kernel for all
//                 consecutive CastOps (strided destinations included).
//   SignalOp   -> a write of the tag, then of the epoch, into the peer's FlagWord (each write is
//                 preceded by a memory barrier: the data before it is visible first).
//   WaitOp     -> wait(epoch >= e), then wait(tag == t): a peer that runs another collective
//                 blocks the stream instead of feeding it wrong data, and the watchdog reports
//                 DesyncError.
//                 Consecutive signals and waits go in one cuStreamBatchMemOp (its operations run
//                 in array order), their waits between the two marks the watchdog reads
//                 (wait_marks.hpp): a driver call costs the host microseconds, and at W = 2 a
//                 collective makes 4 (the cast or reduce, the push, two of these).
//   ReduceOp   -> one reduce kernel for consecutive ReduceOps with as many sources each, none
//                 reading or writing what an earlier one of the kernel writes (up to a launch's
//                 table: 584 of 2 sources, kernels.cuh).
//   The tail of a Delivery::kCastToPeers program (its casts and copies, signals, waits and
//                 reduces after the slot-free handshake) -> one cast-to-peers kernel (kernels.cuh), where
//                 the window's peers can run kernels beside this rank's (CudaWindow::
//                 peers_run_beside_own), the tail fits one
//                 launch and TIDE_CUDA_CAST_TO_PEERS is not 0; the steps above otherwise.
//   NetSendOp/NetRecvOp -> grouped on a network stream, as the group schedule
//                 (src/executor/net/group_schedule.hpp) says: issued after the stream reaches the
//                 group's last op, waited for only by steps that touch its bytes; over NCCL
//                 (nccl_transport.cpp) or, without a communicator on a CudaWindowScope::kHost window,
//                 over CUDA IPC (ipc_transport.cpp).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdlib>
#include <optional>
#include <string>
#include <variant>

#include "cuda_executor_impl.hpp"
#include "executor/resolve.hpp"
#include "tide/error.hpp"

namespace tide {

using namespace cuda_executor_detail;

// A run on a stream being captured into a CUDA graph is recorded with host values that every
// replay repeats, so its flags carry kCapturedEpoch instead of the window's epoch (met on
// equality, cleared by the wait) and nothing in it reads the host. What cannot be recorded so is
// refused before anything moves.
bool CudaExecutor::Impl::check_capture(const Program& program) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t error = cudaStreamIsCapturing(stream, &status);
  if (error == cudaSuccess && status == cudaStreamCaptureStatusNone) return false;
  (void)cudaGetLastError();  // the legacy stream answers an error while another stream captures
  TIDE_CHECK_ARG(error == cudaSuccess, "CudaExecutor::run", "stream",
                 "the legacy stream during a capture", "a stream of its own");
  TIDE_CHECK_ARG(status == cudaStreamCaptureStatusActive, "CudaExecutor::run", "stream",
                 "a capture that was invalidated by an earlier error", "an active capture");
  const std::string refusal = CudaExecutor::capture_refusal(program);
  TIDE_CHECK_ARG(refusal.empty(), "CudaExecutor::run", "program (stream capturing a CUDA graph)",
                 refusal, "a single-node program");
  return true;
}

void CudaExecutor::Impl::run(const Program& program, const Bindings& bindings,
                             PreparedProgram::Lowered& lowered, bool reuse) {
  const bool captured = check_capture(program);
  reuse = reuse && lowered.captured == captured;  // a capture lowers the slot-free head unfused
  if (!reuse) {
    lowered.valid = false;
    validate_run(program, bindings, window.rank(), window.world(), window.data_bytes(),
                 window.data(window.rank()),
                 /*net_supported=*/network != nullptr || window.scope() == CudaWindowScope::kHost);
  }
  throw_if_failed();
  const uint64_t epoch = window.next_epoch();
  // Past this point the window's epoch and network counters have moved: a failure while
  // enqueuing leaves this executor out of step with its peers, so it fails for good.
  try {
    capturing = captured;  // the lowering reads it (cast_to_peers_split)
    if (!reuse) {
      lower(program, bindings, lowered);
      lowered.captured = captured;
      if (&lowered != &one_shot) lowered.bindings = bindings;  // a one-shot lowering is not reused
      lowered.valid = true;
      ++stats.lowerings;
    }
    if (captured) adopt_capture();
    enqueue_program(program, bindings, lowered, captured ? kCapturedEpoch : epoch, program.tag());
    capturing = false;
  } catch (...) {
    capturing = false;
    lowered.valid = false;
    store_error(std::current_exception());
    throw;
  }
}

void CudaExecutor::Impl::lower(const Program& program, const Bindings& bindings,
                               PreparedProgram::Lowered& out) {
  const std::vector<Step>& steps = program.steps;
  out.has_net = false;
  out.scaled_params.clear();
  for (const Step& step : steps) {
    out.has_net |= std::holds_alternative<NetSendOp>(step.op) || std::holds_alternative<NetRecvOp>(step.op);
    if (const auto* cast = std::get_if<CastOp>(&step.op); cast && is_scaled(cast->dst_dtype))
      out.scaled_params.push_back(cast->src.index);
  }
  if (out.has_net) {
    out.schedule = net::schedule_groups(program);
    if (!net_ready) TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&net_ready, cudaEventDisableTiming));
  }
  if (window_data.empty())
    for (int r = 0; r < window.world(); ++r) window_data.push_back(window.data(r));
  const lowering::LoweringContext context{&window_data, out.has_net ? &out.schedule : nullptr,
                                          out.has_net ? steps.size() : cast_to_peers_start(program)};
  lowering::lower(program, bindings, context, out.commands);
  // The reduce and copy kernels' tables, built once for these pointers.
  out.launches.clear();
  out.launches.resize(out.commands.commands.size());
  for (std::size_t k = 0; k < out.commands.commands.size(); ++k) {
    const lowering::Command& c = out.commands.commands[k];
    if (c.kind == lowering::CommandKind::kReduceKernel)
      out.launches[k] = reduce_launches(out.commands, c);
    else if (c.kind == lowering::CommandKind::kCopyKernel)
      out.launches[k] = copy_launches(out.commands.copies, c.first, c.count);
  }
}

void CudaExecutor::Impl::enqueue_program(const Program& program, const Bindings& bindings,
                                         const PreparedProgram::Lowered& lowered, uint64_t epoch,
                                         uint64_t tag) {
  const Resolve resolve = [&](const Address& a) {
    return detail::resolve_address(a, bindings, [&](int r) { return window.data(r); });
  };
  const std::vector<Step>& steps = program.steps;
  const net::GroupSchedule& schedule = lowered.schedule;
  const lowering::CommandList& list = lowered.commands;
  std::vector<cudaEvent_t> group_done;  // this run's groups, in issue order
  for (std::size_t k = 0; k < list.commands.size(); ++k) {
    const lowering::Command& c = list.commands[k];
    switch (c.kind) {
      case lowering::CommandKind::kNetActions:  // the schedule's issues and waits before step c.step
        for (int g : schedule.issue_before[c.step])
          group_done.push_back(issue_group(schedule.groups[g], program, resolve, epoch, tag,
                                           steps[schedule.groups[g].ops.back()].phase));
        if (schedule.wait_before[c.step] >= 0)
          TIDE_CUDA_CHECK(cudaStreamWaitEvent(stream, group_done[schedule.wait_before[c.step]], 0));
        break;
      case lowering::CommandKind::kCastToPeers:
        enqueue_cast_to_peers(steps, c.step, cast_to_peers_split(program).tail, resolve, bindings,
                              epoch, tag);
        break;
      case lowering::CommandKind::kCasts: enqueue_casts(steps, c.step, c.end, resolve, bindings); break;
      case lowering::CommandKind::kReduceKernel:
        run_launches(lowered.launches[k], KernelKind::kReduce);
        break;
      case lowering::CommandKind::kCopy2D: {
        const lowering::Copy2D& copy = list.copies_2d[c.first];
        enqueue_copy_2d(copy.dst, copy.dst_pitch, copy.src, copy.src_pitch, copy.width, copy.rows);
        stats.copies_coalesced += static_cast<int>(copy.merged);
        break;
      }
      case lowering::CommandKind::kEngineCopies: enqueue_engine_copies(list.copies, c.first, c.count); break;
      case lowering::CommandKind::kCopyKernel:
        run_launches(lowered.launches[k], KernelKind::kCopy);
        stats.copies_by_kernel += static_cast<int>(c.count);
        break;
      case lowering::CommandKind::kFlagOps: enqueue_flag_ops(steps, c.step, c.end, epoch, tag); break;
      case lowering::CommandKind::kNetStep:
        // The step's group is issued with the schedule's actions; it waits for the compute
        // stream to get here.
        TIDE_CUDA_CHECK(cudaEventRecord(net_ready, stream));
        break;
    }
  }
  recycle_events(group_done);  // every wait on them is enqueued (waits capture the record)
}

namespace {

bool cast_to_peers_enabled() {
  static const bool enabled = [] {
    const char* text = std::getenv("TIDE_CUDA_CAST_TO_PEERS");
    return !(text && std::string(text) == "0");
  }();
  return enabled;
}

}  // namespace

// Where the cast-to-peers kernel takes over: the first step of the program's tail of stores (contiguous
// casts, 1-D copies), signals, waits and reduces, when the program and the executor allow it
// (lowering's header); steps.size() otherwise.
std::size_t CudaExecutor::Impl::cast_to_peers_start(const Program& program) const {
  return cast_to_peers_split(program).head;
}

// {head, tail}: the kernel runs steps [head, size); [head, tail) is its fused slot-free handshake
// (empty when not fused), from tail on its stores, data-ready handshake and reduces. Both
// steps.size() when the program has no such tail.
CudaExecutor::Impl::CastToPeersSplit CudaExecutor::Impl::cast_to_peers_split(const Program& program) const {
  const std::vector<Step>& steps = program.steps;
  const CastToPeersSplit none{steps.size(), steps.size()};
  if (program.delivery != Delivery::kCastToPeers || !window.peers_run_beside_own() ||
      !cast_to_peers_enabled())
    return none;
  std::size_t k = steps.size(), reduces = 0, sources = 0;
  for (; k > 0; --k) {
    const auto* reduce = std::get_if<ReduceOp>(&steps[k - 1].op);
    if (!reduce || reduce->partial || (reduces > 0 && reduce->sources.size() != sources)) break;
    sources = reduce->sources.size();
    ++reduces;
  }
  int waits = 0, signals = 0;
  for (; k > 0 && std::holds_alternative<WaitOp>(steps[k - 1].op); --k) ++waits;
  for (; k > 0 && std::holds_alternative<SignalOp>(steps[k - 1].op); --k) ++signals;
  if (waits == 0 || signals == 0) return none;
  std::size_t casts = 0, copies = 0;
  for (; k > 0; --k) {
    const Step& step = steps[k - 1];
    if (const auto* cast = std::get_if<CastOp>(&step.op)) {
      if (cast->rows > 1) return none;
      ++(cast->src_dtype == cast->dst_dtype ? copies : casts);
    } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
      for (const CopyOp& c : batch->copies) {
        if (c.rows > 1) return none;
        ++copies;
      }
    } else {
      break;
    }
  }
  if (!cuda_kernels::cast_to_peers_fits(casts, copies, signals, waits, reduces, static_cast<int>(sources)))
    return none;
  // The slot-free handshake before the stores (its signals to every peer, then its waits): the
  // kernel's head as well, where it is fused (one launch and no memop call per collective). Not
  // in a capture: replays of the fused kernel took 68-77 us where the memop head's took 24-38 us
  // (one H200, ranks as threads, BENCHMARKS.md's breakdown), cudaGraphLaunch itself taking ~77 us.
  if (!fuse_handshake || capturing) return {k, k};
  std::size_t head = k;
  int free_waits = 0, free_signals = 0;
  auto slot_free = [](const auto* op) { return op && op->kind == FlagKind::kSlotFree; };
  for (; head > 0 && slot_free(std::get_if<WaitOp>(&steps[head - 1].op)); --head) ++free_waits;
  for (; head > 0 && slot_free(std::get_if<SignalOp>(&steps[head - 1].op)); --head) ++free_signals;
  const bool fused = free_waits > 0 && free_signals > 0 && free_waits <= cuda_kernels::kCastToPeersPeers &&
                     free_signals <= cuda_kernels::kCastToPeersPeers;
  return {fused ? head : k, k};
}

// The tail from `first` on (cast_to_peers_start) as one cast-to-peers kernel: its stores, its signals, its
// waits as one watched record (the kernel writes the marks), its reduces.
// The scale a cast multiplies by: its param's bound scale for a kE4M3 destination (validate_run
// checked it is there), none otherwise.
static const float* scale_of(const CastOp& cast, const Bindings& bindings) {
  return is_scaled(cast.dst_dtype) ? bindings.scales[cast.src.index] : nullptr;
}

void CudaExecutor::Impl::enqueue_cast_to_peers(const std::vector<Step>& steps, std::size_t first,
                                         std::size_t tail, const Resolve& resolve, const Bindings& bindings,
                                         uint64_t epoch, uint64_t tag) {
  const int rank = window.rank(), world = window.world();
  std::vector<cuda_kernels::CastSpec> casts;
  std::vector<cuda_kernels::CopySpec> copies;
  std::vector<const void*> sources;  // filled before the specs point into it
  std::vector<std::size_t> reduce_steps;
  cuda_kernels::CastToPeersSpec spec;
  spec.epoch = epoch, spec.tag = tag, spec.equal = capturing;
  spec.arrivals = window.arrivals();
  spec.ranks_on_gpu = window.ranks_on_gpu();
  std::optional<PendingWait> head_record, record;  // the fused slot-free waits', the others'
  for (std::size_t i = first; i < steps.size(); ++i) {
    const Step& step = steps[i];
    if (const auto* cast = std::get_if<CastOp>(&step.op)) {
      std::byte* dst = resolve(cast->dst);
      const void* src = cast->count > 0 ? resolve(cast->src) : nullptr;
      const std::size_t size = dtype_size(cast->dst_dtype);
      if (cast->src_dtype == cast->dst_dtype)  // bits as they are, like the copy it lowers to
        copies.push_back({src, dst, static_cast<std::size_t>(cast->count) * size,
                          static_cast<std::size_t>(cast->pad) * size});
      else
        casts.push_back({src, dst, cast->count, cast->pad, element_type(cast->src_dtype),
                         element_type(cast->dst_dtype), 1, 0, scale_of(*cast, bindings)});
    } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
      for (const CopyOp& c : batch->copies)
        if (c.bytes > 0) copies.push_back({resolve(c.src), resolve(c.dst), c.bytes});
    } else if (const auto* signal = std::get_if<SignalOp>(&step.op)) {
      // Steps before `tail`: the fused slot-free handshake (cast_to_peers_split).
      FlagWord* flag = window.flags(signal->peer) + flag_index(signal->kind, rank, world);
      if (i < tail)
        spec.free_signals[spec.num_free_signals++] = &flag->epoch;
      else
        spec.signals[spec.num_signals++] = &flag->epoch;
    } else if (const auto* wait = std::get_if<WaitOp>(&step.op)) {
      // Two watched records, as two memop calls would be: the watchdog names the handshake that
      // is stuck.
      std::optional<PendingWait>& r = i < tail ? head_record : record;
      if (!r) r = new_wait(PendingWait::Kind::kFlag, stream, epoch, tag, -1, step.phase, capturing);
      FlagWord* flag = window.flags(rank) + flag_index(wait->kind, wait->peer, world);
      if (i < tail)
        spec.free_waits[spec.num_free_waits++] = &flag->epoch;
      else
        spec.waits[spec.num_waits++] = &flag->epoch;
      r->flags.push_back({flag, wait->kind, wait->peer, step.phase});
    } else {
      const ReduceOp& reduce = std::get<ReduceOp>(step.op);
      for (const Address& a : reduce.sources) sources.push_back(resolve(a));
      reduce_steps.push_back(i);
    }
  }
  std::vector<cuda_kernels::ReduceSpec> reduces;
  for (std::size_t k = 0; k < reduce_steps.size(); ++k) {
    const ReduceOp& reduce = std::get<ReduceOp>(steps[reduce_steps[k]].op);
    spec.num_sources = static_cast<int>(reduce.sources.size());
    reduces.push_back({sources.data() + k * reduce.sources.size(), resolve(reduce.dst), nullptr,
                       reduce.count, reduce.prescale, reduce.scale, reduce.accumulate,
                       element_type(reduce.src_dtype), element_type(reduce.dst_dtype)});
  }
  spec.casts = casts.data(), spec.num_casts = casts.size();
  spec.copies = copies.data(), spec.num_copies = copies.size();
  spec.reduces = reduces.data(), spec.num_reduces = reduces.size();
  if (record) {
    spec.reached = reinterpret_cast<uint64_t*>(marks->reached_address(record->slot));
    spec.passed = reinterpret_cast<uint64_t*>(marks->passed_address(record->slot));
    spec.wait_id = record->id;
  }
  if (head_record) spec.free_wait_id = head_record->id;  // the same stream: the same slot
  // A captured kernel resets the flags it waited on itself (kernels.cuh): no clear follows it.
  launch_timed(KernelKind::kCastToPeers, stream, [&] { return cuda_kernels::launch_cast_to_peers(spec, stream); });
  ++stats.cast_to_peers_kernels;
  if (head_record) watch(std::move(*head_record));
  if (record) watch(std::move(*record));
}

// Consecutive casts write disjoint slots: same-type ones become one copy batch (+ memsets of their
// pads), the rest one kernel.
void CudaExecutor::Impl::enqueue_casts(const std::vector<Step>& steps, std::size_t first,
                                       std::size_t end, const Resolve& resolve,
                                       const Bindings& bindings) {
  std::vector<cuda_kernels::CastSpec> casts;
  cast_copies.clear();  // the same-type casts' copies
  for (std::size_t i = first; i < end; ++i) {
    const CastOp& cast = std::get<CastOp>(steps[i].op);
    std::byte* dst = resolve(cast.dst);
    const std::size_t dst_size = dtype_size(cast.dst_dtype);
    if (cast.rows > 1 && cast.src_dtype == cast.dst_dtype) {  // a strided block, no padding
      if (cast.count > 0)
        enqueue_copy_2d(dst, cast.dst_pitch, resolve(cast.src), cast.count * dst_size,
                        cast.count * dst_size, static_cast<std::size_t>(cast.rows));
    } else if (cast.src_dtype == cast.dst_dtype) {
      if (cast.count > 0)
        cast_copies.push_back({resolve(cast.src), dst, static_cast<std::size_t>(cast.count) * dst_size});
      if (cast.pad > 0)
        TIDE_CUDA_CHECK(cudaMemsetAsync(dst + cast.count * dst_size, 0, cast.pad * dst_size, stream));
    } else {
      casts.push_back({cast.count > 0 ? resolve(cast.src) : nullptr, dst, cast.count, cast.pad,
                       element_type(cast.src_dtype), element_type(cast.dst_dtype), cast.rows,
                       static_cast<int64_t>(cast.dst_pitch / dst_size), scale_of(cast, bindings)});
    }
  }
  const std::size_t all = cast_copies.size();
  const std::size_t kernel = lowering::kernel_copies(cast_copies, 0);
  if (kernel > 0) {
    run_launches(copy_launches(cast_copies, 0, kernel), KernelKind::kCopy);
    stats.copies_by_kernel += static_cast<int>(kernel);
  }
  if (all > kernel) enqueue_engine_copies(cast_copies, kernel, all - kernel);
  if (!casts.empty())
    launch_timed(KernelKind::kCast, stream, [&] {
      return cuda_kernels::launch_casts(casts.data(), casts.size(), 0, stream);
    });
}

// The reduces of one kernel (command_list.cpp batched them), their tables built.
cuda_kernels::Launches CudaExecutor::Impl::reduce_launches(const lowering::CommandList& list,
                                                           const lowering::Command& c) {
  reduce_specs.clear();
  for (std::size_t k = c.first; k < c.first + c.count; ++k) {
    const lowering::Reduce& r = list.reduces[k];
    reduce_specs.push_back({list.sources.data() + r.first_source, r.dst, r.partial, r.count,
                            r.prescale, r.scale, r.accumulate, element_type(r.src_dtype),
                            element_type(r.dst_dtype), element_type(r.partial_dtype)});
  }
  return cuda_kernels::reduce_launches(reduce_specs.data(), reduce_specs.size(), c.num_sources, 0);
}

// copies[first, first + count) as one copy kernel (SM stores), its table built.
cuda_kernels::Launches CudaExecutor::Impl::copy_launches(const std::vector<lowering::Copy>& copies,
                                                         std::size_t first, std::size_t count) {
  copy_specs.clear();
  for (std::size_t k = first; k < first + count; ++k) {
    const lowering::Copy& c = copies[k];
    copy_specs.push_back({c.src, c.dst, c.bytes});
  }
  return cuda_kernels::copy_launches(copy_specs.data(), copy_specs.size());
}

void CudaExecutor::Impl::run_launches(const cuda_kernels::Launches& launches, KernelKind kind) {
  launch_timed(kind, stream, [&] { return launches.run(stream); });
}

// copies[first, first + count) in one cudaMemcpyBatchAsync (copy engines preferred, source in
// stream order); one cudaMemcpyAsync each where batches are unavailable.
void CudaExecutor::Impl::enqueue_engine_copies(const std::vector<lowering::Copy>& copies,
                                               std::size_t first, std::size_t count) {
  batch_dsts.clear(), batch_srcs.clear(), batch_sizes.clear();
  for (std::size_t k = first; k < first + count; ++k) {
    const lowering::Copy& c = copies[k];
    batch_dsts.push_back(c.dst), batch_srcs.push_back(c.src), batch_sizes.push_back(c.bytes);
  }
  stats.copies += static_cast<int>(count);
#if CUDART_VERSION >= 12080
  // cudaMemcpyBatchAsync has no graph node: a captured run copies one cudaMemcpyAsync each.
  if (batch_copies && !capturing && stream != nullptr && stream != cudaStreamLegacy) {
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;  // keep SMs free: copy engines
    std::size_t attribute_index = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t status = cudaMemcpyBatchAsync(batch_dsts.data(), batch_srcs.data(),
                                                    batch_sizes.data(), count, &attributes,
                                                    &attribute_index, 1, stream);
#else
    std::size_t fail_index = 0;
    const cudaError_t status = cudaMemcpyBatchAsync(batch_dsts.data(), batch_srcs.data(),
                                                    batch_sizes.data(), count, &attributes,
                                                    &attribute_index, 1, &fail_index, stream);
#endif
    if (status == cudaSuccess) return;
    // Unsupported here (driver, stream kind): fall back for good. A real addressing error
    // shows up again, with its own message, in cudaMemcpyAsync below.
    (void)cudaGetLastError();
    batch_copies = false;
  }
#endif
  for (std::size_t i = 0; i < count; ++i)
    TIDE_CUDA_CHECK(cudaMemcpyAsync(batch_dsts[i], batch_srcs[i], batch_sizes[i],
                                    cudaMemcpyDeviceToDevice, stream));
  stats.single_copy_calls += static_cast<int>(count);
}

// A 2-D copy (a block of a param sharded on a dim > 0) on a copy engine. cudaMemcpyBatchAsync
// takes 1-D copies only, so each is its own call.
void CudaExecutor::Impl::enqueue_copy_2d(void* dst, std::size_t dst_pitch, const void* src,
                                         std::size_t src_pitch, std::size_t width, std::size_t rows) {
  TIDE_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows,
                                    cudaMemcpyDeviceToDevice, stream));
  ++stats.copies;
  ++stats.copies_2d;
}

namespace {

CUdeviceptr address(uint64_t* word) { return reinterpret_cast<CUdeviceptr>(word); }

}  // namespace

// Consecutive signals and waits (the slot-free signals to every peer and the wait for the
// first; a data-ready signal and the next wait; the data-ready waits at the end) in one
// cuStreamBatchMemOp: per signal the tag, then the epoch, into the peer's FlagWord; per wait
// epoch >= e, then tag == t, on the own one. The waits of the call are one watched record, marked
// reached before the first and passed after the last.
void CudaExecutor::Impl::enqueue_flag_ops(const std::vector<Step>& steps, std::size_t first,
                                          std::size_t end, uint64_t epoch, uint64_t tag) {
  const int rank = window.rank(), world = window.world();
  // On the stack: no allocation per run. command_list.cpp left room for the two marks.
  std::array<CUstreamBatchMemOpParams, lowering::kMaxMemOps> ops;
  std::size_t count = 0;
  std::optional<PendingWait> record;
  for (std::size_t i = first; i < end; ++i) {
    if (const auto* signal = std::get_if<SignalOp>(&steps[i].op)) {
      FlagWord* flag = window.flags(signal->peer) + flag_index(signal->kind, rank, world);
      ops[count++] = write_value(address(&flag->tag), tag);
      ops[count++] = write_value(address(&flag->epoch), epoch);
    } else if (const auto* wait = std::get_if<WaitOp>(&steps[i].op)) {
      if (!record) {
        record = new_wait(PendingWait::Kind::kFlag, stream, epoch, tag, -1, steps[i].phase, capturing);
        ops[count++] = mark(*record, /*passed=*/false);
      }
      FlagWord* flag = window.flags(rank) + flag_index(wait->kind, wait->peer, world);
      ops[count++] = capturing ? wait_eq(&flag->epoch, epoch) : wait_geq(&flag->epoch, epoch);
      ops[count++] = wait_eq(&flag->tag, tag);
      record->flags.push_back({flag, wait->kind, wait->peer, steps[i].phase});
    }
  }
  if (record) ops[count++] = mark(*record, /*passed=*/true);
  if (record && capturing)  // met: cleared, so the next replay waits for the next signal
    for (const AwaitedFlag& f : record->flags) ops[count++] = write_value(address(&f.flag->epoch), 0);
  TIDE_CU_CHECK(api.stream_batch_mem_op(stream, static_cast<unsigned>(count), ops.data(), 0));
  ++stats.mem_op_calls;
  if (record) watch(std::move(*record));
}

// Enqueues a group's sends and receives on the network stream after the compute stream's
// position recorded in net_ready: over NCCL if the executor has a communicator, else over CUDA
// IPC. Returns an event recorded after it, the caller's (its compute stream may wait on it; give
// it back with recycle_events once every cudaStreamWaitEvent on it is enqueued).
cudaEvent_t CudaExecutor::Impl::issue_group(const net::NetGroup& group, const Program& program,
                                            const Resolve& resolve, uint64_t epoch,
                                            uint64_t tag, Phase phase) {
  if (!net_stream) TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&net_stream, cudaStreamNonBlocking));
  use_stream(net_stream);
  TIDE_CUDA_CHECK(cudaStreamWaitEvent(net_stream, net_ready, 0));
  cudaEvent_t done = take_event();
  try {
    if (network)
      issue_nccl_group(group, program, resolve, epoch, tag, phase);
    else
      issue_ipc_group(group, program, resolve, epoch, tag, phase);
    TIDE_CUDA_CHECK(cudaEventRecord(done, net_stream));
  } catch (...) {
    recycle_events({done});
    throw;
  }
  ++stats.network_groups;
  return done;
}

}  // namespace tide
