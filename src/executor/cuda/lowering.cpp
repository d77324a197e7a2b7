// The CUDA executor's lowering: a program's steps -> operations on the compute stream.
//
//   CopyBatch  -> cudaMemcpyBatchAsync (copy engines preferred, source in stream order);
//                 one cudaMemcpyAsync per copy where batches are unavailable; 2-D copies (rows > 1)
//                 one cudaMemcpy2DAsync each (copy engines; the batch API is 1-D only), and so
//                 runs of equal copies at one pitch (equal params: one operation, not one each).
//                 More 1-D copies than kMaxEngineCopies left after that: one copy kernel (SM
//                 stores), as the copy engines cost the host microseconds per copy.
//   CastOp     -> equal types: a batched copy + cudaMemsetAsync of the pad (no kernel), or a
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
//                 reduces after the slot-free handshake) -> one handoff kernel (kernels.cuh), where
//                 the window's peers can run kernels beside this rank's (CudaWindow::
//                 peers_run_beside_own), the tail fits one
//                 launch and TIDE_CUDA_HANDOFF is not 0; the steps above otherwise.
//   NetSendOp/NetRecvOp -> grouped on a network stream, as the group schedule
//                 (src/executor/net/group_schedule.hpp) says: issued after the stream reaches the
//                 group's last op, waited for only by steps that touch its bytes; over NCCL
//                 (nccl_transport.cpp) or, without a communicator on a CudaReach::kHost window,
//                 over CUDA IPC (ipc_transport.cpp).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdlib>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <variant>

#include "cuda_executor_impl.hpp"
#include "executor/resolve.hpp"
#include "tide/error.hpp"

namespace tide {

using namespace cuda_executor_detail;

void CudaExecutor::Impl::enqueue_program(const Program& program, const Bindings& bindings,
                                         uint64_t epoch, uint64_t tag) {
  const Resolve resolve = [&](const Address& a) {
    return detail::resolve_address(a, bindings, [&](int r) { return window.data(r); });
  };

  const std::vector<Step>& steps = program.steps;
  bool has_net = false;
  for (const Step& step : steps)
    has_net |= std::holds_alternative<NetSendOp>(step.op) || std::holds_alternative<NetRecvOp>(step.op);
  net::GroupSchedule schedule;
  if (has_net) {
    schedule = net::schedule_groups(program);
    if (!net_ready) TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&net_ready, cudaEventDisableTiming));
  }
  // Issues and waits the schedule asks for before step i (i == steps.size(): the end).
  std::vector<cudaEvent_t> group_done;  // this run's groups, in issue order
  auto network_actions = [&](std::size_t i) {
    if (!has_net) return;
    for (int g : schedule.issue_before[i])
      group_done.push_back(issue_group(schedule.groups[g], program, resolve, epoch, tag,
                                       steps[schedule.groups[g].ops.back()].phase));
    if (schedule.wait_before[i] >= 0)
      TIDE_CUDA_CHECK(cudaStreamWaitEvent(stream, group_done[schedule.wait_before[i]], 0));
  };
  // Whether step j may join a kernel batch started earlier: no network action falls between.
  const std::function<bool(std::size_t)> batchable = [&](std::size_t j) {
    return !has_net || (schedule.issue_before[j].empty() && schedule.wait_before[j] < 0);
  };

  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<std::size_t> sizes;
  std::vector<int> window_pairs;
  const std::size_t handoff = has_net ? steps.size() : handoff_start(program);
  for (std::size_t i = 0; i < steps.size();) {
    network_actions(i);
    const Step& step = steps[i];
    if (i == handoff) {
      enqueue_handoff(steps, i, resolve, epoch, tag);
      break;
    }
    if (std::holds_alternative<CastOp>(step.op)) {
      i = enqueue_casts(steps, i, resolve, batchable);
    } else if (std::holds_alternative<ReduceOp>(step.op)) {
      i = enqueue_reduces(steps, i, resolve, batchable);
    } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
      dsts.clear(), srcs.clear(), sizes.clear(), window_pairs.clear();
      for (const CopyOp& c : batch->copies) {
        if (c.bytes == 0) continue;
        if (c.rows > 1) {
          enqueue_copy_2d(resolve(c.dst), c.dst_pitch, resolve(c.src), c.src_pitch, c.bytes, c.rows);
          continue;
        }
        dsts.push_back(resolve(c.dst));
        srcs.push_back(resolve(c.src));
        sizes.push_back(c.bytes);
        const bool windows = c.src.space == Space::kWindow && c.dst.space == Space::kWindow;
        window_pairs.push_back(windows ? c.src.index * window.world() + c.dst.index : -1);
      }
      enqueue_copies(dsts, srcs, sizes, window_pairs);
      ++i;
    } else if (std::holds_alternative<SignalOp>(step.op) || std::holds_alternative<WaitOp>(step.op)) {
      i = enqueue_flag_ops(steps, i, epoch, tag, batchable);
    } else {
      // NetSendOp / NetRecvOp: issued with their group (network_actions); the group waits for
      // the compute stream to get here.
      TIDE_CUDA_CHECK(cudaEventRecord(net_ready, stream));
      ++i;
    }
  }
  network_actions(steps.size());
  recycle_events(group_done);  // every wait on them is enqueued (waits capture the record)
}

namespace {

bool handoff_enabled() {
  static const bool enabled = [] {
    const char* text = std::getenv("TIDE_CUDA_HANDOFF");
    return !(text && std::string(text) == "0");
  }();
  return enabled;
}

}  // namespace

// Where the handoff kernel takes over: the first step of the program's tail of stores (contiguous
// casts, 1-D copies), signals, waits and reduces, when the program and the executor allow it
// (lowering's header); steps.size() otherwise.
std::size_t CudaExecutor::Impl::handoff_start(const Program& program) const {
  const std::vector<Step>& steps = program.steps;
  const std::size_t none = steps.size();
  if (program.delivery != Delivery::kCastToPeers || !window.peers_run_beside_own() ||
      !handoff_enabled())
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
  return cuda_kernels::handoff_fits(casts, copies, signals, waits, reduces, static_cast<int>(sources))
             ? k
             : none;
}

// The tail from `first` on (handoff_start) as one handoff kernel: its stores, its signals, its
// waits as one watched record (the kernel writes the marks), its reduces.
void CudaExecutor::Impl::enqueue_handoff(const std::vector<Step>& steps, std::size_t first,
                                         const Resolve& resolve, uint64_t epoch, uint64_t tag) {
  const int rank = window.rank(), world = window.world();
  std::vector<cuda_kernels::CastSpec> casts;
  std::vector<cuda_kernels::CopySpec> copies;
  std::vector<const void*> sources;  // filled before the specs point into it
  std::vector<std::size_t> reduce_steps;
  cuda_kernels::HandoffSpec spec;
  spec.epoch = epoch, spec.tag = tag;
  spec.arrivals = window.arrivals();
  spec.ranks_on_gpu = window.ranks_on_gpu();
  std::optional<PendingWait> record;
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
                         element_type(cast->dst_dtype)});
    } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
      for (const CopyOp& c : batch->copies)
        if (c.bytes > 0) copies.push_back({resolve(c.src), resolve(c.dst), c.bytes});
    } else if (const auto* signal = std::get_if<SignalOp>(&step.op)) {
      FlagWord* flag = window.flags(signal->peer) + flag_index(signal->kind, rank, world);
      spec.signals[spec.num_signals++] = &flag->epoch;
    } else if (const auto* wait = std::get_if<WaitOp>(&step.op)) {
      if (!record) record = new_wait(PendingWait::Kind::kFlag, stream, epoch, tag, -1, step.phase);
      FlagWord* flag = window.flags(rank) + flag_index(wait->kind, wait->peer, world);
      spec.waits[spec.num_waits++] = &flag->epoch;
      record->flags.push_back({flag, wait->kind, wait->peer, step.phase});
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
  launch_timed(KernelKind::kHandoff, stream, [&] { return cuda_kernels::launch_handoff(spec, stream); });
  ++stats.handoff_kernels;
  if (record) watch(std::move(*record));
}

// Consecutive casts write disjoint slots: same-type ones become one copy batch (+ memsets of their
// pads), the rest one kernel.
std::size_t CudaExecutor::Impl::enqueue_casts(const std::vector<Step>& steps, std::size_t first,
                                              const Resolve& resolve,
                                              const std::function<bool(std::size_t)>& batchable) {
  std::vector<cuda_kernels::CastSpec> casts;
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<std::size_t> sizes;
  std::size_t i = first;
  for (; i < steps.size() && std::holds_alternative<CastOp>(steps[i].op) && (i == first || batchable(i));
       ++i) {
    const CastOp& cast = std::get<CastOp>(steps[i].op);
    std::byte* dst = resolve(cast.dst);
    const std::size_t dst_size = dtype_size(cast.dst_dtype);
    if (cast.rows > 1 && cast.src_dtype == cast.dst_dtype) {  // a strided block, no padding
      if (cast.count > 0)
        enqueue_copy_2d(dst, cast.dst_pitch, resolve(cast.src), cast.count * dst_size,
                        cast.count * dst_size, static_cast<std::size_t>(cast.rows));
    } else if (cast.src_dtype == cast.dst_dtype) {
      if (cast.count > 0) {
        dsts.push_back(dst);
        srcs.push_back(resolve(cast.src));
        sizes.push_back(static_cast<std::size_t>(cast.count) * dst_size);
      }
      if (cast.pad > 0)
        TIDE_CUDA_CHECK(cudaMemsetAsync(dst + cast.count * dst_size, 0, cast.pad * dst_size, stream));
    } else {
      casts.push_back({cast.count > 0 ? resolve(cast.src) : nullptr, dst, cast.count, cast.pad,
                       element_type(cast.src_dtype), element_type(cast.dst_dtype), cast.rows,
                       static_cast<int64_t>(cast.dst_pitch / dst_size)});
    }
  }
  enqueue_copies(dsts, srcs, sizes, {});  // from the inputs: never merged
  if (!casts.empty())
    launch_timed(KernelKind::kCast, stream, [&] {
      return cuda_kernels::launch_casts(casts.data(), casts.size(), 0, stream);
    });
  return i;
}

namespace {

// Disjoint byte ranges (begin -> end), overlapping ones inserted merged: whether a range touches
// any of them in O(log n), so batching a bucket's reduces costs an array pass, not n^2 checks.
class SpanSet {
 public:
  bool overlaps(const Span& s) const {
    auto next = spans_.upper_bound(s.begin);  // the first range starting after s.begin
    if (next != spans_.end() && next->first < s.end) return true;
    return next != spans_.begin() && std::prev(next)->second > s.begin;
  }
  void insert(Span s) {
    if (s.begin == s.end) return;
    auto it = spans_.upper_bound(s.begin);
    if (it != spans_.begin() && std::prev(it)->second >= s.begin) --it;
    while (it != spans_.end() && it->first <= s.end) {
      s.begin = std::min(s.begin, it->first);
      s.end = std::max(s.end, it->second);
      it = spans_.erase(it);
    }
    spans_.emplace(s.begin, s.end);
  }

 private:
  std::map<const std::byte*, const std::byte*> spans_;
};

}  // namespace

// One kernel for consecutive reduces with as many sources each, as long as none touches what an
// earlier one in the kernel writes (a multi-node ring step sums the partial it just reduced) or
// writes what an earlier one reads.
std::size_t CudaExecutor::Impl::enqueue_reduces(const std::vector<Step>& steps, std::size_t first,
                                                const Resolve& resolve,
                                                const std::function<bool(std::size_t)>& batchable) {
  const std::size_t num_sources = std::get<ReduceOp>(steps[first].op).sources.size();
  std::vector<const void*> sources;  // num_sources per reduce, filled first: specs point into it
  std::vector<cuda_kernels::ReduceSpec> reduces;
  SpanSet reads, writes;
  std::vector<Span> read_here;
  std::size_t i = first;
  for (; i < steps.size() && std::holds_alternative<ReduceOp>(steps[i].op); ++i) {
    const ReduceOp& reduce = std::get<ReduceOp>(steps[i].op);
    if (!reduces.empty() && (reduce.sources.size() != num_sources || !batchable(i))) break;
    const std::size_t in_bytes = static_cast<std::size_t>(reduce.count) * dtype_size(reduce.src_dtype);
    std::byte* out = resolve(reduce.dst);
    const Span written{out, out + static_cast<std::size_t>(reduce.count) * dtype_size(reduce.dst_dtype)};
    read_here.clear();
    for (const Address& a : reduce.sources) {
      const std::byte* src = resolve(a);
      read_here.push_back({src, src + in_bytes});
    }
    const std::byte* partial = reduce.partial ? resolve(*reduce.partial) : nullptr;
    if (partial)
      read_here.push_back(
          {partial, partial + static_cast<std::size_t>(reduce.count) * dtype_size(reduce.partial_dtype)});
    bool depends = writes.overlaps(written) || reads.overlaps(written);
    for (const Span& r : read_here) depends = depends || writes.overlaps(r);
    if (!reduces.empty() && depends) break;
    for (std::size_t k = 0; k < num_sources; ++k) sources.push_back(read_here[k].begin);
    for (const Span& r : read_here) reads.insert(r);
    writes.insert(written);
    reduces.push_back({nullptr, out, partial, reduce.count, reduce.prescale, reduce.scale,
                       reduce.accumulate, element_type(reduce.src_dtype),
                       element_type(reduce.dst_dtype), element_type(reduce.partial_dtype)});
  }
  for (std::size_t k = 0; k < reduces.size(); ++k) reduces[k].sources = sources.data() + k * num_sources;
  launch_timed(KernelKind::kReduce, stream, [&] {
    return cuda_kernels::launch_reduces(reduces.data(), reduces.size(), static_cast<int>(num_sources),
                                        0, stream);
  });
  return i;
}

// cudaMemcpy2DAsync refuses pitches past the device's maximum (cudaDevAttrMaxPitch, 2^31 - 1 on
// current GPUs); runs farther apart stay 1-D copies.
constexpr std::ptrdiff_t kMaxCopyPitch = (std::ptrdiff_t{1} << 31) - 1;

// More 1-D copies than this in one batch go as one copy kernel: every copy-engine operation costs
// the host microseconds (`cudaMemcpyBatchAsync` makes one per copy, ~7 us each on an H200), so a
// reduce-scatter's pushes of hundreds of gradients, each its own allocation, were host-bound at
// ~7 us per param; one launch costs a few.
constexpr std::size_t kMaxEngineCopies = 4;

// Runs of copies of one size whose sources and destinations each advance by one pitch go as one
// 2-D copy: the copy engine then takes one operation for the run instead of one per copy (a peer's
// pushes of equal params sit W slots apart in both windows; every copy-engine operation costs
// microseconds, BENCHMARKS.md). Only copies between the same two windows merge (window_pairs[k]:
// copy k's source and destination window, -1 for other memory; empty: none): a 2-D copy must lie
// within one allocation on each side, which cudaMemcpy2DAsync checks (invalid argument). The rest
// go as one batch (more than kMaxEngineCopies: one copy kernel). The copies of a batch are
// independent, so their order does not matter.
void CudaExecutor::Impl::enqueue_copies(std::vector<void*>& dsts, std::vector<const void*>& srcs,
                                        std::vector<std::size_t>& sizes,
                                        const std::vector<int>& window_pairs) {
  const std::size_t n = dsts.size();
  auto same_windows = [&](std::size_t a, std::size_t b) {
    return !window_pairs.empty() && window_pairs[a] >= 0 && window_pairs[a] == window_pairs[b];
  };
  std::size_t kept = 0;
  for (std::size_t i = 0; i < n;) {
    const auto* dst = static_cast<const std::byte*>(dsts[i]);
    const auto* src = static_cast<const std::byte*>(srcs[i]);
    std::size_t j = i + 1;
    std::ptrdiff_t dst_pitch = 0, src_pitch = 0;
    if (j < n && sizes[j] == sizes[i] && same_windows(i, j)) {
      dst_pitch = static_cast<const std::byte*>(dsts[j]) - dst;
      src_pitch = static_cast<const std::byte*>(srcs[j]) - src;
      const auto width = static_cast<std::ptrdiff_t>(sizes[i]);
      const bool regular = dst_pitch >= width && src_pitch >= width && dst_pitch <= kMaxCopyPitch &&
                           src_pitch <= kMaxCopyPitch;
      while (regular && j < n && sizes[j] == sizes[i] && same_windows(i, j) &&
             static_cast<const std::byte*>(dsts[j]) - static_cast<const std::byte*>(dsts[j - 1]) == dst_pitch &&
             static_cast<const std::byte*>(srcs[j]) - static_cast<const std::byte*>(srcs[j - 1]) == src_pitch)
        ++j;
    }
    if (j - i >= 2) {
      enqueue_copy_2d(dsts[i], static_cast<std::size_t>(dst_pitch), srcs[i],
                      static_cast<std::size_t>(src_pitch), sizes[i], j - i);
      stats.copies_coalesced += static_cast<int>(j - i);
    } else {
      dsts[kept] = dsts[i], srcs[kept] = srcs[i], sizes[kept] = sizes[i];
      ++kept;
    }
    i = j;
  }
  dsts.resize(kept), srcs.resize(kept), sizes.resize(kept);
  if (dsts.empty()) return;
  if (dsts.size() > kMaxEngineCopies) {
    std::vector<cuda_kernels::CopySpec> copies(dsts.size());
    for (std::size_t k = 0; k < dsts.size(); ++k) copies[k] = {srcs[k], dsts[k], sizes[k]};
    launch_timed(KernelKind::kCopy, stream, [&] {
      return cuda_kernels::launch_copies(copies.data(), copies.size(), stream);
    });
    stats.copies_by_kernel += static_cast<int>(copies.size());
    return;
  }
  stats.copies += static_cast<int>(dsts.size());
#if CUDART_VERSION >= 12080
  if (batch_copies && stream != nullptr && stream != cudaStreamLegacy) {
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;  // keep SMs free: copy engines
    std::size_t attribute_index = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t status = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                                    dsts.size(), &attributes, &attribute_index,
                                                    1, stream);
#else
    std::size_t fail_index = 0;
    const cudaError_t status = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                                    dsts.size(), &attributes, &attribute_index,
                                                    1, &fail_index, stream);
#endif
    if (status == cudaSuccess) return;
    // Unsupported here (driver, stream kind): fall back for good. A real addressing error
    // shows up again, with its own message, in cudaMemcpyAsync below.
    (void)cudaGetLastError();
    batch_copies = false;
  }
#endif
  for (std::size_t i = 0; i < dsts.size(); ++i)
    TIDE_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDeviceToDevice, stream));
  stats.single_copy_calls += static_cast<int>(dsts.size());
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

// cuStreamBatchMemOp takes fewer than 256 operations per call.
constexpr std::size_t kMaxMemOps = 254;

CUdeviceptr address(uint64_t* word) { return reinterpret_cast<CUdeviceptr>(word); }

}  // namespace

// Consecutive signals and waits (the slot-free signals to every peer and the wait for the
// first; a data-ready signal and the next wait; the data-ready waits at the end) in one
// cuStreamBatchMemOp: per signal the tag, then the epoch, into the peer's FlagWord; per wait
// epoch >= e, then tag == t, on the own one. The waits of the call are one watched record, marked
// reached before the first and passed after the last.
std::size_t CudaExecutor::Impl::enqueue_flag_ops(const std::vector<Step>& steps, std::size_t first,
                                                 uint64_t epoch, uint64_t tag,
                                                 const std::function<bool(std::size_t)>& batchable) {
  const int rank = window.rank(), world = window.world();
  std::array<CUstreamBatchMemOpParams, kMaxMemOps> ops;  // on the stack: no allocation per run
  std::size_t count = 0;
  std::optional<PendingWait> record;
  std::size_t i = first;
  // Room for this step's two operations and the two marks.
  for (; i < steps.size() && (i == first || batchable(i)) && count + 4 <= kMaxMemOps; ++i) {
    if (const auto* signal = std::get_if<SignalOp>(&steps[i].op)) {
      FlagWord* flag = window.flags(signal->peer) + flag_index(signal->kind, rank, world);
      ops[count++] = write_value(address(&flag->tag), tag);
      ops[count++] = write_value(address(&flag->epoch), epoch);
    } else if (const auto* wait = std::get_if<WaitOp>(&steps[i].op)) {
      if (!record) {
        record = new_wait(PendingWait::Kind::kFlag, stream, epoch, tag, -1, steps[i].phase);
        ops[count++] = mark(*record, /*passed=*/false);
      }
      FlagWord* flag = window.flags(rank) + flag_index(wait->kind, wait->peer, world);
      ops[count++] = wait_geq(&flag->epoch, epoch);
      ops[count++] = wait_eq(&flag->tag, tag);
      record->flags.push_back({flag, wait->kind, wait->peer, steps[i].phase});
    } else {
      break;
    }
  }
  if (record) ops[count++] = mark(*record, /*passed=*/true);
  TIDE_CU_CHECK(api.stream_batch_mem_op(stream, static_cast<unsigned>(count), ops.data(), 0));
  ++stats.mem_op_calls;
  if (record) watch(std::move(*record));
  return i;
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
