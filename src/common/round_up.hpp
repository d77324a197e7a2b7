// round_up(v, a): v rounded up to a multiple of a (a > 0). The one definition for every layer
// (layout offsets, planner staging, window segments).
#pragma once

#include <cstddef>

namespace tide::detail {

constexpr std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace tide::detail
