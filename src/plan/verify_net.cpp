// Static checker for across-node program sets (topology with nodes > 1): runs every program
// symbolically under the network semantics of plan.hpp (posted sends completing when received, at
// most kNetQueueDepth outstanding per sender/receiver/channel, writes over an outstanding send's
// source waiting for it, programs ending when their sends are received) and tracks what every byte
// of every window holds:
//   - all-gather: the shard bytes that belong at one window offset (they may only move to the same
//     offset of another window), so every slot of every window ends up holding its owner's shard;
//   - reduce-scatter: "param i's chunk for rank d, elements [e, ...), summed over ranks {set}", so
//     every output element is the sum over all W ranks of exactly its chunk, each rank once.
// Also: node-local copies only between ranks of one node, after the slot-free wait and before the
// data-ready signal; a read of bytes a local peer wrote only after its data-ready wait; every send
// received with equal bytes; no deadlock; every window slot and output element written exactly once.
#include <algorithm>
#include <bitset>
#include <deque>
#include <map>
#include <set>
#include <tuple>

#include "tide/error.hpp"
#include "tide/plan.hpp"
#include "verify_internal.hpp"

namespace tide {
namespace {

constexpr int kMaxTrackedWorld = 1024;
using Ranks = std::bitset<kMaxTrackedWorld>;

struct Label {
  bool rs = false;
  std::size_t origin = 0;  // all-gather: the window offset these bytes belong at
  int param = -1, dest = -1;  // reduce-scatter: chunk of `param` destined to rank `dest`
  int64_t elem = 0;           // its first element
  std::size_t elem_size = 1;
  Ranks ranks;                // ranks summed into it
  bool summed = false;        // a reduce's result (prescale applied), not raw gradient bytes
  int writer = -1;            // rank whose copy put it here (-1: the window's own rank)

  Label shifted(std::size_t bytes) const {
    Label l = *this;
    if (rs) l.elem += static_cast<int64_t>(bytes / elem_size);
    else l.origin += bytes;
    return l;
  }
};

struct Region {
  std::size_t end;
  Label label;
};

using Memory = std::map<std::size_t, Region>;  // begin -> region, disjoint

struct Posted {
  std::size_t offset, bytes;
  Label label;
};

using detail::fail;

void write(Memory& m, std::size_t begin, std::size_t bytes, const Label& label) {
  if (bytes == 0) return;
  const std::size_t end = begin + bytes;
  auto it = m.lower_bound(begin);
  if (it != m.begin() && std::prev(it)->second.end > begin) --it;
  std::vector<std::pair<std::size_t, Region>> keep;
  while (it != m.end() && it->first < end) {
    const std::size_t b = it->first;
    const Region r = it->second;
    if (b < begin) keep.push_back({b, {begin, r.label}});
    if (r.end > end) keep.push_back({end, {r.end, r.label.shifted(end - b)}});
    it = m.erase(it);
  }
  for (auto& [b, r] : keep) m.emplace(b, r);
  m.emplace(begin, Region{end, label});
}

}  // namespace

void detail::verify_net_programs(const BucketLayout& layout, const std::vector<Program>& programs) {
  const Topology& topo = layout.topology();
  const int world = layout.world();
  if (static_cast<int>(programs.size()) != world)
    throw Error(detail::concat("verify_programs: ", programs.size(), " programs, expected W = ", world));
  if (world > kMaxTrackedWorld)
    throw Error(detail::concat("verify_programs: W = ", world, " > ", kMaxTrackedWorld));
  if (layout.has_inner_shard_dims())
    throw Error("verify_programs: a across-node layout with a param sharded on a dim > 0 (across-node "
                "plans shard on dim 0 only)");
  const Collective collective = programs[0].collective;
  const bool ag = collective == Collective::kAllGather;
  const auto& params = layout.params();
  const int num_params = static_cast<int>(params.size());
  auto locate = [&](std::size_t offset) { return layout.locate(offset); };

  // --- Static, per program: header, bounds, dtypes, peers, program-order rules. ---
  for (int r = 0; r < world; ++r) {
    const Program& program = programs[r];
    detail::check_joins_set(programs, r, num_params);
    if (program.window_bytes < layout.window_bytes() || program.alignment != layout.alignment() ||
        program.window_bytes > BucketLayout::kMaxWindowBytes)
      fail(program, 0, "window size or alignment disagrees with the layout");
    std::set<int> waited_free, signalled_data;
    for (std::size_t s = 0; s < program.steps.size(); ++s) {
      const Step& step = program.steps[s];
      if (static_cast<int>(step.phase) > static_cast<int>(Phase::kReduce)) fail(program, s, "bad phase");
      auto bounds = [&](const Address& a, std::size_t bytes, const char* what) {
        std::size_t limit = 0;
        if (a.space == Space::kWindow) {
          if (a.index < 0 || a.index >= world) fail(program, s, detail::concat(what, ": bad rank"));
          limit = program.window_bytes;
        } else if (a.space == Space::kInput || a.space == Space::kOutput) {
          if (a.index < 0 || a.index >= num_params) fail(program, s, detail::concat(what, ": bad param"));
          const ParamLayout& p = params[a.index];
          limit = a.space == Space::kOutput ? (ag ? 0 : p.valid_numel(r) * dtype_size(p.shard_dtype))
                  : ag                      ? p.valid_numel(r) * dtype_size(p.shard_dtype)
                                            : p.numel() * p.elem_size;
        } else {
          fail(program, s, detail::concat(what, ": bad space"));
        }
        if (a.offset > limit || bytes > limit - a.offset)
          fail(program, s, detail::concat(what, ": [", a.offset, ", ", a.offset + bytes,
                                          ") outside its buffer of ", limit, " B"));
      };
      auto net_peer = [&](int peer, int channel, const Address& a, std::size_t bytes) {
        if (peer < 0 || peer >= world || topo.node_of(peer) == topo.node_of(r))
          fail(program, s, detail::concat("network peer ", peer, " is not a rank on another node"));
        if (channel < 0 || channel >= kNetChannels) fail(program, s, "bad network channel");
        if (a.space != Space::kWindow || a.index != r)
          fail(program, s, "network ops read and write the own window only");
        if (bytes == 0) fail(program, s, "empty network transfer");
        bounds(a, bytes, "network buffer");
      };
      std::visit(
          [&](const auto& op) {
            using T = std::decay_t<decltype(op)>;
            if constexpr (std::is_same_v<T, CastOp>) {
              if (!ag) fail(program, s, "a reduce-scatter has no casts");
              const auto [i, slot] = locate(op.dst.offset);
              if (op.dst.space != Space::kWindow || op.dst.index != r || i < 0 || slot != r ||
                  op.dst.offset != params[i].slot_offset(r))
                fail(program, s, "cast must write the own slot of a param");
              const ParamLayout& p = params[i];
              if (op.src != Address{Space::kInput, i, 0} || op.count != p.valid_numel(r) ||
                  op.pad != p.shard_numel - op.count || op.src_dtype != p.shard_dtype ||
                  op.dst_dtype != p.dtype || op.rows != 1)
                fail(program, s, "cast is not the param's shard (source, count, padding, dtypes or rows)");
            } else if constexpr (std::is_same_v<T, CopyBatch>) {
              for (const CopyOp& c : op.copies) {
                if (c.rows != 1) fail(program, s, "a 2-D copy in a across-node set (dim-0 sharding only)");
                bounds(c.src, c.bytes, "copy source");
                bounds(c.dst, c.bytes, "copy destination");
                if (c.dst.space == Space::kWindow && c.dst.index == r) {
                  // Staging the own gradient for the network (a reduce-scatter with one rank per
                  // node): the exactly-once check below proves no peer writes those bytes.
                  if (ag || c.src.space != Space::kInput)
                    fail(program, s, "a copy into the own window only stages a gradient (reduce-scatter)");
                  continue;
                }
                if (c.dst.space != Space::kWindow || topo.node_of(c.dst.index) != topo.node_of(r))
                  fail(program, s, "copies must write the window of a peer on the same node");
                if (c.src.space == Space::kOutput ||
                    (c.src.space == Space::kWindow && c.src.index != r))
                  fail(program, s, "copies read the own window or an input");
                if (!waited_free.count(c.dst.index))
                  fail(program, s, detail::concat("copy to rank ", c.dst.index, " before its slot-free wait"));
                if (signalled_data.count(c.dst.index))
                  fail(program, s, detail::concat("copy to rank ", c.dst.index, " after its data-ready signal"));
                if (c.dst.offset + c.bytes > layout.window_bytes())
                  fail(program, s, "copies write only the bucket's slots");
              }
            } else if constexpr (std::is_same_v<T, SignalOp> || std::is_same_v<T, WaitOp>) {
              if (op.peer < 0 || op.peer >= world || op.peer == r ||
                  topo.node_of(op.peer) != topo.node_of(r))
                fail(program, s, "flags are only between ranks of one node");
              if (static_cast<int>(op.kind) >= kNumFlagKinds) fail(program, s, "bad flag kind");
              if constexpr (std::is_same_v<T, SignalOp>) {
                if (op.kind == FlagKind::kDataReady) signalled_data.insert(op.peer);
              } else if (op.kind == FlagKind::kSlotFree) {
                waited_free.insert(op.peer);
              }
            } else if constexpr (std::is_same_v<T, NetSendOp>) {
              net_peer(op.peer, op.channel, op.src, op.bytes);
            } else if constexpr (std::is_same_v<T, NetRecvOp>) {
              net_peer(op.peer, op.channel, op.dst, op.bytes);
            } else {  // ReduceOp
              if (ag) fail(program, s, "an all-gather has no reduces");
              if (op.param < 0 || op.param >= num_params) fail(program, s, "reduce of bad param");
              if (op.sources.empty() || static_cast<int>(op.sources.size()) > world)
                fail(program, s, "reduce needs 1 to W sources");
              if (op.count <= 0) fail(program, s, "empty reduce");
              for (const Address& a : op.sources) {
                bounds(a, op.count * dtype_size(op.src_dtype), "reduce source");
                if (a.space == Space::kOutput || (a.space == Space::kWindow && a.index != r))
                  fail(program, s, "reduces read the own window or an input");
              }
              bounds(op.dst, op.count * dtype_size(op.dst_dtype), "reduce destination");
              if (op.dst.space == Space::kInput || (op.dst.space == Space::kWindow && op.dst.index != r))
                fail(program, s, "reduces write the own window or an output");
              if (op.partial) {
                if (op.partial_dtype != DType::kFP32 && op.partial_dtype != DType::kBF16)
                  fail(program, s, "a reduce's partial is fp32 or bf16");
                bounds(*op.partial, op.count * dtype_size(op.partial_dtype), "reduce partial");
                if (op.partial->space != Space::kWindow || op.partial->index != r)
                  fail(program, s, "a reduce's partial is in the own window");
              }
            }
          },
          step.op);
    }
  }

  // --- Symbolic run. ---
  std::vector<Memory> mem(world);
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> slot_writes(world);  // for exactly-once
  std::vector<std::vector<std::vector<std::pair<int64_t, int64_t>>>> out_writes(
      world, std::vector<std::vector<std::pair<int64_t, int64_t>>>(num_params));
  std::set<std::tuple<int, int, int>> signals;  // (from, to, kind)
  std::vector<std::set<int>> waited_data(world);
  std::map<std::tuple<int, int, int>, std::deque<Posted>> queues;  // (from, to, channel)
  std::vector<std::size_t> pc(world, 0);
  std::vector<bool> done(world, false);

  auto outstanding_overlap = [&](int r, std::size_t begin, std::size_t bytes) {
    for (const auto& [key, q] : queues)
      if (std::get<0>(key) == r)
        for (const Posted& p : q)
          if (p.offset < begin + bytes && begin < p.offset + p.bytes) return true;
    return false;
  };
  auto outstanding = [&](int r) {
    for (const auto& [key, q] : queues)
      if (std::get<0>(key) == r && !q.empty()) return true;
    return false;
  };
  // Reads window bytes of rank r as one labelled piece.
  // Reads window bytes of rank r: one labelled piece (reduce-scatter), or contiguous pieces that
  // each hold the bytes of their own offset (all-gather).
  auto read = [&](const Program& prog, std::size_t s, std::size_t offset, std::size_t bytes) {
    const Memory& m = mem[prog.rank];
    auto it = m.upper_bound(offset);
    const std::size_t end = offset + bytes;
    bool ok = it != m.begin();
    Label first;
    if (ok) {
      --it;
      first = it->second.label.shifted(offset - it->first);
      for (std::size_t at = offset; ok && at < end; ++it) {
        if (it == m.end() || it->first > at || it->second.end <= at) { ok = false; break; }
        const Label& l = it->second.label;
        if (l.writer >= 0 && !waited_data[prog.rank].count(l.writer))
          fail(prog, s, detail::concat("reads bytes rank ", l.writer,
                                       " copied here before waiting for its data-ready"));
        if (at != offset && (l.rs || l.origin != it->first)) { ok = false; break; }
        if (l.rs && ((at - it->first) % l.elem_size != 0 || bytes % l.elem_size != 0)) {
          ok = false;
          break;
        }
        at = it->second.end;
      }
    }
    if (!ok)
      fail(prog, s, detail::concat("reads window bytes [", offset, ", ", end,
                                   ") that nothing wrote (as one piece) before"));
    first.writer = -1;
    return first;
  };
  // Gradient bytes [a.offset, +bytes) of rank r's input: elements of one chunk (one destination).
  auto input_label = [&](const Program& prog, std::size_t s, const Address& a, DType dtype,
                         std::size_t bytes) {
    const ParamLayout& p = params[a.index];
    Label l;
    if (ag) return l;
    const int r = prog.rank;
    if (dtype != p.dtype || a.offset % p.elem_size != 0 || bytes % p.elem_size != 0 ||
        a.offset % p.slot_bytes() + bytes > p.slot_bytes())
      fail(prog, s, detail::concat("reads gradient bytes [", a.offset, ", ", a.offset + bytes,
                                   ") of param ", a.index,
                                   " that are not whole elements of one rank's chunk"));
    l.rs = true;
    l.param = a.index;
    l.dest = static_cast<int>(a.offset / p.slot_bytes());
    l.elem = static_cast<int64_t>((a.offset % p.slot_bytes()) / p.elem_size);
    l.elem_size = dtype_size(dtype);
    l.ranks.set(r);
    return l;
  };
  auto note_slot_write = [&](int q, std::size_t offset, std::size_t bytes) {
    if (offset < layout.window_bytes()) slot_writes[q].push_back({offset, offset + bytes});
  };

  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < world; ++r) {
      const Program& prog = programs[r];
      while (!done[r]) {
        const std::size_t s = pc[r];
        if (s == prog.steps.size()) {
          if (outstanding(r)) break;  // the program ends when its sends are received
          done[r] = true;
          moved = true;
          break;
        }
        const Step& step = prog.steps[s];
        bool blocked = false;
        std::visit(
            [&](const auto& op) {
              using T = std::decay_t<decltype(op)>;
              if constexpr (std::is_same_v<T, WaitOp>) {
                if (!signals.count({op.peer, r, static_cast<int>(op.kind)})) { blocked = true; return; }
                if (op.kind == FlagKind::kDataReady) waited_data[r].insert(op.peer);
              } else if constexpr (std::is_same_v<T, SignalOp>) {
                if (!signals.insert({r, op.peer, static_cast<int>(op.kind)}).second)
                  fail(prog, s, "signals the same flag twice");
              } else if constexpr (std::is_same_v<T, CastOp>) {
                const std::size_t bytes = (op.count + op.pad) * dtype_size(op.dst_dtype);
                if (outstanding_overlap(r, op.dst.offset, bytes)) { blocked = true; return; }
                Label l;
                l.origin = op.dst.offset;
                write(mem[r], op.dst.offset, bytes, l);
                note_slot_write(r, op.dst.offset, bytes);
              } else if constexpr (std::is_same_v<T, CopyBatch>) {
                for (const CopyOp& c : op.copies)  // into the own window: waits for the own sends
                  if (c.dst.index == r && outstanding_overlap(r, c.dst.offset, c.bytes)) {
                    blocked = true;
                    return;
                  }
                for (const CopyOp& c : op.copies) {
                  if (c.bytes == 0) continue;
                  const int q = c.dst.index;
                  if (outstanding_overlap(q, c.dst.offset, c.bytes))
                    fail(prog, s, detail::concat("copy overwrites bytes rank ", q, " has a send outstanding on"));
                  Label l = c.src.space == Space::kWindow ? read(prog, s, c.src.offset, c.bytes)
                                                          : input_label(prog, s, c.src, params[c.src.index].dtype, c.bytes);
                  if (ag && (l.rs || l.origin != c.dst.offset))
                    fail(prog, s, detail::concat("copy to rank ", q, " offset ", c.dst.offset,
                                                 " carries the bytes of offset ", l.origin));
                  if (!ag && (!l.rs || l.elem_size != params[l.param].elem_size))
                    fail(prog, s, "copy does not carry gradient chunk bytes");
                  l.writer = q == r ? -1 : r;
                  write(mem[q], c.dst.offset, c.bytes, l);
                  note_slot_write(q, c.dst.offset, c.bytes);
                }
              } else if constexpr (std::is_same_v<T, NetSendOp>) {
                auto& q = queues[{r, op.peer, op.channel}];
                if (static_cast<int>(q.size()) >= kNetQueueDepth) { blocked = true; return; }
                q.push_back({op.src.offset, op.bytes, read(prog, s, op.src.offset, op.bytes)});
              } else if constexpr (std::is_same_v<T, NetRecvOp>) {
                auto& q = queues[{op.peer, r, op.channel}];
                if (q.empty() || outstanding_overlap(r, op.dst.offset, op.bytes)) { blocked = true; return; }
                const Posted p = q.front();
                if (p.bytes != op.bytes)
                  fail(prog, s, detail::concat("receives ", op.bytes, " B from rank ", op.peer,
                                               " whose matching send has ", p.bytes, " B"));
                if (ag && (p.label.rs || p.label.origin != op.dst.offset))
                  fail(prog, s, detail::concat("receives the bytes of offset ", p.label.origin,
                                               " at offset ", op.dst.offset));
                q.pop_front();
                write(mem[r], op.dst.offset, op.bytes, p.label);
                note_slot_write(r, op.dst.offset, op.bytes);
              } else {  // ReduceOp
                Label acc;
                bool started = false, summed_sources = false;
                if (op.partial) {  // a partial sum of the same chunk, in the wire dtype
                  const std::size_t size = dtype_size(op.partial_dtype);
                  acc = read(prog, s, op.partial->offset, op.count * size);
                  if (!acc.rs || acc.param != op.param || acc.elem_size != size || !acc.summed)
                    fail(prog, s, detail::concat("reduce partial is not a ", dtype_name(op.partial_dtype),
                                                 " partial sum of param ", op.param,
                                                 " (raw gradient bytes are a source: they need the prescale)"));
                  started = true;
                }
                for (std::size_t k = 0; k < op.sources.size(); ++k) {
                  const Address& a = op.sources[k];
                  const std::size_t bytes = op.count * dtype_size(op.src_dtype);
                  const Label l = a.space == Space::kWindow ? read(prog, s, a.offset, bytes)
                                                            : input_label(prog, s, a, op.src_dtype, bytes);
                  if (!l.rs || l.param != op.param || l.elem_size != dtype_size(op.src_dtype))
                    fail(prog, s, detail::concat("reduce source ", k, " is not param ", op.param,
                                                 "'s gradient data in ", dtype_name(op.src_dtype)));
                  if (a.space == Space::kInput && op.src_dtype != params[op.param].dtype)
                    fail(prog, s, "reduce reads a gradient in another dtype");
                  // Partial sums as sources (recursive halving) already carry the prescale.
                  if (l.summed && op.prescale != 1.0f)
                    fail(prog, s, detail::concat("reduce source ", k, " is a partial sum, prescaled again"));
                  if (k > 0 && l.summed != summed_sources)
                    fail(prog, s, "reduce mixes partial sums and raw gradient bytes as sources");
                  summed_sources = l.summed;
                  if (!started) {
                    acc = l;
                    started = true;
                  } else {
                    if (l.dest != acc.dest || l.elem != acc.elem)
                      fail(prog, s, detail::concat("reduce source ", k, " is another chunk (rank ",
                                                   l.dest, " element ", l.elem, ") than source 0 (rank ",
                                                   acc.dest, " element ", acc.elem, ")"));
                    if ((l.ranks & acc.ranks).any())
                      fail(prog, s, "reduce sums some rank's gradient twice");
                    acc.ranks |= l.ranks;
                  }
                }
                acc.elem_size = dtype_size(op.dst_dtype);
                acc.summed = true;
                if (op.dst.space == Space::kWindow) {
                  const std::size_t bytes = op.count * acc.elem_size;
                  if (outstanding_overlap(r, op.dst.offset, bytes)) { blocked = true; return; }
                  write(mem[r], op.dst.offset, bytes, acc);
                  note_slot_write(r, op.dst.offset, bytes);
                } else {
                  const ParamLayout& p = params[op.param];
                  if (op.dst.index != op.param || acc.dest != r ||
                      op.dst.offset != static_cast<std::size_t>(acc.elem) * dtype_size(p.shard_dtype) ||
                      op.dst_dtype != p.shard_dtype)
                    fail(prog, s, "reduce writes another chunk than its own into the output");
                  if (static_cast<int>(acc.ranks.count()) != world)
                    fail(prog, s, detail::concat("output of param ", op.param, " element ", acc.elem,
                                                 " sums ", acc.ranks.count(), " ranks' gradients, not W = ", world));
                  out_writes[r][op.param].push_back({acc.elem, acc.elem + op.count});
                }
              }
            },
            step.op);
        if (blocked) break;
        ++pc[r];
        moved = true;
      }
    }
  }
  for (int r = 0; r < world; ++r)
    if (!done[r]) {
      std::string what = pc[r] < programs[r].steps.size()
                             ? detail::concat("step ", pc[r], " of ", programs[r].steps.size())
                             : std::string("its end (sends never received)");
      throw Error(detail::concat("verify_programs: deadlock: ", collective_name(collective), " rank ",
                                 r, " cannot pass ", what));
    }
  for (const auto& [key, q] : queues)
    if (!q.empty())
      throw Error(detail::concat("verify_programs: ", q.size(), " send(s) from rank ", std::get<0>(key),
                                 " to rank ", std::get<1>(key), " on channel ", std::get<2>(key),
                                 " never received"));

  detail::check_signals_pair_with_waits(programs);

  // --- Exactly once. ---
  for (int q = 0; q < world; ++q) {
    auto& w = slot_writes[q];
    std::sort(w.begin(), w.end());
    for (std::size_t k = 1; k < w.size(); ++k)
      if (w[k].first < w[k - 1].second)
        throw Error(detail::concat("verify_programs: window of rank ", q, ": bytes [", w[k].first,
                                   ", ", std::min(w[k].second, w[k - 1].second), ") written twice"));
    if (ag) {
      std::vector<std::pair<std::size_t, std::size_t>> merged, expected;
      for (const auto& iv : w) {
        if (!merged.empty() && merged.back().second == iv.first) merged.back().second = iv.second;
        else merged.push_back(iv);
      }
      for (const ParamLayout& p : params)
        expected.push_back({p.window_offset, p.window_offset + world * p.slot_bytes()});
      std::vector<std::pair<std::size_t, std::size_t>> exp_merged;
      for (const auto& iv : expected) {
        if (!exp_merged.empty() && exp_merged.back().second == iv.first) exp_merged.back().second = iv.second;
        else exp_merged.push_back(iv);
      }
      if (merged != exp_merged)
        throw Error(detail::concat("verify_programs: window of rank ", q,
                                   ": the bytes written are not exactly every param's W slots"));
    } else {
      for (int i = 0; i < num_params; ++i) {
        auto& o = out_writes[q][i];
        std::sort(o.begin(), o.end());
        int64_t at = 0;
        for (const auto& [b, e] : o) {
          if (b != at)
            throw Error(detail::concat("verify_programs: rank ", q, " output of param ", i,
                                       b < at ? ": elements written twice at " : ": elements missing at ",
                                       std::min(b, at)));
          at = e;
        }
        if (at != params[i].valid_numel(q))
          throw Error(detail::concat("verify_programs: rank ", q, " output of param ", i, " covers ",
                                     at, " of ", params[i].valid_numel(q), " elements"));
      }
    }
  }
}

}  // namespace tide
