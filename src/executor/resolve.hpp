// How every executor turns a program's symbolic Address into a pointer: window[r] through the
// executor's own window (host shared memory or device memory), inputs and outputs through the
// run's Bindings (validate_run has checked every index and range).
#pragma once

#include <cstddef>

#include "tide/executor.hpp"

namespace tide::detail {

// window_data(r): rank r's window data as mapped here; asked only for window addresses.
template <class WindowData>
std::byte* resolve_address(const Address& a, const Bindings& bindings, WindowData&& window_data) {
  switch (a.space) {
    case Space::kWindow: return window_data(a.index) + a.offset;
    case Space::kInput:
      return const_cast<std::byte*>(static_cast<const std::byte*>(bindings.inputs[a.index])) +
             a.offset;
    case Space::kOutput: return static_cast<std::byte*>(bindings.outputs[a.index]) + a.offset;
  }
  return nullptr;
}

}  // namespace tide::detail
