#!/usr/bin/env bash
# The tide.fsdp tests on a second torch version, after scripts/test.sh installed tide into this
# Python: a virtual environment that sees this Python's packages (tide, pytest, numpy) with its
# own torch on top. tide's extension does not link torch, so the installed build serves both.
# With them, tide-bench's compute-only reference (stand-ins for FSDP2's collectives, which return
# what each version's FSDP2 unpacks): one short stock and compute-only run at W = 2.
#   scripts/torch_matrix.sh [torch version]   (default 2.14.1)
# A release this machine's pip sources or configuration do not give (its global constraints file
# caps torch at the releases on its disk: `pip config list`) comes from PyPI into a wheel directory
# kept per version, $TIDE_WHEEL_CACHE/torch-<version> (default ~/.cache/tide/wheels), and is
# installed from there into this venv alone, with the cap lifted for those pip calls only
# (PIP_CONSTRAINT=/dev/null stands in for the configured file). torch 2.15.0 on PyPI is only its
# CUDA 13.2 build (it runs on CPU): about 3 GB of wheels, downloaded once per machine.
# TIDE_MATRIX_DROP=1 removes the venv and the wheels this run downloaded once the tests end, pass or
# fail: a CUDA build of torch takes 5 GB or more installed, and CI runs several in turn.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.14.1}
PY=${PYTHON:-python3}
venv=${TIDE_MATRIX_VENV:-build/torch-$version}
wheels=${TIDE_WHEEL_CACHE:-$HOME/.cache/tide/wheels}/torch-$version
echo "== tide.fsdp tests on torch $version ($venv; $(df -h --output=avail . | tail -1 | tr -d ' ') free on this disk)"
downloaded=0
drop() {
  rm -rf "$venv"
  ((downloaded)) && rm -rf "$wheels"
  return 0
}
[[ ${TIDE_MATRIX_DROP:-0} == 1 ]] && trap drop EXIT
[[ -x "$venv/bin/python" ]] || "$PY" -m venv --system-site-packages "$venv"
has_version() {
  "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null
}
install_cached() {
  PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" "torch==$version"
}
if ! has_version; then
  if compgen -G "$wheels/torch-$version-*.whl" >/dev/null; then
    install_cached
  elif ! "$venv/bin/python" -m pip install -q "torch==$version"; then
    echo "   torch $version is not in this machine's pip sources or is capped there: downloading it into $wheels"
    downloaded=1  # the directory had no torch wheel: what it holds now is this run's
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip download -q -d "$wheels" "torch==$version"
    install_cached
  fi
  has_version || { echo "torch_matrix.sh: $venv has torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'), expected $version" >&2; exit 1; }
fi
"$venv/bin/python" -c "import torch, tide; print('   torch', torch.__version__, '| tide', tide.__file__)"
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/python/test_extension.py \
  tests/python/test_fsdp_conformance.py tests/python/test_fsdp_dtensor.py tests/python/test_fsdp.py \
  tests/python/test_fsdp_extensions.py tests/python/test_fsdp_lifetime.py tests/python/test_fsdp_window.py \
  tests/python/test_fsdp_shard_dim.py tests/python/test_bench_cli.py::test_compute_only_collectives_move_nothing \
  -k "not cuda and not cpu-W3"
