// The CUDA executor's lowering as data (src/executor/cuda/command_list.hpp), on CPU: how many
// driver calls a collective makes, from the program and its run's pointers. Pointers are never
// dereferenced, so the "allocations" here are addresses far apart, like separate cudaMallocs.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "executor/cuda/command_list.hpp"
#include "tide/plan.hpp"

namespace tide {
namespace {

using lowering::CommandKind;

constexpr uintptr_t kAllocationStride = uintptr_t{1} << 32;  // 4 GiB apart: never adjacent

std::byte* allocation(uintptr_t k) { return reinterpret_cast<std::byte*>((k + 1) * kAllocationStride); }

struct Lowered {
  Program program;
  lowering::CommandList list;
  std::map<CommandKind, int> calls;  // commands per kind
  int total = 0;
};

// Rank 0's reduce-scatter of `num_params` params of shape {rows, cols} bf16 at W = 2, each
// gradient and output its own allocation, as the executor lowers it without a cast-to-peers kernel.
Lowered lower_reduce_scatter(int num_params, int64_t rows, int64_t cols, Delivery delivery) {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < num_params; ++i)
    specs.push_back({"p" + std::to_string(i), {rows, cols}, DType::kBF16, DType::kFP32});
  const BucketLayout layout(specs, Topology{1, 2});
  Lowered out;
  out.program = plan_reduce_scatter(layout, 0, ReduceOptions{}, 1, AcrossNodesOptions{}, delivery);
  Bindings bindings;
  uintptr_t next = 0;
  const std::vector<std::byte*> windows{allocation(next++), allocation(next++)};
  for (int i = 0; i < num_params; ++i) {
    bindings.inputs.push_back(allocation(next++));
    bindings.outputs.push_back(allocation(next++));
  }
  validate_run(out.program, bindings, 0, 2, out.program.window_bytes, windows[0], false);
  const lowering::LoweringContext context{&windows, nullptr, out.program.steps.size()};
  lowering::lower(out.program, bindings, context, out.list);
  for (const lowering::Command& c : out.list.commands) ++out.calls[c.kind];
  out.total = static_cast<int>(out.list.commands.size());
  return out;
}

// The push delivery's calls at W = 2: the pushes to the peer, the slot-free and data-ready flag
// calls, one reduce kernel. The same for 1, 48 and 512 params: the host's cost per bucket does not
// grow with its param count (it grew by one copy-engine operation per param, ~4.4 us of host each).
TEST(CommandList, ReduceScatterDriverCallsDoNotGrowWithParams) {
  const Lowered one = lower_reduce_scatter(1, 256, 128, Delivery::kPush);
  const Lowered some = lower_reduce_scatter(48, 256, 128, Delivery::kPush);
  const Lowered many = lower_reduce_scatter(512, 256, 128, Delivery::kPush);
  EXPECT_EQ(many.calls, some.calls);
  EXPECT_EQ(many.total, one.total);
  EXPECT_EQ(many.calls.at(CommandKind::kCopyKernel), 1);
  EXPECT_EQ(many.calls.count(CommandKind::kEngineCopies), 0u);
  EXPECT_EQ(many.calls.at(CommandKind::kReduceKernel), 1);
  EXPECT_EQ(one.calls.at(CommandKind::kEngineCopies), 1);  // one copy: the engines, no kernel
  EXPECT_EQ(one.calls.count(CommandKind::kCopyKernel), 0u);
  // 512 tasks of 2 sources are one launch of the reduce kernel's table (kernels.cuh: 584).
  for (const lowering::Command& c : many.list.commands)
    if (c.kind == CommandKind::kReduceKernel) {
      EXPECT_EQ(c.count, 512u);
      EXPECT_EQ(c.num_sources, 2);
    }
}

// Copies of kMinEngineCopyBytes or more stay on the copy engines, in one batch per step, whatever
// their count: their GPU time outweighs the host's cost per copy-engine operation.
TEST(CommandList, LargeCopiesStayOnTheCopyEngines) {
  // 8 MiB params: 4 MiB chunks per peer at W = 2.
  const Lowered large = lower_reduce_scatter(6, 2048, 2048, Delivery::kPush);
  EXPECT_EQ(large.calls.count(CommandKind::kCopyKernel), 0u);
  for (const lowering::Command& c : large.list.commands) {
    if (c.kind != CommandKind::kEngineCopies) continue;
    for (std::size_t k = c.first; k < c.first + c.count; ++k)
      EXPECT_GE(large.list.copies[k].bytes, lowering::kMinEngineCopyBytes);
  }
  EXPECT_EQ(large.calls.at(CommandKind::kEngineCopies), 1);
}

TEST(CommandList, KernelTakesOnlyTheManySmallCopies) {
  std::vector<lowering::Copy> copies;
  for (uintptr_t k = 0; k < 7; ++k)
    copies.push_back({allocation(2 * k), allocation(2 * k + 1),
                      k % 3 == 0 ? lowering::kMinEngineCopyBytes : std::size_t{65536}});
  // 3 large (k = 0, 3, 6), 4 small: not more than kMaxEngineCopies, all on the engines.
  EXPECT_EQ(lowering::kernel_copies(copies, 0), 0u);
  copies.push_back({allocation(100), allocation(101), 65536});
  ASSERT_EQ(lowering::kernel_copies(copies, 0), 5u);  // 5 small ones, ordered first
  for (std::size_t k = 0; k < copies.size(); ++k)
    EXPECT_EQ(copies[k].bytes < lowering::kMinEngineCopyBytes, k < 5) << k;
}

// A across-node reduce-scatter's ring sums the partial it just received into what it reduced
// before: no reduce kernel may hold a reduce that reads or writes what another of it writes
// (checked pair by pair here), and every reduce step is in exactly one kernel.
TEST(CommandList, ReduceKernelsHoldNoDependentReduces) {
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 24; ++i)
    specs.push_back({"p" + std::to_string(i), {64 + 8 * i, 96}, DType::kBF16, DType::kFP32});
  const BucketLayout layout(specs, Topology{2, 2});
  for (int rank = 0; rank < 4; ++rank) {
    const Program program = plan_reduce_scatter(layout, rank, ReduceOptions{}, 1, AcrossNodesOptions{});
    Bindings bindings;
    uintptr_t next = 0;
    std::vector<std::byte*> windows;
    for (int r = 0; r < 4; ++r) windows.push_back(allocation(next++));
    for (std::size_t i = 0; i < specs.size(); ++i) {
      bindings.inputs.push_back(allocation(next++));
      bindings.outputs.push_back(allocation(next++));
    }
    validate_run(program, bindings, rank, 4, program.window_bytes, windows[rank], true);
    const net::GroupSchedule schedule = net::schedule_groups(program);
    lowering::CommandList list;
    lowering::lower(program, bindings, {&windows, &schedule, program.steps.size()}, list);
    std::size_t reduce_steps = 0, lowered = 0, kernels = 0;
    for (const Step& step : program.steps) reduce_steps += std::holds_alternative<ReduceOp>(step.op);
    for (const lowering::Command& c : list.commands) {
      if (c.kind != CommandKind::kReduceKernel) continue;
      ++kernels;
      lowered += c.count;
      EXPECT_EQ(c.end - c.step, c.count);
      auto span = [](const void* p, int64_t count, DType d) {
        const auto* b = static_cast<const std::byte*>(p);
        return std::pair{b, b + count * dtype_size(d)};
      };
      auto overlap = [](auto a, auto b) { return a.first < b.second && b.first < a.second; };
      for (std::size_t j = c.first; j < c.first + c.count; ++j) {
        const lowering::Reduce& w = list.reduces[j];
        const auto written = span(w.dst, w.count, w.dst_dtype);
        for (std::size_t k = c.first; k < c.first + c.count; ++k) {
          if (k == j) continue;
          const lowering::Reduce& r = list.reduces[k];
          EXPECT_FALSE(overlap(written, span(r.dst, r.count, r.dst_dtype))) << rank << " " << j << " " << k;
          for (int s = 0; s < c.num_sources; ++s) {
            EXPECT_FALSE(overlap(written, span(list.sources[r.first_source + s], r.count, r.src_dtype)))
                << rank << " " << j << " " << k;
          }
          if (r.partial) {
            EXPECT_FALSE(overlap(written, span(r.partial, r.count, r.partial_dtype))) << rank;
          }
        }
      }
    }
    EXPECT_EQ(lowered, reduce_steps) << rank;
    EXPECT_GT(kernels, 0u) << rank;
  }
}

}  // namespace
}  // namespace tide
