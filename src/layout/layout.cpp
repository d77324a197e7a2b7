#include "tide/layout.hpp"

#include <algorithm>
#include <sstream>

#include "common/round_up.hpp"
#include "tide/error.hpp"

namespace tide {

Topology Topology::single_node(int world) {
  Topology t{1, world};
  t.validate();
  return t;
}

void Topology::validate() const {
  TIDE_CHECK_ARG(nodes >= 1, "Topology", "nodes", nodes, ">= 1");
  TIDE_CHECK_ARG(local >= 1, "Topology", "local", local, ">= 1");
  TIDE_CHECK_ARG(static_cast<int64_t>(nodes) * local <= (1 << 20), "Topology", "nodes * local",
                 static_cast<int64_t>(nodes) * local, "<= 1048576");
}

int64_t ParamLayout::valid_rows(int rank) const {
  const int64_t start = rank * rows_per_rank;
  if (start >= shard_dim_size) return 0;
  return std::min(rows_per_rank, shard_dim_size - start);
}

static std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (std::size_t k = 0; k < shape.size(); ++k) os << (k ? ", " : "") << shape[k];
  os << ']';
  return os.str();
}

BucketLayout::BucketLayout(std::vector<ParamSpec> specs, Topology topology, std::size_t alignment)
    : topology_(topology), alignment_(alignment) {
  topology_.validate();
  TIDE_CHECK_ARG(!specs.empty(), "BucketLayout", "params", "an empty list", "at least one param");
  TIDE_CHECK_ARG(alignment >= kMinAlignment && alignment <= kMaxAlignment &&
                     (alignment & (alignment - 1)) == 0,
                 "BucketLayout", "alignment", alignment, "a power of two >= 256 and <= 2^30");
  const int world = topology_.world();
  std::size_t offset = 0;
  params_.reserve(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    ParamSpec& spec = specs[i];
    const std::string where = detail::concat("BucketLayout: param ", i, " ('", spec.name, "')");
    const int ndim = static_cast<int>(spec.shape.size());
    TIDE_CHECK_ARG(spec.shard_dim == 0 || (spec.shard_dim > 0 && spec.shard_dim < ndim), where,
                   "shard_dim", spec.shard_dim,
                   detail::concat("in [0, ", std::max(ndim, 1), ") for shape ", shape_string(spec.shape)));
    // Products of the dims before, at and after the shard dim, each checked against 2^40 elements
    // as it grows (so is the whole: O * d * R below).
    int64_t outer = 1, row_numel = 1;
    for (int k = 0; k < ndim; ++k) {
      TIDE_CHECK_ARG(spec.shape[k] > 0, where, detail::concat("shape[", k, "]"), spec.shape[k],
                     "> 0");
      if (k == spec.shard_dim) continue;
      int64_t& product = k < spec.shard_dim ? outer : row_numel;
      TIDE_CHECK_ARG(product <= (int64_t{1} << 40) / spec.shape[k], where, "shape",
                     shape_string(spec.shape), "fewer than 2^40 elements");
      product *= spec.shape[k];
    }
    auto known = [](DType d) { return is_float(d) || d == DType::kU8 || d == DType::kE4M3; };
    TIDE_CHECK_ARG(known(spec.dtype), where, "dtype", static_cast<int>(spec.dtype),
                   "bf16, fp16, fp32, u8 or e4m3");
    TIDE_CHECK_ARG(known(spec.shard_dtype), where, "shard_dtype", static_cast<int>(spec.shard_dtype),
                   "bf16, fp16, fp32 or u8");
    // Bytes are copied, never cast: a u8 param's shard is u8 too. A float's or an e4m3's shard is a
    // float (an e4m3 param is cast from its float shard, scaled).
    TIDE_CHECK_ARG(spec.dtype == DType::kU8 ? spec.shard_dtype == DType::kU8 : is_float(spec.shard_dtype),
                   where, "shard_dtype", dtype_name(spec.shard_dtype),
                   detail::concat(spec.dtype == DType::kU8 ? "u8" : "bf16, fp16 or fp32",
                                  " for a ", dtype_name(spec.dtype), " param"));
    ParamLayout p;
    p.name = spec.name;
    p.shape = spec.shape;
    p.dtype = spec.dtype;
    p.shard_dtype = spec.shard_dtype;
    p.shard_dim = spec.shard_dim;
    p.shard_dim_size = ndim == 0 ? 1 : spec.shape[spec.shard_dim];
    p.outer_rows = outer;
    p.row_numel = row_numel;
    TIDE_CHECK_ARG(outer <= (int64_t{1} << 40) / row_numel &&
                       p.shard_dim_size <= (int64_t{1} << 40) / (outer * row_numel),
                   where, "shape", shape_string(spec.shape), "fewer than 2^40 elements");
    // FSDP2 pads only dim 0; on another dim every rank holds d / W slices, contiguous.
    TIDE_CHECK_ARG(spec.shard_dim == 0 || p.shard_dim_size % world == 0, where,
                   detail::concat("shape[", spec.shard_dim, "] (shard_dim ", spec.shard_dim, ")"),
                   p.shard_dim_size,
                   detail::concat("a multiple of W = ", world,
                                  " (FSDP2 shards dims other than 0 evenly only)"));
    p.rows_per_rank = (p.shard_dim_size + world - 1) / world;
    p.shard_numel = outer * p.rows_per_rank * row_numel;
    p.elem_size = dtype_size(spec.dtype);
    p.window_offset = offset;
    p.block_pitch = static_cast<std::size_t>(world) * p.block_bytes();
    // Each term is < 2^63 (slot < 2^42 B, W <= 2^20), so only the running sum needs a check.
    const std::size_t param_bytes = static_cast<std::size_t>(world) * p.slot_bytes();
    TIDE_CHECK_ARG(param_bytes <= kMaxWindowBytes - offset &&
                       detail::round_up(offset + param_bytes, alignment_) <= kMaxWindowBytes,
                   where, "window bytes up to this param",
                   detail::concat(offset, " + ", param_bytes),
                   detail::concat("<= 2^48 per rank (W = ", world, ")"));
    offset = detail::round_up(offset + param_bytes, alignment_);
    params_.push_back(std::move(p));
  }
  window_bytes_ = offset;
}

const ParamLayout& BucketLayout::param(std::size_t i) const {
  TIDE_CHECK_ARG(i < params_.size(), "BucketLayout::param", "i", i,
                 detail::concat("< ", params_.size()));
  return params_[i];
}

bool BucketLayout::has_inner_shard_dims() const {
  return std::any_of(params_.begin(), params_.end(), [](const ParamLayout& p) { return p.shard_dim > 0; });
}

std::pair<int, int> BucketLayout::locate(std::size_t offset) const {
  const auto it = std::upper_bound(params_.begin(), params_.end(), offset,
                                   [](std::size_t o, const ParamLayout& p) { return o < p.window_offset; });
  if (it == params_.begin()) return {-1, -1};
  const int i = static_cast<int>(it - params_.begin()) - 1;
  const std::size_t rel = offset - params_[i].window_offset;
  if (rel >= world() * params_[i].slot_bytes()) return {-1, -1};
  return {i, static_cast<int>(rel / params_[i].slot_bytes())};
}

std::string BucketLayout::describe() const {
  std::ostringstream os;
  os << "bucket: " << params_.size() << " params, W = " << world() << " (" << topology_.nodes
     << " node(s) x " << topology_.local << "), window " << window_bytes_ << " B per rank\n";
  for (const ParamLayout& p : params_) {
    os << "  " << (p.name.empty() ? "<unnamed>" : p.name) << " " << shape_string(p.shape) << " "
       << dtype_name(p.dtype) << "/" << dtype_name(p.shard_dtype);
    if (p.shard_dim > 0) os << " on dim " << p.shard_dim << " (" << p.outer_rows << " outer rows)";
    os << ": c = " << p.rows_per_rank << " rows, S = " << p.shard_numel << " elems, offset " << p.window_offset << ", slots "
       << world() << " x " << p.slot_bytes() << " B\n";
  }
  return os.str();
}

}  // namespace tide
