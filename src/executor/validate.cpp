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

bool known_dtype(DType d) { return is_float(d) || d == DType::kU8; }

// CHECK(cond, argument, value, expected): in the fast pass (kExplain false) a failed condition only
// returns false, and the message's operands are not even compiled; the explaining pass throws the
// InvalidArgument. One source for both, so they cannot disagree.
#define CHECK(cond, argument, value, expected)                                       \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      if constexpr (kExplain) TIDE_CHECK_ARG(false, where, argument, value, expected); \
      return false;                                                                  \
    }                                                                                \
  } while (0)

// Every address, count, dtype, peer and flag of every step.
template <bool kExplain>
bool check_steps(const Program& program, const Bindings& bindings, int rank, int world,
                 std::size_t window_bytes, bool net_supported) {
  [[maybe_unused]] const char* where = "Executor::run";
  bool has_net = false;
  for (const Step& step : program.steps)
    if (std::holds_alternative<NetSendOp>(step.op) || std::holds_alternative<NetRecvOp>(step.op)) {
      has_net = true;
      break;
    }
  // a: the address of `bytes` bytes that step i's operand `what` (or `list`[k].`what` when k >= 0)
  // reads, or writes if `write`.
  auto check = [&](std::size_t i, const char* list, long k, const char* what, const Address& a,
                   std::size_t bytes, bool write) -> bool {
    [[maybe_unused]] auto name = [&](const char* field) {
      return k < 0 ? detail::concat("steps[", i, "].", what, field)
                   : detail::concat("steps[", i, "].", list, "[", k, "]", what, field);
    };
    switch (a.space) {
      case Space::kWindow:
        CHECK(a.index >= 0 && a.index < world, name(".index"), a.index,
              detail::concat("a rank in [0, ", world, ")"));
        CHECK(a.offset <= window_bytes && bytes <= window_bytes - a.offset, name(""),
              detail::concat("[", a.offset, ", +", bytes, ") of window[", a.index, "]"),
              detail::concat("inside the window's ", window_bytes, " B"));
        return true;
      case Space::kInput:
      case Space::kOutput: {
        const bool input = a.space == Space::kInput;
        CHECK(!(write && input), name(".space"), "input",
              "a window or an output (inputs are read-only)");
        const std::size_t n = input ? bindings.inputs.size() : bindings.outputs.size();
        CHECK(a.index >= 0 && static_cast<std::size_t>(a.index) < n, name(".index"), a.index,
              detail::concat("a param in [0, ", n, ")"));
        const void* p = input ? bindings.inputs[a.index] : bindings.outputs[a.index];
        CHECK(bytes == 0 || p != nullptr, detail::concat(input ? "inputs[" : "outputs[", a.index, "]"),
              "null", "a buffer");
        CHECK(a.offset <= BucketLayout::kMaxWindowBytes, name(".offset"), a.offset, "<= 2^48");
        return true;
      }
    }
    CHECK(false, name(".space"), static_cast<int>(a.space), "window, input or output");
    return false;
  };
  // Element counts: non-negative and small enough that count * element size cannot overflow.
  auto check_count = [&](std::size_t i, const char* what, int64_t count) -> bool {
    CHECK(count >= 0 && static_cast<uint64_t>(count) <= BucketLayout::kMaxWindowBytes,
          detail::concat("steps[", i, "].", what), count, "in [0, 2^48]");
    return true;
  };
  auto check_dtype = [&](std::size_t i, const char* what, DType d) -> bool {
    CHECK(is_float(d), detail::concat("steps[", i, "].", what), static_cast<int>(d),
          "bf16, fp16 or fp32");
    return true;
  };
  // A cast's types: floats, u8 bytes copied as they are (u8 to u8, never to or from a float), or
  // a float into e4m3, scaled by its param's bound scale.
  auto check_cast_dtypes = [&](std::size_t i, const CastOp& cast) -> bool {
    const DType src = cast.src_dtype, dst = cast.dst_dtype;
    CHECK(known_dtype(src), detail::concat("steps[", i, "].src_dtype"), static_cast<int>(src),
          "bf16, fp16, fp32 or u8");
    CHECK(known_dtype(dst) || is_scaled(dst), detail::concat("steps[", i, "].dst_dtype"),
          static_cast<int>(dst), "bf16, fp16, fp32, u8 or e4m3");
    CHECK(is_float(src) == (is_float(dst) || is_scaled(dst)), detail::concat("steps[", i, "].dst_dtype"),
          dtype_name(dst),
          detail::concat(is_float(src) ? "a float or e4m3" : "u8", " for a ", dtype_name(src), " source"));
    if (is_scaled(dst)) {
      CHECK(cast.src.space == Space::kInput, detail::concat("steps[", i, "].src"), "not an input",
            detail::concat("an input (a ", dtype_name(dst), " cast scales its param's input)"));
      const int param = cast.src.index;
      CHECK(param >= 0 && static_cast<std::size_t>(param) < bindings.scales.size() &&
                bindings.scales[param] != nullptr,
            detail::concat("scales[", param, "]"), "missing",
            detail::concat("the fp32 scale of the ", dtype_name(dst), " cast at steps[", i, "]"));
    }
    return true;
  };
  auto check_peer = [&](std::size_t i, int peer, FlagKind kind) -> bool {
    CHECK(peer >= 0 && peer < world && peer != rank, detail::concat("steps[", i, "].peer"), peer,
          detail::concat("a rank in [0, ", world, ") other than ", rank));
    CHECK(static_cast<int>(kind) < kNumFlagKinds, detail::concat("steps[", i, "].kind"),
          static_cast<int>(kind), "slot_free or data_ready");
    return true;
  };

  for (std::size_t i = 0; i < program.steps.size(); ++i) {
    const Step& step = program.steps[i];
    CHECK(static_cast<int>(step.phase) <= static_cast<int>(Phase::kReduce),
          detail::concat("steps[", i, "].phase"), static_cast<int>(step.phase), "a Phase");
    CHECK(!step.op.valueless_by_exception(), detail::concat("steps[", i, "].op"), "valueless",
          "an operation");
    if (const auto* cast = std::get_if<CastOp>(&step.op)) {
      if (!check_count(i, "count", cast->count) || !check_count(i, "pad", cast->pad) ||
          !check_count(i, "rows", cast->rows) || !check_cast_dtypes(i, *cast))
        return false;
      CHECK(cast->dst.space == Space::kWindow, detail::concat("steps[", i, "].dst"),
            "an input or output", "a window (own, or a peer's with Delivery::kCastToPeers)");
      const std::size_t dst_size = dtype_size(cast->dst_dtype);
      CHECK(cast->rows >= 1, detail::concat("steps[", i, "].rows"), cast->rows, ">= 1");
      if (cast->rows > 1) {  // a strided destination: whole elements apart, rows apart, no padding
        CHECK(cast->pad == 0, detail::concat("steps[", i, "].pad"), cast->pad, "0 when rows > 1");
        CHECK(cast->dst_pitch % dst_size == 0 && cast->dst_pitch >= cast->count * dst_size &&
                  cast->dst_pitch <= BucketLayout::kMaxWindowBytes / (cast->rows - 1),
              detail::concat("steps[", i, "].dst_pitch"), cast->dst_pitch,
              detail::concat("a multiple of ", dst_size, " B, >= the row's ", cast->count * dst_size,
                             " B, and rows x pitch <= 2^48"));
        CHECK(cast->count <= static_cast<int64_t>(BucketLayout::kMaxWindowBytes) / cast->rows,
              detail::concat("steps[", i, "].rows"), cast->rows, "rows x count <= 2^48");
      }
      if (!check(i, "", -1, "src", cast->src, cast->rows * cast->count * dtype_size(cast->src_dtype),
                 false) ||
          !check(i, "", -1, "dst", cast->dst, cast->dst_extent(), true))
        return false;
    } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
      for (std::size_t k = 0; k < batch->copies.size(); ++k) {
        const CopyOp& c = batch->copies[k];
        const auto field = [&](const char* name) {
          return detail::concat("steps[", i, "].copies[", k, "].", name);
        };
        CHECK(c.bytes <= BucketLayout::kMaxWindowBytes, field("bytes"), c.bytes, "<= 2^48");
        CHECK(c.rows >= 1 && c.rows <= BucketLayout::kMaxWindowBytes, field("rows"), c.rows,
              "in [1, 2^48]");
        if (c.rows > 1) {  // rows apart (any order is correct) and the extent within 2^48
          CHECK(c.src_pitch >= c.bytes && c.src_pitch <= BucketLayout::kMaxWindowBytes / (c.rows - 1),
                field("src_pitch"), c.src_pitch,
                detail::concat(">= bytes (", c.bytes, ") and rows x pitch <= 2^48"));
          CHECK(c.dst_pitch >= c.bytes && c.dst_pitch <= BucketLayout::kMaxWindowBytes / (c.rows - 1),
                field("dst_pitch"), c.dst_pitch,
                detail::concat(">= bytes (", c.bytes, ") and rows x pitch <= 2^48"));
        }
        if (!check(i, "copies", static_cast<long>(k), ".src", c.src, c.src_extent(), false) ||
            !check(i, "copies", static_cast<long>(k), ".dst", c.dst, c.dst_extent(), true))
          return false;
      }
    } else if (const auto* signal = std::get_if<SignalOp>(&step.op)) {
      if (!check_peer(i, signal->peer, signal->kind)) return false;
    } else if (const auto* wait = std::get_if<WaitOp>(&step.op)) {
      if (!check_peer(i, wait->peer, wait->kind)) return false;
    } else if (const auto* send = std::get_if<NetSendOp>(&step.op)) {
      CHECK(net_supported, detail::concat("steps[", i, "]"), "a NetSendOp",
            "no network ops: this executor has no network transport (a CudaExecutor needs an "
            "NcclComm, or a window created with CudaWindowScope::kHost)");
      CHECK(send->peer >= 0 && send->peer < world && send->peer != rank,
            detail::concat("steps[", i, "].peer"), send->peer,
            detail::concat("a rank in [0, ", world, ") other than ", rank));
      CHECK(send->channel >= 0 && send->channel < kNetChannels,
            detail::concat("steps[", i, "].channel"), send->channel,
            detail::concat("in [0, ", kNetChannels, ")"));
      CHECK(send->src.space == Space::kWindow && send->src.index == rank,
            detail::concat("steps[", i, "].src"), "another buffer",
            detail::concat("the own window (window[", rank, "])"));
      if (!check(i, "", -1, "src", send->src, send->bytes, false)) return false;
    } else if (const auto* recv = std::get_if<NetRecvOp>(&step.op)) {
      CHECK(net_supported, detail::concat("steps[", i, "]"), "a NetRecvOp",
            "no network ops: this executor has no network transport (a CudaExecutor needs an "
            "NcclComm, or a window created with CudaWindowScope::kHost)");
      CHECK(recv->peer >= 0 && recv->peer < world && recv->peer != rank,
            detail::concat("steps[", i, "].peer"), recv->peer,
            detail::concat("a rank in [0, ", world, ") other than ", rank));
      CHECK(recv->channel >= 0 && recv->channel < kNetChannels,
            detail::concat("steps[", i, "].channel"), recv->channel,
            detail::concat("in [0, ", kNetChannels, ")"));
      CHECK(recv->dst.space == Space::kWindow && recv->dst.index == rank,
            detail::concat("steps[", i, "].dst"), "another buffer",
            detail::concat("the own window (window[", rank, "])"));
      if (!check(i, "", -1, "dst", recv->dst, recv->bytes, true)) return false;
    } else if (const auto* reduce = std::get_if<ReduceOp>(&step.op)) {
      if (!check_count(i, "count", reduce->count) || !check_dtype(i, "src_dtype", reduce->src_dtype) ||
          !check_dtype(i, "dst_dtype", reduce->dst_dtype))
        return false;
      CHECK(reduce->param >= 0 && reduce->param < program.num_params,
            detail::concat("steps[", i, "].param"), reduce->param,
            detail::concat("in [0, ", program.num_params, ")"));
      if (has_net)  // across-node plans reduce local ranks' chunks and received partials
        CHECK(!reduce->sources.empty() && reduce->sources.size() <= static_cast<std::size_t>(world),
              detail::concat("steps[", i, "].sources.size()"), reduce->sources.size(),
              detail::concat("in [1, ", world, "]"));
      else
        CHECK(reduce->sources.size() == static_cast<std::size_t>(world),
              detail::concat("steps[", i, "].sources.size()"), reduce->sources.size(),
              detail::concat(world, " (one per rank)"));
      const std::size_t src_bytes = reduce->count * dtype_size(reduce->src_dtype);
      for (std::size_t k = 0; k < reduce->sources.size(); ++k)
        if (!check(i, "sources", static_cast<long>(k), "", reduce->sources[k], src_bytes, false))
          return false;
      if (!check(i, "", -1, "dst", reduce->dst, reduce->count * dtype_size(reduce->dst_dtype), true))
        return false;
      if (reduce->partial) {
        CHECK(has_net && reduce->partial->space == Space::kWindow && reduce->partial->index == rank,
              detail::concat("steps[", i, "].partial"), "set",
              "unset (single node) or in the own window (across-node)");
        CHECK(reduce->partial_dtype == DType::kFP32 || reduce->partial_dtype == DType::kBF16,
              detail::concat("steps[", i, "].partial_dtype"), dtype_name(reduce->partial_dtype),
              "fp32 or bf16 (AcrossNodesOptions::wire_dtype)");
        const std::size_t size = dtype_size(reduce->partial_dtype);
        CHECK(reduce->partial->offset % size == 0, detail::concat("steps[", i, "].partial.offset"),
              reduce->partial->offset,
              detail::concat("a multiple of ", size, " (", dtype_name(reduce->partial_dtype), ")"));
        if (!check(i, "", -1, "partial", *reduce->partial, reduce->count * size, false)) return false;
      }
    }
  }
  return true;
}

#undef CHECK

}  // namespace

// Everything an executor dereferences is checked here, so no program or bindings can make it touch
// memory outside the windows and the bound buffers (whose sizes it cannot know: their owner's part).
// The steps are checked once without building any message (a run's launch cost), and only a
// program that fails is checked again to explain why.
void validate_run(const Program& program, const Bindings& bindings, int rank, int world,
                  std::size_t window_bytes, const void* window_base, bool net_supported) {
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
  if (check_steps<false>(program, bindings, rank, world, window_bytes, net_supported)) return;
  check_steps<true>(program, bindings, rank, world, window_bytes, net_supported);  // throws the first problem
  throw InvalidArgument("Executor::run: program = rejected, expected a valid program");  // unreachable
}

}  // namespace tide
