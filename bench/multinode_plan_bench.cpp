// Reduce-scatter staging memory per rank vs W at a fixed per-rank output (one Llama-3.1-70B decoder
// layer's shard at W = 64: 13.4 M elements, 53.5 MB in fp32): TIDE's across-node RS (node-local
// accumulation into vacated slots + a chunked ring of fp32 partials through a fixed staging ring)
// vs stock FSDP2's fp32 full-group reduce-scatter input (W x shard x 4 B). Also the network bytes
// each rank sends and the plan time. Plan-level accounting only (no transport runs here).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <variant>
#include <vector>

#include "tide/tide.hpp"

using namespace tide;

// Rows per rank of each param (the 70B layer at W = 64), so the per-rank shard is fixed in W.
static std::vector<ParamSpec> fixed_shard_layer(int world) {
  const int64_t h = 8192, inter = 28672;
  struct P { const char* name; int64_t rows, cols; };
  const P ps[] = {{"q_proj", 128, h},     {"k_proj", 16, h},     {"v_proj", 16, h},
                  {"o_proj", 128, h},     {"gate_proj", 448, h}, {"up_proj", 448, h},
                  {"down_proj", 128, inter}, {"input_layernorm", 128, 0},
                  {"post_attention_layernorm", 128, 0}};
  std::vector<ParamSpec> out;
  for (const P& p : ps) {
    ParamSpec s{p.name, {p.rows * world}};
    if (p.cols) s.shape.push_back(p.cols);
    out.push_back(s);
  }
  return out;
}

static std::size_t net_sends(const Program& p) {
  std::size_t n = 0;
  for (const Step& s : p.steps) n += std::holds_alternative<NetSendOp>(s.op);
  return n;
}

static std::size_t net_bytes_sent(const Program& p) {
  std::size_t total = 0;
  for (const Step& s : p.steps)
    if (const auto* x = std::get_if<NetSendOp>(&s.op)) total += x->bytes;
  return total;
}

int main() {
  const AcrossNodesOptions net;  // 16 MiB chunks, 4 in flight, ring of 4
  std::printf("# RS staging per rank at fixed per-rank output (70B layer shard at W = 64), "
              "chunk %zu B, ring %d\n", net.chunk_bytes, net.ring_depth);
  std::printf("%4s %7s %12s %14s %16s %9s %14s %14s %18s %10s %16s %16s\n", "W", "topo", "shard_MB",
              "tide_stage_MB", "stock_fp32_MB", "ratio", "AG_net_MB/rk", "RS_net_MB/rk",
              "RS_net_bf16wire", "plan_ms", "RS_sends_ring", "RS_sends_halv");
  for (int world : {2, 4, 8, 16, 32, 64}) {
    const int local = world >= 16 ? 8 : world / 2;
    const Topology t{world / local, local};
    const BucketLayout layout(fixed_shard_layer(world), t);
    std::size_t shard = 0;
    for (const ParamLayout& p : layout.params()) shard += p.shard_numel * 4;
    const auto a = std::chrono::steady_clock::now();
    const Program ag = plan_all_gather(layout, 0, 0, net);
    const Program rs = plan_reduce_scatter(layout, 0, {}, 0, net);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
    const std::size_t tide = rs_staging_bytes(layout, net);
    AcrossNodesOptions halving = net;
    halving.rs_recursive_halving = true;
    const Program rs_h = plan_reduce_scatter(layout, 0, {}, 0, halving);
    if (rs_staging_bytes(layout, halving) != tide || net_bytes_sent(rs_h) != net_bytes_sent(rs)) {
      std::fprintf(stderr, "halving staging or bytes differ from the ring\n");
      return 1;
    }
    AcrossNodesOptions bf16_wire = net;
    bf16_wire.wire_dtype = DType::kBF16;  // lossy: partial sums rounded to bf16 on the wire
    const Program rs_b = plan_reduce_scatter(layout, 0, {}, 0, bf16_wire);
    const std::size_t stock = stock_rs_buffer_bytes(layout);
    std::printf("%4d %4dx%-2d %12.1f %14.2f %16.1f %8.1fx %14.1f %14.1f %18.1f %10.2f %16zu %16zu\n",
                world, t.nodes, t.local, shard / 1e6, tide / 1e6, stock / 1e6, double(stock) / tide,
                net_bytes_sent(ag) / 1e6, net_bytes_sent(rs) / 1e6, net_bytes_sent(rs_b) / 1e6, ms,
                net_sends(rs), net_sends(rs_h));
  }
  return 0;
}
