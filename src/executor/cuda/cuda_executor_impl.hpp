// CudaExecutor::Impl: the executor's state and the members its files define, one file per job:
//   cuda_executor.cpp   the public API, life cycle, events and streams, stats
//   lowering.cpp        a program's steps -> stream operations (copy batches, kernel batches,
//                       flag writes and waits), network groups issued where the schedule says
//   nccl_transport.cpp  a network group over NCCL (grouped send/recv), and its timeout message
//   ipc_transport.cpp   a network group over CUDA IPC mailboxes, and diagnosing/releasing a stuck one
//   wait_marks.cpp      where each stream has got to, in host memory the stream writes
//   watchdog.cpp        the host thread that turns a stuck wait into an error and drains the stream
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "cuda/driver_api.hpp"
#include "executor/cuda/command_list.hpp"
#include "executor/net/group_schedule.hpp"
#include "executor/tag.hpp"
#include "kernels.cuh"
#include "tide/cuda.hpp"
#include "wait_marks.hpp"
#include "window/wire.hpp"

namespace tide {
namespace cuda_executor_detail {

using Clock = std::chrono::steady_clock;
using detail::describe_tag;
using detail::flag_kind_name;

// Written into a stuck flag's epoch to release it: cuStreamWaitValue64's GEQ compares the signed
// difference (int64_t)(*addr - value) >= 0, so UINT64_MAX would read as -1 and never pass; 2^62
// passes for every epoch a window can reach.
inline constexpr uint64_t kReleaseEpoch = uint64_t{1} << 62;

// The epoch word of a captured run's signals (CUDA graphs: a replay cannot count epochs on the
// host). Its waits pass on equality and then clear the flag (epoch word 0), so each replay waits
// for the next signal: the peer signals the same flag again only after a handshake this rank
// sends after the clear. Never met by a run-by-run wait: (int64_t)(0xC0.. - e) < 0 for every epoch
// a window reaches, and no run-by-run epoch, 0 or kReleaseEpoch equals it.
inline constexpr uint64_t kCapturedEpoch = uint64_t{3} << 62;

inline cuda_kernels::ElementType element_type(DType dtype) {
  return static_cast<cuda_kernels::ElementType>(static_cast<int>(dtype));
}

// A stream wait on a word of the own window's IPC mailbox: `value` passes it (GEQ or EQ).
struct MailboxWord {
  uint64_t* word;
  uint64_t value;
  bool equal;
};

// One WaitOp of a flag batch: the own flag word it waits on (device pointer), the peer that
// writes it, and the step's phase (for messages).
struct AwaitedFlag {
  FlagWord* flag;
  FlagKind kind;
  int peer;
  Phase phase;
};

// cuStreamBatchMemOp's operations (a call takes fewer than 256).
inline CUstreamBatchMemOpParams wait_geq(const uint64_t* word, uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  op.waitValue.address = reinterpret_cast<CUdeviceptr>(word);
  op.waitValue.value64 = value;
  op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  return op;
}

inline CUstreamBatchMemOpParams wait_eq(const uint64_t* word, uint64_t value) {
  CUstreamBatchMemOpParams op = wait_geq(word, value);
  op.waitValue.flags = CU_STREAM_WAIT_VALUE_EQ;
  return op;
}

// After a memory barrier: what the stream wrote before is visible first. (Without one,
// CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER, the driver refused every write on an H200, driver 580:
// invalid value.)
inline CUstreamBatchMemOpParams write_value(CUdeviceptr word, uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = word;
  op.writeValue.value64 = value;
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}

struct PendingWait {
  enum class Kind : uint8_t {
    kFlag,     // WaitOps of one cuStreamBatchMemOp: `flags`
    kNccl,     // a network group over NCCL: only an abort releases it
    kMailbox,  // an IPC network transfer: `words` of `mailbox`
  };
  // The watchdog's clock for this wait starts once its stream has written `id` as reached and
  // every earlier wait has passed, and stops when the stream writes `id` as passed (wait_marks.hpp).
  uint64_t id = 0;
  int slot = 0;  // its stream's marks
  Kind kind = Kind::kFlag;
  std::vector<AwaitedFlag> flags;  // kFlag, in the batch's order (the stream stops at the first unmet)
  uint64_t epoch = 0;
  uint64_t tag = 0;
  // Captured in a CUDA graph: its marks are replayed (WaitMarks::slot_of), its flags carry
  // kCapturedEpoch, and a timeout ends the process (watchdog.cpp).
  bool captured = false;
  uint64_t graph = 0;  // captured: the id of the capture that recorded it (captured_graphs.cpp)
  int peer = -1;                   // kNccl / kMailbox
  Phase phase = Phase::kPush;      // kNccl / kMailbox
  std::string what;  // kNccl: the group's peers; kMailbox: the transfer, for messages
  const NetOutbox* mailbox = nullptr;  // kMailbox: own mailbox for `peer`
  std::vector<MailboxWord> words;      // kMailbox
  int channel = 0;                     // kMailbox
  uint64_t seq = 0;                    // kMailbox receive: the send number it waits for (else 0)
  uint64_t* offset = nullptr;          // kMailbox receive: its entry's offset, poisoned on release
  std::size_t bytes = 0;               // kMailbox receive: its bytes
};

// The ends of CUDA graphs that hold an executor's captured waits, posted by CUDA's thread (a user
// object's destructor: no CUDA call, only this lock) and taken by the executor (captured_graphs.cpp).
// Shared: a graph may end after its executor.
class GraphEnds {
 public:
  void post(uint64_t capture);
  std::vector<uint64_t> take();
  bool any() const { return any_.load(std::memory_order_acquire); }

 private:
  std::mutex mutex_;
  std::vector<uint64_t> ended_;
  std::atomic<bool> any_{false};
};

enum class KernelKind : uint8_t { kCast, kReduce, kCopy, kNetPull, kCastToPeers };

struct KernelTiming {
  cudaEvent_t start;
  cudaEvent_t end;
  int ctas;
  KernelKind kind;
};

// A program address -> the pointer it names in this run.
using Resolve = std::function<std::byte*(const Address&)>;

}  // namespace cuda_executor_detail

// A program's lowering and the pointers it was made for (PreparedProgram, cuda.hpp).
struct PreparedProgram::Lowered {
  bool valid = false;  // commands and schedule were made for `bindings`
  bool captured = false;  // ... for a captured run (cast_to_peers_split fuses run by run only)
  Bindings bindings;
  bool has_net = false;
  // Params whose casts read a scale: a reused lowering still checks their Bindings::scales, which
  // its pointers do not cover (casts read the scales of the run that enqueues them).
  std::vector<int> scaled_params;
  net::GroupSchedule schedule;  // has_net only
  lowering::CommandList commands;
  // Per command, its kernel launches with their tables (reduce and copy kernels; empty for the
  // others), built with the lowering.
  std::vector<cuda_kernels::Launches> launches;
};

struct CudaExecutor::Impl {
  using PendingWait = cuda_executor_detail::PendingWait;
  using MailboxWord = cuda_executor_detail::MailboxWord;
  using KernelKind = cuda_executor_detail::KernelKind;
  using KernelTiming = cuda_executor_detail::KernelTiming;
  using Resolve = cuda_executor_detail::Resolve;

  CudaWindow& window;
  cudaStream_t stream;
  std::chrono::milliseconds timeout;
  NcclComm* network;
  const cuda_detail::DriverApi& api;
  cudaStream_t net_stream = nullptr;   // created at the first across-node program
  // IPC network: a group's transfers with its second, third... peer run on these, so none waits
  // behind another peer's (NCCL runs a group's transfers concurrently too).
  std::vector<cudaStream_t> peer_streams;
  cudaEvent_t net_ready = nullptr;     // the compute stream's position at a group's last op
  std::mutex net_mutex;                // NCCL calls on `network` vs the watchdog's abort
  cudaStream_t side_stream = nullptr;  // non-blocking: the watchdog's flag reads and releases
  // Host staging of the watchdog's flag reads/writes (pageable: cudaMallocHost/cudaFreeHost may
  // wait for the whole device, which must not happen while ranks of this process wait on each other).
  std::vector<FlagWord> staging;
  NetOutbox mailbox_staging{};
  bool batch_copies = true;            // cleared once cudaMemcpyBatchAsync turns out unusable
  // The cast-to-peers kernel takes the slot-free handshake too (one launch, no memop call per
  // collective); TIDE_CUDA_FUSED_HANDSHAKE=0 when the executor is made: a memop call before it.
  bool fuse_handshake = true;
  // The lowering of a run of a Program, and the launch arguments built from a lowering, reused
  // run after run (their capacity stays: no allocation per run once warm).
  std::vector<std::byte*> window_data;  // window.data(r) per rank, read at the first run
  PreparedProgram::Lowered one_shot;
  // This executor's number among the process's executors: which PreparedPrograms are its own.
  const uint64_t serial = [] {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }();
  std::vector<lowering::Copy> cast_copies;  // enqueue_casts' same-type casts
  std::vector<cuda_kernels::ReduceSpec> reduce_specs;
  std::vector<cuda_kernels::CopySpec> copy_specs;
  std::vector<void*> batch_dsts;
  std::vector<const void*> batch_srcs;
  std::vector<std::size_t> batch_sizes;
  std::vector<cudaStream_t> streams_used;

  bool stats_enabled = false;
  std::vector<KernelTiming> timings;
  Stats stats;

  // Shared with the watchdog thread, under `mutex`.
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<PendingWait> pending;
  // The flag waits of every collective captured in a CUDA graph on this executor, kept for good
  // (a graph may be replayed at any time, without a call into TIDE), and where the watchdog last
  // saw each captured slot: (reached, passed) and since when.
  std::vector<PendingWait> captured;
  struct CapturedSlot {
    int slot;
    uint64_t reached, passed;
    cuda_executor_detail::Clock::time_point since;
  };
  std::vector<CapturedSlot> captured_slots;
  // The graphs that hold them (captured_graphs.cpp): per capture, the mark slots it holds.
  struct LiveGraph {
    uint64_t capture;
    std::vector<int> slots;
    bool tracked;  // its end reaches GraphEnds (a user object the graph retains); else kept for good
  };
  std::vector<LiveGraph> graphs;
  std::shared_ptr<cuda_executor_detail::GraphEnds> graph_ends =
      std::make_shared<cuda_executor_detail::GraphEnds>();
  std::vector<cudaEvent_t> free_events;
  std::optional<cuda_executor_detail::WaitMarks> marks;  // made once the device is checked
  bool stop = false;
  bool watchdog_asleep = false;  // idle past its polls (watchdog.cpp): watch() must notify `wake`
  std::exception_ptr error;     // TimeoutError / DesyncError / SystemError
  std::atomic<bool> failed{false};
  std::atomic<bool> watchdog_dead{false};  // it hit a CUDA error and can no longer drain
  std::thread watchdog;

  Impl(CudaWindow& w, void* s, std::chrono::milliseconds t, NcclComm* n);

  // ---- Events, streams, errors, stats (cuda_executor.cpp; caller's thread). ----
  cudaEvent_t take_event();
  void recycle_events(const std::vector<cudaEvent_t>& events);
  void use_stream(cudaStream_t s);
  // A watched wait to be enqueued on stream `on`: its id and its stream's marks. Enqueue
  // mark(w, false) before its waits and mark(w, true) after them, in the same
  // cuStreamBatchMemOp where the waits are stream operations, then watch() it.
  PendingWait new_wait(PendingWait::Kind kind, cudaStream_t on, uint64_t epoch, uint64_t tag,
                       int peer, Phase phase, bool captured = false);
  CUstreamBatchMemOpParams mark(const PendingWait& w, bool passed) const;
  void enqueue_mark(cudaStream_t on, const PendingWait& w, bool passed);  // in a call of its own
  void watch(PendingWait&& record);  // hands a wait whose marks are enqueued to the watchdog
                                     // (a captured one: kept in `captured` for good)
  void retire(const PendingWait& w);  // (caller holds `mutex`)
  void throw_if_failed();
  void wait_stream(cudaStream_t s);
  void collect_timings();

  template <class Launch>
  void launch_timed(KernelKind kind, cudaStream_t on, Launch&& launch) {
    cudaEvent_t start = nullptr, end = nullptr;
    const bool timed = stats_enabled && !capturing;  // a captured kernel runs at each replay, untimed
    if (timed) {
      TIDE_CUDA_CHECK(cudaEventCreate(&start));
      TIDE_CUDA_CHECK(cudaEventCreate(&end));
      TIDE_CUDA_CHECK(cudaEventRecord(start, on));
    }
    const cuda_kernels::LaunchInfo info = launch();
    stats.kernel_launches += info.launches;
    if (timed) {
      TIDE_CUDA_CHECK(cudaEventRecord(end, on));
      timings.push_back({start, end, info.max_ctas, kind});
    }
  }

  // ---- Lowering (lowering.cpp). ----
  // validate_run, unless `lowered` holds the lowering for these bindings (`reuse`), then the
  // program's commands enqueued (lowered again first unless `reuse`) under the window's next epoch.
  // Enqueueing only reads the lowering: what a reused run issues is what the first one did.
  void run(const Program& program, const Bindings& bindings, PreparedProgram::Lowered& lowered,
           bool reuse);
  // Whether the stream is being captured into a CUDA graph (refused where that cannot be
  // recorded: the legacy stream, an invalidated capture, a program CudaExecutor::capture_refusal
  // names), before anything moves.
  bool check_capture(const Program& program);
  bool capturing = false;  // the run being enqueued is captured (kCapturedEpoch, no copy batches)
  uint64_t capture = 0;    // while capturing: the capture's id

  // ---- CUDA graphs holding captured waits (captured_graphs.cpp). ----
  // At a captured run, before its waits: the capture's id in `capture`, and the graph's end tied
  // to this executor (once per capture).
  void adopt_capture();
  // A captured wait of `capture` on `slot`: the graph holds the slot until it ends (caller holds
  // `mutex`).
  void hold_captured_slot(int slot);
  // Drops the waits and slots of graphs that ended (caller holds `mutex`).
  void forget_ended_graphs();
  void lower(const Program& program, const Bindings& bindings, PreparedProgram::Lowered& out);
  void enqueue_program(const Program& program, const Bindings& bindings,
                       const PreparedProgram::Lowered& lowered, uint64_t epoch, uint64_t tag);
  // The commands of lowering::lower (command_list.hpp), each issued as lowering.cpp's header says.
  void enqueue_casts(const std::vector<Step>& steps, std::size_t first, std::size_t end,
                     const Resolve& resolve, const Bindings& bindings);
  cuda_kernels::Launches reduce_launches(const lowering::CommandList& list, const lowering::Command& c);
  cuda_kernels::Launches copy_launches(const std::vector<lowering::Copy>& copies, std::size_t first,
                                       std::size_t count);
  void run_launches(const cuda_kernels::Launches& launches, KernelKind kind);
  void enqueue_engine_copies(const std::vector<lowering::Copy>& copies, std::size_t first,
                             std::size_t count);
  std::size_t cast_to_peers_start(const Program& program) const;
  struct CastToPeersSplit {
    std::size_t head;  // the kernel's first step
    std::size_t tail;  // its first step after a fused slot-free handshake (head when not fused)
  };
  CastToPeersSplit cast_to_peers_split(const Program& program) const;
  void enqueue_cast_to_peers(const std::vector<Step>& steps, std::size_t first, std::size_t tail,
                             const Resolve& resolve,
                             const Bindings& bindings, uint64_t epoch, uint64_t tag);
  void enqueue_copy_2d(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                       std::size_t width, std::size_t rows);
  // Signals and waits of steps [first, end) in one cuStreamBatchMemOp.
  void enqueue_flag_ops(const std::vector<Step>& steps, std::size_t first, std::size_t end,
                        uint64_t epoch, uint64_t tag);
  cudaEvent_t issue_group(const net::NetGroup& group, const Program& program,
                          const Resolve& resolve, uint64_t epoch, uint64_t tag, Phase phase);

  // ---- NCCL transport (nccl_transport.cpp). ----
  void issue_nccl_group(const net::NetGroup& group, const Program& program,
                        const Resolve& resolve, uint64_t epoch, uint64_t tag, Phase phase);
  std::exception_ptr diagnose_nccl_group(const PendingWait& w);

  // ---- CUDA IPC transport (ipc_transport.cpp). ----
  void issue_ipc_group(const net::NetGroup& group, const Program& program,
                       const Resolve& resolve, uint64_t epoch, uint64_t tag, Phase phase);
  void enqueue_mailbox_wait(cudaStream_t on, const NetOutbox* mailbox, int channel,
                            std::vector<MailboxWord> words, std::string what, int peer,
                            uint64_t seq, std::size_t bytes, uint64_t epoch, uint64_t tag,
                            Phase phase);
  void write_word(cudaStream_t on, uint64_t* word, uint64_t value);
  std::exception_ptr diagnose_mailbox(const PendingWait& w);
  void release_mailbox_wait(const PendingWait& w);

  // ---- Watchdog thread (watchdog.cpp). ----
  void watchdog_loop();
  void store_error(std::exception_ptr e);
  FlagWord read_flag(const FlagWord* flag);
  void write_flags(FlagWord* flags, std::size_t count, uint64_t tag);
  // The first of a stuck flag batch's waits that its flag does not meet, as an error; null if
  // every flag now meets its wait (the batch is about to pass).
  std::exception_ptr diagnose_flag_wait(const PendingWait& w);
  // The captured slots' marks: a replayed wait reached but not passed past the timeout ends the
  // process with its diagnosis (no call into TIDE runs during a replay to raise it in).
  void watch_captured();
  void release_flag_wait(const PendingWait& w);
};

}  // namespace tide
