#!/usr/bin/env bash
# Every test: builds the C++ library and tests (CUDA sources too when nvcc is present), runs them
# with CTest (GPU tests skip visibly without a GPU), installs the Python package, runs pytest.
#
# Prerequisites come first, in seconds: the Python ones (torch, pytest, numpy, matplotlib, the
# build backend, cmake, ninja) are pip-installed into this Python when missing; GoogleTest is
# installed from the distribution (apt-get install libgtest-dev) when it is missing and this user
# may install packages (root, or sudo without a password). Otherwise a missing C++ compiler or
# GoogleTest stops the script at once with the one command to run.
# Environment: TIDE_BUILD_DIR (default build), TIDE_CMAKE_ARGS (extra CMake arguments),
# PYTHON (default python3), TIDE_GTEST_HEADERS (where to look for gtest/gtest.h, space-separated;
# default /usr/include /usr/local/include).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
build="${TIDE_BUILD_DIR:-build}"
jobs="$(nproc 2>/dev/null || echo 2)"

echo "== prerequisites"
stop() { echo "scripts/test.sh: $1" >&2; echo "  run: $2" >&2; exit 2; }
command -v "$PY" >/dev/null || stop "no $PY" "apt-get install python3 python3-venv (or set PYTHON)"
command -v "${CXX:-c++}" >/dev/null || stop "no C++20 compiler (${CXX:-c++})" "apt-get install g++"
gtest_found() {
  [[ -n "${GTest_ROOT:-}" ]] && return 0
  local d
  for d in ${TIDE_GTEST_HEADERS:-/usr/include /usr/local/include}; do [[ -f $d/gtest/gtest.h ]] && return 0; done
  return 1
}
# The command that installs packages as this user: "" (root), "sudo -n" (passwordless sudo), or
# nothing (exit 1).
as_root() {
  if [[ $(id -u) == 0 ]]; then echo ""; return 0; fi
  command -v sudo >/dev/null && sudo -n true 2>/dev/null && { echo "sudo -n"; return 0; }
  return 1
}
if ! gtest_found; then
  if command -v apt-get >/dev/null && root=$(as_root); then
    echo "   GoogleTest not found: installing libgtest-dev with apt-get"
    # shellcheck disable=SC2086
    { DEBIAN_FRONTEND=noninteractive $root apt-get install -y -q libgtest-dev ||
      { $root apt-get update -q && DEBIAN_FRONTEND=noninteractive $root apt-get install -y -q libgtest-dev; }; } >&2 ||
      stop "apt-get could not install libgtest-dev" "sudo apt-get update && sudo apt-get install libgtest-dev"
  fi
  gtest_found ||
    stop "GoogleTest not found (the C++ tests need it; or set GTest_ROOT)" "sudo apt-get install libgtest-dev"
fi
# name to import = requirement to install (torch: the versions tide supports, pyproject.toml)
declare -A PY_REQS=([torch]="torch>=2.11,<2.16" [pytest]=pytest [numpy]=numpy [matplotlib]=matplotlib
                    [nanobind]="nanobind>=2.0" [scikit_build_core]="scikit-build-core>=0.10")
missing=()
for mod in "${!PY_REQS[@]}"; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("${PY_REQS[$mod]}")
done
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja)
if ((${#missing[@]})); then
  echo "   installing into $("$PY" -c 'import sys; print(sys.prefix)'): ${missing[*]}"
  "$PY" -m pip install -q "${missing[@]}" ||
    stop "pip could not install ${missing[*]}" "$PY -m pip install ${missing[*]}"
  hash -r
fi
# torchao: optional (the float8 and NF4 extension tests skip without it); one ~3 MB wheel, no
# dependencies. A failed install (no network) does not stop the tests.
"$PY" -c "import torchao" 2>/dev/null || "$PY" -m pip install -q "torchao>=0.17" 2>/dev/null ||
  echo "   torchao not installed (pip failed): the float8 and NF4 extension tests skip"
# transformers and accelerate: optional too (tests/python/test_huggingface.py skips without them);
# the versions of pyproject.toml's [hf] extra. Their own dependencies are small wheels.
"$PY" -c "import transformers, accelerate" 2>/dev/null ||
  "$PY" -m pip install -q "transformers>=5.25" "accelerate>=1.16" 2>/dev/null ||
  echo "   transformers/accelerate not installed (pip failed): the Hugging Face tests skip"
"$PY" -c "import torch; print('   torch', torch.__version__)"

echo "== C++: configure, build, ctest"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# shellcheck disable=SC2086
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${TIDE_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"

echo "== Python: install the package, pytest"
"$PY" -m pip install -q --no-build-isolation .
"$PY" -m pytest tests/python -v -rs
