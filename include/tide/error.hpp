// Errors thrown by TIDE. Every error names the offending value and what was expected, so the
// message alone is enough to act on; waits name rank, bucket, phase and epoch.
#pragma once

#include <charconv>
#include <locale>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace tide {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input at the API boundary.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A wait that did not complete in time (a peer that never arrived, died, or is stuck).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// Ranks disagree on which collective they are running (mismatched call order).
class DesyncError : public Error {
 public:
  using Error::Error;
};

// A failure reported by the operating system or the CUDA driver/runtime.
class SystemError : public Error {
 public:
  using Error::Error;
};

namespace detail {
// Appends one value as text. Numbers go through std::to_chars: independent of the global locale
// (a user's std::locale::global must not put separators into offsets) and of iostreams.
template <class T>
void append(std::string& out, const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    out += value ? "true" : "false";
  } else if constexpr (std::is_same_v<T, char>) {
    out += value;
  } else if constexpr (std::is_arithmetic_v<T>) {
    char buf[64];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value);
    out.append(buf, ec == std::errc() ? end : buf);
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(value);
  } else {  // anything else with an operator<< (pointers, ...), in the classic locale
    std::ostringstream os;
    os.imbue(std::locale::classic());
    os << value;
    out += os.str();
  }
}

template <class... Args>
std::string concat(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}
}  // namespace detail

// Throws InvalidArgument("<where>: <argument> = <value>, expected <expected>") unless cond holds.
#define TIDE_CHECK_ARG(cond, where, argument, value, expected)                                \
  do {                                                                                        \
    if (!(cond))                                                                              \
      throw ::tide::InvalidArgument(::tide::detail::concat(where, ": ", argument, " = ", value, \
                                                           ", expected ", expected));          \
  } while (0)

}  // namespace tide
