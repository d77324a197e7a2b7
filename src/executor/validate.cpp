// Checks shared by every executor, so all of them reject bad input with the same message.
#include <cstdlib>
#include <string>

#include "tide/error.hpp"
#include "tide/executor.hpp"

namespace tide {

std::chrono::milliseconds default_timeout() {
  const char* env = std::getenv("TIDE_TIMEOUT_MS");
  if (env == nullptr || *env == '\0') return std::chrono::milliseconds(120000);
  char* end = nullptr;
  const long long ms = std::strtoll(env, &end, 10);
  TIDE_CHECK_ARG(end != env && *end == '\0' && ms > 0, "environment", "TIDE_TIMEOUT_MS",
                 std::string("'") + env + "'", "a positive integer (milliseconds)");
  return std::chrono::milliseconds(ms);
}

namespace {

bool known_dtype(DType d) { return d == DType::kBF16 || d == DType::kFP16 || d == DType::kFP32; }

}  // namespace

// Everything an executor dereferences is checked here, so no program or bindings can make it touch
// memory outside the windows and the bound buffers (whose sizes it cannot know: their owner's part).
// Message arguments are only built on failure.
void validate_run(const Program& program, const Bindings& bindings, int rank, int world,
                  std::size_t window_bytes, const void* window_base) {
  const char* where = "Executor::run";
  TIDE_CHECK_ARG(program.world == world, where, "program.world", program.world,
                 detail::concat(world, " (the window's W)"));
  TIDE_CHECK_ARG(program.rank == rank, where, "program.rank", program.rank,
                 detail::concat(rank, " (the window's rank)"));
  TIDE_CHECK_ARG(program.collective == Collective::kAllGather ||
                     program.collective == Collective::kReduceScatter,
                 where, "program.collective", static_cast<int>(program.collective),
                 "all_gather or reduce_scatter");
  TIDE_CHECK_ARG(window_bytes >= program.window_bytes, where, "window data bytes", window_bytes,
                 detail::concat(">= ", program.window_bytes, " (the bucket's window size)"));
  TIDE_CHECK_ARG(program.alignment > 0 && (program.alignment & (program.alignment - 1)) == 0,
                 where, "program.alignment", program.alignment, "a power of two");
  TIDE_CHECK_ARG(window_base != nullptr &&
                     reinterpret_cast<uintptr_t>(window_base) % program.alignment == 0,
                 where, "window base", window_base,
                 detail::concat("an address aligned to ", program.alignment, " B"));
  TIDE_CHECK_ARG(program.num_params >= 0, where, "program.num_params", program.num_params, ">= 0");
  TIDE_CHECK_ARG(bindings.inputs.size() == static_cast<std::size_t>(program.num_params), where,
                 "inputs.size()", bindings.inputs.size(),
                 detail::concat(program.num_params, " (one per param)"));
  const std::size_t outputs_expected =
      program.collective == Collective::kReduceScatter ? program.num_params : 0;
  TIDE_CHECK_ARG(bindings.outputs.size() == outputs_expected, where, "outputs.size()",
                 bindings.outputs.size(), detail::concat(outputs_expected,
                 program.collective == Collective::kReduceScatter ? " (one per param)"
                                                                  : " (all-gather has none)"));

  // a: the address of `bytes` bytes that step i's operand `what` (or `list`[k].`what` when k >= 0)
  // reads, or writes if `write`.
  auto check = [&](std::size_t i, const char* list, long k, const char* what, const Address& a,
                   std::size_t bytes, bool write) {
    auto name = [&](const char* field) {
      return k < 0 ? detail::concat("steps[", i, "].", what, field)
                   : detail::concat("steps[", i, "].", list, "[", k, "]", what, field);
    };
    switch (a.space) {
      case Space::kWindow:
        TIDE_CHECK_ARG(a.index >= 0 && a.index < world, where, name(".index"), a.index,
                       detail::concat("a rank in [0, ", world, ")"));
        TIDE_CHECK_ARG(a.offset <= window_bytes && bytes <= window_bytes - a.offset, where,
                       name(""), detail::concat("[", a.offset, ", +", bytes, ") of window[", a.index, "]"),
                       detail::concat("inside the window's ", window_bytes, " B"));
        return;
      case Space::kInput:
      case Space::kOutput: {
        const bool input = a.space == Space::kInput;
        TIDE_CHECK_ARG(!(write && input), where, name(".space"), "input",
                       "a window or an output (inputs are read-only)");
        const std::size_t n = input ? bindings.inputs.size() : bindings.outputs.size();
        TIDE_CHECK_ARG(a.index >= 0 && static_cast<std::size_t>(a.index) < n, where, name(".index"),
                       a.index, detail::concat("a param in [0, ", n, ")"));
        const void* p = input ? bindings.inputs[a.index] : bindings.outputs[a.index];
        if (bytes > 0)
          TIDE_CHECK_ARG(p != nullptr, where,
                         detail::concat(input ? "inputs[" : "outputs[", a.index, "]"), "null",
                         "a buffer");
        TIDE_CHECK_ARG(a.offset <= BucketLayout::kMaxWindowBytes, where, name(".offset"), a.offset,
                       "<= 2^48");
        return;
      }
    }
    TIDE_CHECK_ARG(false, where, name(".space"), static_cast<int>(a.space), "window, input or output");
  };
  // Element counts: non-negative and small enough that count * element size cannot overflow.
  auto check_count = [&](std::size_t i, const char* what, int64_t count) {
    TIDE_CHECK_ARG(count >= 0 && static_cast<uint64_t>(count) <= BucketLayout::kMaxWindowBytes,
                   where, detail::concat("steps[", i, "].", what), count, "in [0, 2^48]");
  };
  auto check_dtype = [&](std::size_t i, const char* what, DType d) {
    TIDE_CHECK_ARG(known_dtype(d), where, detail::concat("steps[", i, "].", what),
                   static_cast<int>(d), "bf16, fp16 or fp32");
  };
  auto check_peer = [&](std::size_t i, int peer, FlagKind kind) {
    TIDE_CHECK_ARG(peer >= 0 && peer < world && peer != rank, where,
                   detail::concat("steps[", i, "].peer"), peer,
                   detail::concat("a rank in [0, ", world, ") other than ", rank));
    TIDE_CHECK_ARG(static_cast<int>(kind) < kNumFlagKinds, where,
                   detail::concat("steps[", i, "].kind"), static_cast<int>(kind),
                   "slot_free or data_ready");
  };

  for (std::size_t i = 0; i < program.steps.size(); ++i) {
    const Step& step = program.steps[i];
    TIDE_CHECK_ARG(static_cast<int>(step.phase) <= static_cast<int>(Phase::kReduce), where,
                   detail::concat("steps[", i, "].phase"), static_cast<int>(step.phase),
                   "a Phase");
    TIDE_CHECK_ARG(!step.op.valueless_by_exception(), where, detail::concat("steps[", i, "].op"),
                   "valueless", "an operation");
    if (const auto* cast = std::get_if<CastOp>(&step.op)) {
      check_count(i, "count", cast->count);
      check_count(i, "pad", cast->pad);
      check_dtype(i, "src_dtype", cast->src_dtype);
      check_dtype(i, "dst_dtype", cast->dst_dtype);
      TIDE_CHECK_ARG(cast->dst.space == Space::kWindow && cast->dst.index == rank, where,
                     detail::concat("steps[", i, "].dst"), "another buffer",
                     detail::concat("the own window (window[", rank, "])"));
      check(i, "", -1, "src", cast->src, cast->count * dtype_size(cast->src_dtype), false);
      check(i, "", -1, "dst", cast->dst, (cast->count + cast->pad) * dtype_size(cast->dst_dtype),
            true);
    } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
      for (std::size_t k = 0; k < batch->copies.size(); ++k) {
        const CopyOp& c = batch->copies[k];
        TIDE_CHECK_ARG(c.bytes <= BucketLayout::kMaxWindowBytes, where,
                       detail::concat("steps[", i, "].copies[", k, "].bytes"), c.bytes, "<= 2^48");
        check(i, "copies", static_cast<long>(k), ".src", c.src, c.bytes, false);
        check(i, "copies", static_cast<long>(k), ".dst", c.dst, c.bytes, true);
      }
    } else if (const auto* signal = std::get_if<SignalOp>(&step.op)) {
      check_peer(i, signal->peer, signal->kind);
    } else if (const auto* wait = std::get_if<WaitOp>(&step.op)) {
      check_peer(i, wait->peer, wait->kind);
    } else if (const auto* reduce = std::get_if<ReduceOp>(&step.op)) {
      check_count(i, "count", reduce->count);
      check_dtype(i, "src_dtype", reduce->src_dtype);
      check_dtype(i, "dst_dtype", reduce->dst_dtype);
      TIDE_CHECK_ARG(reduce->param >= 0 && reduce->param < program.num_params, where,
                     detail::concat("steps[", i, "].param"), reduce->param,
                     detail::concat("in [0, ", program.num_params, ")"));
      TIDE_CHECK_ARG(reduce->sources.size() == static_cast<std::size_t>(world), where,
                     detail::concat("steps[", i, "].sources.size()"), reduce->sources.size(),
                     detail::concat(world, " (one per rank)"));
      for (std::size_t k = 0; k < reduce->sources.size(); ++k)
        check(i, "sources", static_cast<long>(k), "", reduce->sources[k],
              reduce->count * dtype_size(reduce->src_dtype), false);
      check(i, "", -1, "dst", reduce->dst, reduce->count * dtype_size(reduce->dst_dtype), true);
    }
  }
}

}  // namespace tide
