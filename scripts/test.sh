#!/usr/bin/env bash
# Every test: builds the C++ library and tests (CUDA sources too when nvcc is present), runs them
# with CTest (GPU tests skip visibly without a GPU), installs the Python package, runs pytest.
# Environment: TIDE_BUILD_DIR (default build), TIDE_CMAKE_ARGS (extra CMake arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${TIDE_BUILD_DIR:-build}"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
jobs="$(nproc 2>/dev/null || echo 2)"

echo "== C++: configure, build, ctest"
# shellcheck disable=SC2086
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${TIDE_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"

echo "== Python: install the package, pytest"
python3 -m pip install -q --no-build-isolation .
python3 -m pytest tests/python -v -rs
