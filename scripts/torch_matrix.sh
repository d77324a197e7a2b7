#!/usr/bin/env bash
# The tide.fsdp tests on a second torch version, after scripts/test.sh installed tide into this
# Python: a virtual environment that sees this Python's packages (tide, pytest, numpy) with its
# own torch on top. tide's extension does not link torch, so the installed build serves both.
#   scripts/torch_matrix.sh [torch version]   (default 2.14.1)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.14.1}
PY=${PYTHON:-python3}
venv=${TIDE_MATRIX_VENV:-build/torch-$version}
echo "== tide.fsdp tests on torch $version ($venv)"
[[ -x "$venv/bin/python" ]] || "$PY" -m venv --system-site-packages "$venv"
"$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null ||
  "$venv/bin/python" -m pip install -q "torch==$version"
"$venv/bin/python" -c "import torch, tide; print('   torch', torch.__version__, '| tide', tide.__file__)"
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python/test_extension.py \
  tests/python/test_fsdp_conformance.py tests/python/test_fsdp_dtensor.py tests/python/test_fsdp.py \
  tests/python/test_fsdp_extensions.py tests/python/test_fsdp_lifetime.py tests/python/test_fsdp_window.py \
  tests/python/test_fsdp_shard_dim.py -k "not cuda and not cpu-W3"
