// Static checker for a full set of per-rank programs: the addressing and handshake invariants that
// make a collective correct, independent of any executor.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "tide/error.hpp"
#include "tide/plan.hpp"
#include "verify_internal.hpp"

namespace tide {
namespace {

struct Interval {
  std::size_t begin;
  std::size_t end;
  int writer;
  bool operator<(const Interval& o) const { return std::tie(begin, end) < std::tie(o.begin, o.end); }
};

using detail::fail;

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

// The bytes a rank has written into its own window so far, for read-after-write checks (merged
// only when read after a write: 2-D ops read row by row).
class OwnWrites {
 public:
  void add(std::size_t begin, std::size_t end, int writer) {
    writes_.push_back({begin, end, writer});
    stale_ = true;
  }
  bool covers(std::size_t begin, std::size_t end) {
    if (stale_) merged_ = merged(writes_), stale_ = false;
    // The last merged run starting at or before `begin` is the only one that can hold it.
    auto it = std::upper_bound(merged_.begin(), merged_.end(), begin,
                               [](std::size_t b, const auto& run) { return b < run.first; });
    return it != merged_.begin() && end <= std::prev(it)->second;
  }

 private:
  std::vector<Interval> writes_;
  std::vector<std::pair<std::size_t, std::size_t>> merged_;
  bool stale_ = false;
};

}  // namespace

namespace detail {

void fail(const Program& program, std::size_t step, const std::string& what) {
  throw Error(concat("verify_programs: ", collective_name(program.collective), " rank ", program.rank,
                     " step ", step, ": ", what));
}

void check_joins_set(const std::vector<Program>& programs, int r, int num_params) {
  const Program& program = programs[r];
  const Program& first = programs[0];
  if (program.rank != r || program.world != static_cast<int>(programs.size()) ||
      program.collective != first.collective || program.bucket != first.bucket ||
      program.num_params != num_params)
    fail(program, 0, "rank, world, collective, bucket or param count disagrees with the set");
}

void check_signals_pair_with_waits(const std::vector<Program>& programs) {
  // (from, to, kind) -> count of signals / waits
  std::map<std::tuple<int, int, int>, int> signals, waits;
  for (int r = 0; r < static_cast<int>(programs.size()); ++r)
    for (const Step& st : programs[r].steps) {
      if (const auto* x = std::get_if<SignalOp>(&st.op)) ++signals[{r, x->peer, static_cast<int>(x->kind)}];
      if (const auto* x = std::get_if<WaitOp>(&st.op)) ++waits[{x->peer, r, static_cast<int>(x->kind)}];
    }
  for (const auto& [key, n] : signals)
    if (n != 1 || waits[key] != 1)
      throw Error(detail::concat("verify_programs: rank ", std::get<0>(key), " -> rank ",
                                 std::get<1>(key), " flag ", std::get<2>(key), ": ", n,
                                 " signal(s), ", waits[key], " wait(s); expected 1 and 1"));
  for (const auto& [key, n] : waits)
    if (n > 0 && !signals.count(key))
      throw Error(detail::concat("verify_programs: rank ", std::get<1>(key), " waits on flag ",
                                 std::get<2>(key), " of rank ", std::get<0>(key),
                                 " that nobody signals"));
}

}  // namespace detail

void verify_programs(const BucketLayout& layout, const std::vector<Program>& programs) {
  if (layout.topology().nodes > 1) return detail::verify_net_programs(layout, programs);
  const int world = layout.world();
  if (static_cast<int>(programs.size()) != world)
    throw Error(detail::concat("verify_programs: ", programs.size(), " programs, expected W = ",
                               world));
  const Collective collective = programs[0].collective;
  const auto& params = layout.params();
  const int num_params = static_cast<int>(params.size());

  std::vector<std::vector<Interval>> writes(world);
  auto locate = [&](std::size_t offset) { return layout.locate(offset); };

  for (int r = 0; r < world; ++r) {
    const Program& program = programs[r];
    detail::check_joins_set(programs, r, num_params);
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
    OwnWrites own_writes;
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
      auto record_write = [&](int window, std::size_t offset, std::size_t bytes) {
        if (bytes == 0) return;
        writes[window].push_back({offset, offset + bytes, r});
        if (window == r) own_writes.add(offset, offset + bytes, r);
      };
      const Step& step = program.steps[s];
      if (static_cast<int>(step.phase) > static_cast<int>(Phase::kReduce)) fail(program, s, "bad phase");
      std::visit(
          [&](const auto& op) {
            using T = std::decay_t<decltype(op)>;
            if constexpr (std::is_same_v<T, CastOp>) {
              if (op.dst.space != Space::kWindow || op.dst.index < 0 || op.dst.index >= world)
                fail(program, s, "cast must write a window");
              const int q = op.dst.index;
              if (op.count < 0 || op.pad < 0 || op.rows < 1) fail(program, s, "negative cast size");
              if (op.src.space != Space::kInput) fail(program, s, "cast must read an input");
              if (collective != Collective::kAllGather) fail(program, s, "a reduce-scatter has no casts");
              // Delivery::kCastToPeers: into a peer's window only inside its handshake.
              if (q != r && !waited_free.count(q))
                fail(program, s, detail::concat("cast into rank ", q, "'s window before its slot-free wait"));
              if (q != r && signalled_data.count(q))
                fail(program, s, detail::concat("cast into rank ", q, "'s window after its data-ready signal"));
              const int i = locate(op.dst.offset).first;
              if (i < 0 || op.dst.offset != params[i].block_offset(r))
                fail(program, s, "cast must write the own block of a param");
              const ParamLayout& p = params[i];
              const int64_t valid = p.valid_rows(r) * p.row_numel;
              if (op.src != Address{Space::kInput, i, 0} || op.count != valid ||
                  op.pad != p.rows_per_rank * p.row_numel - valid || op.rows != p.outer_rows ||
                  (op.rows > 1 && op.dst_pitch != p.block_pitch) || op.src_dtype != p.shard_dtype ||
                  op.dst_dtype != p.dtype)
                fail(program, s, detail::concat("cast into block(", i, ", ", r, ") is not param ", i,
                                                "'s shard (source, count, padding, rows, pitch or dtypes)"));
              check_bounds(op.src, op.rows * op.count * dtype_size(op.src_dtype), "cast source");
              check_bounds(op.dst, op.dst_extent(), "cast destination");
              const std::size_t row_bytes = (op.count + op.pad) * dtype_size(op.dst_dtype);
              for (int64_t j = 0; j < op.rows; ++j)
                record_write(q, op.dst.offset + j * op.dst_pitch, row_bytes);
            } else if constexpr (std::is_same_v<T, CopyBatch>) {
              for (const CopyOp& c : op.copies) {
                if (c.rows < 1 || (c.rows > 1 && (c.src_pitch < c.bytes || c.dst_pitch < c.bytes)))
                  fail(program, s, detail::concat("copy of ", c.rows, " rows of ", c.bytes,
                                                  " B with pitches ", c.src_pitch, "/", c.dst_pitch,
                                                  ": rows overlap or none"));
                check_bounds(c.src, c.src_extent(), "copy source");
                check_bounds(c.dst, c.dst_extent(), "copy destination");
                if (c.dst.space != Space::kWindow) fail(program, s, "copies must write a window");
                const int q = c.dst.index;
                // A reduce-scatter stages the own chunk of a param sharded on a dim > 0 (the own
                // window needs no handshake); anything else goes to peers.
                if (q == r && collective == Collective::kAllGather)
                  fail(program, s, "all-gather copies must write a peer's window");
                if (q != r && !waited_free.count(q))
                  fail(program, s, detail::concat("copy to rank ", q, " before its slot-free wait"));
                if (signalled_data.count(q))
                  fail(program, s, detail::concat("copy to rank ", q, " after its data-ready signal"));
                if (c.src.space == Space::kOutput) fail(program, s, "copies may not read outputs");
                if (c.src.space == Space::kWindow && c.src.index != r)
                  fail(program, s, "copies may read only the own window");
                for (std::size_t j = 0; j < c.rows; ++j) {
                  const std::size_t dst = c.dst.offset + j * c.dst_pitch;
                  const Address src{c.src.space, c.src.index, c.src.offset + j * c.src_pitch};
                  const auto [i, slot] = locate(dst);
                  if (i < 0)
                    fail(program, s, detail::concat("copy to rank ", q, " row ", j,
                                                    " writes no param's bytes"));
                  const ParamLayout& p = params[i];
                  const std::size_t rel = dst - p.window_offset;
                  // Provenance: rank r writes only its own part of a peer's param, from where those
                  // bytes live. All-gather: a row of block(i, r), from the same bytes of the own
                  // window. Reduce-scatter: slot(i, r), chunk q of the gradient staged row by row
                  // (rows of rank q's valid slices), from block q of the gradient in place.
                  Address from{};
                  if (collective == Collective::kAllGather) {
                    const std::size_t col = rel % p.block_pitch;
                    if (col / p.block_bytes() != static_cast<std::size_t>(r) ||
                        col % p.block_bytes() + c.bytes > p.block_bytes())
                      fail(program, s, detail::concat("copy to rank ", q, " row ", j,
                                                      " does not stay inside a row of block(", i,
                                                      ", ", r, ")"));
                    from = {Space::kWindow, r, dst};
                  } else {
                    const std::size_t row_bytes = p.valid_rows(q) * p.row_numel * p.elem_size;
                    const std::size_t within = rel - static_cast<std::size_t>(slot) * p.slot_bytes();
                    const std::size_t row = row_bytes == 0 ? 0 : within / row_bytes;
                    const std::size_t col = within - row * row_bytes;
                    if (slot != r || row_bytes == 0 || row >= static_cast<std::size_t>(p.outer_rows) ||
                        col + c.bytes > row_bytes)
                      fail(program, s, detail::concat("copy to rank ", q, " row ", j,
                                                      " does not stay inside a row of slot(", i,
                                                      ", ", r, ")'s chunk"));
                    from = {Space::kInput, i, row * p.block_pitch + q * p.block_bytes() + col};
                  }
                  if (src != from)
                    fail(program, s, detail::concat("copy to slot(", i, ", ", r, ") of rank ", q,
                                                    " row ", j, " reads the wrong source"));
                  if (src.space == Space::kWindow && !own_writes.covers(src.offset, src.offset + c.bytes))
                    fail(program, s, "copy reads own window bytes nothing wrote");
                  record_write(q, dst, c.bytes);
                }
              }
            } else if constexpr (std::is_same_v<T, SignalOp>) {
              if (op.peer < 0 || op.peer >= world || op.peer == r) fail(program, s, "bad signal peer");
              if (static_cast<int>(op.kind) >= kNumFlagKinds) fail(program, s, "bad signal kind");
              if (op.kind == FlagKind::kDataReady) signalled_data.insert(op.peer);
            } else if constexpr (std::is_same_v<T, WaitOp>) {
              if (op.peer < 0 || op.peer >= world || op.peer == r) fail(program, s, "bad wait peer");
              if (static_cast<int>(op.kind) >= kNumFlagKinds) fail(program, s, "bad wait kind");
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
                if (src == r && p.shard_dim == 0) {
                  if (a != Address{Space::kInput, op.param, r * p.slot_bytes()})
                    fail(program, s, "reduce must read the own chunk from its param's gradient");
                  continue;
                }
                if (a.space != Space::kWindow || a.index != r || a.offset != p.slot_offset(src))
                  fail(program, s, detail::concat("reduce source ", src, " is not slot(", op.param,
                                                  ", ", src, ") of the own window"));
                if (src == r) {  // the own chunk of a param sharded on a dim > 0, staged
                  if (!own_writes.covers(a.offset, a.offset + bytes))
                    fail(program, s, "reduce reads the own staged chunk before it is written");
                } else if (!waited_data.count(src)) {
                  fail(program, s, detail::concat("reduce reads rank ", src,
                                                  "'s chunk before its data-ready wait"));
                }
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

  detail::check_signals_pair_with_waits(programs);

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
          if ((src != q || p.shard_dim > 0) && n > 0)
            expected.push_back({p.slot_offset(src), p.slot_offset(src) + n, src});
      }
    }
    if (merged(sorted) != merged(expected))
      throw Error(detail::concat("verify_programs: window of rank ", q,
                                 ": the bytes written are not exactly the bytes the ",
                                 collective_name(collective), " must deliver"));
  }
}

}  // namespace tide
