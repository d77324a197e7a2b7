// Seeded property fuzzer over the API boundary (> 10^5 cases per run, a few seconds): random and
// mostly invalid layouts, topologies, alignments, dtypes, ranks, buckets and reduce options; planned
// programs and their static verification; programs and bindings given to executors (wrong rank or
// world, windows too small or misaligned, missing or null bindings, every field of every step
// corrupted). Properties:
//   - an input with one injected fault throws tide::InvalidArgument whose message names exactly
//     that argument ("<where>: <argument> = <value>, expected <what>"); several faults: still
//     InvalidArgument in that form; never another exception, a crash or (under the sanitizer build)
//     undefined behaviour;
//   - every valid input is accepted, and the programs planned from it pass verify_programs;
//   - verify_programs, given corrupted program sets, throws tide::Error or accepts, and whatever it
//     accepts an executor's validate_run accepts too;
//   - a host executor runs valid programs correctly and rejects invalid ones without side effects.
// TIDE_FUZZ_SEED picks the seed (default fixed, printed), TIDE_FUZZ_SCALE multiplies the counts.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>

#include "rank_runner.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

using Rng = std::mt19937_64;

uint64_t fuzz_seed() {
  const char* env = std::getenv("TIDE_FUZZ_SEED");
  return env && *env ? std::strtoull(env, nullptr, 0) : 0x71DEF022ull;
}

int scaled(int n) {
  const char* env = std::getenv("TIDE_FUZZ_SCALE");
  const double s = env && *env ? std::atof(env) : 1.0;
  return std::max(1, static_cast<int>(n * s));
}

template <class T>
T pick(Rng& rng, std::initializer_list<T> values) {
  return *(values.begin() + rng() % values.size());
}
bool chance(Rng& rng, double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }
int64_t uniform(Rng& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// Counts cases and collects the first few failures, so a broken property reports a handful of
// reproducible cases (seed and index) instead of drowning the log.
struct Tally {
  const char* name;
  uint64_t seed;
  long cases = 0, failures = 0;
  void fail(long index, const std::string& what) {
    if (++failures <= 5)
      ADD_FAILURE() << name << " case " << index << " (TIDE_FUZZ_SEED=" << seed << "): " << what;
  }
  ~Tally() { std::printf("[   FUZZ   ] %s: %ld cases, seed %llu\n", name, cases,
                         static_cast<unsigned long long>(seed)); }
};

// Runs fn; "" if it threw InvalidArgument shaped "<where>: <argument> = <value>, expected <what>"
// naming `argument` (any argument when empty), else what went wrong.
template <class Fn>
std::string expect_invalid(Fn&& fn, const std::string& argument) {
  try {
    fn();
    return "accepted; expected InvalidArgument naming '" + argument + "'";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    if (m.find(" = ") == std::string::npos || m.find(", expected ") == std::string::npos)
      return "InvalidArgument not in the '<argument> = <value>, expected <what>' form: " + m;
    if (!argument.empty() && m.find(": " + argument + " = ") == std::string::npos)
      return "InvalidArgument does not name '" + argument + "': " + m;
    return "";
  } catch (const std::exception& e) {
    return std::string("threw something else than InvalidArgument: ") + e.what();
  }
}

// --- Layouts -------------------------------------------------------------------------------------

struct LayoutCase {
  std::vector<ParamSpec> specs;
  Topology topology{1, 1};
  std::size_t alignment = 256;
  std::string fault;  // the argument the one injected fault is in; "" valid; "*" several faults
};

// inner_shard_dims: some params of 2 or more dims sharded on a dim > 0 that W divides (one node
// only: across-node plans refuse them).
std::vector<ParamSpec> small_specs(Rng& rng, int world, bool inner_shard_dims) {
  std::vector<ParamSpec> specs(uniform(rng, 1, 5));
  for (std::size_t i = 0; i < specs.size(); ++i) {
    ParamSpec& s = specs[i];
    s.name = "p" + std::to_string(i);
    const int ndim = static_cast<int>(uniform(rng, 0, 3));
    for (int k = 0; k < ndim; ++k)
      s.shape.push_back(k == 0 ? uniform(rng, 1, 3 * world + 9)
                               : (chance(rng, 0.1) ? uniform(rng, 100, 300) : uniform(rng, 1, 16)));
    if (inner_shard_dims && ndim >= 2 && chance(rng, 0.3)) {
      s.shard_dim = static_cast<int>(uniform(rng, 1, ndim - 1));
      s.shape[s.shard_dim] = world * uniform(rng, 1, 3);
    }
    s.dtype = pick(rng, {DType::kBF16, DType::kFP16, DType::kFP32});
    s.shard_dtype = chance(rng, 0.25) ? s.dtype : DType::kFP32;
  }
  return specs;
}

// Injects one fault into c; returns the argument it is in.
std::string inject_layout_fault(Rng& rng, LayoutCase& c) {
  if (c.specs.empty()) c.specs.push_back({"q", {4}});  // an earlier fault (of several) emptied it
  // A param with at least one dim, for shape faults.
  auto with_dims = [&]() -> ParamSpec& {
    ParamSpec& s = c.specs[rng() % c.specs.size()];
    if (s.shape.empty()) s.shape.push_back(1);
    return s;
  };
  switch (rng() % 12) {
    case 10: {
      ParamSpec& s = c.specs[rng() % c.specs.size()];
      const int ndim = static_cast<int>(s.shape.size());
      s.shard_dim = pick<int>(rng, {-1, INT_MIN, std::max(ndim, 1), ndim + 5});
      return "shard_dim";
    }
    case 11: {  // a dim > 0 that W does not divide (FSDP2 requires even sharding there)
      const int64_t world = int64_t{c.topology.nodes} * c.topology.local;  // may be a faulted topology
      if (world < 2 || world > 64) {
        c.specs.front().shard_dim = -1;
        return "shard_dim";
      }
      ParamSpec& s = c.specs[rng() % c.specs.size()];
      s.shape = {uniform(rng, 1, 4), world * uniform(rng, 1, 3) + uniform(rng, 1, world - 1)};
      s.shard_dim = 1;
      return "shape[1] (shard_dim 1)";
    }
    case 0: c.topology.nodes = pick<int>(rng, {0, -1, INT_MIN}); return "nodes";
    case 1: c.topology.local = pick<int>(rng, {0, -7, INT_MIN}); return "local";
    case 2: c.topology = pick<Topology>(rng, {{1025, 1024}, {1, (1 << 20) + 1}, {INT_MAX, 2}});
      return "nodes * local";
    case 3:
      c.alignment = pick<std::size_t>(rng, {0, 1, 128, 255, 300, 768, std::size_t{1} << 31,
                                            std::size_t{1} << 40, std::size_t{1} << 63, SIZE_MAX});
      return "alignment";
    case 4: c.specs.clear(); return "params";
    case 5: {
      ParamSpec& s = with_dims();
      const std::size_t k = rng() % s.shape.size();
      s.shape[k] = pick<int64_t>(rng, {0, -1, INT64_MIN});
      return "shape[" + std::to_string(k) + "]";
    }
    case 6: {  // a whole new shape, sharded on dim 0 (the old shard dim may not exist in it)
      ParamSpec& s = with_dims();
      s.shard_dim = 0;
      s.shape = pick<std::vector<int64_t>>(
          rng, {{int64_t{1} << 41}, {1 << 21, 1 << 20}, {3, int64_t{1} << 62}, {INT64_MAX},
                {1, INT64_MAX}, {2, 1 << 20, 1 << 20}, {INT64_MAX, INT64_MAX}});
      return "shape";
    }
    case 7: c.specs[rng() % c.specs.size()].dtype = static_cast<DType>(uniform(rng, 5, 255));
      return "dtype";
    case 8: c.specs[rng() % c.specs.size()].shard_dtype = static_cast<DType>(uniform(rng, 5, 255));
      return "shard_dtype";
    default:  // a window over 2^48 B per rank: W = 2^20 ranks of a 2^39-element row each
      c.topology = {1024, 1024};
      c.specs = {{"huge", {1, int64_t{1} << 39}, DType::kFP32, DType::kFP32}};
      return "window bytes up to this param";
  }
}

LayoutCase random_layout_case(Rng& rng) {
  LayoutCase c;
  c.topology = {static_cast<int>(uniform(rng, 1, 2)), static_cast<int>(uniform(rng, 1, 8))};
  c.alignment = pick<std::size_t>(rng, {256, 256, 512, 4096, 65536, std::size_t{1} << 30});
  c.specs = small_specs(rng, c.topology.world(), c.topology.nodes == 1);
  const double u = std::uniform_real_distribution<double>(0, 1)(rng);
  if (u < 0.45) return c;
  if (u < 0.9) {
    c.fault = inject_layout_fault(rng, c);
  } else {
    for (int k = 0; k < 3; ++k) inject_layout_fault(rng, c);
    c.fault = "*";
  }
  return c;
}

// Layout invariants: aligned, disjoint, in order, every row owned once.
std::string check_layout(const BucketLayout& l) {
  std::size_t end = 0;
  for (const ParamLayout& p : l.params()) {
    if (p.window_offset % l.alignment() != 0) return "unaligned param " + p.name;
    if (p.window_offset < end) return "overlapping param " + p.name;
    end = p.window_offset + l.world() * p.slot_bytes();
    int64_t rows = 0;
    for (int r = 0; r < l.world(); ++r) rows += p.valid_rows(r);
    if (rows != p.shard_dim_size) return "rows of " + p.name + " not owned exactly once";
  }
  if (end > l.window_bytes() || l.window_bytes() % l.alignment() != 0) return "bad window_bytes";
  return "";
}

std::vector<Program> plan_set(const BucketLayout& layout, Collective c, uint32_t bucket,
                              const ReduceOptions& o, std::optional<Delivery> delivery = {}) {
  std::vector<Program> set;
  for (int r = 0; r < layout.world(); ++r)
    set.push_back(test::plan_for(c, layout, r, bucket, o, delivery));
  return set;
}

ReduceOptions random_options(Rng& rng) {
  ReduceOptions o;
  o.kind = chance(rng, 0.5) ? ReduceKind::kAvg : ReduceKind::kSum;
  o.prescale = pick(rng, {1.0f, 0.5f, 0.125f, 3.0f});
  o.postscale = pick(rng, {1.0f, 2.0f, 0.25f});
  o.accumulate = chance(rng, 0.3);
  return o;
}

TEST(Fuzz, LayoutsAndPlans) {
  Tally t{"layouts, topologies, alignments, dtypes (+ plan and verify)", fuzz_seed()};
  Rng rng(t.seed);
  const int n = scaled(40000);
  for (long i = 0; i < n; ++i, ++t.cases) {
    LayoutCase c = random_layout_case(rng);
    auto make = [&] { return BucketLayout(c.specs, c.topology, c.alignment); };
    if (!c.fault.empty()) {
      const std::string bad = expect_invalid(make, c.fault == "*" ? "" : c.fault);
      if (!bad.empty()) t.fail(i, "fault in '" + c.fault + "': " + bad);
      continue;
    }
    try {
      const BucketLayout layout = make();
      if (const std::string bad = check_layout(layout); !bad.empty()) t.fail(i, bad);
      if (i % 3 != 0) continue;  // a third of the valid layouts: plan every rank, verify
      const uint32_t bucket = static_cast<uint32_t>(uniform(rng, 0, (int64_t{1} << 31) - 1));
      // One node: either delivery (across-node plans push).
      const Delivery delivery = layout.topology().nodes == 1 && chance(rng, 0.5)
                                    ? Delivery::kCastToPeers
                                    : Delivery::kPush;
      for (Collective coll : {Collective::kAllGather, Collective::kReduceScatter}) {
        const auto set = plan_set(layout, coll, bucket, random_options(rng), delivery);
        verify_programs(layout, set);
        if (coll == Collective::kAllGather) {
          std::size_t slots = 0;
          for (const ParamLayout& p : layout.params()) slots += p.slot_bytes();
          // One node: every slot to every peer (or none, cast into the peers' windows). Several:
          // node-local copies only, every rail slot (own + the other nodes' on the same rail) to
          // each local peer; the rest is network.
          const Topology& topo = layout.topology();
          const std::size_t expected = topo.nodes > 1 ? std::size_t(topo.local - 1) * topo.nodes * slots
                                       : delivery == Delivery::kCastToPeers ? 0
                                                                             : (layout.world() - 1) * slots;
          if (set[0].bytes_pushed() != expected) t.fail(i, "AG pushes wrong");
        }
      }
    } catch (const std::exception& e) {
      t.fail(i, std::string("valid layout rejected or its programs do not verify: ") + e.what());
    }
  }
}

TEST(Fuzz, PlanArguments) {
  Tally t{"plan_all_gather / plan_reduce_scatter arguments", fuzz_seed() + 1};
  Rng rng(t.seed);
  const int n = scaled(20000);
  for (long i = 0; i < n; ++i, ++t.cases) {
    const int world = static_cast<int>(uniform(rng, 1, 8));
    std::vector<ParamSpec> specs = small_specs(rng, world, true);
    int rank = static_cast<int>(uniform(rng, 0, world - 1));
    uint32_t bucket = static_cast<uint32_t>(uniform(rng, 0, (int64_t{1} << 31) - 1));
    ReduceOptions o = random_options(rng);
    const Collective coll = chance(rng, 0.5) ? Collective::kAllGather : Collective::kReduceScatter;
    std::string fault;
    switch (chance(rng, 0.4) ? -1 : static_cast<int>(rng() % 6)) {
      case 0: rank = pick<int>(rng, {-1, world, world + 3, INT_MAX, INT_MIN}); fault = "rank"; break;
      case 1: bucket = static_cast<uint32_t>(uniform(rng, int64_t{1} << 31, UINT32_MAX));
        fault = "bucket"; break;
      case 2:
        if (coll == Collective::kReduceScatter) {
          o.kind = static_cast<ReduceKind>(uniform(rng, 2, 255));
          fault = "options.kind";
        }
        break;
      case 3:
        if (coll == Collective::kReduceScatter) {
          o.prescale = pick(rng, {std::numeric_limits<float>::quiet_NaN(),
                                  std::numeric_limits<float>::infinity(),
                                  -std::numeric_limits<float>::infinity()});
          fault = "options.prescale";
        }
        break;
      case 4:
        if (coll == Collective::kReduceScatter) {
          o.postscale = pick(rng, {std::numeric_limits<float>::quiet_NaN(),
                                   -std::numeric_limits<float>::infinity()});
          fault = "options.postscale";
        }
        break;
      case 5:
        if (coll == Collective::kReduceScatter) {  // a 16-bit master of another 16-bit dtype
          ParamSpec& s = specs[rng() % specs.size()];
          s.dtype = pick(rng, {DType::kBF16, DType::kFP16});
          s.shard_dtype = s.dtype == DType::kBF16 ? DType::kFP16 : DType::kBF16;
          fault = "param '" + s.name + "' shard_dtype";
        }
        break;
      default: break;
    }
    const BucketLayout layout(specs, Topology::single_node(world));
    auto plan = [&] { return test::plan_for(coll, layout, rank, bucket, o); };
    if (!fault.empty()) {
      if (const std::string bad = expect_invalid(plan, fault); !bad.empty())
        t.fail(i, "fault in '" + fault + "': " + bad);
      continue;
    }
    try {
      const Program p = plan();
      if (p.rank != rank || p.world != world || p.bucket != bucket || p.collective != coll ||
          p.num_params != static_cast<int>(layout.num_params()) ||
          p.window_bytes != layout.window_bytes() || p.alignment != layout.alignment())
        t.fail(i, "program header disagrees with its arguments");
      validate_run(p, Bindings{std::vector<const void*>(p.num_params, &p),
                               std::vector<void*>(coll == Collective::kReduceScatter ? p.num_params : 0,
                                                  const_cast<Program*>(&p))},
                   rank, world, layout.window_bytes(), reinterpret_cast<void*>(uintptr_t{1} << 40));
    } catch (const std::exception& e) {
      t.fail(i, std::string("valid arguments rejected: ") + e.what());
    }
  }
}

// --- Executor inputs (validate_run) ------------------------------------------------------------

struct Pool {
  std::vector<BucketLayout> layouts;
  std::vector<std::pair<std::size_t, Program>> programs;  // (layout index, program)
};

const Pool& pool() {
  static const Pool p = [] {
    Pool p;
    Rng rng(fuzz_seed() + 2);
    test::BucketShape inner_dims{5, 1 << 10};
    inner_dims.inner_shard_dims = true;
    for (int world : {1, 2, 3, 4, 5, 8})
      for (int k = 0; k < 4; ++k)
        p.layouts.emplace_back(test::random_specs(rng, world, inner_dims), Topology::single_node(world));
    for (std::size_t l = 0; l < p.layouts.size(); ++l)
      for (int r = 0; r < p.layouts[l].world(); ++r)
        for (Collective c : {Collective::kAllGather, Collective::kReduceScatter})
          p.programs.emplace_back(l, test::plan_for(c, p.layouts[l], r, 7, random_options(rng)));
    return p;
  }();
  return p;
}

struct RunCase {
  Program program;
  Bindings bindings;
  int rank, world;
  std::size_t window_bytes;
  const void* window_base;
  std::string fault;  // the argument named, "" valid
};

const void* kBase = reinterpret_cast<const void*>(uintptr_t{1} << 40);  // aligned to anything

RunCase valid_run_case(Rng& rng, const Program& program) {
  RunCase c{program, {}, program.rank, program.world, program.window_bytes, kBase, ""};
  for (int i = 0; i < program.num_params; ++i)
    c.bindings.inputs.push_back(reinterpret_cast<const void*>(uintptr_t{0x10000} + 64 * i));
  if (program.collective == Collective::kReduceScatter)
    for (int i = 0; i < program.num_params; ++i)
      c.bindings.outputs.push_back(reinterpret_cast<void*>(uintptr_t{0x20000} + 64 * i));
  if (chance(rng, 0.3)) c.window_bytes += static_cast<std::size_t>(uniform(rng, 1, 4096));
  return c;
}

std::string step_name(std::size_t k) { return "steps[" + std::to_string(k) + "]"; }

// Corrupts one field of one step of c.program so that it is certainly invalid; returns the
// argument validate_run must name, or "" if this program has no step of the kind chosen.
std::string corrupt_step(Rng& rng, RunCase& c) {
  auto& steps = c.program.steps;
  const int world = c.world, rank = c.rank;
  const std::size_t wb = c.window_bytes;
  std::vector<std::size_t> of_kind;
  const int kind = static_cast<int>(rng() % 5);  // 0 copy, 1 cast, 2 signal/wait, 3 reduce, 4 phase
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const auto& op = steps[k].op;
    if ((kind == 0 && std::holds_alternative<CopyBatch>(op) && !std::get<CopyBatch>(op).copies.empty()) ||
        (kind == 1 && std::holds_alternative<CastOp>(op)) ||
        (kind == 2 && (std::holds_alternative<SignalOp>(op) || std::holds_alternative<WaitOp>(op))) ||
        (kind == 3 && std::holds_alternative<ReduceOp>(op)) || kind == 4)
      of_kind.push_back(k);
  }
  if (of_kind.empty()) return "";
  const std::size_t k = of_kind[rng() % of_kind.size()];
  const std::string at = step_name(k);
  Step& step = steps[k];
  auto bad_rank = [&] { return pick<int>(rng, {-1, world, world + 9, INT_MAX, INT_MIN}); };
  if (kind == 4) {
    step.phase = static_cast<Phase>(uniform(rng, 5, 255));
    return at + ".phase";
  }
  if (auto* batch = std::get_if<CopyBatch>(&step.op)) {
    const std::size_t j = rng() % batch->copies.size();
    CopyOp& cp = batch->copies[j];
    const std::string name = at + ".copies[" + std::to_string(j) + "]";
    const bool dst = chance(rng, 0.5);
    Address& a = dst ? cp.dst : cp.src;
    const std::string side = name + (dst ? ".dst" : ".src");
    switch (rng() % 5) {
      case 0: cp.bytes = pick<std::size_t>(rng, {(std::size_t{1} << 48) + 1, SIZE_MAX});
        return name + ".bytes";
      case 1: a.space = static_cast<Space>(uniform(rng, 4, 255)); return side + ".space";
      case 2:
        if (a.space != Space::kWindow) return "";
        a.index = bad_rank(); return side + ".index";
      case 3:
        if (a.space != Space::kWindow) return "";
        a.offset = pick<std::size_t>(rng, {wb - cp.bytes + 1, wb, SIZE_MAX - 3, std::size_t{1} << 47});
        if (cp.bytes == 0 && a.offset <= wb) return "";
        return side;
      default:
        if (!dst) return "";
        cp.dst.space = Space::kInput;
        cp.dst.index = 0;
        return side + ".space";
    }
  }
  if (auto* cast = std::get_if<CastOp>(&step.op)) {
    switch (rng() % 7) {
      case 0: cast->count = pick<int64_t>(rng, {-1, INT64_MIN, (int64_t{1} << 48) + 1}); return at + ".count";
      case 1: cast->pad = pick<int64_t>(rng, {-1, INT64_MIN, INT64_MAX}); return at + ".pad";
      case 2: cast->src_dtype = static_cast<DType>(uniform(rng, 5, 255)); return at + ".src_dtype";
      case 3: cast->dst_dtype = static_cast<DType>(uniform(rng, 5, 255)); return at + ".dst_dtype";
      case 4:  // any rank's window is a cast's to write (Delivery::kCastToPeers); no other buffer
        if (chance(rng, 0.5)) {
          cast->dst.index = bad_rank();
          return at + ".dst.index";
        }
        cast->dst.space = Space::kOutput;
        return at + ".dst";
      case 5: cast->dst.offset = wb; if (cast->count + cast->pad == 0) return ""; return at + ".dst";
      default: cast->src.index = pick<int>(rng, {-1, c.program.num_params, INT_MAX});
        return at + ".src.index";
    }
  }
  if (auto* signal = std::get_if<SignalOp>(&step.op)) {
    if (chance(rng, 0.5)) { signal->kind = static_cast<FlagKind>(uniform(rng, 2, 255)); return at + ".kind"; }
    signal->peer = chance(rng, 0.3) ? rank : bad_rank();
    return at + ".peer";
  }
  if (auto* wait = std::get_if<WaitOp>(&step.op)) {
    if (chance(rng, 0.5)) { wait->kind = static_cast<FlagKind>(uniform(rng, 2, 255)); return at + ".kind"; }
    wait->peer = chance(rng, 0.3) ? rank : bad_rank();
    return at + ".peer";
  }
  auto& reduce = std::get<ReduceOp>(step.op);
  switch (rng() % 7) {
    case 0: reduce.count = pick<int64_t>(rng, {-1, INT64_MIN, INT64_MAX}); return at + ".count";
    case 1: reduce.src_dtype = static_cast<DType>(uniform(rng, 5, 255)); return at + ".src_dtype";
    case 2: reduce.dst_dtype = static_cast<DType>(uniform(rng, 5, 255)); return at + ".dst_dtype";
    case 3: reduce.param = pick<int>(rng, {-1, c.program.num_params, INT_MAX}); return at + ".param";
    case 4:
      if (chance(rng, 0.5)) reduce.sources.pop_back(); else reduce.sources.push_back(reduce.sources[0]);
      return at + ".sources.size()";
    case 5: {
      const std::size_t j = rng() % reduce.sources.size();
      Address& a = reduce.sources[j];
      a.index = a.space == Space::kWindow ? bad_rank() : pick<int>(rng, {-1, c.program.num_params});
      return at + ".sources[" + std::to_string(j) + "].index";
    }
    default: reduce.dst.space = Space::kInput; return at + ".dst.space";
  }
}

// One fault in the program header, the bindings, the window, or a step.
std::string inject_run_fault(Rng& rng, RunCase& c) {
  switch (rng() % 12) {
    case 0: c.world += 1 + static_cast<int>(rng() % 3); return "program.world";
    case 1: c.rank += 1 + static_cast<int>(rng() % 7); return "program.rank";
    case 2: if (c.program.window_bytes == 0) return "";
      c.window_bytes = c.program.window_bytes - static_cast<std::size_t>(uniform(rng, 1, c.program.window_bytes));
      return "window data bytes";
    case 3:
      c.window_base = pick<const void*>(rng, {nullptr, static_cast<const char*>(kBase) + 16,
                                              static_cast<const char*>(kBase) + c.program.alignment / 2});
      return "window base";
    case 4: c.program.alignment = pick<std::size_t>(rng, {0, 3, 100, 257}); return "program.alignment";
    case 5: c.program.collective = static_cast<Collective>(uniform(rng, 2, 255)); return "program.collective";
    case 6:
      if (chance(rng, 0.5)) c.bindings.inputs.pop_back(); else c.bindings.inputs.push_back(kBase);
      return "inputs.size()";
    case 7:
      if (c.program.collective == Collective::kAllGather) c.bindings.outputs.push_back(nullptr);
      else if (chance(rng, 0.5)) c.bindings.outputs.pop_back(); else c.bindings.outputs.push_back(nullptr);
      return "outputs.size()";
    case 8: {  // null an input or output a step really reads or writes
      for (const Step& s : c.program.steps) {
        if (const auto* cast = std::get_if<CastOp>(&s.op); cast && cast->count > 0 && cast->src.space == Space::kInput) {
          c.bindings.inputs[cast->src.index] = nullptr;
          return "inputs[" + std::to_string(cast->src.index) + "]";
        }
        if (const auto* r = std::get_if<ReduceOp>(&s.op); r && r->count > 0) {
          c.bindings.outputs[r->dst.index] = nullptr;
          return "outputs[" + std::to_string(r->dst.index) + "]";
        }
      }
      return "";
    }
    case 9: c.program.num_params = -1 - static_cast<int>(rng() % 5); return "program.num_params";
    default: return corrupt_step(rng, c);
  }
}

TEST(Fuzz, ExecutorInputs) {
  Tally t{"validate_run: programs, bindings, windows", fuzz_seed() + 3};
  Rng rng(t.seed);
  const Pool& p = pool();
  const int n = scaled(40000);
  for (long i = 0; i < n; ++i, ++t.cases) {
    const Program& base = p.programs[rng() % p.programs.size()].second;
    RunCase c = valid_run_case(rng, base);
    if (chance(rng, 0.85)) {
      for (int attempt = 0; attempt < 20 && c.fault.empty(); ++attempt) {
        c = valid_run_case(rng, base);
        c.fault = inject_run_fault(rng, c);
      }
    }
    auto run = [&] { validate_run(c.program, c.bindings, c.rank, c.world, c.window_bytes, c.window_base); };
    if (c.fault.empty()) {
      try {
        run();
      } catch (const std::exception& e) {
        t.fail(i, std::string("valid program and bindings rejected: ") + e.what());
      }
    } else if (const std::string bad = expect_invalid(run, c.fault); !bad.empty()) {
      t.fail(i, "fault in '" + c.fault + "' of " + collective_name(base.collective) + " rank " +
                    std::to_string(base.rank) + "/" + std::to_string(base.world) + ": " + bad);
    }
  }
}

// --- verify_programs on corrupted sets -----------------------------------------------------------

void corrupt_anything(Rng& rng, std::vector<Program>& set) {
  Program& p = set[rng() % set.size()];
  if (p.steps.empty()) return;
  auto& steps = p.steps;
  const std::size_t k = rng() % steps.size();
  auto nudge = [&](auto& v) { v = static_cast<std::remove_reference_t<decltype(v)>>(
                                  static_cast<int64_t>(v) + pick<int64_t>(rng, {-1, 1, 2, -1000, 1 << 20})); };
  switch (rng() % 6) {
    case 0: steps.erase(steps.begin() + k); return;
    case 1: steps.insert(steps.begin() + k, steps[rng() % steps.size()]); return;
    case 2: std::swap(steps[k], steps[rng() % steps.size()]); return;
    case 3: p.rank = static_cast<int>(rng() % (p.world + 1)); return;
    default: break;
  }
  std::visit([&](auto& op) {
    using T = std::decay_t<decltype(op)>;
    if constexpr (std::is_same_v<T, CopyBatch>) {
      if (op.copies.empty()) return;
      CopyOp& c = op.copies[rng() % op.copies.size()];
      switch (rng() % 5) {
        case 0: nudge(c.bytes); break;
        case 1: nudge(c.dst.offset); break;
        case 2: nudge(c.src.offset); break;
        case 3: nudge(c.dst.index); break;
        default: c.src.space = static_cast<Space>(rng() % 4);
      }
    } else if constexpr (std::is_same_v<T, CastOp>) {
      switch (rng() % 5) {
        case 0: nudge(op.count); break;
        case 1: nudge(op.pad); break;
        case 2: nudge(op.dst.offset); break;
        case 3: op.src_dtype = static_cast<DType>(rng() % 5); break;
        default: op.dst.index = static_cast<int>(rng() % (p.world + 2)) - 1;
      }
    } else if constexpr (std::is_same_v<T, ReduceOp>) {
      switch (rng() % 5) {
        case 0: nudge(op.count); break;
        case 1: nudge(op.param); break;
        case 2: if (!op.sources.empty()) nudge(op.sources[rng() % op.sources.size()].offset); break;
        case 3: if (!op.sources.empty()) op.sources.pop_back(); break;
        default: op.dst.space = static_cast<Space>(rng() % 4);
      }
    } else if constexpr (std::is_same_v<T, NetSendOp> || std::is_same_v<T, NetRecvOp>) {
      if (chance(rng, 0.5)) nudge(op.peer); else nudge(op.bytes);
    } else {  // SignalOp, WaitOp
      if (chance(rng, 0.5)) nudge(op.peer); else op.kind = static_cast<FlagKind>(rng() % 3);
    }
  }, steps[k].op);
}

TEST(Fuzz, VerifierOnCorruptedProgramSets) {
  Tally t{"verify_programs on corrupted program sets", fuzz_seed() + 4};
  Rng rng(t.seed);
  const Pool& p = pool();
  const int n = scaled(10000);
  long accepted = 0;
  for (long i = 0; i < n; ++i, ++t.cases) {
    const BucketLayout& layout = p.layouts[rng() % p.layouts.size()];
    const Collective c = chance(rng, 0.5) ? Collective::kAllGather : Collective::kReduceScatter;
    std::vector<Program> set = plan_set(layout, c, 3, {});
    const int mutations = static_cast<int>(uniform(rng, 1, 3));
    for (int m = 0; m < mutations; ++m) corrupt_anything(rng, set);
    try {
      verify_programs(layout, set);
    } catch (const Error&) {
      continue;  // rejected, as it should be, with tide::Error
    } catch (const std::exception& e) {
      t.fail(i, std::string("verify_programs threw a non-tide exception: ") + e.what());
      continue;
    }
    // A harmless corruption (a no-op, or a swap of independent steps): every executor must take
    // it, and (for a sample) it must run to the right result.
    ++accepted;
    for (const Program& prog : set) {
      RunCase rc = valid_run_case(rng, prog);
      rc.window_bytes = layout.window_bytes();
      try {
        validate_run(prog, rc.bindings, prog.rank, prog.world, rc.window_bytes, rc.window_base);
      } catch (const std::exception& e) {
        t.fail(i, std::string("verify_programs accepted a program validate_run rejects: ") + e.what());
      }
    }
    if (accepted > 100) continue;
    std::vector<std::string> wrong(layout.world());
    try {
      harness::run_rank_threads_or_throw(layout.world(), [&](int rank, Bootstrap& bootstrap) {
        auto window = HostWindow::create(bootstrap, layout.window_bytes());
        HostExecutor executor(*window, std::chrono::milliseconds(10000));
        test::RankBuffers buffers(layout, c, rank, 40 + i);
        executor.run(set[rank], buffers.bindings);
        wrong[rank] = test::check_result(layout, c, rank, 40 + i, window->data(rank), buffers);
      });
    } catch (const std::exception& e) {
      wrong[0] = e.what();
    }
    for (const std::string& w : wrong)
      if (!w.empty()) t.fail(i, "a set verify_programs accepted ran wrong: " + w);
  }
  std::printf("[   FUZZ   ] corrupted sets the verifier accepted: %ld of %d\n", accepted, n);
}

// --- A real host executor ------------------------------------------------------------------------

TEST(Fuzz, HostExecutorRunsValidAndRejectsInvalidPrograms) {
  Tally t{"host executor (W = 1): valid runs checked, invalid runs rejected", fuzz_seed() + 5};
  Rng rng(t.seed);
  const int n = scaled(3000);
  harness::run_rank_threads_or_throw(1, [&](int, Bootstrap& bootstrap) {
    auto window = HostWindow::create(bootstrap, 1 << 22);
    HostExecutor executor(*window, std::chrono::milliseconds(5000));
    for (long i = 0; i < n; ++i, ++t.cases) {
      const BucketLayout layout(test::random_specs(rng, 1, 6, 1 << 14), Topology::single_node(1));
      const Collective coll = chance(rng, 0.5) ? Collective::kAllGather : Collective::kReduceScatter;
      const ReduceOptions o = random_options(rng);
      const uint64_t seed = rng();
      test::RankBuffers buffers(layout, coll, 0, seed);
      if (chance(rng, 0.5)) {
        std::memset(window->data(0), 0xA5, layout.window_bytes());
        for (auto& b : buffers.outputs) std::fill(b.bytes.begin(), b.bytes.end(), std::byte{0});
        ReduceOptions checked = o;
        checked.accumulate = false;  // outputs start at zero anyway; keep the fp64 reference simple
        try {
          executor.run(test::plan_for(coll, layout, 0, 1, checked), buffers.bindings);
          const std::string bad = test::check_result(layout, coll, 0, seed, window->data(0), buffers, checked);
          if (!bad.empty()) t.fail(i, bad);
        } catch (const std::exception& e) {
          t.fail(i, std::string("valid run failed: ") + e.what());
        }
        continue;
      }
      RunCase c = valid_run_case(rng, test::plan_for(coll, layout, 0, 1, o));
      c.bindings = buffers.bindings;
      c.window_bytes = window->data_bytes();
      for (int attempt = 0; attempt < 20 && c.fault.empty(); ++attempt) {
        RunCase d = c;
        d.fault = inject_run_fault(rng, d);
        // Only what an executor can be handed: its own rank, world and window.
        if (d.fault == "program.world" || d.fault == "program.rank" || d.fault == "window base" ||
            d.fault == "window data bytes")
          d.fault.clear();
        if (!d.fault.empty()) c = std::move(d);
      }
      if (c.fault.empty()) continue;
      const uint64_t epoch = window->epoch();
      const std::string bad = expect_invalid([&] { executor.run(c.program, c.bindings); }, c.fault);
      if (!bad.empty()) t.fail(i, "fault in '" + c.fault + "': " + bad);
      if (window->epoch() != epoch) t.fail(i, "a rejected run consumed an epoch");
    }
  });
}

}  // namespace
}  // namespace tide
