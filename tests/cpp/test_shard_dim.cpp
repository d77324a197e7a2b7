// Shard(k) for k > 0 (FSDP2's shard_placement_fn): each rank's shard is a strided block of the
// unsharded param (O rows of I elements, pitch W * I). The layout's blocks against FSDP2's chunking,
// the programs' 2-D copies and strided casts, the verifier's rejection of broken ones, and the host
// executor's results element by element, in params mixed with dim-0 ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "rank_runner.hpp"
#include "test_util.hpp"

namespace tide {
namespace {

ParamSpec spec(std::string name, std::vector<int64_t> shape, int shard_dim, DType dtype = DType::kBF16,
               DType shard_dtype = DType::kFP32) {
  return {std::move(name), std::move(shape), dtype, shard_dtype, shard_dim};
}

using test::plan_all;  // pushed unless told otherwise

// A bucket of every kind: dim 0 (padded), dim 1 of a matrix, dims 1 and 2 of a grouped expert
// tensor [E, d, h], bf16 from fp32 and fp32 from fp32.
BucketLayout mixed_bucket(int world, DType dtype = DType::kBF16) {
  return BucketLayout({spec("embed", {7, 5}, 0, dtype), spec("w1", {3, 4 * world}, 1, dtype),
                       spec("experts_d", {2, 2 * world, 3}, 1, dtype),
                       spec("experts_h", {2, 3, world}, 2, DType::kFP32),
                       spec("norm", {5}, 0, DType::kFP32)},
                      Topology::single_node(world));
}

TEST(ShardDimLayout, BlocksOfAMatrixShardedOnDim1) {
  BucketLayout layout({spec("w", {6, 8, 5}, 1)}, Topology::single_node(4));
  const ParamLayout& p = layout.param(0);
  EXPECT_EQ(p.shard_dim, 1);
  EXPECT_EQ(p.shard_dim_size, 8);
  EXPECT_EQ(p.outer_rows, 6);
  EXPECT_EQ(p.rows_per_rank, 2);
  EXPECT_EQ(p.row_numel, 5);
  EXPECT_EQ(p.shard_numel, 60);
  EXPECT_EQ(p.block_bytes(), 20u);  // I = 2 * 5 elements of bf16
  EXPECT_EQ(p.block_pitch, 80u);
  EXPECT_EQ(p.block_offset(3), 60u);
  EXPECT_EQ(p.slot_offset(3), 360u);
  EXPECT_EQ(4 * p.slot_bytes(), p.unsharded_bytes());  // even: no padding
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p.valid_numel(r), 60);
  EXPECT_NE(layout.describe().find("on dim 1 (6 outer rows)"), std::string::npos) << layout.describe();
}

// Every element of every rank's shard (FSDP2's chunk along the shard dim) lies in that rank's
// block, and the blocks of all ranks cover the param exactly once.
TEST(ShardDimLayout, BlocksTileTheParamAsFsdp2ChunksIt) {
  const std::vector<std::vector<int64_t>> shapes = {{4, 12}, {3, 12, 5}, {2, 3, 12}, {12, 1, 12}, {1, 12}};
  for (int world : {2, 3, 4})
    for (const auto& shape : shapes)
      for (int dim = 1; dim < static_cast<int>(shape.size()); ++dim)
        for (DType dtype : {DType::kBF16, DType::kFP32}) {
          if (shape[dim] % world != 0) continue;  // rejected (below)
          BucketLayout layout({spec("w", shape, dim, dtype)}, Topology::single_node(world));
          const ParamLayout& p = layout.param(0);
          const int64_t block = p.rows_per_rank * p.row_numel;
          std::vector<int> owners(p.numel(), 0);
          for (int r = 0; r < world; ++r)
            for (int64_t k = 0; k < p.shard_numel; ++k) {
              const int64_t at = test::unsharded_index(p, r, k);
              const std::size_t bytes = at * p.elem_size;
              ASSERT_EQ(bytes, p.block_offset(r) - p.window_offset + (k / block) * p.block_pitch +
                                   (k % block) * p.elem_size)
                  << "W=" << world << " dim " << dim << " rank " << r << " k " << k;
              ++owners[at];
            }
          for (int n : owners) ASSERT_EQ(n, 1);
        }
}

TEST(ShardDimLayout, UnevenOrOutOfRangeShardDimsAreRejectedByName) {
  auto message = [](std::vector<ParamSpec> specs, int world) {
    try {
      BucketLayout layout(std::move(specs), Topology::single_node(world));
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string uneven = message({spec("experts", {4, 6, 8}, 1)}, 4);
  EXPECT_NE(uneven.find("param 0 ('experts')"), std::string::npos) << uneven;
  EXPECT_NE(uneven.find("shape[1] (shard_dim 1) = 6, expected a multiple of W = 4"), std::string::npos)
      << uneven;
  const std::string past = message({spec("w", {4, 8}, 2)}, 2);
  EXPECT_NE(past.find("shard_dim = 2, expected in [0, 2) for shape [4, 8]"), std::string::npos) << past;
  EXPECT_NE(message({spec("w", {4, 8}, -1)}, 2).find("shard_dim = -1"), std::string::npos);
  EXPECT_NE(message({spec("scalar", {}, 1)}, 2).find("shard_dim = 1"), std::string::npos);
  EXPECT_EQ(message({spec("w", {3, 8}, 1)}, 2), "accepted");  // dim 0 need not divide
}

TEST(ShardDimPlan, AllGatherCastsIntoTheStridedBlockAndPushesIt) {
  BucketLayout layout({spec("w", {4, 6}, 1)}, Topology::single_node(3));  // I = 2, pitch 12 B
  const Program p = plan_all_gather(layout, 1, 9, AcrossNodesOptions{}, Delivery::kPush);
  const std::string text = p.to_string();
  EXPECT_NE(text.find("cast in[0]+0 -> win[1]+4 (fp32->bf16, 2 elems + 0 zero pad x 4 rows, dst "
                      "pitch 12)"), std::string::npos) << text;
  EXPECT_NE(text.find("win[1]+4 -> win[2]+4 (4 B x 4 rows, pitch 12 -> 12)"), std::string::npos) << text;
  EXPECT_EQ(p.bytes_pushed(), 2 * layout.param(0).slot_bytes());
  ASSERT_NO_THROW(verify_programs(layout, plan_all(layout, Collective::kAllGather)));
}

// Cast into the peers' windows: the same strided block, rows at the same pitch, in every window.
TEST(ShardDimPlan, AllGatherCastsTheStridedBlockIntoEveryWindow) {
  BucketLayout layout({spec("w", {4, 6}, 1)}, Topology::single_node(3));
  const Program p = plan_all_gather(layout, 1, 9, AcrossNodesOptions{}, Delivery::kCastToPeers);
  const std::string text = p.to_string();
  for (int q : {1, 2, 0})
    EXPECT_NE(text.find(detail::concat("cast in[0]+0 -> win[", q, "]+4 (fp32->bf16, 2 elems + 0 "
                                       "zero pad x 4 rows, dst pitch 12)")),
              std::string::npos) << text;
  EXPECT_EQ(p.bytes_pushed(), 0u);
  ASSERT_NO_THROW(verify_programs(layout, plan_all(layout, Collective::kAllGather, {},
                                                   Delivery::kCastToPeers)));
  auto programs = plan_all(layout, Collective::kAllGather, {}, Delivery::kCastToPeers);
  for (Step& s : programs[1].steps)
    if (auto* cast = std::get_if<CastOp>(&s.op); cast && cast->dst.index == 2) {
      cast->dst_pitch += 2;
      break;
    }
  EXPECT_THROW(verify_programs(layout, programs), Error) << "a peer's strided cast at the wrong pitch";
}

TEST(ShardDimPlan, ReduceScatterStagesBlocksContiguouslyIncludingItsOwn) {
  BucketLayout layout({spec("w", {4, 6}, 1)}, Topology::single_node(3));  // S = 8, slot 16 B
  const Program p = plan_reduce_scatter(layout, 1, {}, 9);
  const std::string text = p.to_string();
  // Own block 1 of the gradient into the own slot(0, 1); block 2 into rank 2's slot(0, 1).
  EXPECT_NE(text.find("in[0]+4 -> win[1]+16 (4 B x 4 rows, pitch 12 -> 4)"), std::string::npos) << text;
  EXPECT_NE(text.find("in[0]+8 -> win[2]+16 (4 B x 4 rows, pitch 12 -> 4)"), std::string::npos) << text;
  EXPECT_NE(text.find("sources: win[1]+0 win[1]+16 win[1]+32"), std::string::npos) << text;
  ASSERT_NO_THROW(verify_programs(layout, plan_all(layout, Collective::kReduceScatter)));
}

TEST(ShardDimPlan, MultiNodePlansRefuseInnerShardDims) {
  BucketLayout layout({spec("w", {4, 8}, 1)}, Topology{2, 2});
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
    try {
      test::plan_for(c, layout, 0, 1);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("param 'w' shard_dim = 1, expected 0 with 2 nodes"),
                std::string::npos) << e.what();
    }
  }
}

// The 2-D ops must be checked row by row, or the property tests prove nothing for them.
TEST(ShardDimVerifier, CatchesBrokenTwoDimensionalOps) {
  const BucketLayout layout = mixed_bucket(3);
  // Edits the first 2-D copy in rank 1's program.
  auto copy_mutation = [&](Collective c, auto&& edit) {
    auto programs = plan_all(layout, c);
    for (Step& s : programs[1].steps)
      if (auto* b = std::get_if<CopyBatch>(&s.op))
        for (CopyOp& copy : b->copies)
          if (copy.rows > 1) {
            edit(copy);
            return programs;
          }
    ADD_FAILURE() << "no 2-D copy";
    return programs;
  };
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
    ASSERT_NO_THROW(verify_programs(layout, plan_all(layout, c)));
    EXPECT_THROW(verify_programs(layout, copy_mutation(c, [](CopyOp& x) { x.rows -= 1; })), Error)
        << "a missing row";
    EXPECT_THROW(verify_programs(layout, copy_mutation(c, [](CopyOp& x) { x.rows += 1; })), Error)
        << "an extra row";
    EXPECT_THROW(verify_programs(layout, copy_mutation(c, [](CopyOp& x) { x.dst_pitch += 2; })), Error)
        << "rows off their block";
    EXPECT_THROW(verify_programs(layout, copy_mutation(c, [](CopyOp& x) { x.src_pitch += 2; })), Error)
        << "rows from the wrong place";
    EXPECT_THROW(verify_programs(layout, copy_mutation(c, [](CopyOp& x) { x.dst_pitch = x.bytes / 2; })),
                 Error) << "overlapping rows";
    EXPECT_THROW(verify_programs(layout, copy_mutation(c, [](CopyOp& x) { x.bytes += 2; })), Error)
        << "rows too long: overlap the next block";
  }
  // A cast that misses a row or puts them at the wrong pitch.
  for (auto edit : {+[](CastOp& x) { x.rows -= 1; }, +[](CastOp& x) { x.dst_pitch += 2; }}) {
    auto programs = plan_all(layout, Collective::kAllGather);
    for (Step& s : programs[2].steps)
      if (auto* cast = std::get_if<CastOp>(&s.op); cast && cast->rows > 1) {
        edit(*cast);
        break;
      }
    EXPECT_THROW(verify_programs(layout, programs), Error) << "broken strided cast";
  }
  // The reduce-scatter without its own staging: the reduce would read unwritten own-window bytes.
  auto unstaged = plan_all(layout, Collective::kReduceScatter);
  auto& steps = unstaged[0].steps;
  const auto own = std::find_if(steps.begin(), steps.end(), [](const Step& s) {
    const auto* b = std::get_if<CopyBatch>(&s.op);
    return b && !b->copies.empty() && b->copies.front().dst.index == 0;
  });
  ASSERT_NE(own, steps.end());
  steps.erase(own);
  EXPECT_THROW(verify_programs(layout, unstaged), Error) << "own chunk not staged";
}

// AG bitwise and RS element by element (fp32 arithmetic in rank order, as the executors do it)
// on W threads, for mixed buckets of both dtypes.
TEST(ShardDimHostExecutor, AllGatherAndReduceScatterMatchTheReference) {
  for (int world : {2, 3, 4})
    for (DType dtype : {DType::kBF16, DType::kFP32}) {
      const BucketLayout layout = mixed_bucket(world, dtype);
      ReduceOptions o;
      o.prescale = 0.5f;
      const uint64_t seed = 40 + world;
      harness::run_rank_threads_or_throw(world, [&](int rank, Bootstrap& bootstrap) {
        auto window = HostWindow::create(bootstrap, layout.window_bytes());
        std::memset(window->data(rank), 0xA5, layout.window_bytes());  // poison: must be overwritten
        HostExecutor executor(*window);
        for (Collective c : {Collective::kAllGather, Collective::kReduceScatter}) {
          test::RankBuffers buffers(layout, c, rank, seed);
          executor.run(test::plan_for(c, layout, rank, 1, o), buffers.bindings);
          ASSERT_EQ(test::check_result(layout, c, rank, seed, window->data(rank), buffers, o), "")
              << layout.describe();
          if (c == Collective::kAllGather) continue;
          for (std::size_t i = 0; i < layout.num_params(); ++i) {
            const ParamLayout& p = layout.param(i);
            std::vector<test::Buffer> grads;
            for (int src = 0; src < world; ++src) grads.push_back(test::rs_grad(p, int(i), src, seed));
            for (int64_t k = 0; k < p.valid_numel(rank); ++k) {
              float acc = 0.0f;
              for (const test::Buffer& g : grads) {
                const float term = g.at(test::unsharded_index(p, rank, k)) * o.prescale;
                acc = acc + term;  // rounded apart from the product: no fused multiply-add
              }
              const float scale = 1.0f / static_cast<float>(world);  // kAvg, postscale 1
              ASSERT_EQ(buffers.outputs[i].at(k), acc * scale)
                  << p.name << " rank " << rank << " element " << k;
            }
          }
        }
      });
    }
}

}  // namespace
}  // namespace tide
