// Ranks as real processes: fork W children over a rendezvous directory, collect what each reports,
// let the parent act on them while they run (kill one), and find shared-memory segments they left.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tide/tide.hpp"

namespace tide::test {

inline std::string make_temp_dir() {
  char tmpl[] = "/tmp/tide-test-XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  if (!dir) throw std::runtime_error("mkdtemp failed");
  return dir;
}

// "TimeoutError: <what>" etc.: the error's class and message, as a child reports it.
inline std::string describe_exception(std::exception_ptr e) {
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

inline bool file_exists(const std::string& path) { return std::filesystem::exists(path); }
inline void touch(const std::string& path) { std::ofstream(path) << "x"; }
// Polls for a file; false after `limit`.
inline bool wait_for_file(const std::string& path,
                          std::chrono::milliseconds limit = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!file_exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

struct ProcessRun {
  std::vector<std::string> reports;  // per rank: what body returned, its error, or "" if killed
  std::vector<pid_t> pids;
  std::vector<int> statuses;         // waitpid status per rank
  bool hung = false;                 // a child had to be killed by the watchdog
};

// Forks `world` ranks; rank r runs body(r, bootstrap, dir) and reports its return value (or its
// exception, see describe_exception) to the parent through `dir`. parent(pids, dir), if given, runs
// in the parent meanwhile (and may kill children). Children still running after `limit` are killed.
inline ProcessRun run_processes(
    int world, const std::function<std::string(int, Bootstrap&, const std::string&)>& body,
    const std::function<void(const std::vector<pid_t>&, const std::string&)>& parent = {},
    std::chrono::milliseconds limit = std::chrono::seconds(120)) {
  const std::string dir = make_temp_dir();
  ProcessRun run;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::string report;
      try {
        FileBootstrap bootstrap(dir, r, world, std::chrono::milliseconds(30000));
        report = body(r, bootstrap, dir);
      } catch (...) {
        report = describe_exception(std::current_exception());
      }
      {
        std::ofstream out(dir + "/report." + std::to_string(r) + ".tmp");
        out << report;
      }
      std::filesystem::rename(dir + "/report." + std::to_string(r) + ".tmp",
                              dir + "/report." + std::to_string(r));
      ::_exit(0);
    }
    run.pids.push_back(pid);
  }
  if (parent) parent(run.pids, dir);
  run.statuses.assign(world, 0);
  std::vector<bool> reaped(world, false);
  int left = world;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (left > 0) {
    for (int r = 0; r < world; ++r) {
      if (reaped[r]) continue;
      const pid_t w = ::waitpid(run.pids[r], &run.statuses[r], WNOHANG);
      if (w == run.pids[r] || (w < 0 && errno == ECHILD)) reaped[r] = true, --left;  // ECHILD:
    }                                                                 // the parent hook reaped it
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      run.hung = true;
      for (int r = 0; r < world; ++r)
        if (!reaped[r]) ::kill(run.pids[r], SIGKILL);
      for (int r = 0; r < world; ++r)
        if (!reaped[r]) ::waitpid(run.pids[r], &run.statuses[r], 0), reaped[r] = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  run.reports.assign(world, "");
  for (int r = 0; r < world; ++r) {
    std::ifstream in(dir + "/report." + std::to_string(r));
    std::getline(in, run.reports[r], '\0');
  }
  std::filesystem::remove_all(dir);
  return run;
}

// Segments in /dev/shm created by the given processes (HostWindow names them /tide.<pid>....).
inline std::set<std::string> shm_segments_of(const std::vector<pid_t>& pids) {
  std::set<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      for (pid_t pid : pids)
        if (std::strncmp(e->d_name, ("tide." + std::to_string(pid) + ".").c_str(),
                         6 + std::to_string(pid).size()) == 0)
          names.insert(e->d_name);
    ::closedir(d);
  }
  return names;
}

}  // namespace tide::test
