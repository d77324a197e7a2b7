// The host executor: the reference semantics of every program step. Built with -ffp-contract=off
// so its fp32 arithmetic rounds exactly as the CUDA kernels' explicit __fadd_rn/__fmul_rn do.
#include <atomic>
#include <cstring>
#include <thread>

#include "tide/error.hpp"
#include "tide/executor.hpp"

namespace tide {
namespace {

std::string describe_tag(uint64_t tag) {
  return detail::concat("bucket ", tag >> 1, " ",
                        collective_name(static_cast<Collective>(tag & 1)));
}

const char* flag_kind_name(FlagKind kind) {
  return kind == FlagKind::kSlotFree ? "slot_free" : "data_ready";
}

}  // namespace

HostExecutor::HostExecutor(HostWindow& window, std::chrono::milliseconds timeout)
    : window_(window), timeout_(timeout) {
  TIDE_CHECK_ARG(timeout.count() > 0, "HostExecutor", "timeout_ms", timeout.count(), "> 0");
}

void HostExecutor::run(const Program& program, const Bindings& bindings) {
  const int rank = window_.rank();
  const int world = window_.world();
  validate_run(program, bindings, rank, world, window_.data_bytes(), window_.data(rank));
  const uint64_t epoch = window_.next_epoch();
  const uint64_t tag = program.tag();

  auto resolve = [&](const Address& a) -> std::byte* {
    switch (a.space) {
      case Space::kWindow: return window_.data(a.index) + a.offset;
      case Space::kInput:
        return const_cast<std::byte*>(static_cast<const std::byte*>(bindings.inputs[a.index])) +
               a.offset;
      case Space::kOutput: return static_cast<std::byte*>(bindings.outputs[a.index]) + a.offset;
    }
    return nullptr;
  };

  for (const Step& step : program.steps) {
    if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
      for (const CopyOp& c : batch->copies) std::memcpy(resolve(c.dst), resolve(c.src), c.bytes);
    } else if (const auto* cast = std::get_if<CastOp>(&step.op)) {
      std::byte* dst = resolve(cast->dst);
      const std::size_t dst_size = dtype_size(cast->dst_dtype);
      if (cast->src_dtype == cast->dst_dtype) {
        if (cast->count > 0) std::memcpy(dst, resolve(cast->src), cast->count * dst_size);
      } else {
        const std::byte* src = resolve(cast->src);
        for (int64_t k = 0; k < cast->count; ++k)
          store_from_float(dst, cast->dst_dtype, k, load_as_float(src, cast->src_dtype, k));
      }
      std::memset(dst + cast->count * dst_size, 0, cast->pad * dst_size);
    } else if (const auto* signal = std::get_if<SignalOp>(&step.op)) {
      FlagWord& f = window_.flags(signal->peer)[flag_index(signal->kind, rank, world)];
      std::atomic_ref<uint64_t>(f.tag).store(tag, std::memory_order_relaxed);
      std::atomic_ref<uint64_t>(f.epoch).store(epoch, std::memory_order_release);
    } else if (const auto* wait = std::get_if<WaitOp>(&step.op)) {
      FlagWord& f = window_.flags(rank)[flag_index(wait->kind, wait->peer, world)];
      std::atomic_ref<uint64_t> seen_epoch(f.epoch);
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      uint64_t seen = 0;
      for (uint64_t spin = 0;; ++spin) {
        seen = seen_epoch.load(std::memory_order_acquire);
        if (seen >= epoch) break;
        if ((spin & 255) == 255) {
          if (std::chrono::steady_clock::now() > deadline) {
            const uint64_t seen_tag = std::atomic_ref<uint64_t>(f.tag).load(std::memory_order_relaxed);
            throw TimeoutError(detail::concat(
                "rank ", rank, ": timed out after ", timeout_.count(), " ms waiting for ",
                flag_kind_name(wait->kind), " from rank ", wait->peer, " (", describe_tag(tag),
                ", phase ", phase_name(step.phase), ", epoch ", epoch, "); last signal from rank ",
                wait->peer, ": ", seen == 0 ? std::string("none") : detail::concat(
                    "epoch ", seen, ", ", describe_tag(seen_tag)),
                ". The peer is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS "
                "if it is only slow)"));
          }
          std::this_thread::yield();
        }
      }
      const uint64_t seen_tag = std::atomic_ref<uint64_t>(f.tag).load(std::memory_order_relaxed);
      if (seen != epoch || seen_tag != tag)
        throw DesyncError(detail::concat(
            "rank ", rank, " runs ", describe_tag(tag), " at epoch ", epoch, " (phase ",
            phase_name(step.phase), ") but rank ", wait->peer, " signalled ",
            describe_tag(seen_tag), " at epoch ", seen,
            ": the ranks called collectives in different orders"));
    } else if (const auto* reduce = std::get_if<ReduceOp>(&step.op)) {
      std::vector<const std::byte*> sources;
      for (const Address& a : reduce->sources) sources.push_back(resolve(a));
      std::byte* dst = resolve(reduce->dst);
      for (int64_t k = 0; k < reduce->count; ++k) {
        float acc = 0.0f;
        for (const std::byte* src : sources)
          acc = acc + load_as_float(src, reduce->src_dtype, k) * reduce->prescale;
        float result = acc * reduce->scale;
        if (reduce->accumulate) result = load_as_float(dst, reduce->dst_dtype, k) + result;
        store_from_float(dst, reduce->dst_dtype, k, result);
      }
    }
  }
}

}  // namespace tide
