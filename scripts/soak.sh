#!/usr/bin/env bash
# The long reliability run (not part of CI): the soak test with 10^4 random collectives instead of
# CI's 2000, then the API fuzzer at 10x its CI case count with a fresh seed (printed, so a failure
# can be replayed with TIDE_FUZZ_SEED=<seed>).
# Environment: TIDE_SOAK_ITERATIONS (default 10000), TIDE_FUZZ_SCALE (default 10), TIDE_FUZZ_SEED
# (default: from the clock), TIDE_SOAK_SANITIZE=1 to run both under ASan + UBSan (the build of
# scripts/sanitize.sh), TIDE_BUILD_DIR (default build) otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
jobs="$(nproc 2>/dev/null || echo 2)"

if [[ "${TIDE_SOAK_SANITIZE:-0}" == 1 ]]; then
  build="${TIDE_SANITIZE_BUILD_DIR:-build-sanitize}"
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
    -DTIDE_SANITIZE=address,undefined -DTIDE_CUDA=OFF -DTIDE_BUILD_PYTHON=OFF -DTIDE_BUILD_BENCH=OFF
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:abort_on_error=1}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
else
  build="${TIDE_BUILD_DIR:-build}"
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build "$build" -j "$jobs" --target tide_tests

export TIDE_SOAK_ITERATIONS="${TIDE_SOAK_ITERATIONS:-10000}"
export TIDE_FUZZ_SCALE="${TIDE_FUZZ_SCALE:-10}"
export TIDE_FUZZ_SEED="${TIDE_FUZZ_SEED:-$(date +%s)}"
echo "== soak: ${TIDE_SOAK_ITERATIONS} collectives; fuzz: ${TIDE_FUZZ_SCALE}x cases, seed ${TIDE_FUZZ_SEED}"
"$build/tests/tide_tests" --gtest_filter='Soak.*:Fuzz.*'
