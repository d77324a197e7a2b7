#!/usr/bin/env bash
# torchtitan as a TIDE client, on CPU: makes a venv with torch 2.13.0, torchtitan 0.3.0 and triton
# (torchtitan imports it unconditionally), installs TIDE into it, and runs tests/python/test_torchtitan.py
# (torchtitan's own trainer, llama3 debug model, W = 2 over gloo, `--module llama3` vs
# `--module tide.torchtitan`, bitwise). CI runs it (.ci/run).
# Environment: TITAN_VENV (default .venv-titan in the repo), PYTHON (default python3),
# TIDE_TITAN_STEPS (default 20 here; the test's own default is 10).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv="${TITAN_VENV:-.venv-titan}"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "== venv $venv"
  "$PY" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torchtitan, triton, torchao, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  echo "== installing torch 2.13.0, torchtitan 0.3.0, triton, torchao (its float8 converter) and the build tools"
  "$venv/bin/pip" install -q "torch==2.13.0" nanobind scikit-build-core pytest numpy cmake ninja
  "$venv/bin/pip" install -q "torchtitan==0.3.0" triton "torchao>=0.17"
fi
echo "== installing TIDE (builds the C++ extension)"
"$venv/bin/pip" install -q --no-build-isolation .
echo "== pytest tests/python/test_torchtitan.py"
TIDE_TITAN_STEPS="${TIDE_TITAN_STEPS:-20}" "$venv/bin/python" -m pytest tests/python/test_torchtitan.py -v -rs
