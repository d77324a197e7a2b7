// Python bindings: thin. Pointers are ints (tensor.data_ptr()), streams are ints
// (torch.cuda.Stream.cuda_stream); TIDE never links against PyTorch. The GIL is released around
// everything that waits for peers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/chrono.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "tide/nccl.hpp"
#include "tide/tide.hpp"
#if TIDE_WITH_CUDA
#include "tide/cuda.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;
using namespace tide;

namespace {

// A bootstrap whose allgather is a Python callable taking bytes and returning a list of bytes, so
// Python can exchange handles over a torch.distributed Store or process group.
class CallbackBootstrap final : public Bootstrap {
 public:
  CallbackBootstrap(int rank, int world, nb::callable fn) : rank_(rank), world_(world), fn_(fn) {
    TIDE_CHECK_ARG(world >= 1, "CallbackBootstrap", "world", world, ">= 1");
    TIDE_CHECK_ARG(rank >= 0 && rank < world, "CallbackBootstrap", "rank", rank,
                   detail::concat("in [0, ", world, ")"));
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::vector<std::string> allgather(const std::string& mine) override {
    nb::gil_scoped_acquire gil;
    nb::object result = fn_(nb::bytes(mine.data(), mine.size()));
    std::vector<std::string> out;
    for (nb::handle item : result) {
      nb::bytes b = nb::cast<nb::bytes>(item);
      out.emplace_back(b.c_str(), b.size());
    }
    TIDE_CHECK_ARG(static_cast<int>(out.size()) == world_, "CallbackBootstrap", "len(allgather result)",
                   out.size(), detail::concat(world_, " (one entry per rank)"));
    return out;
  }

 private:
  int rank_, world_;
  nb::callable fn_;
};

std::chrono::milliseconds timeout_or_default(std::optional<int64_t> ms) {
  if (!ms) return default_timeout();
  TIDE_CHECK_ARG(*ms > 0, "tide", "timeout_ms", *ms, "> 0");
  return std::chrono::milliseconds(*ms);
}

// scales: per param the address of its fp32 scale, 0 for none (Bindings::scales); may be empty.
Bindings make_bindings(const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs,
                       const std::vector<uintptr_t>& scales) {
  Bindings b;
  for (uintptr_t p : inputs) b.inputs.push_back(reinterpret_cast<const void*>(p));
  for (uintptr_t p : outputs) b.outputs.push_back(reinterpret_cast<void*>(p));
  for (uintptr_t p : scales) b.scales.push_back(reinterpret_cast<const float*>(p));
  return b;
}

}  // namespace

NB_MODULE(_tide, m) {
  // tide.fsdp keeps windows and executors in process-global state for the life of the model;
  // nanobind's at-exit leak report would list them as leaks after every training script.
  nb::set_leak_warnings(false);
  m.doc() = "TIDE: zero-copy collectives for FSDP2 (C++ core)";
  static nb::object desync = nb::steal(PyErr_NewException("tide.DesyncError", PyExc_RuntimeError, nullptr));
  m.attr("DesyncError") = desync;
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const DesyncError& e) {
      PyErr_SetString(desync.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  nb::enum_<DType>(m, "DType")
      .value("bf16", DType::kBF16)
      .value("fp16", DType::kFP16)
      .value("fp32", DType::kFP32)
      .value("u8", DType::kU8)
      .value("e4m3", DType::kE4M3);
  m.def("dtype_size", &dtype_size);
  m.def("parse_dtype", [](const std::string& s) { return parse_dtype(s); });

  nb::class_<Topology>(m, "Topology")
      .def(nb::init<>())
      .def("__init__", [](Topology* t, int nodes, int local) {
        new (t) Topology{nodes, local};
        t->validate();
      }, "nodes"_a, "local"_a)
      .def_static("single_node", &Topology::single_node, "world"_a)
      .def_ro("nodes", &Topology::nodes)
      .def_ro("local", &Topology::local)
      .def_prop_ro("world", &Topology::world);

  nb::class_<ParamSpec>(m, "ParamSpec")
      .def("__init__", [](ParamSpec* s, std::string name, std::vector<int64_t> shape, DType dtype,
                          DType shard_dtype, int shard_dim) {
        new (s) ParamSpec{std::move(name), std::move(shape), dtype, shard_dtype, shard_dim};
      }, "name"_a, "shape"_a, "dtype"_a = DType::kBF16, "shard_dtype"_a = DType::kFP32,
         nb::kw_only(), "shard_dim"_a = 0)
      .def_ro("name", &ParamSpec::name)
      .def_ro("shape", &ParamSpec::shape)
      .def_ro("dtype", &ParamSpec::dtype)
      .def_ro("shard_dtype", &ParamSpec::shard_dtype)
      .def_ro("shard_dim", &ParamSpec::shard_dim);

  nb::class_<ParamLayout>(m, "ParamLayout")
      .def_ro("name", &ParamLayout::name)
      .def_ro("shape", &ParamLayout::shape)
      .def_ro("dtype", &ParamLayout::dtype)
      .def_ro("shard_dtype", &ParamLayout::shard_dtype)
      .def_ro("shard_dim", &ParamLayout::shard_dim)
      .def_ro("shard_dim_size", &ParamLayout::shard_dim_size)
      .def_ro("outer_rows", &ParamLayout::outer_rows)
      .def_ro("row_numel", &ParamLayout::row_numel)
      .def_ro("rows_per_rank", &ParamLayout::rows_per_rank)
      .def_ro("shard_numel", &ParamLayout::shard_numel)
      .def_ro("elem_size", &ParamLayout::elem_size)
      .def_ro("window_offset", &ParamLayout::window_offset)
      .def_ro("block_pitch", &ParamLayout::block_pitch)
      .def_prop_ro("block_bytes", &ParamLayout::block_bytes)
      .def_prop_ro("numel", &ParamLayout::numel)
      .def_prop_ro("slot_bytes", &ParamLayout::slot_bytes)
      .def("valid_rows", &ParamLayout::valid_rows, "rank"_a)
      .def("valid_numel", &ParamLayout::valid_numel, "rank"_a)
      .def("slot_offset", &ParamLayout::slot_offset, "rank"_a)
      .def("block_offset", &ParamLayout::block_offset, "rank"_a);

  nb::class_<BucketLayout>(m, "BucketLayout")
      .def(nb::init<std::vector<ParamSpec>, Topology, std::size_t>(), "params"_a, "topology"_a,
           "alignment"_a = BucketLayout::kMinAlignment)
      .def_prop_ro("topology", &BucketLayout::topology)
      .def_prop_ro("world", &BucketLayout::world)
      .def_prop_ro("alignment", &BucketLayout::alignment)
      .def_prop_ro("params", &BucketLayout::params)
      .def_prop_ro("window_bytes", &BucketLayout::window_bytes)
      .def("describe", &BucketLayout::describe);

  nb::enum_<Collective>(m, "Collective")
      .value("all_gather", Collective::kAllGather)
      .value("reduce_scatter", Collective::kReduceScatter);
  nb::enum_<ReduceKind>(m, "ReduceKind").value("sum", ReduceKind::kSum).value("avg", ReduceKind::kAvg);
  nb::class_<ReduceOptions>(m, "ReduceOptions")
      .def("__init__", [](ReduceOptions* o, ReduceKind kind, float prescale, float postscale,
                          bool accumulate) {
        new (o) ReduceOptions{kind, prescale, postscale, accumulate};
      }, "kind"_a = ReduceKind::kAvg, "prescale"_a = 1.0f, "postscale"_a = 1.0f,
         "accumulate"_a = false)
      .def_rw("kind", &ReduceOptions::kind)
      .def_rw("prescale", &ReduceOptions::prescale)
      .def_rw("postscale", &ReduceOptions::postscale)
      .def_rw("accumulate", &ReduceOptions::accumulate);

  nb::class_<AcrossNodesOptions>(m, "AcrossNodesOptions")
      .def("__init__", [](AcrossNodesOptions* o, std::size_t chunk_bytes, int max_chunks_in_flight,
                          int ring_depth, bool rs_recursive_halving, DType wire_dtype) {
        new (o) AcrossNodesOptions{chunk_bytes, max_chunks_in_flight, ring_depth, rs_recursive_halving,
                           wire_dtype};
      }, "chunk_bytes"_a = AcrossNodesOptions{}.chunk_bytes,
         "max_chunks_in_flight"_a = AcrossNodesOptions{}.max_chunks_in_flight,
         "ring_depth"_a = AcrossNodesOptions{}.ring_depth, "rs_recursive_halving"_a = false,
         "wire_dtype"_a = AcrossNodesOptions{}.wire_dtype)
      .def_rw("chunk_bytes", &AcrossNodesOptions::chunk_bytes)
      .def_rw("max_chunks_in_flight", &AcrossNodesOptions::max_chunks_in_flight)
      .def_rw("ring_depth", &AcrossNodesOptions::ring_depth)
      .def_rw("rs_recursive_halving", &AcrossNodesOptions::rs_recursive_halving)
      .def_rw("wire_dtype", &AcrossNodesOptions::wire_dtype);

  nb::class_<Program>(m, "Program")
      .def_ro("window_bytes", &Program::window_bytes)
      .def_ro("collective", &Program::collective)
      .def_ro("rank", &Program::rank)
      .def_ro("world", &Program::world)
      .def_ro("bucket", &Program::bucket)
      .def_ro("delivery", &Program::delivery)
      .def_prop_ro("num_steps", [](const Program& p) { return p.steps.size(); })
      .def("bytes_pushed", &Program::bytes_pushed)
      .def("to_string", &Program::to_string)
      .def("__str__", &Program::to_string);
  // Across nodes (layout.topology.nodes > 1) the programs carry network ops; size windows from
  // program.window_bytes (a reduce-scatter's adds its staging ring).
  // delivery None: default_delivery(layout) (Delivery.cast_to_peers for small single-node buckets).
  nb::enum_<Delivery>(m, "Delivery")
      .value("push", Delivery::kPush)
      .value("cast_to_peers", Delivery::kCastToPeers);
  m.def("default_delivery", &default_delivery, "layout"_a);
  m.def("plan_all_gather",
        [](const BucketLayout& l, int rank, uint32_t bucket, const AcrossNodesOptions& net,
           std::optional<Delivery> delivery) {
          return plan_all_gather(l, rank, bucket, net, delivery.value_or(default_delivery(l)));
        },
        "layout"_a, "rank"_a, "bucket"_a = 0, "net"_a = AcrossNodesOptions{}, "delivery"_a = nb::none());
  m.def("plan_reduce_scatter",
        [](const BucketLayout& l, int rank, const ReduceOptions& o, uint32_t bucket,
           const AcrossNodesOptions& net, std::optional<Delivery> delivery) {
          return plan_reduce_scatter(l, rank, o, bucket, net, delivery.value_or(default_delivery(l)));
        },
        "layout"_a, "rank"_a, "options"_a = ReduceOptions{}, "bucket"_a = 0, "net"_a = AcrossNodesOptions{},
        "delivery"_a = nb::none());
  m.def("verify_programs", &verify_programs, "layout"_a, "programs"_a);
  m.def("default_timeout_ms", [] { return default_timeout().count(); });

  nb::class_<Bootstrap>(m, "Bootstrap")
      .def_prop_ro("rank", &Bootstrap::rank)
      .def_prop_ro("world", &Bootstrap::world)
      .def("barrier", &Bootstrap::barrier, nb::call_guard<nb::gil_scoped_release>());
  nb::class_<FileBootstrap, Bootstrap>(m, "FileBootstrap")
      .def("__init__", [](FileBootstrap* b, std::string dir, int rank, int world,
                          std::optional<int64_t> timeout_ms) {
        new (b) FileBootstrap(std::move(dir), rank, world, timeout_or_default(timeout_ms));
      }, "dir"_a, "rank"_a, "world"_a, "timeout_ms"_a = nb::none());
  nb::class_<CallbackBootstrap, Bootstrap>(m, "CallbackBootstrap")
      .def(nb::init<int, int, nb::callable>(), "rank"_a, "world"_a, "allgather"_a);

  nb::class_<HostWindow>(m, "HostWindow")
      .def_static("create", &HostWindow::create, "bootstrap"_a, "data_bytes"_a,
                  nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("rank", &HostWindow::rank)
      .def_prop_ro("world", &HostWindow::world)
      .def_prop_ro("data_bytes", &HostWindow::data_bytes)
      .def_prop_ro("epoch", &HostWindow::epoch)
      .def("data_ptr", [](const HostWindow& w, int rank) {
        return reinterpret_cast<uintptr_t>(w.data(rank));
      }, "rank"_a);

  nb::class_<HostAddressRange>(m, "HostAddressRange")
      .def(nb::init<std::size_t>(), "bytes"_a)
      .def_prop_ro("bytes", &HostAddressRange::bytes)
      .def("map_data_of", &HostAddressRange::map_data_of, "window"_a, nb::keep_alive<1, 2>())
      .def_prop_ro("ptr", [](const HostAddressRange& r) { return reinterpret_cast<uintptr_t>(r.base()); });

  nb::class_<HostExecutor>(m, "HostExecutor")
      .def("__init__", [](HostExecutor* e, HostWindow& w, std::optional<int64_t> timeout_ms) {
        new (e) HostExecutor(w, timeout_or_default(timeout_ms));
      }, "window"_a, "timeout_ms"_a = nb::none(), nb::keep_alive<1, 2>())
      .def_prop_ro("rank", &HostExecutor::rank)
      .def_prop_ro("world", &HostExecutor::world)
      .def("run", [](HostExecutor& e, const Program& p, const std::vector<uintptr_t>& inputs,
                     const std::vector<uintptr_t>& outputs, const std::vector<uintptr_t>& scales) {
        Bindings b = make_bindings(inputs, outputs, scales);
        nb::gil_scoped_release release;
        e.run(p, b);
      }, "program"_a, "inputs"_a, "outputs"_a = std::vector<uintptr_t>{},
         "scales"_a = std::vector<uintptr_t>{});

#if TIDE_WITH_CUDA
  m.attr("cuda_built") = true;
  m.def("cuda_device_available", &cuda_device_available);
  m.def("cuda_device_count", &cuda_device_count);
  nb::enum_<CudaMemory>(m, "CudaMemory").value("malloc", CudaMemory::kMalloc).value("vmm", CudaMemory::kVmm);
  nb::enum_<CudaWindowScope>(m, "CudaWindowScope").value("node", CudaWindowScope::kNode).value("host", CudaWindowScope::kHost);
  nb::class_<CudaWindow>(m, "CudaWindow")
      .def_static("create",
                  [](Bootstrap& b, std::size_t data_bytes, std::optional<Topology> topology,
                     CudaMemory memory, CudaWindowScope scope) {
                    return CudaWindow::create(b, data_bytes,
                                              topology ? *topology : Topology::single_node(b.world()),
                                              memory, scope);
                  },
                  "bootstrap"_a, "data_bytes"_a, "topology"_a = nb::none(),
                  "memory"_a = CudaMemory::kMalloc, "scope"_a = CudaWindowScope::kNode,
                  nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("rank", &CudaWindow::rank)
      .def_prop_ro("world", &CudaWindow::world)
      .def_prop_ro("device", &CudaWindow::device)
      .def_prop_ro("data_bytes", &CudaWindow::data_bytes)
      .def_prop_ro("epoch", &CudaWindow::epoch)
      .def("data_ptr", [](const CudaWindow& w, int rank) {
        return reinterpret_cast<uintptr_t>(w.data(rank));
      }, "rank"_a);
  nb::class_<CudaAddressRange>(m, "CudaAddressRange")
      .def(nb::init<std::size_t>(), "bytes"_a)
      .def_prop_ro("ptr", [](const CudaAddressRange& r) { return reinterpret_cast<uintptr_t>(r.data()); })
      .def_prop_ro("bytes", &CudaAddressRange::bytes)
      .def("map_data_of", &CudaAddressRange::map_data_of, "window"_a, nb::keep_alive<1, 2>())
      .def("unmap", &CudaAddressRange::unmap);
  nb::class_<CudaExecutor::Stats>(m, "CudaStats")
      .def_ro("cast_cta_us", &CudaExecutor::Stats::cast_cta_us)
      .def_ro("reduce_cta_us", &CudaExecutor::Stats::reduce_cta_us)
      .def_ro("network_cta_us", &CudaExecutor::Stats::network_cta_us)
      .def_ro("cast_to_peers_cta_us", &CudaExecutor::Stats::cast_to_peers_cta_us)
      .def_ro("cast_to_peers_kernels", &CudaExecutor::Stats::cast_to_peers_kernels)
      .def_ro("network_groups", &CudaExecutor::Stats::network_groups)
      .def_ro("copies", &CudaExecutor::Stats::copies)
      .def_ro("copies_2d", &CudaExecutor::Stats::copies_2d)
      .def_ro("copies_coalesced", &CudaExecutor::Stats::copies_coalesced)
      .def_ro("kernel_launches", &CudaExecutor::Stats::kernel_launches)
      .def_ro("mem_op_calls", &CudaExecutor::Stats::mem_op_calls)
      .def_ro("lowerings", &CudaExecutor::Stats::lowerings);
  nb::class_<PreparedProgram>(m, "PreparedProgram")
      .def_prop_ro("program", &PreparedProgram::program, nb::rv_policy::reference_internal);
  nb::class_<CudaExecutor>(m, "CudaExecutor")
      .def("__init__", [](CudaExecutor* e, CudaWindow& w, uintptr_t stream,
                          std::optional<int64_t> timeout_ms, NcclComm* network) {
        new (e) CudaExecutor(w, reinterpret_cast<void*>(stream), timeout_or_default(timeout_ms),
                             network);
      }, "window"_a, "stream"_a, "timeout_ms"_a = nb::none(), "network"_a = nb::none(),
         nb::keep_alive<1, 2>(), nb::keep_alive<1, 5>())
      .def_prop_ro("rank", &CudaExecutor::rank)
      .def_prop_ro("world", &CudaExecutor::world)
      .def("set_stream", [](CudaExecutor& e, uintptr_t s) { e.set_stream(reinterpret_cast<void*>(s)); })
      .def("run", [](CudaExecutor& e, const Program& p, const std::vector<uintptr_t>& inputs,
                     const std::vector<uintptr_t>& outputs, const std::vector<uintptr_t>& scales) {
        Bindings b = make_bindings(inputs, outputs, scales);
        nb::gil_scoped_release release;
        e.run(p, b);
      }, "program"_a, "inputs"_a, "outputs"_a = std::vector<uintptr_t>{},
         "scales"_a = std::vector<uintptr_t>{})
      .def("prepare", &CudaExecutor::prepare, "program"_a)
      .def("run", [](CudaExecutor& e, PreparedProgram& p, const std::vector<uintptr_t>& inputs,
                     const std::vector<uintptr_t>& outputs, const std::vector<uintptr_t>& scales) {
        Bindings b = make_bindings(inputs, outputs, scales);
        nb::gil_scoped_release release;
        e.run(p, b);
      }, "program"_a, "inputs"_a, "outputs"_a = std::vector<uintptr_t>{},
         "scales"_a = std::vector<uintptr_t>{})
      .def("synchronize", &CudaExecutor::synchronize, nb::call_guard<nb::gil_scoped_release>())
      .def("captured_state", [](CudaExecutor& e) {
        const CudaExecutor::CapturedState s = e.captured_state();
        return nb::make_tuple(s.graphs, s.waits, s.slots);
      })
      .def("live_captures", [](CudaExecutor& e) { return e.captured_state().captures; })
      .def("enable_stats", &CudaExecutor::enable_stats)
      .def("stats", &CudaExecutor::stats, nb::call_guard<nb::gil_scoped_release>())
      .def("reset_stats", &CudaExecutor::reset_stats)
      .def_static("capture_refusal", &CudaExecutor::capture_refusal, "program"_a);
  m.def("cuda_capture_id", [](uintptr_t stream) { return cuda_capture_id(reinterpret_cast<void*>(stream)); },
        "stream"_a);
#else
  m.attr("cuda_built") = false;
  m.def("cuda_device_available", [] { return false; });
  m.def("cuda_device_count", [] { return 0; });
  m.def("cuda_capture_id", [](uintptr_t) { return uint64_t{0}; }, "stream"_a);
#endif
  // NCCL (the network transport across nodes), loaded at run time; raises RuntimeError naming
  // where it looked when there is none.
  m.def("nccl_version", [] { return NcclLibrary::get().version_string(); });
  m.def("nccl_path", [] { return NcclLibrary::get().path(); });
  nb::class_<NcclComm>(m, "NcclComm")
      .def_static("create", &NcclComm::create, "bootstrap"_a,
                  nb::call_guard<nb::gil_scoped_release>())
      .def_static("wrap", [](uintptr_t comm) { return NcclComm::wrap(reinterpret_cast<void*>(comm)); },
                  "comm"_a)
      .def_prop_ro("rank", &NcclComm::rank)
      .def_prop_ro("world", &NcclComm::world)
      .def_prop_ro("device", &NcclComm::device);
}
