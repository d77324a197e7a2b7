// layout: FSDP2's dim-0 sharding and the param-major window, swept over many small cases.
#include <gtest/gtest.h>

#include <random>

#include "test_util.hpp"

namespace tide {
namespace {

TEST(Layout, ShardingMatchesFsdp2OverASweep) {
  for (int world : {1, 2, 3, 4, 5, 7, 8, 16, 64}) {
    for (int64_t d0 : {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100, 1000}) {
      for (int64_t row : {1, 3, 8}) {
        BucketLayout layout({{"w", {d0, row}, DType::kBF16, DType::kFP32}},
                            Topology::single_node(world));
        const ParamLayout& p = layout.param(0);
        const int64_t c = (d0 + world - 1) / world;  // torch.chunk's chunk size, as FSDP2 uses
        ASSERT_EQ(p.rows_per_rank, c);
        ASSERT_EQ(p.shard_numel, c * row);
        int64_t total = 0;
        for (int r = 0; r < world; ++r) {
          const int64_t expect = std::max<int64_t>(0, std::min(c, d0 - r * c));
          ASSERT_EQ(p.valid_rows(r), expect) << "W=" << world << " d0=" << d0 << " r=" << r;
          total += p.valid_rows(r);
          // Rank r's rows sit at rows [r*c, r*c + valid) of the unsharded param.
          ASSERT_EQ(p.slot_offset(r) - p.window_offset, std::size_t(r * c * row * 2));
        }
        ASSERT_EQ(total, d0);
        ASSERT_GE(std::size_t(world) * p.slot_bytes(), p.unsharded_bytes());
      }
    }
  }
}

TEST(Layout, ZeroAndOneDimensionalParams) {
  BucketLayout layout({{"scalar", {}, DType::kFP32, DType::kFP32}, {"bias", {10}, DType::kBF16}},
                      Topology::single_node(4));
  EXPECT_EQ(layout.param(0).shard_dim_size, 1);
  EXPECT_EQ(layout.param(0).numel(), 1);
  EXPECT_EQ(layout.param(0).valid_rows(0), 1);
  EXPECT_EQ(layout.param(0).valid_rows(1), 0);
  EXPECT_EQ(layout.param(1).rows_per_rank, 3);
  EXPECT_EQ(layout.param(1).valid_rows(3), 1);
}

TEST(Layout, WindowIsParamMajorAlignedAndTight) {
  std::mt19937_64 rng(7);
  for (int n = 0; n < 2000; ++n) {
    const int world = std::uniform_int_distribution<int>(1, 64)(rng);
    const std::size_t alignment = std::size_t(256) << std::uniform_int_distribution<int>(0, 4)(rng);
    BucketLayout layout(test::random_specs(rng, world), Topology::single_node(world), alignment);
    std::size_t expect = 0;
    for (const ParamLayout& p : layout.params()) {
      ASSERT_EQ(p.window_offset % alignment, 0u);
      ASSERT_EQ(p.window_offset, expect);  // no gap beyond alignment, params in order
      expect = (p.window_offset + world * p.slot_bytes() + alignment - 1) / alignment * alignment;
    }
    ASSERT_EQ(layout.window_bytes(), expect);
    ASSERT_EQ(layout.window_bytes() % alignment, 0u);
  }
}

TEST(Layout, TopologyCarriesNodesAndLocalRanks) {
  const Topology t{3, 4};
  EXPECT_EQ(t.world(), 12);
  EXPECT_EQ(t.node_of(7), 1);
  EXPECT_EQ(t.local_rank_of(7), 3);
  BucketLayout layout({{"w", {25, 2}}}, t);
  EXPECT_EQ(layout.world(), 12);
  EXPECT_EQ(layout.param(0).rows_per_rank, 3);
  EXPECT_NE(layout.describe().find("3 node(s) x 4"), std::string::npos);
}

TEST(Layout, DescribeNamesEveryParam) {
  BucketLayout layout({{"q_proj", {64, 32}}, {"norm", {32}, DType::kFP32}}, Topology::single_node(8));
  const std::string text = layout.describe();
  EXPECT_NE(text.find("q_proj [64, 32] bf16/fp32: c = 8 rows"), std::string::npos) << text;
  EXPECT_NE(text.find("norm [32] fp32/fp32: c = 4 rows"), std::string::npos) << text;
}

}  // namespace
}  // namespace tide

namespace tide {
namespace {

TEST(Layout, LocateFindsParamAndSlotOfEveryWindowByte) {
  BucketLayout layout({{"a", {10, 3}}, {"b", {5}, DType::kFP32}}, Topology::single_node(4));
  for (std::size_t offset = 0; offset < layout.window_bytes() + 8; ++offset) {
    std::pair<int, int> expect{-1, -1};
    for (int i = 0; i < 2; ++i)
      for (int r = 0; r < 4; ++r)
        if (offset >= layout.param(i).slot_offset(r) &&
            offset < layout.param(i).slot_offset(r) + layout.param(i).slot_bytes())
          expect = {i, r};
    ASSERT_EQ(layout.locate(offset), expect) << "offset " << offset;
  }
}

}  // namespace
}  // namespace tide
