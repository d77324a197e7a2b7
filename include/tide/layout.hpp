// layout: FSDP2's dim-0 sharding, and the param-major window that folds it into addressing.
//
// A bucket is one FSDP2 param group. Every param i is sharded on dim 0 exactly as FSDP2 does it:
// each rank holds c_i = ceil(d0_i / W) rows (trailing ranks short or empty, zero padded), i.e. a
// padded shard of S_i = c_i * R_i elements (R_i = product of the other dims). The bucket's window
// is laid out param-major:
//
//   offset(i)   = align(offset(i-1) + W * S_{i-1} * elem_size_{i-1})     (alignment >= 256 B)
//   param i     = window[offset(i), offset(i) + d0_i * R_i elements)      -- its unsharded storage
//   slot(i, r)  = window[offset(i) + r * S_i, offset(i) + (r+1) * S_i)   -- rank r's rows
//
// so the all-gather's output *is* every param's unsharded storage, and a slot vacated by the
// all-gather is where the reduce-scatter stages rank r's gradient chunk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tide/dtype.hpp"

namespace tide {

// W = nodes x local ranks; rank = node * local + local_rank. Single node is nodes == 1.
struct Topology {
  int nodes = 1;
  int local = 1;

  static Topology single_node(int world);
  int world() const { return nodes * local; }
  int node_of(int rank) const { return rank / local; }
  int local_rank_of(int rank) const { return rank % local; }
  void validate() const;  // throws InvalidArgument
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;         // unsharded shape; {} is a 0-d tensor
  DType dtype = DType::kBF16;         // unsharded / communication dtype: what the window holds
  DType shard_dtype = DType::kFP32;   // sharded master dtype: all-gather input, reduce-scatter output
};

struct ParamLayout {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype;
  DType shard_dtype;
  int64_t dim0;           // d0 (1 for a 0-d tensor)
  int64_t row_numel;      // R
  int64_t rows_per_rank;  // c = ceil(d0 / W)
  int64_t shard_numel;    // S = c * R
  std::size_t elem_size;  // of dtype
  std::size_t window_offset;  // bytes, aligned

  int64_t numel() const { return dim0 * row_numel; }
  int64_t valid_rows(int rank) const;   // rows rank really owns (<= c, may be 0)
  int64_t valid_numel(int rank) const { return valid_rows(rank) * row_numel; }
  std::size_t slot_bytes() const { return static_cast<std::size_t>(shard_numel) * elem_size; }
  std::size_t slot_offset(int rank) const { return window_offset + rank * slot_bytes(); }
  std::size_t unsharded_bytes() const { return static_cast<std::size_t>(numel()) * elem_size; }
};

class BucketLayout {
 public:
  static constexpr std::size_t kMinAlignment = 256;
  static constexpr std::size_t kMaxAlignment = std::size_t{1} << 30;
  // No window (per rank) may exceed this: keeps every offset computation far from overflow.
  static constexpr std::size_t kMaxWindowBytes = std::size_t{1} << 48;

  // Throws InvalidArgument on an empty bucket, a non-positive dim, an unknown dtype, a bad topology
  // or alignment (a power of two in [256 B, 1 GiB]), or a window over kMaxWindowBytes.
  BucketLayout(std::vector<ParamSpec> params, Topology topology,
               std::size_t alignment = kMinAlignment);

  const Topology& topology() const { return topology_; }
  int world() const { return topology_.world(); }
  std::size_t alignment() const { return alignment_; }
  const std::vector<ParamLayout>& params() const { return params_; }
  const ParamLayout& param(std::size_t i) const;
  std::size_t num_params() const { return params_.size(); }
  // Bytes of data in one rank's window (a multiple of the alignment).
  std::size_t window_bytes() const { return window_bytes_; }
  // The (param, slot) a window byte offset falls in, or {-1, -1} in alignment padding or past the
  // last param.
  std::pair<int, int> locate(std::size_t offset) const;
  // One line per param: name, shape, dtype, c, S, offset, bytes.
  std::string describe() const;

 private:
  Topology topology_;
  std::size_t alignment_;
  std::vector<ParamLayout> params_;
  std::size_t window_bytes_ = 0;
};

}  // namespace tide
