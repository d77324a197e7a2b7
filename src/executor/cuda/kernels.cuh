// The kernels of the CUDA executor (cast, reduce, and the IPC network's pull), and their host-side
// launchers. Cast and reduce take a task table by value (a __grid_constant__ kernel parameter), so
// one launch serves every CastOp (or ReduceOp) of a program and nothing has to be uploaded or kept
// alive: the launch copies the table. The benchmark also launches them (ceilings, interference),
// through the internal target tide_cuda_kernels_internal. One .cu file per kernel family defines
// them (cast_kernel.cu, reduce_kernel.cu, copy_kernel.cu, cast_to_peers_kernel.cu,
// net_pull_kernel.cu; README.md lists what they share).
//
// Arithmetic is exactly the host executor's: conversions bit for bit as tide/dtype.hpp's (round to
// nearest even, same NaN encodings), fp32 accumulation with explicit __fadd_rn/__fmul_rn (never
// contracted into FMAs) in fixed rank order, so results are bitwise identical to HostExecutor's.
//
// Plain C++ (no CUDA syntax) so that .cpp files compiled by the host compiler can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include <cuda_runtime.h>

namespace tide::cuda_kernels {

// Element types, numbered as tide::DType (checked by a static_assert in cuda_executor.cpp; 3 is
// tide::DType::kU8, bytes, which no kernel converts). kE4M3: a cast's destination only.
enum ElementType : uint8_t { kBF16 = 0, kFP16 = 1, kFP32 = 2, kE4M3 = 4 };

// dst[0:count] = convert(src[0:count]); dst[count:count+pad] = 0. With rows > 1 (a strided
// destination, pad 0): `count` elements per row, row j from src[j * count] to dst[j * dst_pitch].
// Into kE4M3: convert(x) = e4m3(x * *scale), one fp32 multiply, saturated to +-448.
struct CastSpec {
  const void* src;  // may be null when count == 0
  void* dst;
  int64_t count;
  int64_t pad;
  ElementType src_type;
  ElementType dst_type;
  int64_t rows = 1;
  int64_t dst_pitch = 0;        // elements of dst_type between rows, rows > 1
  const float* scale = nullptr;  // device memory; kE4M3 destinations only
};

// dst[k] (+)= scale * sum_{p in order} (prescale * float(sources[p][k])), k < count.
struct ReduceSpec {
  const void* const* sources;  // num_sources pointers (host array; copied into the launch)
  void* dst;
  const void* partial;         // what the sum starts from (partial_type), or nullptr (ReduceOp::partial)
  int64_t count;
  float prescale;
  float scale;
  bool accumulate;
  ElementType src_type;
  ElementType dst_type;
  ElementType partial_type = kFP32;  // kFP32 or kBF16
};

struct LaunchInfo {
  int launches = 0;  // kernel launches (tables larger than one launch's parameter are chunked)
  int max_ctas = 0;  // the largest grid among them
};

// CTAs of 256 threads; each handles tiles of 8192 elements (16-byte vectors when every pointer of
// the task is 16-byte aligned, scalar otherwise), grid-striding over all tasks' tiles.
inline constexpr int kThreadsPerCta = 256;
inline constexpr int64_t kTileElements = 8192;
inline constexpr int kMaxSources = 3072;  // ranks a reduce can sum (one launch's parameter space)

// The grid cap used when max_ctas <= 0: CTAs per SM (2, or TIDE_CUDA_CTAS_PER_SM) x SMs of the
// current device (reduces; casts use twice as many).
int default_max_ctas();
int sm_count();  // of the current device

// Loads every kernel declared here into the current context now. With CUDA's lazy module loading
// (the default) a kernel's first launch loads its module, and loading waits for the whole
// context: with ranks as threads of one process, a rank whose stream waits on another rank's
// flag then blocks that rank's first launch for good (the hang of ranks-as-threads). CudaExecutor
// calls this before any wait can be enqueued.
void preload_kernels();

// Enqueue the casts (any src/dst types) / reduces / copies on `stream`, grids min(tiles, max_ctas)
// (max_ctas <= 0: the default grid). Each is one launch while its table fits one launch's
// parameter space (every cast up to kLargeCastTasks; reduces up to ~32 KB / (40 + 8 x sources)
// bytes, 584 of 2 sources; copies up to kLargeCopyTasks), so the host's cost does not grow with the
// param count. Throw tide::SystemError on a launch error, InvalidArgument for more than
// kMaxSources sources per task.
LaunchInfo launch_casts(const CastSpec* specs, std::size_t num_specs, int max_ctas,
                        cudaStream_t stream);
LaunchInfo launch_reduces(const ReduceSpec* specs, std::size_t num_specs, int num_sources,
                          int max_ctas, cudaStream_t stream);

struct CopySpec;

// The launches of a batch of reduces or copies with their tables built, to run as they are on any
// stream, as often as the pointers they hold stay valid: a prepared program's kept lowering
// (CudaExecutor::prepare) runs them again without building a table per run.
class Launches {
 public:
  LaunchInfo run(cudaStream_t stream) const;
  bool empty() const { return launches_.empty(); }

 private:
  friend Launches reduce_launches(const ReduceSpec*, std::size_t, int, int);
  friend Launches copy_launches(const CopySpec*, std::size_t);
  std::vector<std::function<int(cudaStream_t)>> launches_;  // each returns its grid
};
// launch_reduces' and launch_copies' tables (same checks), not launched.
Launches reduce_launches(const ReduceSpec* specs, std::size_t num_specs, int num_sources, int max_ctas);

// One kernel for the tail of a small single-node program (Delivery::kCastToPeers): its slot-free
// handshake where the executor fuses it (below), its casts and copies (SM stores, into the peers'
// windows as well), then its signals, then its waits, then its reduces. A collective's fixed cost is host time, a driver call of ~1-7 µs each (BENCHMARKS.md), and
// this turns the tail's calls (a cast or push, a memop, a reduce launch) into one launch. Order and
// visibility are the stream operations':
//   signals  written by the last CTA to finish its stores, after a system-wide fence by every
//            thread: per signal the tag, then the epoch (a release store), as the memops write
//            them;
//   waits    each CTA's first thread spins (acquire loads, with backoff) until epoch >= e (signed
//            difference, as cuStreamWaitValue64's GEQ) and tag == t, writing the watchdog's marks
//            (wait_marks.hpp) around: the watchdog diagnoses a stuck one exactly as it does a
//            stream wait, and releases it the same way (it writes the awaited words into the own
//            flags; the copy completes while the kernel spins);
//   reduces  after the waits, so the peers' chunks in the own window are visible.
// The fused head (free_signals, free_waits: the slot-free handshake, which otherwise is a stream
// memop call before the launch): CTA 0's first thread signals every peer when the kernel starts
// (every earlier operation of the stream has completed then), and every CTA's first thread spins
// on the own slot-free flags before its first store, between watchdog marks of their own (a
// second record, as a memop call's would be). The lowering fuses the head run by run only: a
// capture keeps it a memop node, which clears its own flags. A captured run (`equal`) resets the
// data-ready flags it waited on in the kernel, so no clear node follows it: the last CTA to get
// past them does (the window's second counter; a peer signals data-ready again only after this
// rank's next slot-free signal, which comes after this kernel ends).
// The CTAs that spin hold SMs while they wait, so this is for small buckets only, at most one CTA
// per SM and rank on the GPU, and only where every peer's kernels can run while this one waits
// (ranks that are threads of this process, or on other GPUs: CudaWindow::peers_run_beside_own()).
inline constexpr int kCastToPeersCasts = 32;
inline constexpr int kCastToPeersCopies = 32;
inline constexpr int kCastToPeersReduces = 16;
inline constexpr int kCastToPeersSources = 128;  // sources of all its reduces
inline constexpr int kCastToPeersPeers = 16;     // signals, and waits

// dst[0:bytes] = src[0:bytes], then dst[bytes:bytes + zero_bytes] = 0 (a same-type cast's pad).
struct CopySpec {
  const void* src;
  void* dst;
  std::size_t bytes;
  std::size_t zero_bytes = 0;
};

// Copies on the SMs (stores, into the peers' windows as well), one launch for up to
// kLargeCopyTasks of them: what the lowering uses for a step's copies that would otherwise be one
// copy-engine operation each (a reduce-scatter's pushes from gradients wherever they are), since
// every copy-engine operation costs the host microseconds.
inline constexpr int kLargeCopyTasks = 680;
LaunchInfo launch_copies(const CopySpec* specs, std::size_t num_specs, cudaStream_t stream);
Launches copy_launches(const CopySpec* specs, std::size_t num_specs);

struct CastToPeersSpec {
  const CastSpec* casts = nullptr;  // contiguous destinations only (rows == 1)
  std::size_t num_casts = 0;
  const CopySpec* copies = nullptr;
  std::size_t num_copies = 0;
  uint64_t* signals[kCastToPeersPeers] = {};      // a peer's FlagWord (epoch, then tag)
  int num_signals = 0;
  const uint64_t* waits[kCastToPeersPeers] = {};  // own FlagWords
  int num_waits = 0;
  uint64_t* free_signals[kCastToPeersPeers] = {};  // the fused slot-free handshake: peers' FlagWords
  int num_free_signals = 0;
  uint64_t* free_waits[kCastToPeersPeers] = {};    // own FlagWords
  int num_free_waits = 0;
  uint64_t epoch = 0;
  uint64_t tag = 0;
  // A captured run (CUDA graph): its flags carry a fixed value that every replay writes, and a
  // wait passes when the flag's epoch word equals `epoch` (GEQ otherwise); the kernel resets the
  // awaited flags (above), so the next replay waits for the next signal.
  bool equal = false;
  unsigned int* arrivals = nullptr;  // the window's two CTA counters (arrivals[0], [1]): 0 between launches
  uint64_t* reached = nullptr;       // the watchdog's marks (device addresses of host memory)
  uint64_t* passed = nullptr;
  uint64_t wait_id = 0;       // the waits' watched record
  uint64_t free_wait_id = 0;  // the fused slot-free waits' (marked in the same slot)
  int ranks_on_gpu = 1;                 // ranks whose cast-to-peers kernels share this GPU (the grid's share)
  const ReduceSpec* reduces = nullptr;  // none writing what another reads or writes
  std::size_t num_reduces = 0;
  int num_sources = 0;
};

// Whether the spec fits one launch (the k* limits above); launch_cast_to_peers throws InvalidArgument
// otherwise.
bool cast_to_peers_fits(std::size_t casts, std::size_t copies, int signals, int waits,
                  std::size_t reduces, int num_sources);
LaunchInfo launch_cast_to_peers(const CastToPeersSpec& spec, cudaStream_t stream);

// The CUDA IPC network's receive (CudaWindowScope::kHost): dst[0:bytes] = peer_data[*offset:][0:bytes],
// the offset read on the device from the mailbox entry the sender posted (the receiver's host does
// not know it). An offset past `limit - bytes` (only after the watchdog released a stuck transfer)
// copies nothing. At most kNetPullCtas CTAs, as NCCL drives a peer transfer with a few channels.
inline constexpr int kNetPullCtas = 16;
LaunchInfo launch_net_pull(const uint64_t* offset, const void* peer_data, void* dst,
                           std::size_t bytes, std::size_t limit, cudaStream_t stream);

}  // namespace tide::cuda_kernels
