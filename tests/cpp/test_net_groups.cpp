// Group schedule (src/executor/net/group_schedule.hpp): how across-node programs run on a transport
// with NCCL's group semantics. Swept over topologies, pacing options and random buckets: every
// network op is in exactly one group, in program order; no compute step touches a transfer's bytes
// before the compute stream has waited for its group; and every rank's groups finish when run
// together (no deadlock). Plus the simulator itself catches a deadlock.
#include <gtest/gtest.h>

#include <random>

#include "net/group_schedule.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

const Topology kTopologies[] = {{2, 1}, {2, 4}, {4, 2}, {8, 1}, {3, 2}, {3, 4}, {5, 1}, {6, 2}};

bool is_net(const Step& s) {
  return std::holds_alternative<NetSendOp>(s.op) || std::holds_alternative<NetRecvOp>(s.op);
}

// Network ops appear once each, in program order, issued no earlier than their own position;
// everything is issued and waited for by the end.
void check_structure(const Program& p, const net::GroupSchedule& s) {
  std::vector<std::size_t> order;
  for (const net::NetGroup& g : s.groups) order.insert(order.end(), g.ops.begin(), g.ops.end());
  std::vector<std::size_t> expected;
  for (std::size_t i = 0; i < p.steps.size(); ++i)
    if (is_net(p.steps[i])) expected.push_back(i);
  ASSERT_EQ(order, expected);
  int issued = 0;
  for (std::size_t i = 0; i <= p.steps.size(); ++i)
    for (int g : s.issue_before[i]) {
      ASSERT_EQ(g, issued++);
      ASSERT_LT(s.groups[g].ops.back(), i) << "group " << g << " issued before its last op";
    }
  ASSERT_EQ(issued, static_cast<int>(s.groups.size()));
  const int waited = *std::max_element(s.wait_before.begin(), s.wait_before.end());
  ASSERT_EQ(waited, static_cast<int>(s.groups.size()) - 1);
}

// A compute step that reads a received chunk (the reduce after a ring step, the forward copies
// after a doubling step) has its group waited for.
void check_waits(const Program& p, const net::GroupSchedule& s) {
  std::vector<int> group_of(p.steps.size(), -1);
  for (std::size_t g = 0; g < s.groups.size(); ++g)
    for (std::size_t i : s.groups[g].ops) group_of[i] = static_cast<int>(g);
  int waited = -1;
  for (std::size_t i = 0; i < p.steps.size(); ++i) {
    waited = std::max(waited, s.wait_before[i]);
    std::vector<Address> reads;
    if (const auto* r = std::get_if<ReduceOp>(&p.steps[i].op)) {
      reads = r->sources;
      if (r->partial) reads.push_back(*r->partial);  // the received partial of a ring step
    }
    if (const auto* b = std::get_if<CopyBatch>(&p.steps[i].op))
      for (const CopyOp& c : b->copies) reads.push_back(c.src);
    for (const Address& a : reads) {
      if (a.space != Space::kWindow || a.index != p.rank) continue;
      // The latest receive before step i into this address.
      for (std::size_t j = i; j-- > 0;)
        if (const auto* recv = std::get_if<NetRecvOp>(&p.steps[j].op);
            recv && recv->dst.offset <= a.offset && a.offset < recv->dst.offset + recv->bytes) {
          ASSERT_LE(group_of[j], waited) << "step " << i << " reads what step " << j
                                         << " receives before its group was waited for";
          break;
        }
    }
  }
}

TEST(NetGroups, MultinodePlansScheduleAndNeverDeadlock) {
  std::mt19937_64 rng(77);
  const AcrossNodesOptions nets[] = {{},         {256, 1, 1},       {64, 2, 3},      {1024, 16, 16},
                             {64, 4, 3, true}, {256, 1, 1, true}, {64, 16, 2, true},
                             {64, 2, 2, false, DType::kBF16}, {128, 4, 3, true, DType::kBF16}};
  int checked = 0;
  for (const Topology& t : kTopologies)
    for (int iter = 0; iter < 35; ++iter) {
      BucketLayout layout(test::random_specs(rng, t.world(), 4, 1 << 12), t);
      const AcrossNodesOptions& net = nets[iter % 9];
      for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
        std::vector<Program> programs;
        std::vector<net::GroupSchedule> schedules;
        for (int r = 0; r < t.world(); ++r) {
          programs.push_back(c == Collective::kAllGather
                                 ? plan_all_gather(layout, r, 3, net)
                                 : plan_reduce_scatter(layout, r, ReduceOptions{}, 3, net));
          schedules.push_back(net::schedule_groups(programs.back()));
          ASSERT_NO_FATAL_FAILURE(check_structure(programs.back(), schedules.back()));
          ASSERT_NO_FATAL_FAILURE(check_waits(programs.back(), schedules.back()));
        }
        const std::string stuck = net::simulate_groups(programs, schedules);
        ASSERT_EQ(stuck, "") << t.nodes << "x" << t.local << " " << collective_name(c)
                             << " chunk " << net.chunk_bytes << " in flight "
                             << net.max_chunks_in_flight << " halving " << net.rs_recursive_halving
                             << "\n" << layout.describe();
        // The CUDA IPC network runs the same groups with bounded mailboxes and per-peer order.
        ASSERT_EQ(net::simulate_ipc_groups(programs, schedules), "")
            << "IPC network: " << t.nodes << "x" << t.local << " " << collective_name(c)
            << " chunk " << net.chunk_bytes << " in flight " << net.max_chunks_in_flight
            << " halving " << net.rs_recursive_halving << "\n" << layout.describe();
        ++checked;
      }
    }
  EXPECT_EQ(checked, 8 * 35 * 2);
}

TEST(NetGroups, IpcSimulatorBoundsSendsByTheMailbox) {
  // One group per rank: n sends to the peer, then n receives from it. NCCL's group semantics take
  // any n; the IPC network's mailbox holds kNetQueueDepth sends, so beyond that both ranks wait
  // for room before either receives. Interleaved (what the planner's paced exchanges emit), any n
  // passes. This is the deadlock the first IPC network hit on a GPU (it posted a group's sends
  // before its receives).
  auto exchange = [](int rank, int n, bool interleaved) {
    Program p;
    p.rank = rank, p.world = 2;
    const int peer = 1 - rank;
    for (int k = 0; k < n; ++k) {
      const std::size_t at = 64 * static_cast<std::size_t>(k);
      p.steps.push_back({Phase::kPush, NetSendOp{peer, {Space::kWindow, rank, at}, 16, 0}});
      if (interleaved)
        p.steps.push_back({Phase::kPush, NetRecvOp{peer, {Space::kWindow, rank, at + 32}, 16, 0}});
    }
    for (int k = 0; k < n && !interleaved; ++k)
      p.steps.push_back({Phase::kPush,
                         NetRecvOp{peer, {Space::kWindow, rank, 64 * static_cast<std::size_t>(k) + 32}, 16, 0}});
    return p;
  };
  for (int n : {1, kNetQueueDepth, kNetQueueDepth + 1, 3 * kNetQueueDepth}) {
    for (bool interleaved : {false, true}) {
      const std::vector<Program> programs{exchange(0, n, interleaved), exchange(1, n, interleaved)};
      const std::vector<net::GroupSchedule> schedules{net::schedule_groups(programs[0]),
                                                      net::schedule_groups(programs[1])};
      ASSERT_EQ(schedules[0].groups.size(), 1u) << n;
      SCOPED_TRACE(testing::Message() << n << " sends, interleaved " << interleaved);
      EXPECT_EQ(net::simulate_groups(programs, schedules), "");
      EXPECT_EQ(net::simulate_ipc_groups(programs, schedules) == "",
                interleaved || n <= kNetQueueDepth);
    }
  }
}

TEST(NetGroups, RingOverlapsTheNextLocalReduceWithTheTransfer) {
  // The ring takes chunks two at a time: the reduce of one chunk does not read the other's
  // receive buffer, so it runs after the group carrying the other chunk is issued and before the
  // compute stream waits for it.
  BucketLayout layout({{"w", {64, 64}}}, Topology{2, 2});
  const Program p = plan_reduce_scatter(layout, 0, ReduceOptions{}, 1, AcrossNodesOptions{1024, 2, 2});
  const net::GroupSchedule s = net::schedule_groups(p);
  ASSERT_GE(s.groups.size(), 2u);
  int overlapped = 0;
  for (std::size_t g = 0; g < s.groups.size(); ++g) {
    std::size_t issued_at = 0, waited_at = p.steps.size();
    for (std::size_t i = 0; i <= p.steps.size(); ++i)
      for (int x : s.issue_before[i])
        if (x == static_cast<int>(g)) issued_at = i;
    for (std::size_t i = issued_at; i <= p.steps.size(); ++i)
      if (s.wait_before[i] >= static_cast<int>(g)) {
        waited_at = i;
        break;
      }
    for (std::size_t i = issued_at; i < waited_at; ++i)
      overlapped += std::holds_alternative<ReduceOp>(p.steps[i].op);
  }
  EXPECT_GT(overlapped, 0) << p.to_string();
}

TEST(NetGroups, SimulatorFindsACrossedSendDeadlock) {
  // Two ranks that each send twice before receiving into one buffer. With every op its own group,
  // each rank's first send waits for a receive that only the peer's third group posts.
  Program a, b;
  a.rank = 0, b.rank = 1, a.world = b.world = 2;
  for (Program* p : {&a, &b}) {
    const int peer = 1 - p->rank;
    for (int k = 0; k < 2; ++k)
      p->steps.push_back({Phase::kPush, NetSendOp{peer, {Space::kWindow, p->rank, 0}, 16, 0}});
    for (int k = 0; k < 2; ++k)
      p->steps.push_back({Phase::kPush, NetRecvOp{peer, {Space::kWindow, p->rank, 64}, 16, 0}});
  }
  net::GroupSchedule one_per_op;
  one_per_op.issue_before.assign(5, {});
  one_per_op.wait_before.assign(5, -1);
  for (std::size_t i = 0; i < 4; ++i) one_per_op.groups.push_back({{i}});
  EXPECT_NE(net::simulate_groups({a, b}, {one_per_op, one_per_op}), "");
  // Group semantics cannot express this program at all: both receives write the same bytes, so
  // they cannot share a group, and the second send is stuck behind the first receive's group.
  // The planner never emits such programs (the sweep above simulates every one of them).
  EXPECT_NE(net::simulate_groups({a, b}, {net::schedule_groups(a), net::schedule_groups(b)}), "");
}

}  // namespace
}  // namespace tide
