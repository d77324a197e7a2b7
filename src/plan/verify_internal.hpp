// What verify.cpp (single node) and verify_net.cpp (across nodes) share.
#pragma once

#include <vector>

#include "tide/plan.hpp"

#include <cstddef>
#include <string>

namespace tide::detail {

// Throws Error "verify_programs: <collective> rank <r> step <step>: <what>".
[[noreturn]] void fail(const Program& program, std::size_t step, const std::string& what);

// programs[r] belongs to the set: its rank is r, and its world, collective, bucket and param count
// are programs[0]'s (world = programs.size()); fails naming the program otherwise.
void check_joins_set(const std::vector<Program>& programs, int r, int num_params);

// Every signal is waited for exactly once (a rank that skips its data-ready wait would return
// before its peers' copies landed), and nobody waits for a flag nobody signals; throws Error
// naming the ranks and the flag otherwise.
void check_signals_pair_with_waits(const std::vector<Program>& programs);

// verify_programs for a topology of several nodes (verify_net.cpp).
void verify_net_programs(const BucketLayout& layout, const std::vector<Program>& programs);

}  // namespace tide::detail
