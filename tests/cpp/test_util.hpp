// Shared test helpers: random buckets, deterministic per-rank data, references (the rank runners
// are testing/rank_runner.hpp).
#pragma once

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "tide/tide.hpp"

namespace tide::test {

// A random bucket: shapes include 0-d, 1-d, d0 = 1, d0 < W, d0 not divisible by W, wide rows,
// and mixed bf16 / fp16 / fp32 params (sharded masters in fp32 or in the param's own dtype).
// How large a random bucket may be; the GPU tests ask for longer rows and more wide ones, which
// reach the kernels' 16-byte vector paths.
struct BucketShape {
  int max_params = 6;
  int64_t max_numel = 1 << 16;   // per param
  int64_t max_row_multiple = 4;  // d0 = W * [1, this] in the "multiple of W" case
  int64_t extra_rows = 40;       // d0 in [1, 3W + this] in the general case
  int wide_one_in = 10;          // a trailing dim is wide with probability 1/this
  int64_t wide_min = 512;        // wide dims in [wide_min, 4096]
  int64_t narrow_max = 24;       // other dims in [1, narrow_max]
  // Half the params of 2 or more dims sharded on a dim k > 0 (FSDP2's shard_placement_fn), with
  // shape[k] = W * [1, 3] and narrow other dims.
  bool inner_shard_dims = false;
};

inline std::vector<ParamSpec> random_specs(std::mt19937_64& rng, int world, const BucketShape& b) {
  std::uniform_int_distribution<int> n_params(1, b.max_params);
  const int64_t max_numel = b.max_numel;
  std::vector<ParamSpec> specs(n_params(rng));
  for (std::size_t i = 0; i < specs.size(); ++i) {
    ParamSpec& s = specs[i];
    s.name = "p" + std::to_string(i);
    const int ndim = std::uniform_int_distribution<int>(0, 3)(rng);
    int64_t d0 = 1;
    switch (std::uniform_int_distribution<int>(0, 4)(rng)) {
      case 0: d0 = 1; break;
      case 1: d0 = std::uniform_int_distribution<int64_t>(1, std::max(1, world - 1))(rng); break;
      case 2: d0 = world * std::uniform_int_distribution<int64_t>(1, b.max_row_multiple)(rng); break;
      default: d0 = std::uniform_int_distribution<int64_t>(1, 3 * world + b.extra_rows)(rng);
    }
    if (ndim > 0) s.shape.push_back(d0);
    int64_t numel = ndim > 0 ? d0 : 1;
    for (int k = 1; k < ndim; ++k) {
      const bool wide = std::uniform_int_distribution<int>(0, b.wide_one_in - 1)(rng) == 0;
      int64_t d = wide ? std::uniform_int_distribution<int64_t>(b.wide_min, 4096)(rng)
                       : std::uniform_int_distribution<int64_t>(1, b.narrow_max)(rng);
      d = std::max<int64_t>(1, std::min<int64_t>(d, max_numel / numel));
      s.shape.push_back(d);
      numel *= d;
    }
    if (b.inner_shard_dims && ndim >= 2 && std::uniform_int_distribution<int>(0, 1)(rng) == 1) {
      s.shard_dim = std::uniform_int_distribution<int>(1, ndim - 1)(rng);
      for (int k = 0; k < ndim; ++k)
        s.shape[k] = k == s.shard_dim ? world * std::uniform_int_distribution<int64_t>(1, 3)(rng)
                                      : std::uniform_int_distribution<int64_t>(1, b.narrow_max)(rng);
    }
    const DType dtypes[] = {DType::kBF16, DType::kBF16, DType::kFP16, DType::kFP32};
    s.dtype = dtypes[std::uniform_int_distribution<int>(0, 3)(rng)];
    s.shard_dtype = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? s.dtype : DType::kFP32;
  }
  return specs;
}

inline std::vector<ParamSpec> random_specs(std::mt19937_64& rng, int world, int max_params = 6,
                                           int64_t max_numel = 1 << 16) {
  return random_specs(rng, world, BucketShape{max_params, max_numel});
}

// Deterministic values in [-1, 1) from (seed, param, rank, element): every rank can compute every
// other rank's data, so processes need not exchange anything to check results.
inline float value_at(uint64_t seed, int param, int rank, int64_t k) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (uint64_t(param) << 40) ^ (uint64_t(rank) << 20) ^
               uint64_t(k) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31; x *= 0x94D049BB133111EBull; x ^= x >> 29;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / float(1 << 23);
}

// Where element k of rank's shard (FSDP2's chunk `rank` of the param along its shard dim,
// contiguous) sits in the unsharded param: unravel k in the shard's shape, offset the shard dim by
// rank * c, ravel in the full shape. Derived from the shapes alone, not from the layout's blocks.
inline int64_t unsharded_index(const ParamLayout& p, int rank, int64_t k) {
  const int ndim = static_cast<int>(p.shape.size());
  std::vector<int64_t> index(ndim);
  for (int d = ndim - 1; d >= 0; --d) {
    const int64_t extent = d == p.shard_dim ? p.rows_per_rank : p.shape[d];
    index[d] = k % extent;
    k /= extent;
  }
  int64_t flat = 0;
  for (int d = 0; d < ndim; ++d)
    flat = flat * p.shape[d] + index[d] + (d == p.shard_dim ? rank * p.rows_per_rank : 0);
  return ndim == 0 ? k : flat;
}

// A typed buffer holding `n` elements of `dtype` filled from value_at (rounded to dtype).
struct Buffer {
  DType dtype;
  std::vector<std::byte> bytes;
  Buffer(DType d, int64_t n) : dtype(d), bytes(std::max<int64_t>(n, 1) * dtype_size(d)) {}
  void* data() { return bytes.data(); }
  float at(int64_t k) const { return load_as_float(bytes.data(), dtype, k); }
};

// All-gather input of `rank` for param i: its valid rows of the full param, in shard_dtype.
inline Buffer ag_shard(const ParamLayout& p, int param, int rank, uint64_t seed) {
  Buffer b(p.shard_dtype, p.valid_numel(rank));
  for (int64_t k = 0; k < p.valid_numel(rank); ++k)
    store_from_float(b.data(), p.shard_dtype, k, value_at(seed, param, 0, unsharded_index(p, rank, k)));
  return b;
}

// What every rank's window must hold for param i after the all-gather: the unsharded param, then
// zeros to the end of its W slots (dim-0 padding).
inline std::vector<std::byte> ag_expected(const ParamLayout& p, int param, int world, uint64_t seed) {
  std::vector<std::byte> out(world * p.slot_bytes(), std::byte{0});
  for (int r = 0; r < world; ++r) {
    const Buffer shard = ag_shard(p, param, r, seed);
    for (int64_t k = 0; k < p.valid_numel(r); ++k)
      store_from_float(out.data(), p.dtype, unsharded_index(p, r, k), shard.at(k));
  }
  return out;
}

// Reduce-scatter input of `rank` for param i: a full gradient in the param's dtype.
inline Buffer rs_grad(const ParamLayout& p, int param, int rank, uint64_t seed) {
  Buffer b(p.dtype, p.numel());
  for (int64_t k = 0; k < p.numel(); ++k)
    store_from_float(b.data(), p.dtype, k, value_at(seed, param, rank + 1, k));
  return b;
}

// fp64 reference of rank `rank`'s reduce-scatter output for param i (before any accumulate).
// The reduce-scatter's result in fp64 or, with `magnitude`, the same sum over absolute terms.
inline std::vector<double> rs_reference(const ParamLayout& p, int param, int rank, int world,
                                        uint64_t seed, const ReduceOptions& o, bool magnitude = false) {
  std::vector<double> out(p.valid_numel(rank), 0.0);
  for (int src = 0; src < world; ++src) {
    Buffer g = rs_grad(p, param, src, seed);
    for (int64_t k = 0; k < p.valid_numel(rank); ++k) {
      const double term = double(o.prescale) * g.at(unsharded_index(p, rank, k));
      out[k] += magnitude ? std::abs(term) : term;
    }
  }
  const double scale = o.kind == ReduceKind::kAvg ? double(o.postscale) / world : o.postscale;
  for (double& v : out) v *= magnitude ? std::abs(scale) : scale;
  return out;
}

// ||a - b|| / ||b|| (0 when both are empty or zero).
inline double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t k = 0; k < a.size(); ++k) num += (a[k] - b[k]) * (a[k] - b[k]), den += b[k] * b[k];
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// One rank's inputs and outputs for one collective of `layout`, filled from value_at(seed), and
// the bindings over them (stable: the buffers' storage never moves).
struct RankBuffers {
  std::vector<Buffer> inputs, outputs;
  Bindings bindings;
  RankBuffers(const BucketLayout& layout, Collective c, int rank, uint64_t seed) {
    for (std::size_t i = 0; i < layout.num_params(); ++i) {
      const ParamLayout& p = layout.param(i);
      if (c == Collective::kAllGather) {
        inputs.push_back(ag_shard(p, int(i), rank, seed));
      } else {
        inputs.push_back(rs_grad(p, int(i), rank, seed));
        outputs.emplace_back(p.shard_dtype, p.valid_numel(rank));
      }
    }
    for (auto& b : inputs) bindings.inputs.push_back(b.data());
    for (auto& b : outputs) bindings.outputs.push_back(b.data());
  }
  RankBuffers(const RankBuffers&) = delete;
  RankBuffers& operator=(const RankBuffers&) = delete;
  RankBuffers(RankBuffers&&) = default;
};

// All-gathers delivered as `delivery` says (unset: default_delivery(layout)).
inline Program plan_for(Collective c, const BucketLayout& layout, int rank, uint32_t bucket,
                        const ReduceOptions& o = {}, std::optional<Delivery> delivery = {}) {
  const Delivery d = delivery.value_or(default_delivery(layout));
  return c == Collective::kAllGather ? plan_all_gather(layout, rank, bucket, AcrossNodesOptions{}, d)
                                     : plan_reduce_scatter(layout, rank, o, bucket, AcrossNodesOptions{}, d);
}

// Every rank's program of collective c (bucket 5), pushed unless `delivery` says otherwise.
inline std::vector<Program> plan_all(const BucketLayout& layout, Collective c, const ReduceOptions& o = {},
                                     Delivery delivery = Delivery::kPush) {
  std::vector<Program> programs;
  for (int r = 0; r < layout.world(); ++r) programs.push_back(plan_for(c, layout, r, 5, o, delivery));
  return programs;
}

// "" if rank's result of collective c (seed, options o) is right: all-gather bitwise in `window`,
// reduce-scatter outputs within 1e-6 (fp32) / 1e-2 (16-bit outputs) of fp64 in norm; with
// `lossy_unit` > 0 (bf16 partials on the wire) each element within lossy_unit x the sum of its
// terms' magnitudes instead (a norm-wise bound fails under cancellation); else what is wrong.
inline std::string check_result(const BucketLayout& layout, Collective c, int rank, uint64_t seed,
                                const std::byte* window, const RankBuffers& buffers,
                                const ReduceOptions& o = {}, double lossy_unit = 0) {
  for (std::size_t i = 0; i < layout.num_params(); ++i) {
    const ParamLayout& p = layout.param(i);
    if (c == Collective::kAllGather) {
      const auto expected = ag_expected(p, int(i), layout.world(), seed);
      if (std::memcmp(window + p.window_offset, expected.data(), expected.size()) != 0)
        return "all-gather mismatch on param " + std::to_string(i) + " of rank " +
               std::to_string(rank);
    } else {
      const auto ref = rs_reference(p, int(i), rank, layout.world(), seed, o);
      std::vector<double> got(ref.size());
      for (std::size_t k = 0; k < ref.size(); ++k) got[k] = buffers.outputs[i].at(k);
      if (lossy_unit > 0) {
        const auto magnitude = rs_reference(p, int(i), rank, layout.world(), seed, o, true);
        for (std::size_t k = 0; k < ref.size(); ++k)
          if (!(std::abs(got[k] - ref[k]) <= lossy_unit * magnitude[k] + 1e-30))
            return "reduce-scatter mismatch on param " + std::to_string(i) + " of rank " +
                   std::to_string(rank) + " element " + std::to_string(k) + ": got " +
                   std::to_string(got[k]) + ", fp64 " + std::to_string(ref[k]);
        continue;
      }
      const double tol = p.shard_dtype == DType::kFP32 ? 1e-6 : 1e-2;
      const double error = relative_error(got, ref);
      if (error > tol)
        return "reduce-scatter mismatch on param " + std::to_string(i) + " of rank " +
               std::to_string(rank) + ": relative error " + std::to_string(error) + " > " +
               std::to_string(tol);
    }
  }
  return "";
}

}  // namespace tide::test
