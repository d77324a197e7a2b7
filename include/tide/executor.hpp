// executor: runs a Program. Binds its symbolic addresses to real buffers: the window (own and
// peers'), and per param one input (all-gather: this rank's shard in shard_dtype, valid rows only;
// reduce-scatter: the full unsharded gradient in the window's dtype) and one output
// (reduce-scatter: this rank's shard in shard_dtype, valid rows only; unused for all-gather).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "tide/plan.hpp"
#include "tide/window.hpp"

namespace tide {

struct Bindings {
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
};

// Every wait's bound. TIDE_TIMEOUT_MS overrides the default (120000 ms).
std::chrono::milliseconds default_timeout();

class Executor {
 public:
  virtual ~Executor() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  // Runs (host) or enqueues (CUDA) one collective; takes the window's next epoch.
  virtual void run(const Program& program, const Bindings& bindings) = 0;
};

// Runs programs on the host: memcpy for copies, a loop for casts and reduces, atomics for flags.
// A wait that exceeds the timeout throws TimeoutError naming rank, peer, bucket, phase and epoch;
// a peer whose signal carries another program's tag throws DesyncError naming both.
class HostExecutor final : public Executor {
 public:
  explicit HostExecutor(HostWindow& window, std::chrono::milliseconds timeout = default_timeout());
  int rank() const override { return window_.rank(); }
  int world() const override { return window_.world(); }
  void run(const Program& program, const Bindings& bindings) override;

 private:
  HostWindow& window_;
  std::chrono::milliseconds timeout_;
};

// Checks a program and its bindings against an executor's window before anything runs: rank and
// world match, the window is large and aligned enough, every input and output a step uses is bound.
// Shared by all executors so they reject bad input identically.
void validate_run(const Program& program, const Bindings& bindings, int rank, int world,
                  std::size_t window_bytes, const void* window_base);

}  // namespace tide
