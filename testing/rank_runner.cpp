#include "rank_runner.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "tide/error.hpp"

namespace tide::harness {

TempDir::TempDir() {
  char pattern[] = "/tmp/tide-ranks-XXXXXX";
  if (::mkdtemp(pattern) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

void write_file(const std::string& path, const void* data, std::size_t bytes) {
  {
    std::ofstream out(path + ".tmp", std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  }
  std::filesystem::rename(path + ".tmp", path);
}

bool read_file(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  out = ss.str();
  return true;
}

std::string describe_exception(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const TimeoutError& x) {
    return std::string("TimeoutError: ") + x.what();
  } catch (const DesyncError& x) {
    return std::string("DesyncError: ") + x.what();
  } catch (const InvalidArgument& x) {
    return std::string("InvalidArgument: ") + x.what();
  } catch (const Error& x) {
    return std::string("Error: ") + x.what();
  } catch (const std::exception& x) {
    return std::string("std::exception: ") + x.what();
  } catch (...) {
    return "unknown exception";
  }
}

namespace {

std::string report_path(const std::string& dir, int rank) {
  return dir + "/report." + std::to_string(rank);
}

std::string run_rank(const ReportingRankBody& body, const std::string& dir, int rank, int world,
                     std::chrono::milliseconds bootstrap_timeout) {
  // Before CUDA starts in this rank: enough hardware queues that no two ranks' streams share one
  // (see CudaExecutor in tide/cuda.hpp).
  ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  try {
    FileBootstrap bootstrap(dir, rank, world, bootstrap_timeout);
    return body(rank, bootstrap);
  } catch (...) {
    return describe_exception(std::current_exception());
  }
}

// The report rank r left, or why there is none.
std::string collect_report(const std::string& dir, int rank, const std::string& why_none) {
  std::string report;
  return read_file(report_path(dir, rank), report) ? report : "no result (" + why_none + ")";
}

}  // namespace

RankProcesses run_rank_processes(int world, const ReportingRankBody& body,
                                 const RankProcessOptions& options) {
  std::optional<TempDir> temporary;
  if (options.dir.empty()) temporary.emplace();
  const std::string& dir = temporary ? temporary->path() : options.dir;
  RankProcesses run;
  if (options.single_rank_in_process && world == 1) {
    run.pids = {::getpid()};
    run.statuses = {0};
    run.reports = {run_rank(body, dir, 0, 1, options.bootstrap_timeout)};
    return run;
  }
  // Whatever this process has buffered is printed once, not again by every child.
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t started : run.pids) ::kill(started, SIGKILL), ::waitpid(started, nullptr, 0);
      throw std::runtime_error("fork failed");
    }
    if (pid == 0) {
      const std::string report = run_rank(body, dir, r, world, options.bootstrap_timeout);
      write_file(report_path(dir, r), report.data(), report.size());
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(0);  // no atexit handlers: the parent's state (gtest's) is not the child's to finish
    }
    run.pids.push_back(pid);
  }
  if (options.while_running) options.while_running(run.pids);
  run.reports.assign(world, "");
  run.statuses.assign(world, 0);
  std::vector<bool> reaped(world, false);
  const auto deadline = std::chrono::steady_clock::now() + options.deadline;
  for (int left = world; left > 0;) {
    for (int r = 0; r < world; ++r) {
      if (reaped[r]) continue;
      const pid_t w = ::waitpid(run.pids[r], &run.statuses[r], WNOHANG);
      if (w == run.pids[r]) {
        reaped[r] = true, --left;
        run.reports[r] = collect_report(dir, r, "exit status " + std::to_string(run.statuses[r]));
      } else if (w < 0 && errno == ECHILD) {  // while_running reaped it
        reaped[r] = true, --left;
        run.reports[r] = collect_report(dir, r, "reaped by while_running");
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      run.hung = true;
      for (int r = 0; r < world; ++r)
        if (!reaped[r]) ::kill(run.pids[r], SIGKILL);
      for (int r = 0; r < world; ++r)
        if (!reaped[r]) {
          ::waitpid(run.pids[r], &run.statuses[r], 0);
          run.reports[r] = "killed: still running after the deadline";
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return run;
}

namespace {

std::vector<std::exception_ptr> run_threads(int world, const RankBody& body,
                                            std::chrono::milliseconds bootstrap_timeout) {
  auto rendezvous = make_thread_rendezvous(world);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        ThreadBootstrap bootstrap(rendezvous, r, bootstrap_timeout);
        body(r, bootstrap);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

std::vector<std::string> run_rank_threads(int world, const RankBody& body,
                                          std::chrono::milliseconds bootstrap_timeout) {
  std::vector<std::string> reports;
  for (const std::exception_ptr& e : run_threads(world, body, bootstrap_timeout))
    reports.push_back(e ? describe_exception(e) : "ok");
  return reports;
}

void run_rank_threads_or_throw(int world, const RankBody& body,
                               std::chrono::milliseconds bootstrap_timeout) {
  for (const std::exception_ptr& e : run_threads(world, body, bootstrap_timeout))
    if (e) std::rethrow_exception(e);
}

}  // namespace tide::harness
