// CudaWindow: one allocation per rank, [data][FlagWord flags[2][W]][NetOutbox mailboxes[2][W]],
// mapped into every peer of its node (every rank for CudaWindowScope::kHost); CudaAddressRange: a fixed address showing a VMM window's data. Compiled into tide_cuda
// (tide_core stays free of CUDA).
//
// kMalloc: cudaMalloc, data rounded up to 256 B, shared with CUDA IPC. A peer with this process's
// token is a thread of this process: its pointer is used as is (CUDA refuses to open a process's
// own IPC handle); such peers must be on the same device.
// kVmm: cuMemCreate (POSIX file descriptor handle), data rounded up to the allocation granularity,
// mapped with cuMemMap; peers import the descriptor passed by exchange_fds and map it themselves.
//
// Exchanged over the bootstrap, one line per rank:
//   "<data_bytes> <process token> <device> <base pointer> <kind 0|1> <cudaIpcMemHandle_t as hex | ->"
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <string>

#include "common/round_up.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/driver_api.hpp"
#include "tide/cuda.hpp"
#include "tide/error.hpp"
#include "window/wire.hpp"

namespace tide {
namespace {

constexpr std::size_t kDataAlignment = 256;

using detail::round_up;

// Flags, then the IPC network's mailboxes (at their alignment), then the cast-to-peers kernel's two
// CTA counters (16 bytes): what follows a window's data, zeroed at creation.
std::size_t mailbox_offset(int world) { return round_up(flag_array_bytes(world), alignof(NetOutbox)); }
std::size_t arrivals_offset(int world) {
  return mailbox_offset(world) + sizeof(NetOutbox) * kNetChannels * static_cast<std::size_t>(world);
}
std::size_t control_bytes(int world) { return arrivals_offset(world) + 16; }

// The GPU as every process names it (device ordinals depend on CUDA_VISIBLE_DEVICES).
std::string pci_bus_id(int device) {
  char id[64] = {};
  TIDE_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof id, device));
  return id;
}

// Identifies this process among the ranks: the pid alone is not enough across containers, and a
// fork()ed child inherits statics, so the token is regenerated whenever the pid changes.
uint64_t process_token() {
  // Ranks that are threads of one process draw it at once when they create their windows: without
  // the lock two of them could each draw a token and publish different ones, and then open each
  // other's handle with cudaIpcOpenMemHandle in the exporting process, which fails
  // (cudaErrorDeviceUninitialized, 1 run in 10-40 of `tide_bench_cuda sweep --threads` on an
  // H200) while the peer waits in the bootstrap. Keyed by the pid: a fork()ed child draws its own.
  static std::mutex mutex;
  static pid_t cached_pid = 0;
  static uint64_t token = 0;
  const std::lock_guard<std::mutex> lock(mutex);
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

namespace {

CUmemAllocationProp vmm_properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

std::size_t vmm_granularity(int device) {
  const auto& api = cuda_detail::driver_api();
  int supported = 0;
  TIDE_CU_CHECK(api.device_get_attribute(
      &supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device));
  if (!supported)
    throw SystemError(detail::concat("CUDA device ", device, " cannot export VMM allocations as "
                                     "POSIX file descriptors (needed by CudaMemory::kVmm)"));
  const CUmemAllocationProp prop = vmm_properties(device);
  std::size_t granularity = 0;
  TIDE_CU_CHECK(api.mem_get_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  return granularity;
}

// Reserves `bytes` of address space and maps `handle` there, readable and writable from `device`.
std::byte* map_vmm(CUmemGenericAllocationHandle handle, std::size_t bytes, std::size_t granularity,
                   int device) {
  const auto& api = cuda_detail::driver_api();
  CUdeviceptr va = 0;
  TIDE_CU_CHECK(api.mem_address_reserve(&va, bytes, granularity, 0, 0));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult status = api.mem_map(va, bytes, 0, handle, 0);
  if (status == CUDA_SUCCESS) {
    status = api.mem_set_access(va, bytes, &access, 1);
    if (status != CUDA_SUCCESS) (void)api.mem_unmap(va, bytes);
  }
  if (status != CUDA_SUCCESS) {
    (void)api.mem_address_free(va, bytes);
    TIDE_CU_CHECK(status);
  }
  return reinterpret_cast<std::byte*>(va);
}

void unmap_vmm(std::byte* base, std::size_t bytes) {
  const auto& api = cuda_detail::driver_api();
  (void)api.mem_unmap(reinterpret_cast<CUdeviceptr>(base), bytes);
  (void)api.mem_address_free(reinterpret_cast<CUdeviceptr>(base), bytes);
}

}  // namespace

std::unique_ptr<CudaWindow> CudaWindow::create(Bootstrap& bootstrap, std::size_t data_bytes,
                                               const Topology& topology, CudaMemory memory,
                                               CudaWindowScope scope) {
  const char* where = "CudaWindow::create";
  const int rank = bootstrap.rank();
  const int world = bootstrap.world();
  TIDE_CHECK_ARG(data_bytes > 0, where, "data_bytes", data_bytes, "> 0");
  TIDE_CHECK_ARG(topology.nodes >= 1 && topology.local >= 1 && topology.world() == world, where,
                 "topology", detail::concat(topology.nodes, " nodes x ", topology.local, " local"),
                 detail::concat(world, " ranks in all (the bootstrap's world)"));
  const bool vmm = memory == CudaMemory::kVmm;

  std::unique_ptr<CudaWindow> window(new CudaWindow());
  window->rank_ = rank;
  window->world_ = world;
  window->data_bytes_ = data_bytes;
  window->memory_ = memory;
  window->scope_ = scope;
  window->peers_.assign(world, Peer{});
  window->net_sent_.assign(static_cast<std::size_t>(kNetChannels) * world, 0);
  window->net_received_.assign(static_cast<std::size_t>(kNetChannels) * world, 0);
  window->topology_ = topology;
  TIDE_CUDA_CHECK(cudaGetDevice(&window->device_));
  const int device = window->device_;

  // Own memory (freed by the destructor once recorded in peers_[rank]).
  std::size_t granularity = 0;
  int own_fd = -1;
  cudaIpcMemHandle_t handle{};
  if (vmm) {
    const auto& api = cuda_detail::driver_api();
    granularity = vmm_granularity(device);
    window->flag_offset_ = round_up(data_bytes, granularity);
    window->mapped_bytes_ = window->flag_offset_ + round_up(control_bytes(world), granularity);
    const CUmemAllocationProp prop = vmm_properties(device);
    CUmemGenericAllocationHandle own = 0;
    TIDE_CU_CHECK(api.mem_create(&own, window->mapped_bytes_, &prop, 0));
    window->peers_[rank].vmm_handle = own;
    window->peers_[rank].base = map_vmm(own, window->mapped_bytes_, granularity, device);
    TIDE_CU_CHECK(api.mem_export(&own_fd, own, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  } else {
    window->flag_offset_ = round_up(data_bytes, kDataAlignment);
    void* base = nullptr;
    TIDE_CUDA_CHECK(cudaMalloc(&base, window->flag_offset_ + control_bytes(world)));
    window->peers_[rank].base = static_cast<std::byte*>(base);
    TIDE_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
  }
  struct CloseFd {
    int& fd;
    ~CloseFd() {
      if (fd >= 0) ::close(fd);
    }
  } close_own_fd{own_fd};
  std::byte* const base = window->peers_[rank].base;
  TIDE_CHECK_ARG(reinterpret_cast<uintptr_t>(base) % kDataAlignment == 0, where, "window base",
                 static_cast<void*>(base), detail::concat("aligned to ", kDataAlignment, " B"));
  window->mailbox_offset_ = window->flag_offset_ + mailbox_offset(world);
  window->arrivals_offset_ = window->flag_offset_ + arrivals_offset(world);
  // Flags must read zero before any peer can signal into them: zero, and wait, before the
  // handles are published. A private stream, not cudaDeviceSynchronize: other ranks of this
  // process (threads) may have streams blocked on flags, and a device-wide wait would join them.
  cudaStream_t zeroing = nullptr;
  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking));
  const cudaError_t zeroed =
      cudaMemsetAsync(base + window->flag_offset_, 0, control_bytes(world), zeroing);
  const cudaError_t synced = zeroed == cudaSuccess ? cudaStreamSynchronize(zeroing) : zeroed;
  (void)cudaStreamDestroy(zeroing);
  TIDE_CUDA_CHECK(synced);

  const std::string gpu = pci_bus_id(device);
  char head[224];
  std::snprintf(head, sizeof head, "%zu %" PRIu64 " %d %s %" PRIxPTR " %d ", data_bytes,
                process_token(), device, gpu.c_str(), reinterpret_cast<uintptr_t>(base), vmm ? 1 : 0);
  const std::vector<std::string> all = bootstrap.allgather(
      std::string(head) + (vmm ? std::string("-") : to_hex(&handle, sizeof handle)));

  std::vector<int> mapped_peers;
  for (int r = 0; r < world; ++r) {
    if (r == rank || (scope == CudaWindowScope::kNode && topology.node_of(r) != topology.node_of(rank)))
      continue;
    std::size_t theirs = 0;
    uint64_t token = 0;
    int peer_device = 0, kind = 0;
    uintptr_t pointer = 0;
    char peer_gpu[64] = {};
    char hex[2 * sizeof(cudaIpcMemHandle_t) + 2] = {};
    if (std::sscanf(all[r].c_str(), "%zu %" SCNu64 " %d %63s %" SCNxPTR " %d %129s", &theirs,
                    &token, &peer_device, peer_gpu, &pointer, &kind, hex) != 7)
      throw InvalidArgument(detail::concat(where, ": rank ", r, " sent a malformed handle '",
                                           all[r], "', expected '<bytes> <token> <device> "
                                           "<pci bus id> <pointer> <kind> <handle>'"));
    if (gpu == peer_gpu) {
      ++window->ranks_on_gpu_;
      if (token != process_token()) window->peers_run_beside_own_ = false;
    }
    TIDE_CHECK_ARG(theirs == data_bytes, where, detail::concat("data_bytes of rank ", r), theirs,
                   detail::concat(data_bytes, " (rank ", rank, "'s)"));
    TIDE_CHECK_ARG(kind == (vmm ? 1 : 0), where, detail::concat("memory kind of rank ", r),
                   kind ? "kVmm" : "kMalloc", vmm ? "kVmm (rank's own)" : "kMalloc (rank's own)");
    if (token == process_token()) {
      // Ranks as threads of one process on different GPUs failed once on an H200 pair with an
      // "unspecified launch failure" (2026-11-30, not investigated): refused until it is.
      TIDE_CHECK_ARG(!vmm, where, "memory", "kVmm",
                     "kMalloc for ranks that are threads of one process (VMM windows pass file "
                     "descriptors between processes)");
      TIDE_CHECK_ARG(peer_device == device, where, detail::concat("device of rank ", r),
                     peer_device,
                     detail::concat(device, " (rank ", rank, "'s: ranks that are threads "
                                    "of one process must share a GPU; use processes across GPUs)"));
      window->peers_[r].base = reinterpret_cast<std::byte*>(pointer);
    } else if (vmm) {
      mapped_peers.push_back(r);
    } else {
      cudaIpcMemHandle_t peer_handle;
      if (!from_hex(hex, &peer_handle, sizeof peer_handle))
        throw InvalidArgument(detail::concat(where, ": rank ", r, " sent a malformed IPC handle '",
                                             hex, "', expected 128 hex digits"));
      void* mapped = nullptr;
      TIDE_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, peer_handle, cudaIpcMemLazyEnablePeerAccess));
      window->peers_[r].base = static_cast<std::byte*>(mapped);
      window->peers_[r].ipc_opened = true;
    }
  }
  if (vmm) {
    // Collective: every rank calls it (ranks of other nodes, or alone, with no peers to ask).
    const std::vector<int> fds = exchange_fds(bootstrap, own_fd, mapped_peers);
    const auto& api = cuda_detail::driver_api();
    std::exception_ptr failure;
    for (std::size_t k = 0; k < fds.size(); ++k) {
      try {
        if (failure) continue;
        CUmemGenericAllocationHandle imported = 0;
        TIDE_CU_CHECK(api.mem_import(&imported, reinterpret_cast<void*>(static_cast<uintptr_t>(fds[k])),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        window->peers_[mapped_peers[k]].vmm_handle = imported;
        window->peers_[mapped_peers[k]].base = map_vmm(imported, window->mapped_bytes_, granularity, device);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    for (int fd : fds) ::close(fd);
    if (failure) std::rethrow_exception(failure);
  }
  bootstrap.barrier();  // every rank has mapped every window before anyone may signal
  return window;
}

CudaWindow::~CudaWindow() {
  // Errors are ignored here: a destructor must not throw, and a dead peer's mapping may already
  // be gone.
  for (int r = 0; r < static_cast<int>(peers_.size()); ++r) {
    Peer& p = peers_[r];
    if (p.vmm_handle != 0) {
      if (p.base) unmap_vmm(p.base, mapped_bytes_);
      (void)cuda_detail::driver_api().mem_release(p.vmm_handle);
    } else if (p.ipc_opened) {
      (void)cudaIpcCloseMemHandle(p.base);
    } else if (r == rank_ && p.base) {
      (void)cudaFree(p.base);
    }
  }
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

unsigned int* CudaWindow::arrivals() const {
  return reinterpret_cast<unsigned int*>(data(rank_) + arrivals_offset_);
}

NetOutbox* CudaWindow::mailbox(int rank, int channel, int peer) const {
  TIDE_CHECK_ARG(channel >= 0 && channel < kNetChannels, "CudaWindow::mailbox", "channel", channel,
                 detail::concat("in [0, ", kNetChannels, ")"));
  TIDE_CHECK_ARG(peer >= 0 && peer < world_ && peer != rank, "CudaWindow::mailbox", "peer", peer,
                 detail::concat("a rank in [0, ", world_, ") other than ", rank));
  return reinterpret_cast<NetOutbox*>(data(rank) + mailbox_offset_) +
         static_cast<std::size_t>(channel) * world_ + peer;
}

CudaAddressRange::CudaAddressRange(std::size_t bytes) : bytes_(bytes) {
  TIDE_CHECK_ARG(bytes > 0, "CudaAddressRange", "bytes", bytes, "> 0");
  TIDE_CUDA_CHECK(cudaGetDevice(&device_));
}

CudaAddressRange::~CudaAddressRange() {
  // Kernels that read the range through tensors viewing data() may still be queued on any stream
  // of its device: a backward that raised leaves them behind the host, which then tears the
  // buckets down. Unmapping under them is an illegal address, so teardown waits for the device
  // (once per range; a remap waits for the params' last readers instead, _window.py).
  if (mapped_) {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess &&
        (current == device_ || cudaSetDevice(device_) == cudaSuccess)) {
      (void)cudaDeviceSynchronize();
      if (current != device_) (void)cudaSetDevice(current);
    }
    (void)cudaGetLastError();
  }
  unmap();
  if (base_)
    (void)cuda_detail::driver_api().mem_address_free(reinterpret_cast<CUdeviceptr>(base_), reserved_);
}

void CudaAddressRange::map_data_of(const CudaWindow& window) {
  const char* where = "CudaAddressRange::map_data_of";
  TIDE_CHECK_ARG(window.memory() == CudaMemory::kVmm, where, "window memory", "kMalloc", "kVmm");
  TIDE_CHECK_ARG(window.device() == device_, where, "window device", window.device(),
                 detail::concat(device_, " (the range's)"));
  TIDE_CHECK_ARG(window.flag_offset_ >= bytes_, where, "range bytes", bytes_,
                 detail::concat("<= the window's data region (", window.flag_offset_, " B)"));
  const auto& api = cuda_detail::driver_api();
  // cuMemMap maps whole allocations only (offset 0, full size; CUDA_ERROR_NOT_SUPPORTED
  // otherwise, seen on an H200): the range covers the window's flags too, after the data, and
  // takes its size from the first window mapped into it.
  if (!base_) {
    CUdeviceptr va = 0;
    TIDE_CU_CHECK(api.mem_address_reserve(&va, window.mapped_bytes_, vmm_granularity(device_), 0, 0));
    base_ = reinterpret_cast<std::byte*>(va);
    reserved_ = window.mapped_bytes_;
  }
  TIDE_CHECK_ARG(window.mapped_bytes_ == reserved_, where, "window allocation bytes",
                 window.mapped_bytes_, detail::concat(reserved_, " (the first window mapped here)"));
  unmap();
  const CUdeviceptr va = reinterpret_cast<CUdeviceptr>(base_);
  TIDE_CU_CHECK(api.mem_map(va, reserved_, 0, window.peers_[window.rank()].vmm_handle, 0));
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUresult status = api.mem_set_access(va, reserved_, &access, 1);
  if (status != CUDA_SUCCESS) (void)api.mem_unmap(va, reserved_);
  TIDE_CU_CHECK(status);
  mapped_ = &window;
}

void CudaAddressRange::unmap() {
  if (!mapped_) return;
  (void)cuda_detail::driver_api().mem_unmap(reinterpret_cast<CUdeviceptr>(base_), reserved_);
  mapped_ = nullptr;
}

}  // namespace tide
