// The CUDA graphs that hold an executor's captured waits, and what their end releases. A captured
// run ties its graph's life to the executor: a CUDA user object, retained by the graph being
// captured, whose destructor CUDA calls once the graph and every executable graph made from it are
// destroyed. The destructor runs on a thread of CUDA's and may call no CUDA function, so it only
// posts the capture's id to GraphEnds; the watchdog (and live_graphs()) then drops the graph's
// wait records and gives back its mark slots, and with no graph left the watchdog sleeps again.
#include <algorithm>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "cuda_executor_impl.hpp"
#include "tide/error.hpp"

namespace tide {

using namespace cuda_executor_detail;

namespace cuda_executor_detail {

void GraphEnds::post(uint64_t capture) {
  std::lock_guard<std::mutex> lock(mutex_);
  ended_.push_back(capture);
  any_.store(true, std::memory_order_release);
}

std::vector<uint64_t> GraphEnds::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  any_.store(false, std::memory_order_relaxed);
  return std::exchange(ended_, {});
}

namespace {

// What a graph's user object carries: where to post its end, and which capture it was.
struct GraphEnd {
  std::shared_ptr<GraphEnds> ends;
  uint64_t capture;
  static void destroy(void* self) {
    auto* end = static_cast<GraphEnd*>(self);
    end->ends->post(end->capture);
    delete end;
  }
};

}  // namespace
}  // namespace cuda_executor_detail

void CudaExecutor::Impl::adopt_capture() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  cudaGraph_t graph = nullptr;
  TIDE_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id, &graph));
  capture = id;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (std::any_of(graphs.begin(), graphs.end(), [&](const LiveGraph& g) { return g.capture == id; }))
      return;
  }
  auto* end = new GraphEnd{graph_ends, id};
  cudaUserObject_t object = nullptr;
  bool tracked =
      cudaUserObjectCreate(&object, end, &GraphEnd::destroy, 1, cudaUserObjectNoDestructorSync) ==
      cudaSuccess;
  if (!tracked) {
    delete end;
  } else if (cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove) != cudaSuccess) {
    // The graph did not take the reference: ours ends the object (and `end`) now.
    (void)cudaUserObjectRelease(object, 1);
    tracked = false;
  }
  if (!tracked) {
    // A driver that refuses user objects during this capture: the graph's waits and slots are
    // kept for good, as a graph's life cannot be followed (captured_state() does not count it).
    (void)cudaGetLastError();
  }
  std::lock_guard<std::mutex> lock(mutex);
  graphs.push_back({id, {}, tracked});
}

void CudaExecutor::Impl::hold_captured_slot(int slot) {
  for (LiveGraph& g : graphs) {
    if (g.capture != capture) continue;
    if (std::find(g.slots.begin(), g.slots.end(), slot) == g.slots.end()) {
      g.slots.push_back(slot);
      marks->hold(slot);  // a replay of this graph may write the slot's marks at any time
    }
    return;
  }
}

void CudaExecutor::Impl::forget_ended_graphs() {
  if (!graph_ends->any()) return;
  for (const uint64_t ended : graph_ends->take()) {
    const auto g = std::find_if(graphs.begin(), graphs.end(),
                                [&](const LiveGraph& live) { return live.capture == ended; });
    if (g == graphs.end() || !g->tracked) continue;  // an untracked graph's end is not its own
    for (const int slot : g->slots) marks->release(slot);
    graphs.erase(g);
    captured.erase(std::remove_if(captured.begin(), captured.end(),
                                  [&](const PendingWait& w) { return w.graph == ended; }),
                   captured.end());
  }
  captured_slots.erase(
      std::remove_if(captured_slots.begin(), captured_slots.end(),
                     [&](const CapturedSlot& c) {
                       return std::none_of(captured.begin(), captured.end(),
                                           [&](const PendingWait& w) { return w.slot == c.slot; });
                     }),
      captured_slots.end());
}

CudaExecutor::CapturedState CudaExecutor::captured_state() {
  using LiveGraph = Impl::LiveGraph;
  Impl& d = *impl_;
  std::lock_guard<std::mutex> lock(d.mutex);
  d.forget_ended_graphs();
  CapturedState state;
  for (const LiveGraph& g : d.graphs)
    if (g.tracked) state.captures.push_back(g.capture);
  state.graphs = static_cast<int>(state.captures.size());
  state.waits = static_cast<int>(d.captured.size());
  state.slots = static_cast<int>(d.captured_slots.size());
  return state;
}

}  // namespace tide
