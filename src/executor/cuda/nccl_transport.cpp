// The CUDA executor's NCCL transport: a network group as one ncclGroupStart/End of ncclSend and
// ncclRecv on the network stream, watched as a whole (only aborting the communicator releases it).
#include "cuda_executor_impl.hpp"
#include "tide/error.hpp"
#include "tide/nccl.hpp"

namespace tide {

using namespace cuda_executor_detail;

// One NCCL group, watched as a whole: NCCL can only be released by aborting the communicator.
void CudaExecutor::Impl::issue_nccl_group(const net::NetGroup& group, const Program& program,
                                          const Resolve& resolve, uint64_t epoch,
                                          uint64_t tag, Phase phase) {
  const NcclLibrary& nccl = NcclLibrary::get();
  PendingWait record = new_wait(PendingWait::Kind::kNccl, net_stream, epoch, tag, -1, phase);
  {
    enqueue_mark(net_stream, record, /*passed=*/false);
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
    enqueue_mark(net_stream, record, /*passed=*/true);
  }
  watch(std::move(record));
}

std::exception_ptr CudaExecutor::Impl::diagnose_nccl_group(const PendingWait& w) {
  return std::make_exception_ptr(TimeoutError(detail::concat(
      "rank ", window.rank(), ": timed out after ", timeout.count(),
      " ms in a network transfer (", w.what, "; ", describe_tag(w.tag), ", phase ",
      phase_name(w.phase), ", epoch ", w.epoch, ") over NCCL; the communicator was aborted. A "
      "peer is dead, stuck, or running other collectives (raise TIDE_TIMEOUT_MS if it is only "
      "slow)")));
}

}  // namespace tide
