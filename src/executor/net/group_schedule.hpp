// How a program's network ops run on a transport with *group* semantics (NCCL: ncclSend/ncclRecv
// between ncclGroupStart/End, one kernel per group on a network stream, the group done only when
// every op in it is), derived from the plan's *posted-send* semantics (plan.hpp, NetSendOp).
//
// A run of consecutive network ops is one group, split where an op overlaps the bytes of one
// already in it (one group's ops run concurrently) and where a send follows a receive from
// another peer (the next exchange: recursive doubling forwards what it just received). The group is issued on the network stream,
// after the compute stream has reached its last op, just before the next compute step, signal or
// wait (or the end). The compute stream waits for an issued group only before a step that touches
// its bytes (reads or writes what a receive writes, writes what a send reads), before a signal
// ("everything before it is done") and at the end; steps in between (the next chunk's local
// reduce) overlap the transfer.
//
// Group semantics are stricter than posted sends: a send finishes only once the peer's group
// holding the matching receive runs. The planner's programs keep every send in the same run as
// the receives it is exchanged against (simulate_groups checks all of them in the tests).
//
// Host-only and transport-independent, so its deadlock freedom is tested without a GPU
// (simulate_groups, tests/cpp/test_net_groups.cpp) and the CUDA executor only follows it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "tide/plan.hpp"

namespace tide::net {

struct NetGroup {
  std::vector<std::size_t> ops;  // step indices of its NetSendOp/NetRecvOp, in program order
};

struct GroupSchedule {
  std::vector<NetGroup> groups;  // in issue order (the order they run on the network stream)
  // Per step index i in [0, steps.size()]: groups to issue before step i runs, then the group
  // whose completion the compute stream waits for before step i (-1: none; a wait for group g
  // also covers every earlier group). Index steps.size() is the program's end.
  std::vector<std::vector<int>> issue_before;
  std::vector<int> wait_before;
};

GroupSchedule schedule_groups(const Program& program);

// Runs every rank's groups under group semantics: a rank's groups run one after another; a group
// finishes once each of its ops is matched (k-th send s->r on a channel with the k-th receive of r
// from s) by an op in a group that is running or finished on the peer. Returns "" when all
// finish, else a description of the stuck groups (a deadlock).
//
// What it does not model: the compute stream (a group starts only once the compute stream has
// reached it; the compute stream waits for groups) and node-local signals and waits. The
// planner's programs keep those out of the way (local handshakes come before or after all
// network ops; a group's last op is right before the step that issues it), which is why the
// network-only check suffices for them; a new planner shape needs the full model. Channels stand
// for separate communicators: two programs sharing one NCCL communicator concurrently (an AG and
// an RS in flight at once on one NcclComm) are matched by NCCL in issue order, not by channel.
std::string simulate_groups(const std::vector<Program>& programs,
                            const std::vector<GroupSchedule>& schedules);

// The same question for the CUDA IPC network (CudaWindowScope::kHost windows, CudaExecutor without
// NCCL), whose semantics differ from NCCL's: a rank's groups run one after another; inside a
// group, each peer's ops run in program order (one stream per peer); a send may be posted only
// while fewer than kNetQueueDepth of its earlier sends to that peer on that channel are still
// unreceived (the mailbox holds kNetQueueDepth entries); a receive completes once its send is
// posted; a group ends when every peer's ops are done and its sends received. "" when every
// rank finishes, else the stuck ranks.
std::string simulate_ipc_groups(const std::vector<Program>& programs,
                                const std::vector<GroupSchedule>& schedules);

}  // namespace tide::net
