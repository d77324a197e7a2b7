#!/usr/bin/env bash
# The one script a GPU run calls: build (or take prebuilt binaries), run the GPU tests, check a
# small case under compute-sanitizer, run the benchmarks. Logs go to $OUT (or ./gpu-out).
#
#   scripts/gpu_suite.sh [quick|full|tests|bench|sanitize]   (default: full)
#   scripts/gpu_suite.sh bench <tide_bench_cuda mode> [args]   (e.g. bench compare --quick)
#
# Environment:
#   TIDE_PREBUILT  a folder holding tide_gpu_tests and tide_bench_cuda built elsewhere; used when
#                  they run here, else the script builds from source (build-gpu/).
#   OUT            where logs and the test report go.
# GoogleTest: find_package first; else built from /usr/src/googletest or third_party/googletest.
set -uo pipefail
# NVLink multicast must never run on shared machines (it can take a host's GPUs down); TIDE never
# uses it, and nothing this script starts may either.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Ranks as threads of one process need a hardware queue per stream (include/tide/cuda.hpp).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}

MODE=${1:-full}
shift $(( $# > 0 ? 1 : 0 ))  # the rest goes to tide_bench_cuda (e.g. --quick)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
LOG="$OUT/suite.log"
: >"$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
status=0

say "gpu_suite $MODE  $(date -u +%Y-%m-%dT%H:%M:%SZ)  host $(hostname)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$LOG"
nvidia-smi 2>&1 | head -12 >>"$LOG"
(nvcc --version | tail -2; cmake --version | head -1) 2>&1 | tee -a "$LOG"
ls -d /usr/src/googletest /usr/include/gtest 2>&1 | tee -a "$LOG"

# ---- Binaries. ----
BIN=""
if [[ -n "${TIDE_PREBUILT:-}" && -x "$TIDE_PREBUILT/tide_gpu_tests" && -x "$TIDE_PREBUILT/tide_bench_cuda" ]] &&
   "$TIDE_PREBUILT/tide_gpu_tests" --gtest_list_tests >/dev/null 2>&1; then
  BIN=$TIDE_PREBUILT
  say "using prebuilt binaries in $BIN"
else
  say "building from source"
  GTEST_ARGS=()
  if ! ls /usr/lib/*/cmake/GTest/GTestConfig.cmake /usr/lib/cmake/GTest/GTestConfig.cmake \
       /usr/local/lib/cmake/GTest/GTestConfig.cmake >/dev/null 2>&1; then
    GTEST_SRC=""
    for d in /usr/src/googletest "$ROOT/third_party/googletest"; do
      [[ -f "$d/CMakeLists.txt" ]] && GTEST_SRC=$d && break
    done
    if [[ -n "$GTEST_SRC" ]]; then
      say "building GoogleTest from $GTEST_SRC"
      cmake -S "$GTEST_SRC" -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON -DCMAKE_INSTALL_PREFIX=/tmp/gtest >>"$LOG" 2>&1 &&
        cmake --build /tmp/gtest-build -j16 >>"$LOG" 2>&1 && cmake --install /tmp/gtest-build >>"$LOG" 2>&1
      GTEST_ARGS=(-DGTest_ROOT=/tmp/gtest)
    else
      say "no GoogleTest found: only the benchmark can be built"
    fi
  fi
  cmake -S "$ROOT" -B "$ROOT/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_PYTHON=OFF \
    -DTIDE_CUDA=ON "${GTEST_ARGS[@]}" >>"$LOG" 2>&1 || { say "configure failed (see suite.log)"; tail -30 "$LOG"; exit 1; }
  cmake --build "$ROOT/build-gpu" -j16 --target tide_gpu_tests tide_bench_cuda >>"$LOG" 2>&1 ||
    { say "build failed"; tail -40 "$LOG"; exit 1; }
  BIN="$ROOT/build-gpu"
  cp "$BIN/tests/gpu/tide_gpu_tests" "$BIN/bench/cuda/tide_bench_cuda" "$BIN/" 2>/dev/null
fi

# cuBLAS for the interference benchmark (loaded at run time).
if [[ -z "${TIDE_CUBLAS_LIB:-}" ]]; then
  SITES=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
  CUBLAS=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt $SITES -name 'libcublas.so.13*' 2>/dev/null | head -1)
  [[ -n "$CUBLAS" ]] && export TIDE_CUBLAS_LIB=$CUBLAS && say "cuBLAS: $CUBLAS"
fi

# NCCL for the network transport and the baselines (loaded at run time): PyTorch's wheel ships it.
if [[ -z "${TIDE_NCCL_LIB:-}" ]]; then
  SITES=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
  NCCL=$(find $SITES /usr/lib/x86_64-linux-gnu /usr/local -name 'libnccl.so.2*' 2>/dev/null | head -1)
  [[ -n "$NCCL" ]] && export TIDE_NCCL_LIB=$NCCL && say "NCCL: $NCCL"
fi
nvidia-smi topo -m 2>&1 | head -8 >>"$LOG"

run_tests() {
  say "tide_gpu_tests"
  timeout ${TESTS_TIMEOUT:-420} "$BIN/tide_gpu_tests" --gtest_output="xml:$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  local rc=${PIPESTATUS[0]}
  say "tide_gpu_tests exit $rc"
  [[ $rc == 0 ]] || status=1
}

# What compute-sanitizer checks: every GPU test that runs in one process (ranks as threads, or a
# single rank), each as "gtest filter|environment|tests it must pass|tools|runs" (no tools: all
# three; no runs: 1).
# Tests whose ranks are fork()ed processes cannot run under it (docs/testing.md names them and why).
SANITIZER_CASES=(
  # one rank: the kernels' vector, scalar and tail paths, AG and RS with accumulate
  "CudaKernels.SingleRankCastAndReduce||1"
  # one rank: an executor refused on a window that has one; bad bindings refused before enqueuing
  "CudaCollectives.OneExecutorPerWindow:CudaCollectives.RejectsBadBindingsBeforeEnqueuing||2"
  # ranks as threads, W = 2 and 4, AG then RS: copy-engine pushes (Delivery::kPush) and the cast
  # into the peers' windows (kCastToPeers) as stream operations. The cast-to-peers kernel is off here:
  # it spins on flags its peers' kernels write, and the sanitizer runs one kernel at a time. Under
  # racecheck only, 10 runs. Not under memcheck: there 6 of 19 runs hung (passes take 1-2 s)
  # with no output on one H200, every thread of the test in a futex wait but one running, the
  # watchdogs silent past their timeout (their copies cannot be issued either). That reads as a
  # host deadlock inside the sanitizer (thread states from /proc, no symbolized stack): a launch it
  # makes wait for its kernel, queued behind a wait for a flag another rank's thread has yet to
  # enqueue while that thread waits for the launch's lock. Without the
  # sanitizer the case passed 40 of 40 runs; memcheck covers these kernels in the single-rank case.
  # Not under synccheck either: under it the ranks' stream waits did not finish in 300 s.
  "CudaCollectives.RanksAsThreadsOfOneProcess|TIDE_CUDA_CAST_TO_PEERS=0|1|racecheck|10"
  # the same ranks as threads, W = 3, with AG and RS captured in CUDA graphs and replayed between
  # run-by-run runs (copy-engine pushes: the stream path's captured waits and clears); racecheck
  # only, as the case above
  "CudaGraphs.ReplaysMatchRunByRunAsThreadsPushing||1|racecheck|3"
  # the cast-to-peers kernel itself: one rank's kernel stuck on a flag, released by the watchdog (its
  # peers run no kernel), in both outcomes (DesyncError, TimeoutError)
  "CudaCollectives.AStuckCastToPeersKernelTimesOutLikeAStreamWait||1"
)

# What every thread of the processes running the GPU tests is blocked in (kernel wait channel and
# system call, from /proc: attaching cuda-gdb to a process under compute-sanitizer killed it), into
# $1: a hang's evidence.
dump_stacks() {
  local pid task
  for pid in $(pgrep -f "tide_gpu_tests --gtest_filter"); do
    echo "=== pid $pid: $(tr '\0' ' ' </proc/"$pid"/cmdline)"
    for task in /proc/"$pid"/task/*; do
      echo "${task##*/} $(cat "$task"/comm) wchan=$(cat "$task"/wchan) syscall=$(cut -d' ' -f1 "$task"/syscall)"
    done
  done >"$1" 2>&1
}

# Runs "$@" with its output in $1; past SANITIZER_STACKS_AFTER seconds, dumps the stacks to
# $1.stacks once (the command's own timeout then ends it). Returns its exit status.
run_watched() {
  local log=$1 waited=0 pid; shift
  "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    if (( ++waited == ${SANITIZER_STACKS_AFTER:-60} )); then
      say "still running after $waited s: stacks to $log.stacks"
      dump_stacks "$log.stacks"
    fi
  done
  wait "$pid"
}

run_sanitizer() {
  # racecheck checks shared-memory hazards, synccheck barriers; memcheck is the one that matters
  # when time is short (SANITIZER_TOOLS="memcheck").
  local tool entry filter env want tools runs run rc log
  for tool in ${SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
    for entry in "${SANITIZER_CASES[@]}"; do
      IFS='|' read -r filter env want tools runs <<<"$entry"
      [[ -z "$tools" || " $tools " == *" $tool "* ]] || continue
      for ((run = 1; run <= ${runs:-1}; ++run)); do
        log="$OUT/sanitizer_${tool}_${filter%%:*}.log"
        say "compute-sanitizer --tool $tool $filter ${env} (run $run of ${runs:-1})"
        # TIDE_GPU_TEST_IN_PROCESS: the single "process" of a test runs in this one (a fork()ed
        # child never finished under the sanitizer).
        # shellcheck disable=SC2086
        run_watched "$log" env TIDE_GPU_TEST_IN_PROCESS=1 $env timeout ${SANITIZER_TIMEOUT:-120} \
          compute-sanitizer --tool "$tool" --error-exitcode 3 \
          "$BIN/tide_gpu_tests" --gtest_filter="$filter"
        rc=$?
        # A skipped test exits 0 but checked nothing.
        grep -q "PASSED  \] $want tests\?\." "$log" || { [[ $rc == 0 ]] && rc=4; }
        tail -4 "$log" | tee -a "$LOG"
        say "compute-sanitizer $tool $filter exit $rc"
        [[ $rc == 0 ]] || { status=1; cp "$log" "$log.run$run"; }
      done
    done
  done
}

run_bench() {
  local mode=all
  [[ $# -gt 0 && $1 != -* ]] && mode=$1 && shift
  say "tide_bench_cuda $mode $*"
  timeout ${BENCH_TIMEOUT:-560} "$BIN/tide_bench_cuda" "$mode" "$@" 2>&1 | tee "$OUT/bench_$mode.log"
  local rc=${PIPESTATUS[0]}
  say "tide_bench_cuda exit $rc"
  [[ $rc == 0 ]] || status=1
}

case "$MODE" in
  tests) run_tests ;;
  sanitize) run_sanitizer ;;
  bench) run_bench "$@" ;;
  quick) run_tests; run_bench --quick "$@"; run_sanitizer ;;
  full) run_tests; run_bench "$@"; run_sanitizer ;;
  *) echo "usage: $0 [quick|full|tests|bench|sanitize]"; exit 2 ;;
esac
say "gpu_suite $MODE done, status $status"
exit $status
