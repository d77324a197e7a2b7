// Planner pieces shared between the single-node planner (planner.cpp), the across-node all-gather
// (net_planner.cpp) and the across-node reduce-scatter (net_reduce_scatter.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tide/plan.hpp"

namespace tide::detail {

// Across-node staging buffers start at, and are sized in, multiples of this.
inline constexpr std::size_t kStagingAlign = 256;

inline Address win(int rank, std::size_t offset) { return {Space::kWindow, rank, offset}; }

void check_reduce_options(const BucketLayout& layout, const ReduceOptions& options);
void check_net(const AcrossNodesOptions& net, const char* where);
// A program with its header filled in and no steps; checks rank and bucket (`where` names the API).
Program empty_program(Collective collective, const BucketLayout& layout, int rank, uint32_t bucket,
                      const char* where);
// Param i's input shard of `rank`, cast into block(i, rank) of `window`'s window (zero padded;
// strided for a param sharded on a dim > 0).
CastOp shard_cast(const ParamLayout& p, int i, int rank, int window);
// The all-gather's first steps: every param's input shard cast into the own block, zero padded.
void add_cast_in(Program& program, const BucketLayout& layout);
// `delivery` is a Delivery, and kPush when the layout spans several nodes (across-node plans
// push): InvalidArgument otherwise.
void check_delivery(const BucketLayout& layout, Delivery delivery, const char* where);
// Across-node plans shard on dim 0 only: InvalidArgument naming the first param that does not.
void check_dim0_sharding(const BucketLayout& layout, const char* where);
// Local peers of `rank` on its node, staggered (local + 1, local + 2, ...).
std::vector<int> local_peers(const Topology& t, int rank);
// Elements of one reduce-scatter staging chunk (sized for fp32 whatever the wire dtype).
int64_t rs_chunk_elems(const BucketLayout& layout, const AcrossNodesOptions& net);

Program plan_all_gather_one_node(const BucketLayout& layout, int rank, uint32_t bucket,
                                 Delivery delivery);
Program plan_reduce_scatter_one_node(const BucketLayout& layout, int rank,
                                     const ReduceOptions& options, uint32_t bucket,
                                     Delivery delivery);

}  // namespace tide::detail
