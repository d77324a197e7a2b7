// TIDE: zero-copy collectives for FSDP2. The public C++ contract in one header.
//
// Layers (each depends only on those before it; see docs/ARCHITECTURE.md):
//   layout.hpp     params + topology -> shard sizes, padding, param-major window offsets, slots
//   plan.hpp       a collective on a layout -> a per-rank program (copies, signals, waits, reduces)
//   bootstrap.hpp  exchange of bytes between ranks at set-up time
//   window.hpp     a buffer + flags mapped into every rank (host: POSIX shm)
//   executor.hpp   runs programs (host executor here; cuda.hpp for GPUs)
//   tide.hpp       AllGather / ReduceScatter: a planned collective bound to an executor
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "tide/bootstrap.hpp"
#include "tide/dtype.hpp"
#include "tide/error.hpp"
#include "tide/executor.hpp"
#include "tide/layout.hpp"
#include "tide/plan.hpp"
#include "tide/window.hpp"

namespace tide {

// TIDE-AG for one bucket on one rank. Planned once; run every step. Across nodes
// (layout.topology().nodes > 1) the program has network ops: run it on an executor with a network
// transport (HostExecutor; CudaExecutor with an NcclComm), pacing as `net` says. Delivered as
// `delivery` says (unset: default_delivery(layout), plan.hpp).
class AllGather {
 public:
  AllGather(const BucketLayout& layout, int rank, uint32_t bucket = 0, const AcrossNodesOptions& net = {},
            std::optional<Delivery> delivery = std::nullopt)
      : program_(plan_all_gather(layout, rank, bucket, net,
                                 delivery.value_or(default_delivery(layout)))) {}
  const Program& program() const { return program_; }
  // Bytes of window this collective needs per rank: create the window with at least this.
  std::size_t window_bytes() const { return program_.window_bytes; }
  // shards[i]: this rank's valid rows of param i (shard_dtype). Afterwards every rank's window holds
  // every param whole, at layout.param(i).window_offset. scales[i]: param i's fp32 scale where its
  // dtype is e4m3 (each element is cast as e4m3(x * scale)), else null; empty without such params.
  void run(Executor& executor, std::span<const void* const> shards,
           std::span<const float* const> scales = {}) const {
    executor.run(program_, Bindings{{shards.begin(), shards.end()}, {}, {scales.begin(), scales.end()}});
  }

 private:
  Program program_;
};

// TIDE-RS for one bucket on one rank. grads[i]: the full gradient of param i (the window's dtype);
// outputs[i]: this rank's valid rows of param i (shard_dtype), overwritten or accumulated into.
// Across nodes the window also holds the fixed fp32 staging ring: use window_bytes(). Delivered as
// `delivery` says (unset: default_delivery(layout)).
class ReduceScatter {
 public:
  ReduceScatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                uint32_t bucket = 0, const AcrossNodesOptions& net = {},
                std::optional<Delivery> delivery = std::nullopt)
      : program_(plan_reduce_scatter(layout, rank, options, bucket, net,
                                     delivery.value_or(default_delivery(layout)))) {}
  const Program& program() const { return program_; }
  std::size_t window_bytes() const { return program_.window_bytes; }
  void run(Executor& executor, std::span<const void* const> grads,
           std::span<void* const> outputs) const {
    executor.run(program_, Bindings{{grads.begin(), grads.end()}, {outputs.begin(), outputs.end()}});
  }

 private:
  Program program_;
};

}  // namespace tide
