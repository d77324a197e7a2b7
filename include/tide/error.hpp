// Errors thrown by TIDE. Every error names the offending value and what was expected, so the
// message alone is enough to act on; waits name rank, bucket, phase and epoch.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
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
