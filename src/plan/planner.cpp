// Builds the per-rank programs of TIDE-AG and TIDE-RS (single node). See plan.hpp and docs/DESIGN.md §2.
#include <cmath>
#include <string>

#include "tide/error.hpp"
#include "tide/plan.hpp"
#include "planner_internal.hpp"

namespace tide {

Program detail::empty_program(Collective collective, const BucketLayout& layout, int rank,
                              uint32_t bucket, const char* where) {
  TIDE_CHECK_ARG(rank >= 0 && rank < layout.world(), where, "rank", rank,
                 detail::concat("in [0, ", layout.world(), ")"));
  TIDE_CHECK_ARG(bucket < (1u << 31), where, "bucket", bucket, "< 2^31");
  Program program;
  program.collective = collective;
  program.rank = rank;
  program.world = layout.world();
  program.bucket = bucket;
  program.num_params = static_cast<int>(layout.num_params());
  program.window_bytes = layout.window_bytes();
  program.alignment = layout.alignment();
  return program;
}

CastOp detail::shard_cast(const ParamLayout& p, int i, int rank, int window) {
  const int64_t valid = p.valid_rows(rank) * p.row_numel;
  const int64_t pad = p.rows_per_rank * p.row_numel - valid;
  return {win(window, p.block_offset(rank)), {Space::kInput, i, 0}, valid, pad, p.shard_dtype,
          p.dtype, p.outer_rows, p.outer_rows > 1 ? p.block_pitch : 0};
}

void detail::add_cast_in(Program& program, const BucketLayout& layout) {
  const auto& params = layout.params();
  for (std::size_t i = 0; i < params.size(); ++i)
    program.steps.push_back(
        {Phase::kCastIn, shard_cast(params[i], static_cast<int>(i), program.rank, program.rank)});
}

const char* delivery_name(Delivery delivery) {
  switch (delivery) {
    case Delivery::kPush: return "push";
    case Delivery::kCastToPeers: return "cast_to_peers";
  }
  return "?";
}

Delivery default_delivery(const BucketLayout& layout) {
  return layout.topology().nodes == 1 && layout.world() > 1 &&
                 layout.window_bytes() <= kCastToPeersMaxBytes
             ? Delivery::kCastToPeers
             : Delivery::kPush;
}

void detail::check_delivery(const BucketLayout& layout, Delivery delivery, const char* where) {
  TIDE_CHECK_ARG(delivery == Delivery::kPush || delivery == Delivery::kCastToPeers, where,
                 "delivery", static_cast<int>(delivery), "Delivery::kPush or Delivery::kCastToPeers");
  const int nodes = layout.topology().nodes;
  TIDE_CHECK_ARG(nodes <= 1 || delivery == Delivery::kPush, where, "delivery",
                 delivery_name(delivery),
                 detail::concat("push with ", nodes, " nodes (across-node plans push)"));
}

void detail::check_dim0_sharding(const BucketLayout& layout, const char* where) {
  for (const ParamLayout& p : layout.params())
    TIDE_CHECK_ARG(p.shard_dim == 0, where, detail::concat("param '", p.name, "' shard_dim"),
                   p.shard_dim,
                   detail::concat("0 with ", layout.topology().nodes,
                                  " nodes (across-node plans shard on dim 0 only)"));
}

namespace {

using detail::win;

// Peers in staggered order rank+1, rank+2, ...: at any moment each rank pushes to a different peer,
// so no window receives from everyone at once.
std::vector<int> staggered_peers(int rank, int world) {
  std::vector<int> peers;
  peers.reserve(world > 0 ? world - 1 : 0);
  for (int k = 1; k < world; ++k) peers.push_back((rank + k) % world);
  return peers;
}

void add_slot_free_signals(Program& program, const std::vector<int>& peers) {
  for (int q : peers) program.steps.push_back({Phase::kSlotFree, SignalOp{q, FlagKind::kSlotFree}});
}

// Delivery::kCastToPeers: the whole slot-free handshake before any byte moves, and the whole
// data-ready handshake after the last.
void add_slot_free_handshake(Program& program, const std::vector<int>& peers) {
  add_slot_free_signals(program, peers);
  for (int q : peers) program.steps.push_back({Phase::kSlotFree, WaitOp{q, FlagKind::kSlotFree}});
}

void add_data_ready_handshake(Program& program, const std::vector<int>& peers) {
  for (int q : peers) program.steps.push_back({Phase::kDataReady, SignalOp{q, FlagKind::kDataReady}});
  for (int q : peers) program.steps.push_back({Phase::kDataReady, WaitOp{q, FlagKind::kDataReady}});
}

// For each peer: wait until its window is free, push the batch, tell it the data is there.
template <class MakeBatch>
void add_pushes(Program& program, const std::vector<int>& peers, MakeBatch make_batch) {
  for (int q : peers) {
    program.steps.push_back({Phase::kSlotFree, WaitOp{q, FlagKind::kSlotFree}});
    CopyBatch batch = make_batch(q);
    if (!batch.copies.empty()) program.steps.push_back({Phase::kPush, std::move(batch)});
    program.steps.push_back({Phase::kDataReady, SignalOp{q, FlagKind::kDataReady}});
  }
  for (int q : peers) program.steps.push_back({Phase::kDataReady, WaitOp{q, FlagKind::kDataReady}});
}

// Rank `to`'s copy of rank `from`'s block of param i: the same block in both windows (a 2-D copy
// when the param is sharded on a dim > 0).
CopyOp block_push(const ParamLayout& p, int to, int from) {
  const std::size_t offset = p.block_offset(from);
  return {win(to, offset), win(from, offset), p.block_bytes(), static_cast<std::size_t>(p.outer_rows),
          p.outer_rows > 1 ? p.block_pitch : 0, p.outer_rows > 1 ? p.block_pitch : 0};
}

// Chunk q of param i's gradient (its block q, read in place) into slot(i, from) of rank q's
// window, contiguously. q == from stages the own chunk (dims > 0, where the reduce cannot read it
// from the gradient as one contiguous run).
CopyOp chunk_push(const ParamLayout& p, int i, int q, int from) {
  const std::size_t row = static_cast<std::size_t>(p.valid_rows(q) * p.row_numel) * p.elem_size;
  return {win(q, p.slot_offset(from)), {Space::kInput, i, q * p.block_bytes()}, row,
          static_cast<std::size_t>(p.outer_rows), p.outer_rows > 1 ? p.block_pitch : 0,
          p.outer_rows > 1 ? row : 0};
}

}  // namespace

Program plan_all_gather(const BucketLayout& layout, int rank, uint32_t bucket) {
  return plan_all_gather(layout, rank, bucket, AcrossNodesOptions{}, default_delivery(layout));
}

Program plan_reduce_scatter(const BucketLayout& layout, int rank, const ReduceOptions& options,
                            uint32_t bucket) {
  return plan_reduce_scatter(layout, rank, options, bucket, AcrossNodesOptions{}, default_delivery(layout));
}

namespace detail {

void check_reduce_options(const BucketLayout& layout, const ReduceOptions& options) {
  TIDE_CHECK_ARG(options.kind == ReduceKind::kSum || options.kind == ReduceKind::kAvg,
                 "plan_reduce_scatter", "options.kind", static_cast<int>(options.kind),
                 "kSum or kAvg");
  TIDE_CHECK_ARG(std::isfinite(options.prescale), "plan_reduce_scatter", "options.prescale",
                 options.prescale, "a finite number");
  TIDE_CHECK_ARG(std::isfinite(options.postscale), "plan_reduce_scatter", "options.postscale",
                 options.postscale, "a finite number");
  for (const ParamLayout& p : layout.params()) {
    TIDE_CHECK_ARG(is_float(p.dtype), "plan_reduce_scatter", detail::concat("param '", p.name, "' dtype"),
                   dtype_name(p.dtype), "bf16, fp16 or fp32 (u8 bytes and e4m3 casts are gathered, never reduced)");
    TIDE_CHECK_ARG(p.shard_dtype == DType::kFP32 || p.shard_dtype == p.dtype,
                   "plan_reduce_scatter", detail::concat("param '", p.name, "' shard_dtype"),
                   dtype_name(p.shard_dtype),
                   detail::concat("fp32 or the param's dtype ", dtype_name(p.dtype)));
  }
}

Program plan_all_gather_one_node(const BucketLayout& layout, int rank, uint32_t bucket,
                                 Delivery delivery) {
  Program program = detail::empty_program(Collective::kAllGather, layout, rank, bucket, "plan_all_gather");
  program.delivery = delivery;
  const auto& params = layout.params();
  const std::vector<int> peers = staggered_peers(rank, layout.world());
  if (delivery == Delivery::kCastToPeers) {
    // Every peer's slot-free first: the casts into its window follow, all in one kernel.
    add_slot_free_handshake(program, peers);
    add_cast_in(program, layout);
    for (int q : peers)
      for (std::size_t i = 0; i < params.size(); ++i)
        program.steps.push_back({Phase::kPush, shard_cast(params[i], static_cast<int>(i), rank, q)});
    add_data_ready_handshake(program, peers);
    return program;
  }
  add_cast_in(program, layout);
  add_slot_free_signals(program, peers);
  add_pushes(program, peers, [&](int q) {
    CopyBatch batch;
    for (const ParamLayout& p : params) batch.copies.push_back(block_push(p, q, rank));
    return batch;
  });
  return program;
}

Program plan_reduce_scatter_one_node(const BucketLayout& layout, int rank,
                                     const ReduceOptions& options, uint32_t bucket,
                                     Delivery delivery) {
  Program program =
      detail::empty_program(Collective::kReduceScatter, layout, rank, bucket, "plan_reduce_scatter");
  program.delivery = delivery;
  check_reduce_options(layout, options);
  const auto& params = layout.params();
  const std::vector<int> peers = staggered_peers(rank, layout.world());
  const auto chunks_for = [&](int q) {
    CopyBatch batch;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].valid_numel(q) > 0)
        batch.copies.push_back(chunk_push(params[i], static_cast<int>(i), q, rank));
    return batch;
  };
  const bool handshake_first = delivery == Delivery::kCastToPeers;  // then one run of copies
  if (handshake_first)
    add_slot_free_handshake(program, peers);
  else
    add_slot_free_signals(program, peers);
  CopyBatch own;
  for (std::size_t i = 0; i < params.size(); ++i)
    if (params[i].shard_dim > 0) own.copies.push_back(chunk_push(params[i], static_cast<int>(i), rank, rank));
  if (!own.copies.empty()) program.steps.push_back({Phase::kPush, std::move(own)});
  if (handshake_first) {
    for (int q : peers) {
      CopyBatch batch = chunks_for(q);
      if (!batch.copies.empty()) program.steps.push_back({Phase::kPush, std::move(batch)});
    }
    add_data_ready_handshake(program, peers);
  } else {
    add_pushes(program, peers, chunks_for);
  }
  const float scale = options.kind == ReduceKind::kAvg
                          ? options.postscale / static_cast<float>(layout.world())
                          : options.postscale;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamLayout& p = params[i];
    const int64_t n = p.valid_numel(rank);
    if (n == 0) continue;
    ReduceOp reduce{static_cast<int>(i), {}, {Space::kOutput, static_cast<int>(i), 0}, n,
                    p.dtype, p.shard_dtype, options.prescale, scale, options.accumulate};
    for (int src = 0; src < layout.world(); ++src)
      reduce.sources.push_back(src == rank && p.shard_dim == 0
                                   ? Address{Space::kInput, static_cast<int>(i), rank * p.slot_bytes()}
                                   : win(rank, p.slot_offset(src)));
    program.steps.push_back({Phase::kReduce, std::move(reduce)});
  }
  return program;
}

}  // namespace detail

}  // namespace tide
