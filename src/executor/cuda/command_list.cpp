// The lowering's decisions (command_list.hpp): which steps share a driver call, and which copies
// go to the copy engines or the SMs. Everything here is host arithmetic over the run's pointers.
#include "executor/cuda/command_list.hpp"

#include <algorithm>
#include <iterator>
#include <map>
#include <variant>

#include "executor/resolve.hpp"

namespace tide::lowering {

void CommandList::clear() {
  commands.clear();
  copies.clear();
  copies_2d.clear();
  reduces.clear();
  sources.clear();
}

namespace {

// cudaMemcpy2DAsync refuses pitches past the device's maximum (cudaDevAttrMaxPitch, 2^31 - 1 on
// current GPUs); runs farther apart stay 1-D copies.
constexpr std::ptrdiff_t kMaxCopyPitch = (std::ptrdiff_t{1} << 31) - 1;

struct Span {
  const std::byte* begin;
  const std::byte* end;
};

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

class Lowering {
 public:
  Lowering(const Program& program, const Bindings& bindings, const LoweringContext& context,
           CommandList& out)
      : steps_(program.steps), bindings_(bindings), context_(context), out_(out) {}

  void run() {
    out_.clear();
    for (std::size_t i = 0; i < steps_.size();) {
      network_actions(i);
      const Step& step = steps_[i];
      if (i == context_.cast_to_peers_step) {
        out_.commands.push_back({CommandKind::kCastToPeers, i, steps_.size()});
        return;  // the cast-to-peers kernel tail never holds network ops
      }
      if (std::holds_alternative<CastOp>(step.op)) {
        i = casts(i);
      } else if (std::holds_alternative<ReduceOp>(step.op)) {
        i = reduces(i);
      } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
        copies(*batch);
        ++i;
      } else if (std::holds_alternative<SignalOp>(step.op) || std::holds_alternative<WaitOp>(step.op)) {
        i = flag_ops(i);
      } else {
        out_.commands.push_back({CommandKind::kNetStep, i, i + 1});
        ++i;
      }
    }
    network_actions(steps_.size());
  }

 private:
  std::byte* resolve(const Address& a) const {
    return detail::resolve_address(a, bindings_, [&](int r) { return (*context_.window_data)[r]; });
  }

  void network_actions(std::size_t i) {
    const net::GroupSchedule* s = context_.schedule;
    if (s && (!s->issue_before[i].empty() || s->wait_before[i] >= 0))
      out_.commands.push_back({CommandKind::kNetActions, i, i});
  }

  // Whether step j may join a batch started earlier: no network action falls between.
  bool batchable(std::size_t j) const {
    const net::GroupSchedule* s = context_.schedule;
    return !s || (s->issue_before[j].empty() && s->wait_before[j] < 0);
  }

  std::size_t casts(std::size_t first) {
    std::size_t i = first + 1;
    while (i < steps_.size() && std::holds_alternative<CastOp>(steps_[i].op) && batchable(i)) ++i;
    out_.commands.push_back({CommandKind::kCasts, first, i});
    return i;
  }

  // As enqueue_flag_ops issues them: per signal two writes, per wait two waits (and its clear
  // when the run is captured in a CUDA graph: the lowering serves both), and the two marks around
  // the call's waits.
  std::size_t flag_ops(std::size_t first) {
    std::size_t count = 0, i = first;
    bool waits = false;
    for (; i < steps_.size() && (i == first || batchable(i)) && count + 5 <= kMaxMemOps; ++i) {
      if (std::holds_alternative<SignalOp>(steps_[i].op)) {
        count += 2;
      } else if (std::holds_alternative<WaitOp>(steps_[i].op)) {
        count += waits ? 3 : 4;
        waits = true;
      } else {
        break;
      }
    }
    out_.commands.push_back({CommandKind::kFlagOps, first, i});
    return i;
  }

  // One kernel for consecutive reduces with as many sources each, as long as none touches what an
  // earlier one in the kernel writes (a across-node ring step sums the partial it just reduced) or
  // writes what an earlier one reads. A bucket's reduces (hundreds) almost never do: they are
  // taken together and checked at once by sorting their writes (no allocation once warm);
  // only a run with an overlap is split, reduce by reduce.
  std::size_t reduces(std::size_t first) {
    const std::size_t num_sources = std::get<ReduceOp>(steps_[first].op).sources.size();
    const std::size_t first_reduce = out_.reduces.size(), first_source = out_.sources.size();
    std::size_t end = first;
    for (; end < steps_.size(); ++end) {
      const auto* reduce = std::get_if<ReduceOp>(&steps_[end].op);
      if (!reduce || (end > first && (reduce->sources.size() != num_sources || !batchable(end))))
        break;
      push_reduce(*reduce);
    }
    if (overlapping(first_reduce, num_sources)) {
      out_.reduces.resize(first_reduce), out_.sources.resize(first_source);
      end = first + split_reduces(first, end, num_sources);
    }
    out_.commands.push_back({CommandKind::kReduceKernel, first, end, first_reduce,
                             out_.reduces.size() - first_reduce, static_cast<int>(num_sources)});
    return end;
  }

  void push_reduce(const ReduceOp& reduce) {
    const std::size_t first_source = out_.sources.size();
    for (const Address& a : reduce.sources) out_.sources.push_back(resolve(a));
    out_.reduces.push_back({first_source, resolve(reduce.dst),
                            reduce.partial ? resolve(*reduce.partial) : nullptr, reduce.count,
                            reduce.prescale, reduce.scale, reduce.accumulate, reduce.src_dtype,
                            reduce.dst_dtype, reduce.partial_dtype});
  }

  struct Access {
    Span span;
    std::size_t reduce;
  };

  // Whether any reduce from `first_reduce` on reads or writes what another of them writes.
  bool overlapping(std::size_t first_reduce, std::size_t num_sources) const {
    thread_local std::vector<Access> writes;
    writes.clear();
    for (std::size_t k = first_reduce; k < out_.reduces.size(); ++k) {
      const Reduce& r = out_.reduces[k];
      const auto* dst = static_cast<const std::byte*>(r.dst);
      if (r.count > 0) writes.push_back({{dst, dst + r.count * dtype_size(r.dst_dtype)}, k});
    }
    std::sort(writes.begin(), writes.end(),
              [](const Access& a, const Access& b) { return a.span.begin < b.span.begin; });
    for (std::size_t k = 1; k < writes.size(); ++k)
      if (writes[k].span.begin < writes[k - 1].span.end) return true;  // sorted: neighbours suffice
    // A read overlapping a write of another reduce: the writes are disjoint and sorted, so those
    // overlapping a read are the ones just below its end, one of them at most its own.
    auto touches_other = [&](const Span& read, std::size_t reduce) {
      auto it = std::lower_bound(writes.begin(), writes.end(), read.end,
                                 [](const Access& a, const std::byte* e) { return a.span.begin < e; });
      for (; it != writes.begin() && std::prev(it)->span.end > read.begin; --it)
        if (std::prev(it)->reduce != reduce) return true;
      return false;
    };
    for (std::size_t k = first_reduce; k < out_.reduces.size(); ++k) {
      const Reduce& r = out_.reduces[k];
      if (r.count == 0) continue;
      const std::size_t in_bytes = r.count * dtype_size(r.src_dtype);
      for (std::size_t s = 0; s < num_sources; ++s) {
        const auto* src = static_cast<const std::byte*>(out_.sources[r.first_source + s]);
        if (touches_other({src, src + in_bytes}, k)) return true;
      }
      const auto* partial = static_cast<const std::byte*>(r.partial);
      if (partial && touches_other({partial, partial + r.count * dtype_size(r.partial_dtype)}, k))
        return true;
    }
    return false;
  }

  // Steps [first, end) from the start as far as none touches what an earlier one writes or writes
  // what an earlier one reads (at least one step); returns how many.
  std::size_t split_reduces(std::size_t first, std::size_t end, std::size_t num_sources) {
    SpanSet reads, writes;
    std::size_t i = first;
    for (; i < end; ++i) {
      const ReduceOp& reduce = std::get<ReduceOp>(steps_[i].op);
      push_reduce(reduce);
      const Reduce& r = out_.reduces.back();
      const auto* out = static_cast<const std::byte*>(r.dst);
      const Span written{out, out + r.count * dtype_size(r.dst_dtype)};
      const auto* partial = static_cast<const std::byte*>(r.partial);
      const Span partial_read{partial, partial ? partial + r.count * dtype_size(r.partial_dtype) : nullptr};
      const std::size_t in_bytes = r.count * dtype_size(r.src_dtype);
      auto source = [&](std::size_t k) {
        const auto* s = static_cast<const std::byte*>(out_.sources[r.first_source + k]);
        return Span{s, s + in_bytes};
      };
      bool depends = writes.overlaps(written) || reads.overlaps(written) ||
                     (partial && writes.overlaps(partial_read));
      for (std::size_t k = 0; k < num_sources && !depends; ++k) depends = writes.overlaps(source(k));
      if (i > first && depends) {
        out_.sources.resize(r.first_source);
        out_.reduces.pop_back();
        break;
      }
      for (std::size_t k = 0; k < num_sources; ++k) reads.insert(source(k));
      if (partial) reads.insert(partial_read);
      writes.insert(written);
    }
    return i - first;
  }

  // A CopyBatch: its 2-D copies, and runs of equal 1-D copies whose sources and destinations each
  // advance by one pitch, one cudaMemcpy2DAsync each (a peer's pushes of equal params sit W slots
  // apart in both windows). Only copies between the same two windows merge: a 2-D copy must lie
  // within one allocation on each side, which cudaMemcpy2DAsync checks (invalid argument). The
  // rest: engine_or_kernel. The copies of a batch are independent, so their order does not matter.
  void copies(const CopyBatch& batch) {
    const std::vector<CopyOp>& ops = batch.copies;
    const std::size_t first_copy = out_.copies.size();
    auto same_windows = [&](const CopyOp& a, const CopyOp& b) {
      return a.src.space == Space::kWindow && a.dst.space == Space::kWindow &&
             b.src.space == Space::kWindow && b.dst.space == Space::kWindow &&
             a.src.index == b.src.index && a.dst.index == b.dst.index;
    };
    for (std::size_t i = 0; i < ops.size();) {
      const CopyOp& c = ops[i];
      if (c.bytes == 0) {
        ++i;
        continue;
      }
      const auto* src = resolve(c.src);
      auto* dst = resolve(c.dst);
      if (c.rows > 1) {
        push_2d({src, c.src_pitch, dst, c.dst_pitch, c.bytes, c.rows});
        ++i;
        continue;
      }
      std::size_t j = i + 1;
      const auto width = static_cast<std::ptrdiff_t>(c.bytes);
      std::ptrdiff_t src_pitch = 0, dst_pitch = 0;
      if (j < ops.size() && ops[j].rows == 1 && ops[j].bytes == c.bytes && same_windows(c, ops[j])) {
        src_pitch = static_cast<std::ptrdiff_t>(ops[j].src.offset - c.src.offset);
        dst_pitch = static_cast<std::ptrdiff_t>(ops[j].dst.offset - c.dst.offset);
        const bool regular = src_pitch >= width && dst_pitch >= width && src_pitch <= kMaxCopyPitch &&
                             dst_pitch <= kMaxCopyPitch;
        while (regular && j < ops.size() && ops[j].rows == 1 && ops[j].bytes == c.bytes &&
               same_windows(c, ops[j]) &&
               static_cast<std::ptrdiff_t>(ops[j].src.offset - ops[j - 1].src.offset) == src_pitch &&
               static_cast<std::ptrdiff_t>(ops[j].dst.offset - ops[j - 1].dst.offset) == dst_pitch)
          ++j;
      }
      if (j - i >= 2) {
        push_2d({src, static_cast<std::size_t>(src_pitch), dst, static_cast<std::size_t>(dst_pitch),
                 c.bytes, j - i, j - i});
      } else {
        out_.copies.push_back({src, dst, c.bytes});
      }
      i = j;
    }
    engine_or_kernel(first_copy);
  }

  void push_2d(const Copy2D& c) {
    out_.commands.push_back({CommandKind::kCopy2D, 0, 0, out_.copies_2d.size(), 1});
    out_.copies_2d.push_back(c);
  }

  void engine_or_kernel(std::size_t first_copy) {
    const std::size_t all = out_.copies.size() - first_copy;
    const std::size_t kernel = kernel_copies(out_.copies, first_copy);
    if (kernel > 0) out_.commands.push_back({CommandKind::kCopyKernel, 0, 0, first_copy, kernel});
    if (all > kernel)
      out_.commands.push_back({CommandKind::kEngineCopies, 0, 0, first_copy + kernel, all - kernel});
  }

  const std::vector<Step>& steps_;
  const Bindings& bindings_;
  const LoweringContext& context_;
  CommandList& out_;
};

}  // namespace

// Measured (`tide_bench_cuda copy-paths`, H200, BENCHMARKS.md): 384 copies from as many
// allocations cost the host ~4.4 us each in one cudaMemcpyBatchAsync (~1 700 us per call up to
// 4 MiB a copy), and ~16 us per call as one copy kernel. Below 4 MiB the engines' GPU time is the
// host's (2 MiB: 1 482 us both): the call is host-bound, so those copies go as one kernel. From
// 4 MiB their GPU time exceeds that host cost (4 MiB: 1 926 us on the GPU, 1 671 on the host;
// 8 MiB: 2 732 / 2 719), the host is amortized, and they stay on the engines, which leave the SMs
// to the compute a reduce-scatter overlaps, although the copy kernel is faster on an idle GPU
// (849 us at 4 MiB). Up to kMaxEngineCopies small copies cost the host less than a launch.
std::size_t kernel_copies(std::vector<Copy>& copies, std::size_t first) {
  const auto begin = copies.begin() + static_cast<std::ptrdiff_t>(first);
  const auto small_end = std::partition(
      begin, copies.end(), [](const Copy& c) { return c.bytes < kMinEngineCopyBytes; });
  const auto small = static_cast<std::size_t>(small_end - begin);
  return small > kMaxEngineCopies ? small : 0;
}

void lower(const Program& program, const Bindings& bindings, const LoweringContext& context,
           CommandList& out) {
  Lowering(program, bindings, context, out).run();
}

}  // namespace tide::lowering
