// The host executor: the reference semantics of every program step. Built with -ffp-contract=off
// so its fp32 arithmetic rounds exactly as the CUDA kernels' explicit __fadd_rn/__fmul_rn do.
//
// Failure handling (docs/FAILURES.md): every step publishes the executor's state in its window
// segment (published_state.hpp, a seqlock), so a rank that waits on a peer can tell from the peer's
// state whether the signal can still come (flag_wait.cpp, host_transport.cpp, wait_loop.cpp): a
// peer that failed, moved past this epoch, waits on us for an epoch it left, or whose process has
// exited (liveness.hpp) ends the wait at once with an error that names both sides; otherwise the
// wait ends at its timeout. host_internal.hpp lists the files.
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "executor/resolve.hpp"
#include "executor/tag.hpp"
#include "host_internal.hpp"
#include "liveness.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

using host_detail::Status;

// --- Registry of live executors, for describe_executor_state(). ---

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<const HostExecutor*>& registry() {
  static std::vector<const HostExecutor*> executors;
  return executors;
}

}  // namespace

bool debug_enabled() {
  const char* env = std::getenv("TIDE_DEBUG");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "0") == 0) return false;
  TIDE_CHECK_ARG(std::strcmp(env, "1") == 0, "environment", "TIDE_DEBUG",
                 std::string("'") + env + "'", "0 or 1");
  return true;
}

HostExecutor::HostExecutor(HostWindow& window, std::chrono::milliseconds timeout)
    : window_(window), timeout_(timeout), debug_(debug_enabled()) {
  TIDE_CHECK_ARG(timeout.count() > 0, "HostExecutor", "timeout_ms", timeout.count(), "> 0");
  identity_ = host_detail::self_identity();
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().push_back(this);
}

HostExecutor::~HostExecutor() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  for (auto it = r.begin(); it != r.end(); ++it)
    if (*it == this) {
      r.erase(it);
      break;
    }
}

ExecutorState HostExecutor::state(int rank) const {
  if (rank == -1) rank = window_.rank();
  TIDE_CHECK_ARG(rank >= 0 && rank < window_.world(), "HostExecutor::state", "rank", rank,
                 detail::concat("in [0, ", window_.world(), ") or -1 (own)"));
  return peer_state(rank);
}

std::string HostExecutor::describe_group() const {
  std::string out;
  for (int r = 0; r < window_.world(); ++r) out += "  " + state(r).to_string() + "\n";
  return out;
}

std::string describe_executor_state() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (registry().empty()) return "no host executors in this process\n";
  std::string out;
  for (const HostExecutor* e : registry()) out += e->state().to_string() + "\n";
  return out;
}

void HostExecutor::run(const Program& program, const Bindings& bindings) {
  const int rank = window_.rank();
  const int world = window_.world();
  validate_run(program, bindings, rank, world, window_.data_bytes(), window_.data(rank),
               /*net_supported=*/true);
  const uint64_t epoch = window_.next_epoch();
  const uint64_t tag = program.tag();
  Publisher publisher(*window_.state(rank), identity_, epoch, tag, program.steps.size());

  RunState state{program, epoch, tag, publisher, {}};
  auto resolve = [&](const Address& a) {
    return detail::resolve_address(a, bindings, [&](int r) { return window_.data(r); });
  };

  try {
    for (std::size_t index = 0; index < program.steps.size(); ++index) {
      const Step& step = program.steps[index];
      if (const auto* wait_op = std::get_if<WaitOp>(&step.op)) {
        wait_for_flag(state, index, *wait_op);
        continue;
      }
      if (const auto* send = std::get_if<NetSendOp>(&step.op)) {
        net_send(state, index, *send);
        continue;
      }
      if (const auto* recv = std::get_if<NetRecvOp>(&step.op)) {
        net_receive(state, index, *recv);
        continue;
      }
      // Before a step writes own-window bytes, the sends reading them complete.
      if (const auto* c = std::get_if<CastOp>(&step.op))
        complete_sends_reading(state, c->dst, c->dst_extent(), index);
      else if (const auto* b = std::get_if<CopyBatch>(&step.op))
        for (const CopyOp& c : b->copies) complete_sends_reading(state, c.dst, c.dst_extent(), index);
      else if (const auto* r = std::get_if<ReduceOp>(&step.op))
        complete_sends_reading(state, r->dst, r->count * dtype_size(r->dst_dtype), index);
      publisher.publish(Status::kRunning, step.phase, index);
      if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
        for (const CopyOp& c : batch->copies) {
          if (c.bytes == 0) continue;
          std::byte* dst = resolve(c.dst);
          const std::byte* src = resolve(c.src);
          for (std::size_t j = 0; j < c.rows; ++j)
            std::memcpy(dst + j * c.dst_pitch, src + j * c.src_pitch, c.bytes);
        }
      } else if (const auto* cast = std::get_if<CastOp>(&step.op)) {
        const std::size_t dst_size = dtype_size(cast->dst_dtype);
        const std::size_t src_row = cast->count * dtype_size(cast->src_dtype);
        for (int64_t j = 0; j < cast->rows; ++j) {
          std::byte* dst = resolve(cast->dst) + j * cast->dst_pitch;
          const std::byte* src = cast->count > 0 ? resolve(cast->src) + j * src_row : nullptr;
          if (cast->src_dtype == cast->dst_dtype) {
            if (cast->count > 0) std::memcpy(dst, src, cast->count * dst_size);
          } else if (is_scaled(cast->dst_dtype)) {  // one fp32 multiply per element, then saturate
            const float scale = *bindings.scales[cast->src.index];
            for (int64_t k = 0; k < cast->count; ++k) {
              // A NaN keeps the element's sign, else the scale's, as torch's x * scale on the CPU
              // (the compiler may swap a product's operands, and x86 returns the first one's NaN).
              const float x = load_as_float(src, cast->src_dtype, k);
              const float product = std::isnan(x) ? x : std::isnan(scale) ? scale : x * scale;
              store_from_float(dst, cast->dst_dtype, k, product);
            }
          } else {
            for (int64_t k = 0; k < cast->count; ++k)
              store_from_float(dst, cast->dst_dtype, k, load_as_float(src, cast->src_dtype, k));
          }
          if (cast->pad > 0) std::memset(dst + cast->count * dst_size, 0, cast->pad * dst_size);
        }
      } else if (const auto* signal = std::get_if<SignalOp>(&step.op)) {
        FlagWord& f = window_.flags(signal->peer)[flag_index(signal->kind, rank, world)];
        std::atomic_ref<uint64_t>(f.tag).store(tag, std::memory_order_relaxed);
        std::atomic_ref<uint64_t>(f.epoch).store(epoch, std::memory_order_release);
        host_detail::wake_sleepers(&f.epoch);
      } else if (const auto* reduce = std::get_if<ReduceOp>(&step.op)) {
        std::vector<const std::byte*> sources;
        for (const Address& a : reduce->sources) sources.push_back(resolve(a));
        std::byte* dst = resolve(reduce->dst);
        const std::byte* partial = reduce->partial ? resolve(*reduce->partial) : nullptr;
        for (int64_t k = 0; k < reduce->count; ++k) {
          float acc = partial ? load_as_float(partial, reduce->partial_dtype, k) : 0.0f;
          for (const std::byte* src : sources)
            acc = acc + load_as_float(src, reduce->src_dtype, k) * reduce->prescale;
          float result = acc * reduce->scale;
          if (reduce->accumulate) result = load_as_float(dst, reduce->dst_dtype, k) + result;
          store_from_float(dst, reduce->dst_dtype, k, result);
        }
      }
    }
    for (const PostedSend& p : state.posted)
      complete_send(state, p, program.steps.empty() ? 0 : program.steps.size() - 1);
    publisher.publish(Status::kDone,
                      program.steps.empty() ? Phase::kCastIn : program.steps.back().phase,
                      program.steps.size());
  } catch (const TimeoutError&) {  // publish first: a peer that sees a withdrawn signal reads why
    publisher.finish(Status::kTimedOut);
    retract_slot_free(epoch);
    throw;
  } catch (const DesyncError&) {
    publisher.finish(Status::kDesynced);
    retract_slot_free(epoch);
    throw;
  } catch (...) {
    publisher.finish(Status::kFailed);
    retract_slot_free(epoch);
    throw;
  }
}

// A failed collective withdraws the slot-free signals it sent: a peer that arrives late at this
// epoch (a rank behind this one) must not write into this window, which has moved on. A peer that
// already saw the signal is inside the same collective, which wrote into this window anyway.
void HostExecutor::retract_slot_free(uint64_t epoch) {
  const int rank = window_.rank();
  for (int q = 0; q < window_.world(); ++q) {
    if (q == rank) continue;
    FlagWord& f = window_.flags(q)[flag_index(FlagKind::kSlotFree, rank, window_.world())];
    if (std::atomic_ref<uint64_t>(f.epoch).load(std::memory_order_relaxed) != epoch) continue;
    std::atomic_ref<uint64_t> tag(f.tag);
    tag.store(tag.load(std::memory_order_relaxed) | detail::kAbandonedTag, std::memory_order_release);
  }
}

}  // namespace tide
