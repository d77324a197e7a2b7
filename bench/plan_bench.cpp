// Plan generation time for one Llama-3.1-70B decoder layer (hidden 8192, intermediate 28672,
// 8 KV heads of 128) at W = 8 and W = 64. Prints one table; medians over many repetitions.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "tide/tide.hpp"

using namespace tide;

static std::vector<ParamSpec> llama70b_layer() {
  const int64_t h = 8192, inter = 28672, kv = 8 * 128;
  return {{"q_proj", {h, h}},        {"k_proj", {kv, h}},      {"v_proj", {kv, h}},
          {"o_proj", {h, h}},        {"gate_proj", {inter, h}}, {"up_proj", {inter, h}},
          {"down_proj", {h, inter}}, {"input_layernorm", {h}}, {"post_attention_layernorm", {h}}};
}

template <class Fn>
static double median_us(Fn&& fn, int reps) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    const auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(b - a).count());
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

int main() {
  std::printf("# plan generation, one Llama-3.1-70B decoder layer (9 params, 855.7 M elements)\n");
  std::printf("%6s %10s %12s %12s %12s %12s %14s\n", "W", "steps/rk", "layout_us", "AG_plan_us",
              "RS_plan_us", "verify_us", "bytes_pushed");
  for (int world : {8, 64}) {
    const Topology topo = Topology::single_node(world);
    const auto specs = llama70b_layer();
    const double layout_us = median_us([&] { BucketLayout l(specs, topo); }, 2001);
    BucketLayout layout(specs, topo);
    std::size_t steps = 0, pushed = 0;
    const double ag_us = median_us([&] {
      Program p = plan_all_gather(layout, world / 2);
      steps = p.steps.size();
      pushed = p.bytes_pushed();
    }, 2001);
    const double rs_us = median_us([&] { plan_reduce_scatter(layout, world / 2, {}); }, 2001);
    std::vector<Program> all;
    for (int r = 0; r < world; ++r) all.push_back(plan_all_gather(layout, r));
    const double verify_us = median_us([&] { verify_programs(layout, all); }, 21);
    std::printf("%6d %10zu %12.2f %12.2f %12.2f %12.1f %14zu\n", world, steps, layout_us, ag_us,
                rs_us, verify_us, pushed);
  }
  return 0;
}
