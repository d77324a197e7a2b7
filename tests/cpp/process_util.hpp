// Beside the rank runner (testing/rank_runner.hpp) for ranks as processes: files through which the
// parent and its children signal each other, and the shared-memory segments the children left.
#pragma once

#include <dirent.h>
#include <sys/types.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace tide::test {

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
