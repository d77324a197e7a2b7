// HostWindow over POSIX shared memory. Segment layout:
// [data (data_bytes, rounded to 64 B)][flags (FlagWord[2][W], rounded to 64 B)][PublishedState].
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/round_up.hpp"
#include "tide/error.hpp"
#include "tide/window.hpp"
#include "window/wire.hpp"

namespace tide {
namespace {

std::size_t data_region_bytes(std::size_t data_bytes) { return detail::round_up(data_bytes, 64); }
std::size_t flag_region_bytes(int world) { return detail::round_up(flag_array_bytes(world), 64); }

std::string unique_segment_name(int rank) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return detail::concat("/tide.", ::getpid(), ".", counter++, ".", rd() & 0xFFFFFF, ".r", rank);
}

std::size_t page_size() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

// Maps segment `name`; returns the mapping and, when keep_fd, the open descriptor in *fd_out.
std::byte* map_segment(const std::string& name, std::size_t bytes, bool create,
                       int* fd_out = nullptr) {
  const int fd = create ? ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                        : ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    throw SystemError(detail::concat("HostWindow: shm_open(", name, "): ", std::strerror(errno)));
  if (create && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw SystemError(detail::concat("HostWindow: ftruncate(", name, ", ", bytes,
                                     "): ", std::strerror(err)));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  if (fd_out != nullptr && p != MAP_FAILED)
    *fd_out = fd;
  else
    ::close(fd);
  if (p == MAP_FAILED) {
    if (create) ::shm_unlink(name.c_str());
    throw SystemError(detail::concat("HostWindow: mmap(", name, ", ", bytes,
                                     " B): ", std::strerror(err)));
  }
  return static_cast<std::byte*>(p);
}

}  // namespace

HostWindow::HostWindow(int rank, std::size_t data_bytes, std::size_t mapped_bytes)
    : rank_(rank), data_bytes_(data_bytes), mapped_bytes_(mapped_bytes) {}

HostWindow::~HostWindow() {
  for (std::byte* p : maps_)
    if (p) ::munmap(p, mapped_bytes_);
  if (own_fd_ >= 0) ::close(own_fd_);
}

void HostAddressRange::map_data_of(const HostWindow& window) {
  const std::size_t bytes = (window.data_bytes_ + page_size() - 1) / page_size() * page_size();
  TIDE_CHECK_ARG(bytes_ >= bytes, "HostAddressRange::map_data_of", "bytes()", bytes_,
                 detail::concat(">= ", bytes, " (the window's data, in pages)"));
  void* p = ::mmap(base_, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, window.own_fd_, 0);
  if (p == MAP_FAILED)
    throw SystemError(detail::concat("HostAddressRange::map_data_of(", static_cast<void*>(base_),
                                     ", ", bytes, " B): ", std::strerror(errno)));
}

HostAddressRange::HostAddressRange(std::size_t bytes) {
  TIDE_CHECK_ARG(bytes > 0, "HostAddressRange", "bytes", bytes, "> 0");
  bytes_ = (bytes + page_size() - 1) / page_size() * page_size();
  void* p = ::mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw SystemError(detail::concat("HostAddressRange: mmap(", bytes_, " B): ", std::strerror(errno)));
  base_ = static_cast<std::byte*>(p);
}

HostAddressRange::~HostAddressRange() {
  if (base_) ::munmap(base_, bytes_);
}

std::unique_ptr<HostWindow> HostWindow::create(Bootstrap& bootstrap, std::size_t data_bytes) {
  const int rank = bootstrap.rank();
  const int world = bootstrap.world();
  TIDE_CHECK_ARG(data_bytes > 0 && data_bytes <= BucketLayout::kMaxWindowBytes, "HostWindow::create",
                 "data_bytes", data_bytes, "> 0 and <= 2^48");
  const std::size_t mapped =
      data_region_bytes(data_bytes) + flag_region_bytes(world) + sizeof(PublishedState) +
      sizeof(NetOutbox) * kNetChannels * static_cast<std::size_t>(world);
  std::unique_ptr<HostWindow> window(new HostWindow(rank, data_bytes, mapped));
  window->maps_.assign(world, nullptr);

  const std::string mine = unique_segment_name(rank);
  window->maps_[rank] = map_segment(mine, mapped, /*create=*/true, &window->own_fd_);
  std::vector<std::string> names;
  try {
    names = bootstrap.allgather(detail::concat(data_bytes, " ", mine));
    for (int r = 0; r < world; ++r) {
      std::size_t theirs = 0;
      char name[256] = {};
      if (std::sscanf(names[r].c_str(), "%zu %255s", &theirs, name) != 2)
        throw InvalidArgument(detail::concat("HostWindow::create: rank ", r,
                                             " sent a malformed handle '", names[r], "'"));
      TIDE_CHECK_ARG(theirs == data_bytes, "HostWindow::create",
                     detail::concat("data_bytes of rank ", r), theirs,
                     detail::concat(data_bytes, " (rank ", rank, "'s)"));
      if (r != rank) window->maps_[r] = map_segment(name, mapped, /*create=*/false);
    }
    bootstrap.barrier();  // every rank has mapped every segment: the names can go
  } catch (...) {
    ::shm_unlink(mine.c_str());
    throw;
  }
  ::shm_unlink(mine.c_str());
  return window;
}

NetOutbox* HostWindow::outbox(int sender, int channel, int receiver) const {
  auto* first = reinterpret_cast<NetOutbox*>(reinterpret_cast<std::byte*>(state(sender)) +
                                             sizeof(PublishedState));
  return first + static_cast<std::size_t>(channel) * world() + receiver;
}

std::byte* HostWindow::data(int rank) const {
  TIDE_CHECK_ARG(rank >= 0 && rank < world(), "HostWindow::data", "rank", rank,
                 detail::concat("in [0, ", world(), ")"));
  return maps_[rank];
}

FlagWord* HostWindow::flags(int rank) const {
  return reinterpret_cast<FlagWord*>(data(rank) + data_region_bytes(data_bytes_));
}

PublishedState* HostWindow::state(int rank) const {
  return reinterpret_cast<PublishedState*>(data(rank) + data_region_bytes(data_bytes_) +
                                           flag_region_bytes(world()));
}

}  // namespace tide
