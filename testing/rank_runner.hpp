// Ranks of a test or benchmark as processes (fork()ed, a FileBootstrap each) or as threads of this
// process (a ThreadBootstrap each), and what each rank reports: the one runner of tests/cpp,
// tests/gpu and bench/cuda (README.md says why it lives here).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "tide/bootstrap.hpp"

namespace tide::harness {

// A fresh directory /tmp/tide-ranks-XXXXXX, removed with its contents at destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Writes under a temporary name, then renames: a process polling for `path` never reads half of it.
void write_file(const std::string& path, const void* data, std::size_t bytes);
// The whole file; false if it cannot be opened.
bool read_file(const std::string& path, std::string& out);

// "TimeoutError: <what>", "DesyncError: ", "InvalidArgument: ", "Error: " (other tide errors),
// "std::exception: ", or "unknown exception": how a rank reports what it threw.
std::string describe_exception(std::exception_ptr e);

// ---- Ranks as processes. ----------------------------------------------------------------------

struct RankProcesses {
  // Per rank: what its body returned ("ok" for a body that returns nothing), what it threw
  // (describe_exception), "no result (...)" if its process ended without a report, or "killed: ..."
  // if it was still running at the deadline.
  std::vector<std::string> reports;
  std::vector<pid_t> pids;
  std::vector<int> statuses;  // waitpid's, per rank (0 for a rank while_running reaped itself)
  bool hung = false;          // the deadline passed and the ranks still running were killed
};

// The defaults are the CPU tests'. Every member has an initializer, so designated initializers may
// leave any out (-Wextra).
struct RankProcessOptions {
  // The ranks' rendezvous directory, where rank r also leaves its report as "report.<r>"; "" for a
  // temporary one, removed afterwards.
  std::string dir = {};
  std::chrono::milliseconds bootstrap_timeout = std::chrono::seconds(30);  // each FileBootstrap's
  // Ranks still running this long after while_running returned are killed.
  std::chrono::milliseconds deadline = std::chrono::seconds(120);
  // Runs in the parent while the ranks run, given their pids (it may signal or reap them).
  std::function<void(const std::vector<pid_t>&)> while_running = {};
  // A world of 1 runs in this process, unforked: under compute-sanitizer a fork()ed child that
  // starts CUDA never finished (H200, 2026-11-30, > 280 s for a case that takes 1 s).
  bool single_rank_in_process = false;
};

using ReportingRankBody = std::function<std::string(int rank, Bootstrap& bootstrap)>;

// Forks `world` ranks; rank r runs body(r, bootstrap) over a FileBootstrap in options.dir and
// reports its return value (or its exception). If the ranks use CUDA, this process must not have
// started it: a fork()ed child of a CUDA process cannot use CUDA.
RankProcesses run_rank_processes(int world, const ReportingRankBody& body,
                                 const RankProcessOptions& options = {});

// A body that returns nothing reports "ok" when it returns.
template <class Body>
  requires std::is_void_v<std::invoke_result_t<Body&, int, Bootstrap&>>
RankProcesses run_rank_processes(int world, Body&& body, const RankProcessOptions& options = {}) {
  return run_rank_processes(
      world,
      ReportingRankBody([&body](int rank, Bootstrap& bootstrap) {
        body(rank, bootstrap);
        return std::string("ok");
      }),
      options);
}

// ---- Ranks as threads. ------------------------------------------------------------------------

using RankBody = std::function<void(int rank, Bootstrap& bootstrap)>;

// Runs body(rank, bootstrap) on `world` threads of this process, each over a ThreadBootstrap
// (`bootstrap_timeout`, by default the CPU tests'); per rank "ok" or what it threw
// (describe_exception).
std::vector<std::string> run_rank_threads(
    int world, const RankBody& body,
    std::chrono::milliseconds bootstrap_timeout = std::chrono::seconds(20));

// The same, rethrowing the lowest failing rank's exception (a test then fails with its text).
void run_rank_threads_or_throw(
    int world, const RankBody& body,
    std::chrono::milliseconds bootstrap_timeout = std::chrono::seconds(20));

}  // namespace tide::harness
