// The CUDA executor: the host executor's step semantics, enqueued on a stream.
//
//   CopyBatch  -> cudaMemcpyBatchAsync (copy engines preferred, source in stream order);
//                 one cudaMemcpyAsync per copy where batches are unavailable.
//   CastOp     -> equal types: a batched copy + cudaMemsetAsync of the pad (no kernel);
//                 otherwise one cast kernel for all consecutive CastOps.
//   SignalOp   -> cuStreamWriteValue64 of the tag, then of the epoch, into the peer's FlagWord (each
//                 write is preceded by a memory barrier: the data before it is visible first).
//   WaitOp     -> cuStreamWaitValue64(epoch >= e), then cuStreamWaitValue64(tag == t): a peer that
//                 runs another collective blocks the stream instead of feeding it wrong data, and
//                 the watchdog reports DesyncError.
//   ReduceOp   -> one reduce kernel for consecutive ReduceOps with as many sources each, none
//                 reading or writing what an earlier one of the kernel writes.
//   NetSendOp/NetRecvOp -> grouped ncclSend/ncclRecv on a network stream, as the group schedule
//                 (src/executor/net/group_schedule.hpp) says: issued after the stream reaches the
//                 group's last op, waited for only by steps that touch its bytes. Without NCCL,
//                 on a CudaReach::kHost window, the same groups run over CUDA IPC: a send posts
//                 its (offset, bytes, epoch, tag) into the receiver's mailbox with stream writes;
//                 a receive waits for the post (stream waits that also check epoch, tag and
//                 bytes), pulls the bytes with a kernel and counts the send as taken in the
//                 sender's mailbox; the group ends once its sends are taken.
//
// Watchdog: each wait is bracketed by two events. A host thread looks at the oldest wait not yet
// passed; once its "before" event has completed but its "after" has not for longer than the
// timeout, it reads the flag on a side stream, stores TimeoutError (or DesyncError when the epoch
// arrived with another program's tag) naming rank, peer, bucket, phase and epoch, and releases the
// stuck wait by writing the awaited values into the flag, and so every later stuck wait of this
// executor, so the stream drains and nothing hangs. synchronize() and run() then throw the error.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "cuda_check.hpp"
#include "driver_api.hpp"
#include "kernels.cuh"
#include "net/group_schedule.hpp"
#include "resolve.hpp"
#include "tide/cuda.hpp"
#include "tide/error.hpp"

namespace tide {

static_assert(static_cast<int>(DType::kBF16) == cuda_kernels::kBF16 &&
                  static_cast<int>(DType::kFP16) == cuda_kernels::kFP16 &&
                  static_cast<int>(DType::kFP32) == cuda_kernels::kFP32,
              "kernel element types must be numbered as tide::DType");

namespace {

using Clock = std::chrono::steady_clock;

// Written into a stuck flag's epoch to release it: cuStreamWaitValue64's GEQ compares the signed
// difference (int64_t)(*addr - value) >= 0, so UINT64_MAX would read as -1 and never pass; 2^62
// passes for every epoch a window can reach.
constexpr uint64_t kReleaseEpoch = uint64_t{1} << 62;

std::string describe_tag(uint64_t tag) {
  return detail::concat("bucket ", tag >> 1, " ",
                        collective_name(static_cast<Collective>(tag & 1)));
}

const char* flag_kind_name(FlagKind kind) {
  return kind == FlagKind::kSlotFree ? "slot_free" : "data_ready";
}

cuda_kernels::ElementType element_type(DType dtype) {
  return static_cast<cuda_kernels::ElementType>(static_cast<int>(dtype));
}

// A stream wait on a word of the own window's IPC mailbox: `value` passes it (GEQ or EQ).
struct MailboxWord {
  uint64_t* word;
  uint64_t value;
  bool equal;
};

struct PendingWait {
  enum class Kind : uint8_t {
    kFlag,     // a WaitOp: `flag`
    kNccl,     // a network group over NCCL: only an abort releases it
    kMailbox,  // an IPC network transfer: `words` of `mailbox`
  };
  uint64_t id = 0;
  cudaEvent_t before = nullptr;
  cudaEvent_t after = nullptr;
  Kind kind = Kind::kFlag;
  FlagWord* flag = nullptr;  // kFlag: own flag, device pointer
  uint64_t epoch = 0;
  uint64_t tag = 0;
  int peer = -1;
  FlagKind flag_kind = FlagKind::kDataReady;  // kFlag
  Phase phase = Phase::kPush;
  std::string what;  // kNccl: the group's peers; kMailbox: the transfer, for messages
  const NetOutbox* mailbox = nullptr;  // kMailbox: own mailbox for `peer`
  std::vector<MailboxWord> words;      // kMailbox
  int channel = 0;                     // kMailbox
  uint64_t seq = 0;                    // kMailbox receive: the send number it waits for (else 0)
  uint64_t* offset = nullptr;          // kMailbox receive: its entry's offset, poisoned on release
  std::size_t bytes = 0;               // kMailbox receive: its bytes
};

struct Span {
  const std::byte* begin;
  const std::byte* end;
  bool overlaps(const Span& o) const { return begin < o.end && o.begin < end; }
};

enum class KernelKind : uint8_t { kCast, kReduce, kNetPull };

struct KernelTiming {
  cudaEvent_t start;
  cudaEvent_t end;
  int ctas;
  KernelKind kind;
};

}  // namespace

struct CudaExecutor::Impl {
  CudaWindow& window;
  cudaStream_t stream;
  std::chrono::milliseconds timeout;
  NcclComm* network;
  const cuda_detail::DriverApi& api;
  cudaStream_t net_stream = nullptr;   // created at the first multi-node program
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
  std::vector<cudaStream_t> streams_used;

  bool stats_enabled = false;
  std::vector<KernelTiming> timings;
  Stats stats;

  // Shared with the watchdog thread, under `mutex`.
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<PendingWait> pending;
  std::vector<cudaEvent_t> free_events;
  uint64_t next_wait_id = 0;
  bool stop = false;
  std::exception_ptr error;     // TimeoutError / DesyncError / SystemError
  std::atomic<bool> failed{false};
  std::atomic<bool> watchdog_dead{false};  // it hit a CUDA error and can no longer drain
  std::thread watchdog;

  Impl(CudaWindow& w, void* s, std::chrono::milliseconds t, NcclComm* n)
      : window(w), stream(static_cast<cudaStream_t>(s)), timeout(t), network(n),
        api(cuda_detail::driver_api()) {
    const char* batch = std::getenv("TIDE_CUDA_BATCH_COPY");
    if (batch && std::string(batch) == "0") batch_copies = false;
  }

  // ---- Enqueueing (caller's thread). ----

  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!free_events.empty()) {
        cudaEvent_t e = free_events.back();
        free_events.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  void enqueue_copies(std::vector<void*>& dsts, std::vector<const void*>& srcs,
                      std::vector<std::size_t>& sizes) {
    if (dsts.empty()) return;
    stats.copies += static_cast<int>(dsts.size());
#if CUDART_VERSION >= 12080
    if (batch_copies && stream != nullptr && stream != cudaStreamLegacy) {
      cudaMemcpyAttributes attributes{};
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;  // keep SMs free: copy engines
      std::size_t attribute_index = 0;
#if CUDART_VERSION >= 13000
      const cudaError_t status = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                                      dsts.size(), &attributes, &attribute_index,
                                                      1, stream);
#else
      std::size_t fail_index = 0;
      const cudaError_t status = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                                      dsts.size(), &attributes, &attribute_index,
                                                      1, &fail_index, stream);
#endif
      if (status == cudaSuccess) {
        ++stats.batched_copy_calls;
        return;
      }
      // Unsupported here (driver, stream kind): fall back for good. A real addressing error
      // shows up again, with its own message, in cudaMemcpyAsync below.
      (void)cudaGetLastError();
      batch_copies = false;
    }
#endif
    for (std::size_t i = 0; i < dsts.size(); ++i)
      TIDE_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDeviceToDevice, stream));
    stats.single_copy_calls += static_cast<int>(dsts.size());
  }

  template <class Launch>
  void launch_timed(KernelKind kind, cudaStream_t on, Launch&& launch) {
    cudaEvent_t start = nullptr, end = nullptr;
    if (stats_enabled) {
      TIDE_CUDA_CHECK(cudaEventCreate(&start));
      TIDE_CUDA_CHECK(cudaEventCreate(&end));
      TIDE_CUDA_CHECK(cudaEventRecord(start, on));
    }
    const cuda_kernels::LaunchInfo info = launch();
    stats.kernel_launches += info.launches;
    if (stats_enabled) {
      TIDE_CUDA_CHECK(cudaEventRecord(end, on));
      timings.push_back({start, end, info.max_ctas, kind});
    }
  }

  PendingWait new_wait(PendingWait::Kind kind, uint64_t epoch, uint64_t tag, int peer, Phase phase) {
    PendingWait record;
    record.before = take_event(), record.after = take_event();
    record.kind = kind, record.epoch = epoch, record.tag = tag, record.peer = peer;
    record.phase = phase;
    return record;
  }

  void watch(PendingWait&& record) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      record.id = next_wait_id++;
      pending.push_back(std::move(record));
    }
    wake.notify_one();
  }

  void enqueue_wait(const WaitOp& wait, Phase phase, uint64_t epoch, uint64_t tag) {
    const int rank = window.rank();
    FlagWord* flag = window.flags(rank) + flag_index(wait.kind, wait.peer, window.world());
    PendingWait record = new_wait(PendingWait::Kind::kFlag, epoch, tag, wait.peer, phase);
    record.flag = flag, record.flag_kind = wait.kind;
    TIDE_CUDA_CHECK(cudaEventRecord(record.before, stream));
    TIDE_CU_CHECK(api.stream_wait_value64(stream, reinterpret_cast<CUdeviceptr>(&flag->epoch), epoch,
                                          CU_STREAM_WAIT_VALUE_GEQ));
    TIDE_CU_CHECK(api.stream_wait_value64(stream, reinterpret_cast<CUdeviceptr>(&flag->tag), tag,
                                          CU_STREAM_WAIT_VALUE_EQ));
    TIDE_CUDA_CHECK(cudaEventRecord(record.after, stream));
    watch(std::move(record));
  }

  void enqueue_signal(const SignalOp& signal, uint64_t epoch, uint64_t tag) {
    FlagWord* flag =
        window.flags(signal.peer) + flag_index(signal.kind, window.rank(), window.world());
    TIDE_CU_CHECK(api.stream_write_value64(stream, reinterpret_cast<CUdeviceptr>(&flag->tag), tag,
                                           CU_STREAM_WRITE_VALUE_DEFAULT));
    TIDE_CU_CHECK(api.stream_write_value64(stream, reinterpret_cast<CUdeviceptr>(&flag->epoch),
                                           epoch, CU_STREAM_WRITE_VALUE_DEFAULT));
  }

  // Enqueues a group's sends and receives on the network stream after the compute stream's
  // position recorded in net_ready: over NCCL if the executor has a communicator, else over CUDA
  // IPC. Returns an event recorded after it, the caller's (its compute stream may wait on it; give
  // it back with recycle_events once every cudaStreamWaitEvent on it is enqueued). The watchdog's
  // events are separate: it recycles them as soon as they complete, which must not re-record an
  // event a later wait still refers to.
  cudaEvent_t issue_group(const net::NetGroup& group, const Program& program,
                          const std::function<std::byte*(const Address&)>& resolve, uint64_t epoch,
                          uint64_t tag, Phase phase) {
    if (!net_stream) TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&net_stream, cudaStreamNonBlocking));
    use_stream(net_stream);
    TIDE_CUDA_CHECK(cudaStreamWaitEvent(net_stream, net_ready, 0));
    cudaEvent_t done = take_event();
    try {
      if (network)
        issue_nccl_group(group, program, resolve, epoch, tag, phase);
      else
        issue_ipc_group(group, program, resolve, epoch, tag, phase);
      TIDE_CUDA_CHECK(cudaEventRecord(done, net_stream));
    } catch (...) {
      recycle_events({done});
      throw;
    }
    ++stats.network_groups;
    return done;
  }

  void use_stream(cudaStream_t s) {
    if (std::find(streams_used.begin(), streams_used.end(), s) == streams_used.end())
      streams_used.push_back(s);
  }

  // One NCCL group, watched as a whole: NCCL can only be released by aborting the communicator.
  void issue_nccl_group(const net::NetGroup& group, const Program& program,
                        const std::function<std::byte*(const Address&)>& resolve, uint64_t epoch,
                        uint64_t tag, Phase phase) {
    const NcclLibrary& nccl = NcclLibrary::get();
    PendingWait record = new_wait(PendingWait::Kind::kNccl, epoch, tag, -1, phase);
    try {
      TIDE_CUDA_CHECK(cudaEventRecord(record.before, net_stream));
      // Under net_mutex: the watchdog aborts the communicator (which frees it) only between
      // groups, never while this thread is inside an NCCL call on it.
      std::lock_guard<std::mutex> net_lock(net_mutex);
      throw_if_failed();  // aborted meanwhile: the communicator is gone
      nccl.check(nccl.group_start(), "ncclGroupStart");
      int result = 0;
      for (std::size_t i : group.ops) {
        const Step& step = program.steps[i];
        if (const auto* send = std::get_if<NetSendOp>(&step.op)) {
          record.what += detail::concat(record.what.empty() ? "" : ", ", "send to ", send->peer);
          if (result == 0)
            result = nccl.send(resolve(send->src), send->bytes, NcclLibrary::kUint8, send->peer,
                               network->get(), net_stream);
        } else if (const auto* recv = std::get_if<NetRecvOp>(&step.op)) {
          record.what += detail::concat(record.what.empty() ? "" : ", ", "receive from ", recv->peer);
          if (result == 0)
            result = nccl.recv(resolve(recv->dst), recv->bytes, NcclLibrary::kUint8, recv->peer,
                               network->get(), net_stream);
        }
      }
      const int ended = nccl.group_end();  // always ended, even after a failed call inside
      nccl.check(result, "ncclSend/ncclRecv");
      nccl.check(ended, "ncclGroupEnd");
      TIDE_CUDA_CHECK(cudaEventRecord(record.after, net_stream));
    } catch (...) {
      recycle_events({record.before, record.after});
      throw;
    }
    watch(std::move(record));
  }

  // Stream waits on `words` of the own mailbox for `peer` on stream `on`, watched.
  void enqueue_mailbox_wait(cudaStream_t on, const NetOutbox* mailbox, int channel,
                            std::vector<MailboxWord> words, std::string what, int peer,
                            uint64_t seq, std::size_t bytes, uint64_t epoch, uint64_t tag,
                            Phase phase) {
    PendingWait record = new_wait(PendingWait::Kind::kMailbox, epoch, tag, peer, phase);
    record.what = std::move(what), record.mailbox = mailbox, record.channel = channel;
    record.words = std::move(words), record.seq = seq, record.bytes = bytes;
    if (seq > 0)
      record.offset = const_cast<uint64_t*>(&mailbox->entries[(seq - 1) % kNetQueueDepth].offset);
    TIDE_CUDA_CHECK(cudaEventRecord(record.before, on));
    for (const MailboxWord& w : record.words)
      TIDE_CU_CHECK(api.stream_wait_value64(on, reinterpret_cast<CUdeviceptr>(w.word), w.value,
                                            w.equal ? CU_STREAM_WAIT_VALUE_EQ
                                                    : CU_STREAM_WAIT_VALUE_GEQ));
    TIDE_CUDA_CHECK(cudaEventRecord(record.after, on));
    watch(std::move(record));
  }

  void write_word(cudaStream_t on, uint64_t* word, uint64_t value) {
    TIDE_CU_CHECK(api.stream_write_value64(on, reinterpret_cast<CUdeviceptr>(word), value,
                                           CU_STREAM_WRITE_VALUE_DEFAULT));
  }

  // One group over CUDA IPC (window.reach() == kHost). Each peer's sends and receives run in
  // program order on a stream of their own (the first peer's on the network stream, the others'
  // forked from it), so no transfer waits behind another peer's, and a send past the mailbox's
  // depth waits only for that peer to receive; the group ends once they all have and its sends
  // are taken: NCCL's group semantics plus per-peer order and a bounded mailbox, which
  // net::simulate_ipc_groups models (the tests run every planner schedule through it).
  void issue_ipc_group(const net::NetGroup& group, const Program& program,
                       const std::function<std::byte*(const Address&)>& resolve, uint64_t epoch,
                       uint64_t tag, Phase phase) {
    const int rank = window.rank();
    auto peer_of = [&](std::size_t i) {
      const Step& step = program.steps[i];
      const auto* send = std::get_if<NetSendOp>(&step.op);
      return send ? send->peer : std::get<NetRecvOp>(step.op).peer;
    };
    std::vector<int> peers;  // distinct, in order of first appearance
    for (std::size_t i : group.ops)
      if (std::find(peers.begin(), peers.end(), peer_of(i)) == peers.end()) peers.push_back(peer_of(i));
    while (peer_streams.size() + 1 < peers.size()) {
      cudaStream_t s = nullptr;
      TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      peer_streams.push_back(s);
    }
    struct Posted {
      int channel, peer;
      uint64_t seq;
      std::size_t bytes;
    };
    std::vector<Posted> sends;
    std::vector<cudaEvent_t> joins;
    cudaEvent_t fork = nullptr;
    if (peers.size() > 1) {
      fork = take_event();
      TIDE_CUDA_CHECK(cudaEventRecord(fork, net_stream));
    }
    for (std::size_t p = 0; p < peers.size(); ++p) {
      cudaStream_t on = p == 0 ? net_stream : peer_streams[p - 1];
      if (p > 0) {
        use_stream(on);
        TIDE_CUDA_CHECK(cudaStreamWaitEvent(on, fork, 0));
      }
      for (std::size_t i : group.ops) {
        if (peer_of(i) != peers[p]) continue;
        const Step& step = program.steps[i];
        if (const auto* send = std::get_if<NetSendOp>(&step.op)) {
          const uint64_t k = window.next_net_send(send->channel, send->peer);
          const NetOutbox* own = window.mailbox(rank, send->channel, send->peer);
          if (k > static_cast<uint64_t>(kNetQueueDepth))
            enqueue_mailbox_wait(on, own, send->channel,
                                 {{const_cast<uint64_t*>(&own->taken), k - kNetQueueDepth, false}},
                                 detail::concat("room in the mailbox of rank ", send->peer,
                                                " for net send #", k),
                                 send->peer, 0, send->bytes, epoch, tag, phase);
          NetOutbox* theirs = window.mailbox(send->peer, send->channel, rank);
          NetEntry& entry = theirs->entries[(k - 1) % kNetQueueDepth];
          write_word(on, &entry.epoch, epoch);
          write_word(on, &entry.tag, tag);
          write_word(on, &entry.offset, send->src.offset);
          write_word(on, &entry.bytes, send->bytes);
          write_word(on, &theirs->posted, k);  // after a barrier: the entry is visible first
          sends.push_back({send->channel, send->peer, k, send->bytes});
          continue;
        }
        const auto& recv = std::get<NetRecvOp>(step.op);
        const uint64_t k = window.next_net_receive(recv.channel, recv.peer);
        NetOutbox* own = window.mailbox(rank, recv.channel, recv.peer);
        NetEntry& entry = own->entries[(k - 1) % kNetQueueDepth];
        enqueue_mailbox_wait(on, own, recv.channel,
                             {{&own->posted, k, false},
                              {&entry.epoch, epoch, true},
                              {&entry.tag, tag, true},
                              {&entry.bytes, recv.bytes, true}},
                             detail::concat("net receive #", k, " (", recv.bytes, " B) from rank ",
                                            recv.peer),
                             recv.peer, k, recv.bytes, epoch, tag, phase);
        launch_timed(KernelKind::kNetPull, on, [&] {
          return cuda_kernels::launch_net_pull(&entry.offset, window.data(recv.peer),
                                               resolve(recv.dst), recv.bytes, window.data_bytes(),
                                               on);
        });
        write_word(on, &window.mailbox(recv.peer, recv.channel, rank)->taken, k);
      }
      if (p > 0) {
        joins.push_back(take_event());
        TIDE_CUDA_CHECK(cudaEventRecord(joins.back(), on));
        TIDE_CUDA_CHECK(cudaStreamWaitEvent(net_stream, joins.back(), 0));
      }
    }
    if (fork) joins.push_back(fork);
    recycle_events(joins);  // every wait on them is enqueued
    for (const Posted& send : sends) {
      const NetOutbox* own = window.mailbox(rank, send.channel, send.peer);
      enqueue_mailbox_wait(net_stream, own, send.channel,
                           {{const_cast<uint64_t*>(&own->taken), send.seq, false}},
                           detail::concat("rank ", send.peer, " to receive net send #", send.seq,
                                          " (", send.bytes, " B)"),
                           send.peer, 0, send.bytes, epoch, tag, phase);
    }
  }

  void recycle_events(const std::vector<cudaEvent_t>& events) {
    std::lock_guard<std::mutex> lock(mutex);
    free_events.insert(free_events.end(), events.begin(), events.end());
  }

  void throw_if_failed() {
    if (watchdog_dead.load() || failed.load()) {
      std::lock_guard<std::mutex> lock(mutex);
      if (error) std::rethrow_exception(error);
    }
  }

  // Waits for `s` without blocking in the driver, so a dead watchdog cannot leave us hanging.
  void wait_stream(cudaStream_t s) {
    for (int spin = 0;; ++spin) {
      const cudaError_t status = cudaStreamQuery(s);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) TIDE_CUDA_CHECK(status);
      if (watchdog_dead.load()) throw_if_failed();
      if (spin < 64)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void collect_timings() {
    for (const KernelTiming& t : timings) {
      float ms = 0;
      TIDE_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.end));
      double& cta_us = t.kind == KernelKind::kCast     ? stats.cast_cta_us
                       : t.kind == KernelKind::kReduce ? stats.reduce_cta_us
                                                       : stats.network_cta_us;
      cta_us += 1000.0 * ms * t.ctas;
      (void)cudaEventDestroy(t.start);
      (void)cudaEventDestroy(t.end);
    }
    timings.clear();
  }

  // ---- Watchdog thread. ----

  void store_error(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!error) error = e;
    failed = true;
  }

  FlagWord read_flag(const FlagWord* flag) {
    TIDE_CUDA_CHECK(cudaMemcpyAsync(staging.data(), flag, sizeof(FlagWord), cudaMemcpyDeviceToHost,
                                    side_stream));
    TIDE_CUDA_CHECK(cudaStreamSynchronize(side_stream));
    return staging[0];
  }

  void write_flags(FlagWord* flags, std::size_t count, uint64_t tag) {
    for (std::size_t i = 0; i < count; ++i) staging[i] = FlagWord{kReleaseEpoch, tag};
    TIDE_CUDA_CHECK(cudaMemcpyAsync(flags, staging.data(), count * sizeof(FlagWord),
                                    cudaMemcpyHostToDevice, side_stream));
    TIDE_CUDA_CHECK(cudaStreamSynchronize(side_stream));
  }

  std::exception_ptr diagnose_network(const PendingWait& w) {
    return std::make_exception_ptr(TimeoutError(detail::concat(
        "rank ", window.rank(), ": timed out after ", timeout.count(),
        " ms in a network transfer (", w.what, "; ", describe_tag(w.tag), ", phase ",
        phase_name(w.phase), ", epoch ", w.epoch, ") over NCCL; the communicator was aborted. A "
        "peer is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is only "
        "slow)")));
  }

  // A stuck IPC transfer. DesyncError when the awaited send was posted for another collective,
  // epoch or size, or the peer posted on the other channel (all-gather vs reduce-scatter) at this
  // epoch; TimeoutError otherwise.
  std::exception_ptr diagnose_mailbox(const PendingWait& w) {
    auto read_mailbox = [&](const NetOutbox* box) {
      TIDE_CUDA_CHECK(cudaMemcpyAsync(&mailbox_staging, box, sizeof(NetOutbox),
                                      cudaMemcpyDeviceToHost, side_stream));
      TIDE_CUDA_CHECK(cudaStreamSynchronize(side_stream));
      return mailbox_staging;
    };
    const int rank = window.rank();
    const std::string where = detail::concat(describe_tag(w.tag), ", phase ", phase_name(w.phase),
                                             ", epoch ", w.epoch);
    auto desync = [&](uint64_t seq, const NetEntry& e, const char* channel) {
      return std::make_exception_ptr(DesyncError(detail::concat(
          "rank ", rank, " runs ", where, " and expects ", w.what, ", but rank ", w.peer,
          " posted send #", seq, channel, " of ", e.bytes, " B for ", describe_tag(e.tag),
          " at epoch ", e.epoch, ": the ranks called collectives in different orders [CUDA IPC "
          "network]")));
    };
    const NetOutbox box = read_mailbox(w.mailbox);
    if (w.seq > 0 && box.posted >= w.seq) {
      const NetEntry& e = box.entries[(w.seq - 1) % kNetQueueDepth];
      if (e.epoch != w.epoch || e.tag != w.tag || e.bytes != w.bytes) return desync(w.seq, e, "");
    }
    const NetOutbox other = read_mailbox(window.mailbox(rank, 1 - w.channel, w.peer));
    if (other.posted > 0) {
      const NetEntry& e = other.entries[(other.posted - 1) % kNetQueueDepth];
      if (e.epoch == w.epoch && e.tag != w.tag)
        return desync(other.posted, e, " on the other collective's channel");
    }
    return std::make_exception_ptr(TimeoutError(detail::concat(
        "rank ", rank, ": timed out after ", timeout.count(), " ms waiting for ", w.what, " (",
        where, ") on the GPU; rank ", w.peer, " has posted ", box.posted,
        " sends to this rank and received ", box.taken, " of its sends [CUDA IPC network]. The "
        "peer is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is only "
        "slow)")));
  }

  // Releases a stuck IPC wait. A receive's offset is poisoned first, so its pull kernel copies
  // nothing (the sender may be gone) unless a live sender posts the real one meanwhile.
  void release_mailbox_wait(const PendingWait& w) {
    auto write = [&](uint64_t* word, uint64_t value) {
      TIDE_CUDA_CHECK(cudaMemcpyAsync(word, &value, sizeof value, cudaMemcpyHostToDevice,
                                      side_stream));
      TIDE_CUDA_CHECK(cudaStreamSynchronize(side_stream));
    };
    if (w.offset) write(w.offset, UINT64_MAX);
    for (const MailboxWord& m : w.words) write(m.word, m.equal ? m.value : kReleaseEpoch);
  }

  std::exception_ptr diagnose(const PendingWait& w, const FlagWord& seen) {
    const int rank = window.rank();
    const bool epoch_arrived = static_cast<int64_t>(seen.epoch - w.epoch) >= 0;
    if (epoch_arrived) {
      return std::make_exception_ptr(DesyncError(detail::concat(
          "rank ", rank, " runs ", describe_tag(w.tag), " at epoch ", w.epoch, " (phase ",
          phase_name(w.phase), ") but rank ", w.peer, " signalled ", describe_tag(seen.tag),
          " at epoch ", seen.epoch, ": the ranks called collectives in different orders")));
    }
    return std::make_exception_ptr(TimeoutError(detail::concat(
        "rank ", rank, ": timed out after ", timeout.count(), " ms waiting for ",
        flag_kind_name(w.flag_kind), " from rank ", w.peer, " (", describe_tag(w.tag), ", phase ",
        phase_name(w.phase), ", epoch ", w.epoch, ") on the GPU; last signal from rank ", w.peer,
        ": ",
        seen.epoch == 0 ? std::string("none")
                        : detail::concat("epoch ", seen.epoch, ", ", describe_tag(seen.tag)),
        ". The peer is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is "
        "only slow)")));
  }

  void watchdog_loop() {
    try {
      TIDE_CUDA_CHECK(cudaSetDevice(window.device()));
      uint64_t stuck_id = UINT64_MAX;
      Clock::time_point stuck_since{};
      std::unique_lock<std::mutex> lock(mutex);
      for (;;) {
        if (pending.empty()) {
          if (stop) return;
          wake.wait(lock);
          continue;
        }
        const PendingWait w = pending.front();
        lock.unlock();
        const cudaError_t after = cudaEventQuery(w.after);
        if (after == cudaSuccess) {
          lock.lock();
          pending.pop_front();
          free_events.push_back(w.before);
          free_events.push_back(w.after);
          continue;
        }
        if (after != cudaErrorNotReady) TIDE_CUDA_CHECK(after);
        const cudaError_t before = cudaEventQuery(w.before);
        if (before != cudaSuccess && before != cudaErrorNotReady) TIDE_CUDA_CHECK(before);
        bool draining = failed.load();
        if (before == cudaSuccess) {
          const Clock::time_point now = Clock::now();
          if (stuck_id != w.id) stuck_id = w.id, stuck_since = now;
          const bool timed_out = !draining && now - stuck_since >= timeout;
          if (timed_out) {
            store_error(w.kind == PendingWait::Kind::kNccl      ? diagnose_network(w)
                        : w.kind == PendingWait::Kind::kMailbox ? diagnose_mailbox(w)
                                                                : diagnose(w, read_flag(w.flag)));
            // Release every own flag at once (this program's remaining waits pass quickly);
            // waits of later programs, or flags a live peer overwrites, are released one by one.
            write_flags(window.flags(window.rank()), kNumFlagKinds * window.world(), w.tag);
            draining = true;
          }
          if (draining) {
            if (w.kind == PendingWait::Kind::kNccl) {  // NCCL can only be released by an abort
              if (!network->aborted()) {
                std::lock_guard<std::mutex> net_lock(net_mutex);
                network->abort();
              }
            } else if (w.kind == PendingWait::Kind::kMailbox) {
              release_mailbox_wait(w);
            } else if (!timed_out) {
              write_flags(w.flag, 1, w.tag);
            }
          }
        }
        std::this_thread::sleep_for(draining ? std::chrono::microseconds(100)
                                              : std::chrono::microseconds(1000));
        lock.lock();
      }
    } catch (...) {
      // A CUDA error here (the context is broken): report it and stop; wait_stream() and
      // throw_if_failed() see watchdog_dead and throw instead of waiting for a drain.
      store_error(std::current_exception());
      watchdog_dead = true;
      std::lock_guard<std::mutex> lock(mutex);
      pending.clear();
    }
  }
};

CudaExecutor::CudaExecutor(CudaWindow& window, void* stream, std::chrono::milliseconds timeout,
                           NcclComm* network)
    : impl_(std::make_unique<Impl>(window, stream, timeout, network)) {
  TIDE_CHECK_ARG(timeout.count() > 0, "CudaExecutor", "timeout_ms", timeout.count(), "> 0");
  if (network) {
    TIDE_CHECK_ARG(network->world() == window.world() && network->rank() == window.rank(),
                   "CudaExecutor", "network",
                   detail::concat("rank ", network->rank(), " of ", network->world()),
                   detail::concat("rank ", window.rank(), " of ", window.world(),
                                  " (the window's: NCCL rank i must be TIDE rank i)"));
    TIDE_CHECK_ARG(network->device() == window.device(), "CudaExecutor", "network device",
                   network->device(), detail::concat(window.device(), " (the window's device)"));
  }
  int device = 0;
  TIDE_CUDA_CHECK(cudaGetDevice(&device));
  TIDE_CHECK_ARG(device == window.device(), "CudaExecutor", "current device", device,
                 detail::concat(window.device(), " (the window's device)"));
  cuda_kernels::preload_kernels();
  // Reads TIDE_CUDA_CTAS_PER_SM now: a bad value must not first throw mid-collective.
  cuda_kernels::default_max_ctas();
  TIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&impl_->side_stream, cudaStreamNonBlocking));
  impl_->staging.resize(static_cast<std::size_t>(kNumFlagKinds) * window.world());
  impl_->streams_used.push_back(impl_->stream);
  impl_->watchdog = std::thread([impl = impl_.get()] { impl->watchdog_loop(); });
}

CudaExecutor::~CudaExecutor() {
  Impl& d = *impl_;
  for (cudaStream_t s : d.streams_used) {
    try {
      d.wait_stream(s);
    } catch (...) {
      // Destructors do not throw; synchronize() is where errors are reported.
    }
  }
  {
    std::lock_guard<std::mutex> lock(d.mutex);
    d.stop = true;
  }
  d.wake.notify_all();
  d.watchdog.join();
  for (const PendingWait& w : d.pending) {
    (void)cudaEventDestroy(w.before);
    (void)cudaEventDestroy(w.after);
  }
  for (cudaEvent_t e : d.free_events) (void)cudaEventDestroy(e);
  if (d.net_ready) (void)cudaEventDestroy(d.net_ready);
  if (d.net_stream) (void)cudaStreamDestroy(d.net_stream);
  for (cudaStream_t s : d.peer_streams) (void)cudaStreamDestroy(s);
  for (const KernelTiming& t : d.timings) {
    (void)cudaEventDestroy(t.start);
    (void)cudaEventDestroy(t.end);
  }
  (void)cudaStreamDestroy(d.side_stream);
  (void)cudaGetLastError();
}

int CudaExecutor::rank() const { return impl_->window.rank(); }
int CudaExecutor::world() const { return impl_->window.world(); }
void* CudaExecutor::stream() const { return impl_->stream; }

void CudaExecutor::set_stream(void* stream) {
  impl_->stream = static_cast<cudaStream_t>(stream);
  impl_->use_stream(impl_->stream);
}

void CudaExecutor::run(const Program& program, const Bindings& bindings) {
  Impl& d = *impl_;
  CudaWindow& window = d.window;
  const int rank = window.rank();
  const int world = window.world();
  validate_run(program, bindings, rank, world, window.data_bytes(), window.data(rank),
               /*net_supported=*/d.network != nullptr || window.reach() == CudaReach::kHost);
  d.throw_if_failed();
  const uint64_t epoch = window.next_epoch();
  const uint64_t tag = program.tag();
  // Past this point the window's epoch and network counters have moved: a failure while
  // enqueuing leaves this executor out of step with its peers, so it fails for good.
  try {
    const std::function<std::byte*(const Address&)> resolve = [&](const Address& a) {
      return detail::resolve_address(a, bindings, [&](int r) { return window.data(r); });
    };

    const std::vector<Step>& steps = program.steps;
    bool has_net = false;
    for (const Step& step : steps)
      has_net |= std::holds_alternative<NetSendOp>(step.op) || std::holds_alternative<NetRecvOp>(step.op);
    net::GroupSchedule schedule;
    if (has_net) {
      schedule = net::schedule_groups(program);
      if (!d.net_ready) TIDE_CUDA_CHECK(cudaEventCreateWithFlags(&d.net_ready, cudaEventDisableTiming));
    }
    // Issues and waits the schedule asks for before step i (i == steps.size(): the end).
    std::vector<cudaEvent_t> group_done;  // this run's groups, in issue order
    auto network_actions = [&](std::size_t i) {
      if (!has_net) return;
      for (int g : schedule.issue_before[i])
        group_done.push_back(d.issue_group(schedule.groups[g], program, resolve, epoch, tag,
                                           steps[schedule.groups[g].ops.back()].phase));
      if (schedule.wait_before[i] >= 0)
        TIDE_CUDA_CHECK(cudaStreamWaitEvent(d.stream, group_done[schedule.wait_before[i]], 0));
    };
    // Whether step j may join a kernel batch started earlier: no network action falls between.
    auto batchable = [&](std::size_t j) {
      return !has_net || (schedule.issue_before[j].empty() && schedule.wait_before[j] < 0);
    };

    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<std::size_t> sizes;
    for (std::size_t i = 0; i < steps.size();) {
      network_actions(i);
      const Step& step = steps[i];
      if (std::holds_alternative<CastOp>(step.op)) {
        // Consecutive casts write disjoint slots: same-type ones become one copy batch (+ memsets
        // of their pads), the rest one kernel.
        std::vector<cuda_kernels::CastSpec> casts;
        dsts.clear(), srcs.clear(), sizes.clear();
        for (std::size_t first = i;
             i < steps.size() && std::holds_alternative<CastOp>(steps[i].op) && (i == first || batchable(i));
             ++i) {
          const CastOp& cast = std::get<CastOp>(steps[i].op);
          std::byte* dst = resolve(cast.dst);
          const std::size_t dst_size = dtype_size(cast.dst_dtype);
          if (cast.src_dtype == cast.dst_dtype) {
            if (cast.count > 0) {
              dsts.push_back(dst);
              srcs.push_back(resolve(cast.src));
              sizes.push_back(static_cast<std::size_t>(cast.count) * dst_size);
            }
            if (cast.pad > 0)
              TIDE_CUDA_CHECK(cudaMemsetAsync(dst + cast.count * dst_size, 0, cast.pad * dst_size,
                                              d.stream));
          } else {
            casts.push_back({cast.count > 0 ? resolve(cast.src) : nullptr, dst, cast.count, cast.pad,
                             element_type(cast.src_dtype), element_type(cast.dst_dtype)});
          }
        }
        d.enqueue_copies(dsts, srcs, sizes);
        if (!casts.empty())
          d.launch_timed(KernelKind::kCast, d.stream, [&] {
            return cuda_kernels::launch_casts(casts.data(), casts.size(), 0, d.stream);
          });
      } else if (std::holds_alternative<ReduceOp>(step.op)) {
        // One kernel for consecutive reduces with as many sources each, as long as none touches
        // what an earlier one in the kernel writes (a multi-node ring step sums the partial it just
        // reduced) or writes what an earlier one reads.
        const std::size_t num_sources = std::get<ReduceOp>(step.op).sources.size();
        std::vector<const void*> sources;  // num_sources per reduce, filled first: specs point into it
        std::vector<Span> reads, writes;
        std::vector<std::size_t> batch;
        for (; i < steps.size() && std::holds_alternative<ReduceOp>(steps[i].op); ++i) {
          const ReduceOp& reduce = std::get<ReduceOp>(steps[i].op);
          if (!batch.empty() && (reduce.sources.size() != num_sources || !batchable(i))) break;
          const std::size_t in_bytes = static_cast<std::size_t>(reduce.count) * dtype_size(reduce.src_dtype);
          const std::byte* out = resolve(reduce.dst);
          const Span written{out, out + static_cast<std::size_t>(reduce.count) * dtype_size(reduce.dst_dtype)};
          bool depends = false;
          for (const Span& w : writes) depends |= w.overlaps(written);
          for (const Span& r : reads) depends |= r.overlaps(written);
          std::vector<Span> read_here;
          for (const Address& a : reduce.sources) {
            const std::byte* src = resolve(a);
            read_here.push_back({src, src + in_bytes});
          }
          if (reduce.partial) {
            const std::byte* partial = resolve(*reduce.partial);
            read_here.push_back(
                {partial, partial + static_cast<std::size_t>(reduce.count) * dtype_size(reduce.partial_dtype)});
          }
          for (const Span& r : read_here)
            for (const Span& w : writes) depends |= w.overlaps(r);
          if (!batch.empty() && depends) break;
          for (const Address& a : reduce.sources) sources.push_back(resolve(a));
          reads.insert(reads.end(), read_here.begin(), read_here.end());
          writes.push_back(written);
          batch.push_back(i);
        }
        std::vector<cuda_kernels::ReduceSpec> reduces;
        for (std::size_t k = 0; k < batch.size(); ++k) {
          const ReduceOp& reduce = std::get<ReduceOp>(steps[batch[k]].op);
          const void* partial = reduce.partial ? resolve(*reduce.partial) : nullptr;
          reduces.push_back({sources.data() + k * num_sources, resolve(reduce.dst), partial, reduce.count,
                             reduce.prescale, reduce.scale, reduce.accumulate,
                             element_type(reduce.src_dtype), element_type(reduce.dst_dtype),
                             element_type(reduce.partial_dtype)});
        }
        d.launch_timed(KernelKind::kReduce, d.stream, [&] {
          return cuda_kernels::launch_reduces(reduces.data(), reduces.size(),
                                              static_cast<int>(num_sources), 0, d.stream);
        });
      } else if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
        dsts.clear(), srcs.clear(), sizes.clear();
        for (const CopyOp& c : batch->copies) {
          if (c.bytes == 0) continue;
          dsts.push_back(resolve(c.dst));
          srcs.push_back(resolve(c.src));
          sizes.push_back(c.bytes);
        }
        d.enqueue_copies(dsts, srcs, sizes);
        ++i;
      } else if (const auto* signal = std::get_if<SignalOp>(&step.op)) {
        d.enqueue_signal(*signal, epoch, tag);
        ++i;
      } else if (const auto* wait = std::get_if<WaitOp>(&step.op)) {
        d.enqueue_wait(*wait, step.phase, epoch, tag);
        ++i;
      } else {
        // NetSendOp / NetRecvOp: issued with their group (network_actions); the group waits for
        // the compute stream to get here.
        TIDE_CUDA_CHECK(cudaEventRecord(d.net_ready, d.stream));
        ++i;
      }
    }
    network_actions(steps.size());
    d.recycle_events(group_done);  // every wait on them is enqueued (waits capture the record)
  } catch (...) {
    d.store_error(std::current_exception());
    throw;
  }
}

void CudaExecutor::synchronize() {
  Impl& d = *impl_;
  try {
    for (cudaStream_t s : d.streams_used) d.wait_stream(s);
  } catch (const SystemError&) {
    // A CUDA error after a wait timed out (say, a copy into a dead peer's memory) is a
    // consequence; the watchdog's error names the cause.
    d.throw_if_failed();
    throw;
  }
  d.streams_used.assign(1, d.stream);
  d.collect_timings();
  d.throw_if_failed();
  if (d.network) d.network->check_async();
}

void CudaExecutor::enable_stats(bool enabled) { impl_->stats_enabled = enabled; }

CudaExecutor::Stats CudaExecutor::stats() {
  synchronize();
  return impl_->stats;
}

void CudaExecutor::reset_stats() { impl_->stats = Stats{}; }

}  // namespace tide
