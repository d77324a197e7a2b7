// layout: FSDP2's sharding, and the param-major window that folds it into addressing.
//
// A bucket is one FSDP2 param group. Every param i is sharded on its shard dim k (FSDP2's
// Shard(k); 0 unless shard_placement_fn says otherwise) exactly as FSDP2 does it. With
// d = shape[k], O = prod(shape[:k]) "outer rows" (1 for k = 0) and R = prod(shape[k+1:]), each rank
// holds c = ceil(d / W) of the d slices (trailing ranks short or empty, zero padded; FSDP2 allows
// that on dim 0 only, and k > 0 needs d % W == 0), i.e. a padded shard of S = O * c * R elements,
// contiguous. In the unsharded param, rank r's part is its *block*: O rows of I = c * R elements,
// the first at element r * I, one every W * I elements (for k = 0 one row: the rank's rows).
//
// The bucket's window is laid out param-major:
//
//   offset(i)   = align(offset(i-1) + W * S_{i-1} * elem_size_{i-1})     (alignment >= 256 B)
//   param i     = window[offset(i), offset(i) + numel_i elements)        -- its unsharded storage
//   block(i, r) = O_i rows of I_i elements at offset(i) + r * I_i, pitch W * I_i   -- all-gather
//   slot(i, r)  = window[offset(i) + r * S_i, offset(i) + (r+1) * S_i)   -- reduce-scatter staging
//
// so the all-gather's output *is* every param's unsharded storage, and the window it vacates is
// where the reduce-scatter stages rank r's gradient chunk, contiguously in slot(i, r). For k = 0 a
// block is the slot.
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
  int shard_dim = 0;                  // FSDP2's Shard(k): in [0, ndim) (0 for a 0-d tensor)
};

struct ParamLayout {
  std::string name;
  std::vector<int64_t> shape;
  DType dtype;
  DType shard_dtype;
  int shard_dim;               // k
  int64_t shard_dim_size;      // d = shape[k] (1 for a 0-d tensor)
  int64_t outer_rows;          // O = prod(shape[:k]) (1 for k = 0)
  int64_t row_numel;           // R = prod(shape[k+1:])
  int64_t rows_per_rank;       // c = ceil(d / W) (d / W for k > 0)
  int64_t shard_numel;         // S = O * c * R
  std::size_t elem_size;       // of dtype
  std::size_t window_offset;   // bytes, aligned
  std::size_t block_pitch;     // bytes between a block's rows: W * c * R * elem_size

  int64_t numel() const { return outer_rows * shard_dim_size * row_numel; }
  int64_t valid_rows(int rank) const;   // slices of dim k rank really owns (<= c, may be 0)
  int64_t valid_numel(int rank) const { return outer_rows * valid_rows(rank) * row_numel; }
  std::size_t slot_bytes() const { return static_cast<std::size_t>(shard_numel) * elem_size; }
  std::size_t slot_offset(int rank) const { return window_offset + rank * slot_bytes(); }
  // One row of a block (I elements), and where rank r's block starts.
  std::size_t block_bytes() const { return static_cast<std::size_t>(rows_per_rank * row_numel) * elem_size; }
  std::size_t block_offset(int rank) const { return window_offset + rank * block_bytes(); }
  std::size_t unsharded_bytes() const { return static_cast<std::size_t>(numel()) * elem_size; }
};

class BucketLayout {
 public:
  static constexpr std::size_t kMinAlignment = 256;
  static constexpr std::size_t kMaxAlignment = std::size_t{1} << 30;
  // No window (per rank) may exceed this: keeps every offset computation far from overflow.
  static constexpr std::size_t kMaxWindowBytes = std::size_t{1} << 48;

  // Throws InvalidArgument on an empty bucket, a non-positive dim, an unknown dtype, a shard dim
  // outside the shape, a dim k > 0 that W does not divide, a bad topology or alignment (a power of
  // two in [256 B, 1 GiB]), or a window over kMaxWindowBytes.
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
  // Whether some param is sharded on a dim other than 0.
  bool has_inner_shard_dims() const;
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
