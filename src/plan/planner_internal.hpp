// Planner pieces shared between the single-node and the multi-node planners.
#pragma once

#include "tide/plan.hpp"

namespace tide::detail {

void check_reduce_options(const BucketLayout& layout, const ReduceOptions& options);
// A program with its header filled in and no steps; checks rank and bucket (`where` names the API).
Program empty_program(Collective collective, const BucketLayout& layout, int rank, uint32_t bucket,
                      const char* where);
Program plan_all_gather_one_node(const BucketLayout& layout, int rank, uint32_t bucket);
Program plan_reduce_scatter_one_node(const BucketLayout& layout, int rank,
                                     const ReduceOptions& options, uint32_t bucket);

}  // namespace tide::detail
