#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <sys/stat.h>
#include <unistd.h>

#include "tide/bootstrap.hpp"
#include "tide/error.hpp"

namespace tide {

FileBootstrap::FileBootstrap(std::string dir, int rank, int world,
                             std::chrono::milliseconds timeout)
    : dir_(std::move(dir)), rank_(rank), world_(world), timeout_(timeout) {
  TIDE_CHECK_ARG(world >= 1, "FileBootstrap", "world", world, ">= 1");
  TIDE_CHECK_ARG(rank >= 0 && rank < world, "FileBootstrap", "rank", rank,
                 detail::concat("in [0, ", world, ")"));
  TIDE_CHECK_ARG(timeout.count() > 0, "FileBootstrap", "timeout_ms", timeout.count(), "> 0");
  struct stat st {};
  TIDE_CHECK_ARG(::stat(dir_.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "FileBootstrap", "dir",
                 "'" + dir_ + "'", "an existing directory");
}

// The last round's file stays: a peer may still be reading it when this rank is done (only the
// next round proves everyone has read it). The directory's owner removes what is left.
FileBootstrap::~FileBootstrap() = default;

std::string FileBootstrap::path(long round, int rank) const {
  return detail::concat(dir_, "/", round, ".", rank);
}

std::vector<std::string> FileBootstrap::allgather(const std::string& mine) {
  const long round = round_++;
  const std::string final_path = path(round, rank_);
  const std::string tmp = final_path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(mine.data(), static_cast<std::streamsize>(mine.size()));
    if (!out) throw SystemError(detail::concat("FileBootstrap: rank ", rank_, " cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), final_path.c_str()) != 0)
    throw SystemError(detail::concat("FileBootstrap: rename ", tmp, ": ", std::strerror(errno)));

  std::vector<std::string> all(world_);
  std::vector<bool> have(world_, false);
  int missing = world_;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  auto sleep = std::chrono::microseconds(50);
  while (missing > 0) {
    for (int r = 0; r < world_; ++r) {
      if (have[r]) continue;
      std::ifstream in(path(round, r), std::ios::binary);
      if (!in) continue;
      std::ostringstream ss;
      ss << in.rdbuf();
      all[r] = ss.str();
      have[r] = true;
      --missing;
    }
    if (missing == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      std::ostringstream absent;
      for (int r = 0; r < world_; ++r)
        if (!have[r]) absent << ' ' << r;
      throw TimeoutError(detail::concat("FileBootstrap: rank ", rank_, " waited ", timeout_.count(),
                                        " ms in round ", round, " for rank(s)", absent.str(),
                                        " (dir ", dir_, ")"));
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(5000));
  }
  // Everyone has finished reading round - 1 before anyone can finish round: drop our file of it.
  if (round >= 1) std::remove(path(round - 1, rank_).c_str());
  return all;
}

}  // namespace tide
