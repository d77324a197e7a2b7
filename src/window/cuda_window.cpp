// CudaWindow: one cudaMalloc per rank, [data (rounded up to 256 B)][FlagWord flags[2][W]], mapped
// into every peer with CUDA IPC. Compiled into tide_cuda (tide_core stays free of CUDA).
//
// Handle exchanged over the bootstrap, one line per rank:
//   "<data_bytes> <process token> <device> <base pointer> <cudaIpcMemHandle_t as hex>"
// A peer with this process's token is a thread of this process: its pointer is used as is (CUDA
// refuses to open a process's own IPC handle); such peers must be on the same device.
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "cuda_check.hpp"
#include "tide/cuda.hpp"
#include "tide/error.hpp"

namespace tide {
namespace {

constexpr std::size_t kDataAlignment = 256;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// Identifies this process among the ranks: the pid alone is not enough across containers, and a
// fork()ed child inherits statics, so the token is regenerated whenever the pid changes.
uint64_t process_token() {
  static pid_t cached_pid = 0;
  static uint64_t token = 0;
  const pid_t pid = ::getpid();
  if (pid != cached_pid) {
    std::random_device rd;
    token = (static_cast<uint64_t>(rd()) << 32 ^ rd()) << 20 ^ static_cast<uint64_t>(pid);
    cached_pid = pid;
  }
  return token;
}

std::string to_hex(const void* bytes, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    const auto b = static_cast<const unsigned char*>(bytes)[i];
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

bool from_hex(const std::string& hex, void* bytes, std::size_t n) {
  if (hex.size() != 2 * n) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (std::size_t i = 0; i < n; ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    static_cast<unsigned char*>(bytes)[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

}  // namespace

std::unique_ptr<CudaWindow> CudaWindow::create(Bootstrap& bootstrap, std::size_t data_bytes) {
  return create(bootstrap, data_bytes, Topology::single_node(bootstrap.world()));
}

std::unique_ptr<CudaWindow> CudaWindow::create(Bootstrap& bootstrap, std::size_t data_bytes,
                                               const Topology& topology) {
  const char* where = "CudaWindow::create";
  const int rank = bootstrap.rank();
  const int world = bootstrap.world();
  TIDE_CHECK_ARG(data_bytes > 0, where, "data_bytes", data_bytes, "> 0");
  TIDE_CHECK_ARG(topology.nodes >= 1 && topology.local >= 1 && topology.world() == world, where,
                 "topology", detail::concat(topology.nodes, " nodes x ", topology.local, " local"),
                 detail::concat(world, " ranks in all (the bootstrap's world)"));

  std::unique_ptr<CudaWindow> window(new CudaWindow());
  window->rank_ = rank;
  window->world_ = world;
  window->data_bytes_ = data_bytes;
  window->flag_offset_ = round_up(data_bytes, kDataAlignment);
  window->peers_.assign(world, Peer{});
  window->topology_ = topology;
  TIDE_CUDA_CHECK(cudaGetDevice(&window->device_));

  const std::size_t total = window->flag_offset_ + flag_array_bytes(world);
  void* base = nullptr;
  TIDE_CUDA_CHECK(cudaMalloc(&base, total));
  window->peers_[rank].base = static_cast<std::byte*>(base);  // owned: freed by the destructor
  // Flags must read zero before any peer can signal into them: zero, and wait, before the
  // handles are published. A private stream, not cudaDeviceSynchronize: other ranks of this
  // process (threads) may have streams blocked on flags, and a device-wide wait would join them.
  cudaStream_t zeroing = nullptr;
  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking));
  const cudaError_t zeroed = cudaMemsetAsync(window->peers_[rank].base + window->flag_offset_, 0,
                                             flag_array_bytes(world), zeroing);
  const cudaError_t synced = zeroed == cudaSuccess ? cudaStreamSynchronize(zeroing) : zeroed;
  (void)cudaStreamDestroy(zeroing);
  TIDE_CUDA_CHECK(synced);
  TIDE_CHECK_ARG(reinterpret_cast<uintptr_t>(base) % kDataAlignment == 0, where, "cudaMalloc base",
                 base, detail::concat("aligned to ", kDataAlignment, " B"));

  cudaIpcMemHandle_t handle;
  TIDE_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
  char head[160];
  std::snprintf(head, sizeof head, "%zu %" PRIu64 " %d %" PRIxPTR " ", data_bytes,
                process_token(), window->device_, reinterpret_cast<uintptr_t>(base));
  const std::vector<std::string> all =
      bootstrap.allgather(std::string(head) + to_hex(&handle, sizeof handle));

  for (int r = 0; r < world; ++r) {
    if (r == rank || topology.node_of(r) != topology.node_of(rank)) continue;
    std::size_t theirs = 0;
    uint64_t token = 0;
    int device = 0;
    uintptr_t pointer = 0;
    char hex[2 * sizeof(cudaIpcMemHandle_t) + 2] = {};
    cudaIpcMemHandle_t peer_handle;
    if (std::sscanf(all[r].c_str(), "%zu %" SCNu64 " %d %" SCNxPTR " %129s", &theirs, &token,
                    &device, &pointer, hex) != 5 ||
        !from_hex(hex, &peer_handle, sizeof peer_handle))
      throw InvalidArgument(detail::concat(where, ": rank ", r, " sent a malformed handle '",
                                           all[r], "', expected '<bytes> <token> <device> "
                                           "<pointer> <128 hex digits>'"));
    TIDE_CHECK_ARG(theirs == data_bytes, where, detail::concat("data_bytes of rank ", r), theirs,
                   detail::concat(data_bytes, " (rank ", rank, "'s)"));
    if (token == process_token()) {
      // Ranks as threads of one process on different GPUs failed once on an H200 pair with an
      // "unspecified launch failure" (2026-11-30, not investigated): refused until it is.
      TIDE_CHECK_ARG(device == window->device_, where, detail::concat("device of rank ", r), device,
                     detail::concat(window->device_, " (rank ", rank, "'s: ranks that are threads "
                                    "of one process must share a GPU; use processes across GPUs)"));
      window->peers_[r].base = reinterpret_cast<std::byte*>(pointer);
    } else {
      void* mapped = nullptr;
      TIDE_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, peer_handle, cudaIpcMemLazyEnablePeerAccess));
      window->peers_[r].base = static_cast<std::byte*>(mapped);
      window->peers_[r].ipc_opened = true;
    }
  }
  bootstrap.barrier();  // every rank has mapped every window before anyone may signal
  return window;
}

CudaWindow::~CudaWindow() {
  // Errors are ignored here: a destructor must not throw, and a dead peer's mapping may already
  // be gone.
  for (int r = 0; r < static_cast<int>(peers_.size()); ++r) {
    if (peers_[r].ipc_opened) (void)cudaIpcCloseMemHandle(peers_[r].base);
  }
  if (rank_ < static_cast<int>(peers_.size()) && peers_[rank_].base) (void)cudaFree(peers_[rank_].base);
  (void)cudaGetLastError();
}

std::byte* CudaWindow::data(int rank) const {
  TIDE_CHECK_ARG(rank >= 0 && rank < world_, "CudaWindow::data", "rank", rank,
                 detail::concat("in [0, ", world_, ")"));
  TIDE_CHECK_ARG(peers_[rank].base != nullptr, "CudaWindow::data", "rank", rank,
                 detail::concat("a rank of node ", topology_.node_of(rank_),
                                " (other nodes' windows are not mapped)"));
  return peers_[rank].base;
}

FlagWord* CudaWindow::flags(int rank) const {
  return reinterpret_cast<FlagWord*>(data(rank) + flag_offset_);
}

}  // namespace tide
