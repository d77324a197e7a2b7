// exchange_fds: ranks as processes pass file descriptors (memfds here; CUDA VMM allocations on
// GPUs) through abstract Unix sockets. Every rank reads each peer's content through the received
// descriptor; asymmetric requests; a peer that offers nothing is an error naming it.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>

#include "rank_runner.hpp"
#include "tide/bootstrap.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

int memfd_with(const std::string& text) {
  const int fd = ::memfd_create("tide-test", MFD_CLOEXEC);
  if (fd < 0 || ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    throw std::runtime_error("memfd_create/write failed");
  return fd;
}

std::string read_all(int fd) {
  char buffer[64] = {};
  const ssize_t n = ::pread(fd, buffer, sizeof buffer, 0);
  return n > 0 ? std::string(buffer, static_cast<std::size_t>(n)) : std::string();
}

TEST(FdExchange, EveryRankReadsThePeersItAskedFor) {
  for (int world : {2, 3, 5}) {
    const harness::RankProcesses run = harness::run_rank_processes(world, [&](int rank, Bootstrap& b) {
      const int mine = memfd_with("content of rank " + std::to_string(rank));
      std::vector<int> from;  // asymmetric: even ranks ask everyone, odd ranks only rank 0
      for (int q = 0; q < world; ++q)
        if (q != rank && (rank % 2 == 0 || q == 0)) from.push_back(q);
      const std::vector<int> fds = exchange_fds(b, mine, from, std::chrono::seconds(20));
      std::string report;
      for (std::size_t k = 0; k < fds.size(); ++k) {
        if (read_all(fds[k]) != "content of rank " + std::to_string(from[k]))
          report += "wrong content from rank " + std::to_string(from[k]) + "; ";
        ::close(fds[k]);
      }
      ::close(mine);
      return report.empty() ? std::string("ok ") + std::to_string(fds.size()) : report;
    });
    for (int r = 0; r < world; ++r) {
      const int expected = r % 2 == 0 ? world - 1 : (r == 0 ? 0 : 1);
      EXPECT_EQ(run.reports[r], "ok " + std::to_string(expected)) << "W=" << world << " rank " << r;
    }
  }
}

TEST(FdExchange, APeerThatDoesNotServeIsAnErrorNamingIt) {
  const harness::RankProcesses run = harness::run_rank_processes(2, [&](int rank, Bootstrap& b) {
    if (rank == 0) {  // joins the name exchange without listening anywhere
      b.allgather("tide-fd-nobody-listens-here ");
      return std::string("ok");
    }
    const int mine = memfd_with("x");
    exchange_fds(b, mine, {0}, std::chrono::seconds(5));
    return std::string("no error");
  });
  EXPECT_NE(run.reports[1].find("rank 0"), std::string::npos) << run.reports[1];
  EXPECT_EQ(run.reports[1].find("no error"), std::string::npos) << run.reports[1];
}

TEST(FdExchange, RejectsBadRequests) {
  const harness::RankProcesses run = harness::run_rank_processes(2, [&](int rank, Bootstrap& b) {
    try {
      exchange_fds(b, 3, {rank});  // itself
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  });
  EXPECT_NE(run.reports[0].find("another rank"), std::string::npos) << run.reports[0];
}

}  // namespace
}  // namespace tide

namespace tide {
namespace {

// A process that is not a rank asking for the descriptor (it learnt the socket's name) is refused;
// the rank that asked still gets it.
TEST(FdExchange, AProcessThatDidNotAskIsRefused) {
  const harness::RankProcesses run = harness::run_rank_processes(3, [&](int rank, Bootstrap& b) {
    if (rank == 2) {  // the intruder: joins the name exchange asking for nothing, then connects
      const std::vector<std::string> all = b.allgather("tide-fd-intruder 1 ");
      const std::string name = all[0].substr(0, all[0].find(' '));
      const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      std::memcpy(a.sun_path + 1, name.data(), name.size());
      const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
      // Refused: the connection is closed (or reset, or never accepted once rank 0 has served
      // rank 1 and closed its listener) without a byte or a descriptor.
      ssize_t n = -1;
      char byte = 0;
      if (::connect(s, reinterpret_cast<const sockaddr*>(&a), length) == 0) n = ::recv(s, &byte, 1, 0);
      ::close(s);
      b.barrier();
      return std::string(n > 0 ? "served" : "not served");
    }
    const int mine = memfd_with("rank " + std::to_string(rank));
    const std::vector<int> fds = exchange_fds(b, mine, rank == 1 ? std::vector<int>{0} : std::vector<int>{},
                                              std::chrono::seconds(20));
    std::string report = "ok";
    if (rank == 1 && (fds.size() != 1 || read_all(fds[0]) != "rank 0")) report = "rank 1 lost its descriptor";
    for (int fd : fds) ::close(fd);
    b.barrier();
    return report;
  });
  EXPECT_EQ(run.reports[0], "ok");
  EXPECT_EQ(run.reports[1], "ok");
  EXPECT_EQ(run.reports[2], "not served");
}

}  // namespace
}  // namespace tide
