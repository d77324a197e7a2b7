// Static checker for a full set of per-rank programs: the addressing and handshake invariants that
// make a collective correct, independent of any executor.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "tide/error.hpp"
#include "tide/plan.hpp"

namespace tide {
namespace {

struct Interval {
  std::size_t begin;
  std::size_t end;
  int writer;
  bool operator<(const Interval& o) const { return std::tie(begin, end) < std::tie(o.begin, o.end); }
};

[[noreturn]] void fail(const Program& program, std::size_t step, const std::string& what) {
  throw Error(detail::concat("verify_programs: ", collective_name(program.collective), " rank ",
                             program.rank, " step ", step, ": ", what));
}

// Merges touching intervals so that two tilings of the same bytes compare equal.
std::vector<std::pair<std::size_t, std::size_t>> merged(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (const Interval& iv : v) {
    if (!out.empty() && out.back().second == iv.begin)
      out.back().second = iv.end;
    else
      out.emplace_back(iv.begin, iv.end);
  }
  return out;
}

}  // namespace

void verify_net_programs(const BucketLayout& layout, const std::vector<Program>& programs);

void verify_programs(const BucketLayout& layout, const std::vector<Program>& programs) {
  if (layout.topology().nodes > 1) return verify_net_programs(layout, programs);
  const int world = layout.world();
  if (static_cast<int>(programs.size()) != world)
    throw Error(detail::concat("verify_programs: ", programs.size(), " programs, expected W = ",
                               world));
  const Collective collective = programs[0].collective;
  const auto& params = layout.params();
  const int num_params = static_cast<int>(params.size());

  std::vector<std::vector<Interval>> writes(world);
  auto locate = [&](std::size_t offset) { return layout.locate(offset); };
  // (from, to, kind) -> count of signals / waits
  std::map<std::tuple<int, int, int>, int> signals, waits;

  for (int r = 0; r < world; ++r) {
    const Program& program = programs[r];
    if (program.rank != r || program.world != world || program.collective != collective ||
        program.bucket != programs[0].bucket || program.num_params != num_params)
      fail(program, 0, "rank, world, collective, bucket or param count disagrees with the set");
    if (program.window_bytes != layout.window_bytes() || program.alignment != layout.alignment())
      fail(program, 0, "window size or alignment disagrees with the layout");
    auto input_bytes = [&](int i) -> std::size_t {
      const ParamLayout& p = params[i];
      return collective == Collective::kAllGather
                 ? p.valid_numel(r) * dtype_size(p.shard_dtype)
                 : p.numel() * p.elem_size;
    };
    auto output_bytes = [&](int i) -> std::size_t {
      return collective == Collective::kAllGather
                 ? 0
                 : params[i].valid_numel(r) * dtype_size(params[i].shard_dtype);
    };
    std::set<int> waited_free, waited_data, signalled_data;
    std::vector<Interval> own_writes;
    std::vector<int> reduces(num_params, 0);

    for (std::size_t s = 0; s < program.steps.size(); ++s) {
      auto check_bounds = [&](const Address& a, std::size_t bytes, const char* what) {
        std::size_t limit = 0;
        if (a.space != Space::kWindow && a.space != Space::kInput && a.space != Space::kOutput)
          fail(program, s, detail::concat(what, ": bad space ", static_cast<int>(a.space)));
        if (a.space == Space::kWindow) {
          if (a.index < 0 || a.index >= world) fail(program, s, detail::concat(what, ": bad rank"));
          limit = layout.window_bytes();
        } else {
          if (a.index < 0 || a.index >= num_params)
            fail(program, s, detail::concat(what, ": bad param ", a.index));
          limit = a.space == Space::kInput ? input_bytes(a.index) : output_bytes(a.index);
        }
        if (a.offset > limit || bytes > limit - a.offset)
          fail(program, s, detail::concat(what, ": [", a.offset, ", ", a.offset + bytes,
                                          ") outside its buffer of ", limit, " B"));
      };
      auto record_write = [&](const Address& dst, std::size_t bytes) {
        if (bytes == 0) return;
        writes[dst.index].push_back({dst.offset, dst.offset + bytes, r});
        if (dst.index == r) own_writes.push_back({dst.offset, dst.offset + bytes, r});
      };
      const Step& step = program.steps[s];
      if (static_cast<int>(step.phase) > static_cast<int>(Phase::kReduce)) fail(program, s, "bad phase");
      std::visit(
          [&](const auto& op) {
            using T = std::decay_t<decltype(op)>;
            if constexpr (std::is_same_v<T, CastOp>) {
              if (op.dst.space != Space::kWindow || op.dst.index != r)
                fail(program, s, "cast must write the own window");
              if (op.count < 0 || op.pad < 0) fail(program, s, "negative cast size");
              if (op.src.space != Space::kInput) fail(program, s, "cast must read an input");
              if (collective != Collective::kAllGather) fail(program, s, "a reduce-scatter has no casts");
              const auto [i, slot] = locate(op.dst.offset);
              if (i < 0 || slot != r || op.dst.offset != params[i].slot_offset(r))
                fail(program, s, "cast must write the own slot of a param");
              const ParamLayout& p = params[i];
              if (op.src != Address{Space::kInput, i, 0} || op.count != p.valid_numel(r) ||
                  op.pad != p.shard_numel - op.count || op.src_dtype != p.shard_dtype ||
                  op.dst_dtype != p.dtype)
                fail(program, s, detail::concat("cast into slot(", i, ", ", r, ") is not param ", i,
                                                "'s shard (source, count, padding or dtypes)"));
              check_bounds(op.src, op.count * dtype_size(op.src_dtype), "cast source");
              const std::size_t bytes = (op.count + op.pad) * dtype_size(op.dst_dtype);
              check_bounds(op.dst, bytes, "cast destination");
              record_write(op.dst, bytes);
            } else if constexpr (std::is_same_v<T, CopyBatch>) {
              for (const CopyOp& c : op.copies) {
                check_bounds(c.src, c.bytes, "copy source");
                check_bounds(c.dst, c.bytes, "copy destination");
                if (c.dst.space != Space::kWindow || c.dst.index == r)
                  fail(program, s, "copies must write a peer's window");
                const int q = c.dst.index;
                if (!waited_free.count(q))
                  fail(program, s, detail::concat("copy to rank ", q, " before its slot-free wait"));
                if (signalled_data.count(q))
                  fail(program, s, detail::concat("copy to rank ", q, " after its data-ready signal"));
                if (c.src.space == Space::kOutput) fail(program, s, "copies may not read outputs");
                // Provenance: rank r writes only slot(i, r) of a peer, from where that slot's bytes
                // live: its own slot (all-gather) or chunk q of param i's gradient (reduce-scatter).
                const auto [i, slot] = locate(c.dst.offset);
                if (i < 0 || slot != r ||
                    c.dst.offset + c.bytes > params[i].slot_offset(r) + params[i].slot_bytes())
                  fail(program, s, detail::concat("copy to rank ", q, " does not stay inside slot(i, ",
                                                  r, ") of one param"));
                const std::size_t within = c.dst.offset - params[i].slot_offset(r);
                const Address from =
                    collective == Collective::kAllGather
                        ? Address{Space::kWindow, r, c.dst.offset}
                        : Address{Space::kInput, i, q * params[i].slot_bytes() + within};
                if (c.src != from)
                  fail(program, s, detail::concat("copy to slot(", i, ", ", r, ") of rank ", q,
                                                  " reads the wrong source"));
                if (c.src.space == Space::kWindow) {
                  if (c.src.index != r) fail(program, s, "copies may read only the own window");
                  const bool written = std::any_of(own_writes.begin(), own_writes.end(), [&](auto& w) {
                    return w.begin <= c.src.offset && c.src.offset + c.bytes <= w.end;
                  });
                  if (!written) fail(program, s, "copy reads own window bytes nothing wrote");
                }
                record_write(c.dst, c.bytes);
              }
            } else if constexpr (std::is_same_v<T, SignalOp>) {
              if (op.peer < 0 || op.peer >= world || op.peer == r) fail(program, s, "bad signal peer");
              if (static_cast<int>(op.kind) >= kNumFlagKinds) fail(program, s, "bad signal kind");
              ++signals[{r, op.peer, static_cast<int>(op.kind)}];
              if (op.kind == FlagKind::kDataReady) signalled_data.insert(op.peer);
            } else if constexpr (std::is_same_v<T, WaitOp>) {
              if (op.peer < 0 || op.peer >= world || op.peer == r) fail(program, s, "bad wait peer");
              if (static_cast<int>(op.kind) >= kNumFlagKinds) fail(program, s, "bad wait kind");
              ++waits[{op.peer, r, static_cast<int>(op.kind)}];
              (op.kind == FlagKind::kSlotFree ? waited_free : waited_data).insert(op.peer);
            } else if constexpr (std::is_same_v<T, NetSendOp> || std::is_same_v<T, NetRecvOp>) {
              fail(program, s, "a network op in a single-node set (topology has 1 node)");
            } else {  // ReduceOp
              if (collective != Collective::kReduceScatter) fail(program, s, "an all-gather has no reduces");
              if (static_cast<int>(op.sources.size()) != world)
                fail(program, s, "reduce needs one source per rank");
              if (op.partial) fail(program, s, "a single-node reduce takes no partial");
              if (op.param < 0 || op.param >= num_params)
                fail(program, s, detail::concat("reduce of bad param ", op.param));
              const ParamLayout& p = params[op.param];
              ++reduces[op.param];
              if (op.dst != Address{Space::kOutput, op.param, 0})
                fail(program, s, "reduce must write its param's output");
              if (op.src_dtype != p.dtype || op.dst_dtype != p.shard_dtype)
                fail(program, s, "reduce dtypes are not the param's");
              const std::size_t bytes = op.count * dtype_size(op.src_dtype);
              if (op.count != p.valid_numel(r)) fail(program, s, "reduce count is not the own shard");
              check_bounds(op.dst, op.count * dtype_size(op.dst_dtype), "reduce destination");
              for (int src = 0; src < world; ++src) {
                const Address& a = op.sources[src];
                check_bounds(a, bytes, "reduce source");
                if (src == r) {
                  if (a != Address{Space::kInput, op.param, r * p.slot_bytes()})
                    fail(program, s, "reduce must read the own chunk from its param's gradient");
                  continue;
                }
                if (a.space != Space::kWindow || a.index != r || a.offset != p.slot_offset(src))
                  fail(program, s, detail::concat("reduce source ", src, " is not slot(", op.param,
                                                  ", ", src, ") of the own window"));
                if (!waited_data.count(src))
                  fail(program, s, detail::concat("reduce reads rank ", src,
                                                  "'s chunk before its data-ready wait"));
              }
            }
          },
          step.op);
    }
    if (collective == Collective::kReduceScatter)
      for (int i = 0; i < num_params; ++i)
        if (reduces[i] != (params[i].valid_numel(r) > 0 ? 1 : 0))
          fail(program, program.steps.size(),
               detail::concat(reduces[i], " reduce(s) of param ", i, ", expected ",
                              params[i].valid_numel(r) > 0 ? "1" : "0 (no rows here)"));
  }

  for (const auto& [key, n] : signals)
    if (n != 1 || waits[key] != 1)
      throw Error(detail::concat("verify_programs: rank ", std::get<0>(key), " -> rank ",
                                 std::get<1>(key), " flag ", std::get<2>(key), ": ", n,
                                 " signal(s), ", waits[key], " wait(s); expected 1 and 1"));
  for (const auto& [key, n] : waits)
    if (!signals.count(key))
      throw Error(detail::concat("verify_programs: rank ", std::get<1>(key), " waits on flag ",
                                 std::get<2>(key), " of rank ", std::get<0>(key),
                                 " that nobody signals"));

  // The handshakes complete: run every program's signals and waits in order, each rank as far as
  // it can, until none can move; a rank left waiting means the set would hang.
  std::vector<std::size_t> pc(world, 0);
  std::set<std::tuple<int, int, int>> sent;
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < world; ++r) {
      const std::vector<Step>& steps = programs[r].steps;
      for (; pc[r] < steps.size(); ++pc[r], moved = true) {
        if (const auto* w = std::get_if<WaitOp>(&steps[pc[r]].op)) {
          if (!sent.count({w->peer, r, static_cast<int>(w->kind)})) break;
        } else if (const auto* sig = std::get_if<SignalOp>(&steps[pc[r]].op)) {
          sent.insert({r, sig->peer, static_cast<int>(sig->kind)});
        }
      }
    }
  }
  for (int r = 0; r < world; ++r)
    if (pc[r] < programs[r].steps.size()) {
      const auto& w = std::get<WaitOp>(programs[r].steps[pc[r]].op);
      throw Error(detail::concat("verify_programs: deadlock: ", collective_name(collective), " rank ",
                                 r, " step ", pc[r], " waits for flag ", static_cast<int>(w.kind),
                                 " from rank ", w.peer, ", which stops at step ", pc[w.peer], " of ",
                                 programs[w.peer].steps.size()));
    }

  for (int q = 0; q < world; ++q) {
    std::vector<Interval> sorted = writes[q];
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t k = 1; k < sorted.size(); ++k)
      if (sorted[k].begin < sorted[k - 1].end)
        throw Error(detail::concat("verify_programs: window of rank ", q, ": writes by rank ",
                                   sorted[k - 1].writer, " [", sorted[k - 1].begin, ", ",
                                   sorted[k - 1].end, ") and rank ", sorted[k].writer, " [",
                                   sorted[k].begin, ", ", sorted[k].end, ") overlap"));
    std::vector<Interval> expected;
    for (const ParamLayout& p : params) {
      if (collective == Collective::kAllGather) {
        expected.push_back({p.window_offset, p.window_offset + world * p.slot_bytes(), -1});
      } else {
        const std::size_t n = p.valid_numel(q) * p.elem_size;
        for (int src = 0; src < world; ++src)
          if (src != q && n > 0) expected.push_back({p.slot_offset(src), p.slot_offset(src) + n, src});
      }
    }
    if (merged(sorted) != merged(expected))
      throw Error(detail::concat("verify_programs: window of rank ", q,
                                 ": the bytes written are not exactly the bytes the ",
                                 collective_name(collective), " must deliver"));
  }
}

}  // namespace tide
