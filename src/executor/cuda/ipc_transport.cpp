// The CUDA executor's CUDA IPC transport (CudaWindowScope::kHost windows, no communicator): the host
// transport's protocol on the GPU. A send posts its (offset, bytes, epoch, tag) into the receiver's
// mailbox with stream writes; a receive waits for the post (stream waits that also check epoch, tag
// and bytes), pulls the bytes with a kernel and counts the send as taken in the sender's mailbox;
// the group ends once its sends are taken. A stuck transfer is diagnosed from the mailboxes and
// released by writing the awaited words (the watchdog calls diagnose_mailbox/release_mailbox_wait).
#include <algorithm>

#include "cuda_executor_impl.hpp"
#include "tide/error.hpp"

namespace tide {

using namespace cuda_executor_detail;

// Stream waits on `words` of the own mailbox for `peer` on stream `on`, watched: one
// cuStreamBatchMemOp of the waits between the record's marks.
void CudaExecutor::Impl::enqueue_mailbox_wait(cudaStream_t on, const NetOutbox* mailbox, int channel,
                                              std::vector<MailboxWord> words, std::string what, int peer,
                                              uint64_t seq, std::size_t bytes, uint64_t epoch, uint64_t tag,
                                              Phase phase) {
  PendingWait record = new_wait(PendingWait::Kind::kMailbox, on, epoch, tag, peer, phase);
  record.what = std::move(what), record.mailbox = mailbox, record.channel = channel;
  record.words = std::move(words), record.seq = seq, record.bytes = bytes;
  if (seq > 0)
    record.offset = const_cast<uint64_t*>(&mailbox->entries[(seq - 1) % kNetQueueDepth].offset);
  std::vector<CUstreamBatchMemOpParams> ops{mark(record, /*passed=*/false)};
  for (const MailboxWord& w : record.words)
    ops.push_back(w.equal ? wait_eq(w.word, w.value) : wait_geq(w.word, w.value));
  ops.push_back(mark(record, /*passed=*/true));
  TIDE_CU_CHECK(api.stream_batch_mem_op(on, static_cast<unsigned>(ops.size()), ops.data(), 0));
  watch(std::move(record));
}

void CudaExecutor::Impl::write_word(cudaStream_t on, uint64_t* word, uint64_t value) {
  TIDE_CU_CHECK(api.stream_write_value64(on, reinterpret_cast<CUdeviceptr>(word), value,
                                         CU_STREAM_WRITE_VALUE_DEFAULT));
}

// One group over CUDA IPC (window.scope() == kHost). Each peer's sends and receives run in
// program order on a stream of their own (the first peer's on the network stream, the others'
// forked from it), so no transfer waits behind another peer's, and a send past the mailbox's
// depth waits only for that peer to receive; the group ends once they all have and its sends
// are taken: NCCL's group semantics plus per-peer order and a bounded mailbox, which
// net::simulate_ipc_groups models (the tests run every planner schedule through it).
void CudaExecutor::Impl::issue_ipc_group(const net::NetGroup& group, const Program& program,
                                         const Resolve& resolve, uint64_t epoch,
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

// A stuck IPC transfer. DesyncError when the awaited send was posted for another collective,
// epoch or size, or the peer posted on the other channel (all-gather vs reduce-scatter) at this
// epoch; TimeoutError otherwise.
std::exception_ptr CudaExecutor::Impl::diagnose_mailbox(const PendingWait& w) {
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
void CudaExecutor::Impl::release_mailbox_wait(const PendingWait& w) {
  auto write = [&](uint64_t* word, uint64_t value) {
    TIDE_CUDA_CHECK(cudaMemcpyAsync(word, &value, sizeof value, cudaMemcpyHostToDevice,
                                    side_stream));
    TIDE_CUDA_CHECK(cudaStreamSynchronize(side_stream));
  };
  if (w.offset) write(w.offset, UINT64_MAX);
  for (const MailboxWord& m : w.words) write(m.word, m.equal ? m.value : kReleaseEpoch);
}

}  // namespace tide
