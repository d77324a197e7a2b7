// schedule_groups and simulate_groups; see group_schedule.hpp.
#include "group_schedule.hpp"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <variant>

namespace tide::net {
namespace {

struct Range {
  std::size_t begin, end;
  bool overlaps(const Range& o) const { return begin < o.end && o.begin < end; }
};

bool overlaps_any(const Range& r, const std::vector<Range>& list) {
  return std::any_of(list.begin(), list.end(), [&](const Range& o) { return r.overlaps(o); });
}

// The own-window bytes a compute step reads and writes (other spaces never meet network ops,
// which only touch the own window).
struct Access {
  std::vector<Range> reads, writes;
};

Access access_of(const Step& step, int rank) {
  Access a;
  auto add = [&](std::vector<Range>& to, const Address& addr, std::size_t bytes) {
    if (addr.space == Space::kWindow && addr.index == rank && bytes > 0)
      to.push_back({addr.offset, addr.offset + bytes});
  };
  if (const auto* batch = std::get_if<CopyBatch>(&step.op)) {
    for (const CopyOp& c : batch->copies)  // 2-D ops by their extents: a superset of their bytes
      add(a.reads, c.src, c.src_extent()), add(a.writes, c.dst, c.dst_extent());
  } else if (const auto* cast = std::get_if<CastOp>(&step.op)) {
    add(a.reads, cast->src,
        static_cast<std::size_t>(cast->rows * cast->count) * dtype_size(cast->src_dtype));
    add(a.writes, cast->dst, cast->dst_extent());
  } else if (const auto* reduce = std::get_if<ReduceOp>(&step.op)) {
    for (const Address& s : reduce->sources)
      add(a.reads, s, static_cast<std::size_t>(reduce->count) * dtype_size(reduce->src_dtype));
    if (reduce->partial)
      add(a.reads, *reduce->partial,
          static_cast<std::size_t>(reduce->count) * dtype_size(reduce->partial_dtype));
    const std::size_t out = static_cast<std::size_t>(reduce->count) * dtype_size(reduce->dst_dtype);
    add(a.writes, reduce->dst, out);
    if (reduce->accumulate) add(a.reads, reduce->dst, out);
  }
  return a;
}

// Bytes a group's sends read and its receives write.
struct GroupBytes {
  std::vector<Range> sent, received;
  bool empty() const { return sent.empty() && received.empty(); }
  // Whether a step with `a` must run after the group: it writes what a send reads, or touches
  // what a receive writes.
  bool blocks(const Access& a) const {
    for (const Range& w : a.writes)
      if (overlaps_any(w, sent) || overlaps_any(w, received)) return true;
    for (const Range& r : a.reads)
      if (overlaps_any(r, received)) return true;
    return false;
  }
};

}  // namespace

GroupSchedule schedule_groups(const Program& program) {
  const std::vector<Step>& steps = program.steps;
  GroupSchedule s;
  s.issue_before.assign(steps.size() + 1, {});
  s.wait_before.assign(steps.size() + 1, -1);
  NetGroup pending;
  GroupBytes pending_bytes;
  std::vector<GroupBytes> issued_bytes;  // per issued group
  int waited = -1;                       // groups [0, waited] are known complete to compute
  int last_recv_peer = -1;               // of the pending group's last receive

  auto issue = [&](std::size_t before) {
    if (pending.ops.empty()) return;
    s.issue_before[before].push_back(static_cast<int>(s.groups.size()));
    s.groups.push_back(std::move(pending));
    issued_bytes.push_back(std::move(pending_bytes));
    pending = {}, pending_bytes = {}, last_recv_peer = -1;
  };
  auto wait_for = [&](std::size_t before, int group) {
    if (group <= waited) return;
    s.wait_before[before] = std::max(s.wait_before[before], group);
    waited = group;
  };
  auto wait_all = [&](std::size_t before) { wait_for(before, static_cast<int>(s.groups.size()) - 1); };

  for (std::size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    if (const auto* send = std::get_if<NetSendOp>(&step.op)) {
      const Range r{send->src.offset, send->src.offset + send->bytes};
      // A send after a receive from another peer starts the next exchange (recursive doubling's
      // step k+1 forwards what step k received): its own group, matched by the partner's.
      if (overlaps_any(r, pending_bytes.received) ||
          (last_recv_peer >= 0 && last_recv_peer != send->peer))
        issue(i);
      pending.ops.push_back(i);
      pending_bytes.sent.push_back(r);
      continue;
    }
    if (const auto* recv = std::get_if<NetRecvOp>(&step.op)) {
      const Range r{recv->dst.offset, recv->dst.offset + recv->bytes};
      if (overlaps_any(r, pending_bytes.received) || overlaps_any(r, pending_bytes.sent)) issue(i);
      pending.ops.push_back(i);
      pending_bytes.received.push_back(r);
      last_recv_peer = recv->peer;
      continue;
    }
    if (std::holds_alternative<SignalOp>(step.op)) {
      issue(i);
      wait_all(i);
      continue;
    }
    if (std::holds_alternative<WaitOp>(step.op)) {
      issue(i);
      continue;
    }
    // Issued at the first compute step, whether or not it touches the group's bytes: the step
    // then overlaps the transfer instead of delaying it, and groups stay exactly the plan's runs
    // of consecutive network ops (which the planner matches across ranks: an exchange's sends and
    // receives, a ring step's send and receive).
    issue(i);
    const Access a = access_of(step, program.rank);
    for (int g = static_cast<int>(issued_bytes.size()) - 1; g > waited; --g)
      if (issued_bytes[g].blocks(a)) {
        wait_for(i, g);
        break;
      }
  }
  issue(steps.size());
  wait_all(steps.size());
  return s;
}

std::string simulate_groups(const std::vector<Program>& programs,
                            const std::vector<GroupSchedule>& schedules) {
  const int world = static_cast<int>(programs.size());
  // Every op's match key: (sender, receiver, channel, k). An op is matched once the same key
  // appears on the peer in a running or finished group.
  using Key = std::tuple<int, int, int, int>;
  struct Op {
    Key key;
  };
  std::vector<std::vector<std::vector<Op>>> groups(world);  // [rank][group][op]
  for (int r = 0; r < world; ++r) {
    std::map<std::tuple<int, int, int>, int> count;
    for (const NetGroup& g : schedules[r].groups) {
      std::vector<Op> ops;
      for (std::size_t i : g.ops) {
        const Step& step = programs[r].steps[i];
        if (const auto* send = std::get_if<NetSendOp>(&step.op))
          ops.push_back({{r, send->peer, send->channel, count[{r, send->peer, send->channel}]++}});
        else if (const auto* recv = std::get_if<NetRecvOp>(&step.op))
          ops.push_back({{recv->peer, r, recv->channel, count[{recv->peer, r, recv->channel}]++}});
      }
      groups[r].push_back(std::move(ops));
    }
  }
  std::vector<std::size_t> head(world, 0);  // the running group of each rank
  // Keys posted by each rank so far (in its running and finished groups), sends and receives apart.
  std::vector<std::map<Key, bool>> posted_send(world), posted_recv(world);
  auto post = [&](int r) {
    if (head[r] >= groups[r].size()) return;
    for (const Op& op : groups[r][head[r]]) {
      const int sender = std::get<0>(op.key);
      (sender == r ? posted_send[r] : posted_recv[r])[op.key] = true;
    }
  };
  for (int r = 0; r < world; ++r) post(r);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < world; ++r) {
      if (head[r] >= groups[r].size()) continue;
      bool done = true;
      for (const Op& op : groups[r][head[r]]) {
        const auto [sender, receiver, channel, k] = op.key;
        const bool matched = sender == r ? posted_recv[receiver].count(op.key) > 0
                                         : posted_send[sender].count(op.key) > 0;
        if (!matched) {
          done = false;
          break;
        }
      }
      if (done) {
        ++head[r];
        post(r);
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (int r = 0; r < world; ++r)
    if (head[r] < groups[r].size())
      stuck << (stuck.tellp() > 0 ? "; " : "") << "rank " << r << " stuck in group " << head[r]
            << " of " << groups[r].size() << " (" << groups[r][head[r]].size() << " ops)";
  return stuck.str();
}

std::string simulate_ipc_groups(const std::vector<Program>& programs,
                                const std::vector<GroupSchedule>& schedules) {
  const int world = static_cast<int>(programs.size());
  struct Op {
    bool send;
    int peer, channel;
    int seq;  // 1-based number among (sender, receiver, channel)'s sends
  };
  // [rank][group] -> ops per peer lane, each lane in program order.
  std::vector<std::vector<std::map<int, std::vector<Op>>>> lanes(world);
  for (int r = 0; r < world; ++r) {
    std::map<std::tuple<int, int, int>, int> count;
    for (const NetGroup& g : schedules[r].groups) {
      std::map<int, std::vector<Op>> by_peer;
      for (std::size_t i : g.ops) {
        const Step& step = programs[r].steps[i];
        if (const auto* send = std::get_if<NetSendOp>(&step.op))
          by_peer[send->peer].push_back(
              {true, send->peer, send->channel, ++count[{r, send->peer, send->channel}]});
        else if (const auto* recv = std::get_if<NetRecvOp>(&step.op))
          by_peer[recv->peer].push_back(
              {false, recv->peer, recv->channel, ++count[{recv->peer, r, recv->channel}]});
      }
      lanes[r].push_back(std::move(by_peer));
    }
  }
  // posted[(s, r, c)]: sends s -> r on c posted; received[(s, r, c)]: of those, received by r.
  std::map<std::tuple<int, int, int>, int> posted, received;
  std::vector<std::size_t> head(world, 0);
  std::vector<std::map<int, std::size_t>> position(world);  // per peer lane of the running group
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < world; ++r) {
      if (head[r] >= lanes[r].size()) continue;
      bool all_done = true;
      for (const auto& [peer, ops] : lanes[r][head[r]]) {
        std::size_t& at = position[r][peer];
        while (at < ops.size()) {
          const Op& op = ops[at];
          if (op.send) {
            if (op.seq - received[{r, op.peer, op.channel}] > kNetQueueDepth) break;
            posted[{r, op.peer, op.channel}] = op.seq;
          } else {
            if (posted[{op.peer, r, op.channel}] < op.seq) break;
            received[{op.peer, r, op.channel}] = op.seq;
          }
          ++at, progress = true;
        }
        if (at < ops.size()) all_done = false;
        for (const Op& op : ops)  // the group's end waits for its sends to be received
          if (op.send && received[{r, op.peer, op.channel}] < op.seq) all_done = false;
      }
      if (all_done) {
        ++head[r];
        position[r].clear();
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (int r = 0; r < world; ++r)
    if (head[r] < lanes[r].size())
      stuck << (stuck.tellp() > 0 ? "; " : "") << "rank " << r << " stuck in group " << head[r]
            << " of " << lanes[r].size();
  return stuck.str();
}

}  // namespace tide::net
