// exchange_fds: SCM_RIGHTS over abstract Unix sockets. Each rank binds a listener before the
// names are exchanged (so peers can connect at once), then serves as many connections as peers
// asked for its descriptor from a thread while it connects to the ranks it asks for itself.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <exception>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "tide/bootstrap.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

using Clock = std::chrono::steady_clock;

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

[[noreturn]] void throw_errno(const std::string& what) {
  throw SystemError(detail::concat("exchange_fds: ", what, " failed: ", std::strerror(errno)));
}

sockaddr_un address_of(const std::string& name, socklen_t& length) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  a.sun_path[0] = '\0';  // abstract namespace: nothing on disk to clean up
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

// Waits for `events` on fd until `deadline`; false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) throw_errno("poll");
  }
}

void send_fd(int socket, int fd) {
  char byte = 'f';
  iovec io{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &io, msg.msg_iovlen = 1;
  msg.msg_control = control, msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (::sendmsg(socket, &msg, MSG_NOSIGNAL) != 1) throw_errno("sendmsg");
}

int receive_fd(int socket) {
  char byte = 0;
  iovec io{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &io, msg.msg_iovlen = 1;
  msg.msg_control = control, msg.msg_controllen = sizeof control;
  if (::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC) != 1) throw_errno("recvmsg");
  const cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (!c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
    throw SystemError("exchange_fds: a peer answered without a file descriptor");
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

}  // namespace

std::vector<int> exchange_fds(Bootstrap& bootstrap, int mine, const std::vector<int>& from,
                              std::chrono::milliseconds timeout) {
  const int rank = bootstrap.rank(), world = bootstrap.world();
  for (int q : from)
    TIDE_CHECK_ARG(q >= 0 && q < world && q != rank, "exchange_fds", "from rank", q,
                   detail::concat("another rank in [0, ", world, ")"));
  TIDE_CHECK_ARG(from.empty() || mine >= 0, "exchange_fds", "mine", mine, "an open descriptor");

  Fd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) throw_errno("socket");
  std::random_device rd;
  const std::string name = detail::concat("tide-fd-", ::getpid(), "-", rd(), "-", rank);
  socklen_t length = 0;
  const sockaddr_un address = address_of(name, length);
  if (::bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0)
    throw_errno("bind");
  if (::listen(listener.get(), world) != 0) throw_errno("listen");

  // "<name> <pid> <q1>,<q2>,..." : where to find me, who I am, whose descriptors I ask for.
  std::ostringstream mine_line;
  mine_line << name << ' ' << ::getpid() << ' ';
  for (int q : from) mine_line << q << ',';
  const std::vector<std::string> all = bootstrap.allgather(mine_line.str());
  std::vector<std::string> names(world);
  std::vector<pid_t> asker_pids;  // the processes allowed to take my descriptor
  for (int r = 0; r < world; ++r) {
    std::istringstream in(all[r]);
    std::string asks;
    long pid = 0;
    in >> names[r] >> pid >> asks;
    std::istringstream list(asks);
    for (std::string q; std::getline(list, q, ',');)
      if (!q.empty() && std::stoi(q) == rank) asker_pids.push_back(static_cast<pid_t>(pid));
  }
  const int askers = static_cast<int>(asker_pids.size());

  const Clock::time_point deadline = Clock::now() + timeout;
  std::exception_ptr server_error;
  std::thread server([&] {
    try {
      for (int served = 0; served < askers; ++served) {
        if (!wait_for(listener.get(), POLLIN, deadline))
          throw TimeoutError(detail::concat("exchange_fds: rank ", rank, " served ", served, " of ",
                                            askers, " peers asking for its descriptor within ",
                                            timeout.count(), " ms"));
        Fd client(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (client.get() < 0) throw_errno("accept");
        // Abstract socket names are visible to every process of the network namespace: hand the
        // descriptor (GPU memory) only to a process of a rank that asked for it.
        ucred peer{};
        socklen_t peer_length = sizeof peer;
        if (::getsockopt(client.get(), SOL_SOCKET, SO_PEERCRED, &peer, &peer_length) != 0)
          throw_errno("getsockopt(SO_PEERCRED)");
        const auto it = std::find(asker_pids.begin(), asker_pids.end(), peer.pid);
        if (it == asker_pids.end()) {
          --served;  // not a rank: refused, and it does not count
          continue;
        }
        asker_pids.erase(it);
        send_fd(client.get(), mine);
      }
    } catch (...) {
      server_error = std::current_exception();
    }
  });

  std::vector<int> received;
  std::exception_ptr client_error;
  try {
    for (int q : from) {
      Fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (s.get() < 0) throw_errno("socket");
      socklen_t peer_length = 0;
      const sockaddr_un peer = address_of(names[q], peer_length);
      if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&peer), peer_length) != 0)
        throw_errno(detail::concat("connect to rank ", q));
      if (!wait_for(s.get(), POLLIN, deadline))
        throw TimeoutError(detail::concat("exchange_fds: rank ", rank, " got no descriptor from rank ",
                                          q, " within ", timeout.count(), " ms"));
      received.push_back(receive_fd(s.get()));
    }
  } catch (...) {
    client_error = std::current_exception();
  }
  server.join();
  if (client_error || server_error) {
    for (int fd : received) ::close(fd);
    std::rethrow_exception(client_error ? client_error : server_error);
  }
  return received;
}

}  // namespace tide
