// The CUDA transport: the same per-rank programs as the host executor, run on GPUs.
//
//   CudaWindow    one cudaMalloc per rank (data, then the FlagWord array and the IPC network's
//                 mailboxes), mapped into every other rank of its node (of the host, for virtual
//                 nodes) with CUDA IPC (or used directly when the peer is a thread of this process).
//   CudaExecutor  enqueues a program on a stream: copy batches on the copy engines, casts and
//                 reduces as kernels, signals/waits as stream memory operations on the flags, every
//                 wait watched by a host thread that turns a stuck wait into TimeoutError/DesyncError.
//
// No CUDA header is needed to use this one: streams are passed as void* (a cudaStream_t), buffers
// are device pointers. All results are bitwise identical to HostExecutor's on the same inputs.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tide/bootstrap.hpp"
#include "tide/executor.hpp"
#include "tide/layout.hpp"
#include "tide/nccl.hpp"
#include "tide/window.hpp"

namespace tide {

// True when a CUDA device can be used. Never throws. Unless something in this process already
// loaded the CUDA driver library (then the answer is asked in-process), the question is asked in a
// forked child, so this process stays CUDA-free and may still fork() ranks that use CUDA afterwards
// (a process that initialised CUDA cannot hand it to fork()ed children). The answer is cached.
bool cuda_device_available();
// The number of CUDA devices, asked the same way (0 without a driver or a device).
int cuda_device_count();

// How a CudaWindow's memory is allocated and shared.
enum class CudaMemory : uint8_t {
  kMalloc,  // cudaMalloc, peers open it with CUDA IPC (ranks as processes or threads)
  kVmm,     // cuMemCreate + cuMemMap, peers import it from a POSIX file descriptor passed with
            // exchange_fds (ranks as processes only); its data can also be mapped at a fixed
            // address of the owner's (CudaAddressRange): what tide.fsdp needs on GPUs
};

// Which peers' windows a rank maps, and so how a CudaExecutor reaches the other nodes.
enum class CudaWindowScope : uint8_t {
  kNode,  // the ranks of its own node; other nodes over NCCL (an NcclComm given to the executor)
  kHost,  // every rank: the nodes are virtual nodes of one host (tests, one-GPU benchmarks), and
          // an executor given no NcclComm runs the network ops over CUDA IPC: the receiver's
          // kernel pulls the bytes out of the sender's window (a stand-in for NCCL's SM-driven
          // transfers, mailboxes in the windows instead of a network)
};

// A window in device memory: [data (data_bytes, rounded up to 256 B, or to the allocation
// granularity for kVmm)][FlagWord flags[2][W]][NetOutbox mailboxes[kNetChannels][W]] per rank in
// one allocation, on the device current when create() is called. Flags and mailboxes start zeroed.
class CudaWindow {
 public:
  // Collective over `bootstrap`: every rank calls it with the same data_bytes (checked). Peers
  // are opened with cudaIpcOpenMemHandle (peers in this same process: their pointer as is).
  static std::unique_ptr<CudaWindow> create(Bootstrap& bootstrap, std::size_t data_bytes);
  // Across nodes (topology.world() == the bootstrap's world): with CudaWindowScope::kNode only the
  // ranks of this rank's node are mapped (data(r) of another node's rank throws) and NCCL reaches
  // the others; with kHost every rank is mapped (all ranks must be on one host).
  static std::unique_ptr<CudaWindow> create(Bootstrap& bootstrap, std::size_t data_bytes,
                                            const Topology& topology,
                                            CudaMemory memory = CudaMemory::kMalloc,
                                            CudaWindowScope scope = CudaWindowScope::kNode);
  // Unmaps the peers and frees this rank's memory. Destroy it only after every rank is done with
  // the window (synchronize the executors, then a bootstrap barrier), or peers write into freed
  // memory. cudaMalloc/cudaFree may wait for the whole device: with ranks as threads of one
  // process, create and destroy windows (and allocate buffers) only while no rank's stream waits
  // on another's, e.g. before the first collective and after the last barrier.
  ~CudaWindow();
  CudaWindow(const CudaWindow&) = delete;
  CudaWindow& operator=(const CudaWindow&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  std::size_t data_bytes() const { return data_bytes_; }
  CudaMemory memory() const { return memory_; }
  std::byte* data(int rank) const;   // rank's data, as a device pointer valid in this process
  FlagWord* flags(int rank) const;   // rank's flag array, as a device pointer valid in this process
  CudaWindowScope scope() const { return scope_; }
  const Topology& topology() const { return topology_; }
  // The IPC network's mailbox in `rank`'s window for its exchanges with `peer` on `channel`
  // (CudaWindowScope::kHost windows). Every word of it is written by `peer` only: `posted` and `entries`
  // describe peer's sends to rank (entries[(k - 1) % kNetQueueDepth] is send k; `seq` unused),
  // `taken` counts rank's sends that peer has received. So every wait is on the waiter's own
  // memory, where the watchdog can release it.
  NetOutbox* mailbox(int rank, int channel, int peer) const;
  // This rank's two CTA counters for the executor's cast-to-peers kernel
  // (src/executor/cuda/kernels.cuh: arrivals()[0] counts CTAs done storing, arrivals()[1] CTAs past
  // a captured run's waits), zero at creation, a device pointer into the own window's control words.
  unsigned int* arrivals() const;
  // Whether every mapped peer's kernels can run while one of this rank's kernels spins on a flag:
  // the peer is a thread of this process (one context: kernels of its streams run side by side)
  // or on another GPU. Not for a peer process on this rank's GPU: contexts time-slice there, and
  // a spinning kernel would hold the GPU for its slice.
  bool peers_run_beside_own() const { return peers_run_beside_own_; }
  // Ranks of this window on this rank's GPU, this one included (1 with one GPU per rank).
  int ranks_on_gpu() const { return ranks_on_gpu_; }
  // Host-side numbering of the IPC network's transfers on this window (1-based, never reset, like
  // epochs): the next send to / receive from `peer` on `channel`.
  uint64_t next_net_send(int channel, int peer) { return ++net_sent_[channel * world_ + peer]; }
  uint64_t next_net_receive(int channel, int peer) {
    return ++net_received_[channel * world_ + peer];
  }
  // Epochs count collectives run on this window; they never reset.
  uint64_t next_epoch() { return ++epoch_; }
  uint64_t epoch() const { return epoch_; }

 private:
  friend class CudaAddressRange;
  CudaWindow() = default;
  struct Peer {
    std::byte* base = nullptr;
    bool ipc_opened = false;  // true: close with cudaIpcCloseMemHandle; false: own or same process
    unsigned long long vmm_handle = 0;  // kVmm: the allocation handle (own or imported)
  };
  CudaMemory memory_ = CudaMemory::kMalloc;
  CudaWindowScope scope_ = CudaWindowScope::kNode;
  std::size_t mapped_bytes_ = 0;  // kVmm: bytes of each rank's allocation (granularity multiple)
  int rank_ = 0;
  int world_ = 0;
  int device_ = 0;
  Topology topology_;
  std::size_t data_bytes_ = 0;
  std::size_t flag_offset_ = 0;
  std::size_t mailbox_offset_ = 0;
  std::size_t arrivals_offset_ = 0;
  bool peers_run_beside_own_ = true;
  int ranks_on_gpu_ = 1;
  std::vector<Peer> peers_;
  std::vector<uint64_t> net_sent_, net_received_;
  uint64_t epoch_ = 0;
  // One executor per window (CudaExecutor checks): its collectives share the window's slots,
  // flags and CTA counter, so they must run one at a time, in epoch order.
  friend class CudaExecutor;
  std::atomic<bool> has_executor_{false};
};

// A fixed device address range that shows a VMM window's data: reserve it once per bucket, then
// map the data of whichever pooled window holds the bucket now. Tensors viewing data() stay valid
// across remaps (autograd's saved views of unsharded params: docs/DESIGN.md §5). Map and unmap only
// while no work on the range or the window is in flight; the destructor synchronizes the range's
// device before it unmaps.
class CudaAddressRange {
 public:
  // A range for `bytes` of window data on the current device. The address space is reserved at
  // the first map_data_of (cuMemMap maps whole allocations: the window's flags follow its data
  // there too); data() is null until then and never changes after.
  explicit CudaAddressRange(std::size_t bytes);
  ~CudaAddressRange();
  CudaAddressRange(const CudaAddressRange&) = delete;
  CudaAddressRange& operator=(const CudaAddressRange&) = delete;

  std::byte* data() const { return base_; }
  std::size_t bytes() const { return bytes_; }  // the data bytes asked for
  const CudaWindow* mapped() const { return mapped_; }
  // Maps `window`'s own allocation (a kVmm window of this process, on this range's device, whose
  // data region is at least bytes(); every window mapped here must have the first one's size) at
  // data(), replacing an earlier mapping.
  void map_data_of(const CudaWindow& window);
  void unmap();

 private:
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t reserved_ = 0;
  int device_ = 0;
  const CudaWindow* mapped_ = nullptr;
};

class CudaExecutor;

// The id of the CUDA graph capture `stream` (a cudaStream_t) is in, 0 when it is not capturing:
// work recorded in one capture may wait only for work of the same capture. InvalidArgument for
// the legacy stream while another stream captures.
uint64_t cuda_capture_id(void* stream);

// A program checked and lowered on one CudaExecutor (CudaExecutor::prepare), for the collective a
// bucket runs every step. Its checks and lowering (which steps share a driver call, every address
// resolved) are kept with the pointers they were made for: a run whose bindings are those of the
// one before costs the host its driver calls and one comparison of the pointer arrays, whatever the
// param count; other pointers are checked and lowered again, and kept instead.
class PreparedProgram {
 public:
  ~PreparedProgram();
  PreparedProgram(const PreparedProgram&) = delete;
  PreparedProgram& operator=(const PreparedProgram&) = delete;
  const Program& program() const { return program_; }

  struct Lowered;  // defined with the executor (src/executor/cuda/)

 private:
  friend class CudaExecutor;
  PreparedProgram(uint64_t owner, Program program);
  uint64_t owner_;  // the preparing executor's serial number (an address could be reused)
  const Program program_;  // a copy: nothing can change it under the kept lowering
  std::unique_ptr<Lowered> lowered_;
};

// Runs programs on a CUDA stream. run() is asynchronous: it validates, then enqueues and returns.
// Inputs and outputs in Bindings are device pointers; they must stay valid until synchronize().
// One thread at a time may call into an executor.
//
// Waits block the stream's hardware queue. Streams share queues once a process has more of them
// than CUDA_DEVICE_MAX_CONNECTIONS (default 8), and a wait in a shared queue also blocks the other
// stream's work behind it: with several ranks as threads of one process (each executor uses its
// stream plus a side stream for the watchdog; across-node programs add a network stream, and the
// IPC network one more per extra peer of a group), set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA
// starts, or a rank's wait can block the very signal it waits for. One rank per process is safe.
class CudaExecutor final : public Executor {
 public:
  // Per-executor SM usage, for benchmarks: kernel time x CTAs launched, over the runs since the
  // last reset_stats(), complete after synchronize(). Only measured while stats are enabled.
  struct Stats {
    double cast_cta_us = 0;    // CTA-microseconds of cast kernels
    double reduce_cta_us = 0;  // CTA-microseconds of reduce kernels
    double network_cta_us = 0; // CTA-microseconds of the IPC network's pull kernels
    double cast_to_peers_cta_us = 0; // CTA-microseconds of cast-to-peers kernels (their waits included)
    double copy_cta_us = 0;    // CTA-microseconds of copy kernels (kMaxEngineCopies, command_list.hpp)
    int copies = 0;            // copy-engine copies enqueued
    int single_copy_calls = 0;   // cudaMemcpyAsync calls (no batch API, or TIDE_CUDA_BATCH_COPY=0)
    int copies_2d = 0;           // cudaMemcpy2DAsync calls (blocks of params sharded on a dim > 0,
                                 // and runs of equal copies at one pitch)
    int copies_coalesced = 0;    // 1-D copies of a program sent as part of such a run
    int copies_by_kernel = 0;    // small 1-D copies of a step too many for copy engines, stored by one
                                 // copy kernel (also in kernel_launches)
    int kernel_launches = 0;
    int network_groups = 0;      // network groups (NCCL: ncclGroupStart/End pairs)
    int mem_op_calls = 0;        // cuStreamBatchMemOp calls of the programs' signals and waits
    int lowerings = 0;           // runs that checked and lowered their program: every run of a
                                 // Program, a PreparedProgram's first and those with new pointers
    int cast_to_peers_kernels = 0;     // cast-to-peers kernels (also in kernel_launches): a kCastToPeers
                                 // program's stores, signals, waits and reduces in one launch
  };

  // `stream` is a cudaStream_t of the window's device (not the legacy default stream, which
  // cudaMemcpyBatchAsync refuses; the executor then falls back to one cudaMemcpyAsync per copy, as
  // it does when TIDE_CUDA_BATCH_COPY=0 or the batch API fails once).
  //
  // `network` (across-node programs only; may be null otherwise): the NCCL communicator over all W
  // ranks that carries NetSendOp/NetRecvOp as grouped ncclSend/ncclRecv on a network stream of
  // this executor. A network group stuck past the timeout aborts the communicator (NCCL's only
  // way to release its kernels) and becomes a TimeoutError naming the peers. Without one, a
  // window created with CudaWindowScope::kHost carries them over CUDA IPC (same groups, same network
  // stream; a stuck transfer is a TimeoutError, one whose peer runs another collective a
  // DesyncError, both naming peer, transfer, bucket, phase and epoch); otherwise across-node
  // programs are rejected.
  //
  // One executor per window at a time: InvalidArgument if `window` has one already.
  CudaExecutor(CudaWindow& window, void* stream,
               std::chrono::milliseconds timeout = default_timeout(), NcclComm* network = nullptr);
  // Waits for enqueued work (a stuck wait still ends within the timeout), then stops the watchdog.
  ~CudaExecutor() override;
  CudaExecutor(const CudaExecutor&) = delete;
  CudaExecutor& operator=(const CudaExecutor&) = delete;

  int rank() const override;
  int world() const override;
  // Later runs go to `stream`; work already enqueued stays where it is (synchronize() waits for it).
  // Runs on one window must not overlap (they share its slots, flags and CTA counter): order
  // `stream` after the last run's stream first, as tide.fsdp does with the window's `ready` event.
  void set_stream(void* stream);
  void* stream() const;

  // validate_run(...) first (throws InvalidArgument before anything is enqueued), then the error
  // of an earlier run if the watchdog stored one, then enqueues the program on the stream.
  //
  // On a stream being captured into a CUDA graph (cudaStreamBeginCapture, torch.cuda.graph) the
  // run is recorded into the graph, and every replay runs the collective again: its flags carry a
  // fixed value that each wait clears once met, so nothing a replay does depends on the host.
  // Run-by-run and replayed collectives of a window interleave in any order, as long as every
  // rank runs them in the same order. Every pointer of the bindings must hold at each replay, and
  // the executor and its window must outlive the graph's replays.
  // Copies go to the engines one cudaMemcpyAsync each (cudaMemcpyBatchAsync has no graph node).
  // A replayed wait that times out ends the process, after printing the error (rank, peer,
  // bucket, phase): no call into TIDE runs during a replay to throw it in. Refused with
  // InvalidArgument before anything moves: a program capture_refusal() names, a capture on the
  // legacy stream, an invalidated capture.
  void run(const Program& program, const Bindings& bindings) override;
  // Why `program` cannot be captured into a CUDA graph; empty if it can.
  static std::string capture_refusal(const Program& program);
  // A copy of `program` to run on this executor only (its first run checks and lowers it).
  std::unique_ptr<PreparedProgram> prepare(const Program& program) const;
  // run(prepared.program(), bindings), without checking or lowering again when `bindings` are the
  // last run's. InvalidArgument if `prepared` belongs to another executor.
  void run(PreparedProgram& prepared, const Bindings& bindings);
  // Waits for every stream this executor enqueued work on; throws the watchdog's TimeoutError or
  // DesyncError if a wait got stuck (then every later call throws it too: the window's epochs are
  // out of step with the peers', so make a new window and executor). Never hangs: a stuck wait is
  // released by the watchdog once it has timed out.
  void synchronize();

  // The CUDA graphs alive now that hold collectives captured on this executor, their waits the
  // watchdog watches, and the mark slots those take. A graph counts until it and every executable
  // graph made from it are destroyed (CUDA then tells the executor, from a thread of its own,
  // shortly after the last destroy); its replays write this executor's window, so the window and
  // the executor must outlive it. A driver that refuses to tie a graph's life to the executor
  // (a user object retained during the capture) leaves that graph's waits and slots held for good,
  // and it is not counted in `graphs`. `captures`: the counted graphs' capture ids (as
  // cuda_capture_id reports them while capturing), so a caller that recorded what each capture
  // holds can tell which captures' graphs are gone.
  struct CapturedState {
    int graphs = 0;
    int waits = 0;
    int slots = 0;
    std::vector<uint64_t> captures;
  };
  CapturedState captured_state();

  void enable_stats(bool enabled);
  // Waits for the streams first. Counters of a failed executor too: its error is synchronize()'s
  // and run()'s to throw (a CUDA error is thrown here).
  Stats stats();
  void reset_stats();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tide
