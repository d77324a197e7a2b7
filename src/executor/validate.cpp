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

void validate_run(const Program& program, const Bindings& bindings, int rank, int world,
                  std::size_t window_bytes, const void* window_base) {
  const char* where = "Executor::run";
  TIDE_CHECK_ARG(program.world == world, where, "program.world", program.world,
                 detail::concat(world, " (the window's W)"));
  TIDE_CHECK_ARG(program.rank == rank, where, "program.rank", program.rank,
                 detail::concat(rank, " (the window's rank)"));
  TIDE_CHECK_ARG(window_bytes >= program.window_bytes, where, "window data bytes", window_bytes,
                 detail::concat(">= ", program.window_bytes, " (the bucket's window size)"));
  TIDE_CHECK_ARG(reinterpret_cast<uintptr_t>(window_base) % program.alignment == 0, where,
                 "window base", window_base,
                 detail::concat("an address aligned to ", program.alignment, " B"));
  TIDE_CHECK_ARG(static_cast<int>(bindings.inputs.size()) == program.num_params, where,
                 "inputs.size()", bindings.inputs.size(),
                 detail::concat(program.num_params, " (one per param)"));
  const std::size_t outputs_expected =
      program.collective == Collective::kReduceScatter ? program.num_params : 0;
  TIDE_CHECK_ARG(bindings.outputs.size() == outputs_expected, where, "outputs.size()",
                 bindings.outputs.size(), detail::concat(outputs_expected,
                 program.collective == Collective::kReduceScatter ? " (one per param)"
                                                                  : " (all-gather has none)"));
  auto check = [&](const Address& a) {
    if (a.space == Space::kInput)
      TIDE_CHECK_ARG(bindings.inputs[a.index] != nullptr, where,
                     detail::concat("inputs[", a.index, "]"), "null", "a buffer");
    else if (a.space == Space::kOutput)
      TIDE_CHECK_ARG(bindings.outputs[a.index] != nullptr, where,
                     detail::concat("outputs[", a.index, "]"), "null", "a buffer");
  };
  for (const Step& step : program.steps) {
    if (const auto* cast = std::get_if<CastOp>(&step.op)) {
      if (cast->count > 0) check(cast->src);
    } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
      for (const CopyOp& c : batch->copies) check(c.src);
    } else if (const auto* reduce = std::get_if<ReduceOp>(&step.op)) {
      for (const Address& a : reduce->sources) check(a);
      check(reduce->dst);
    }
  }
}

}  // namespace tide
