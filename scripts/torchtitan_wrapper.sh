#!/usr/bin/env bash
# torchtitan's own CUDA-graph wrapper (and torchao's float8 training) for a GPU machine that
# reaches no package registry: run this where PyPI is reachable; it puts torchtitan 0.3.0 and the
# pure-Python packages that `torchtitan.distributed.cudagraph` imports, and torchao 0.18.0 without
# its compiled kernels (float8 training is Python; kernels built for another torch need not load),
# into build-titan/ (ignored by git, ~15 MB). Carry that folder with the tree; the GPU gate's python
# stage then puts it on PYTHONPATH, so tests/python/test_fsdp_cuda_graphs.py steps captured training
# with torchtitan's CUDAGraphWrapper (which the test then requires) instead of
# tide.bench.captured_step.CapturedStep, and runs its float8 configuration.
# torchtitan's other dependencies are not needed for that import. Its trainer (`torchtitan.train`,
# which scripts/torchtitan_gpu.sh runs) imports more: torchdata, tokenizers (compiled: the wheel for
# TITAN_PLATFORM, default manylinux2014_x86_64, and Python TITAN_PYTHON_VERSION, default 3.12, the
# GPU machine's), tensorboard (torchtitan imports its SummaryWriter; with protobuf and absl-py) and
# typeguard (tyro checks the trainer's arguments with it; with the typing_extensions it needs).
# Those go to build-titan/trainer/, which only scripts/torchtitan_gpu.sh puts on PYTHONPATH, so
# nothing else sees their versions. `datasets` (pyarrow, pandas: too large to carry) is not
# carried: tests/python/torchtitan_shared_gpu.py stands in for it where it is not installed.
# Versions are pinned to what was checked to import: the wrapper and torchao on torch 2.11 and
# 2.13, the trainer's packages on torch 2.13 (CPU).
#   scripts/torchtitan_wrapper.sh [folder]     (default build-titan; ~40 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-build-titan}
PY=${PYTHON:-python3}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$PY" -m pip download -q --no-deps -d "$wheels" "torchtitan==0.3.0" "spmd_types==0.2.3" \
  "tyro==1.0.17" "docstring_parser==0.18.0" "torchao==0.18.0"
"$PY" -m pip download -q --no-deps --only-binary=:all: --platform "${TITAN_PLATFORM:-manylinux2014_x86_64}" \
  --python-version "${TITAN_PYTHON_VERSION:-3.12}" --implementation cp -d "$wheels/trainer" \
  "torchdata==0.11.0" "tokenizers==0.23.3" "tensorboard==2.21.0" "protobuf==7.36.2" "absl-py==2.5.1" \
  "typeguard==4.6.1" "typing_extensions==4.16.0"
rm -rf "$dest" && mkdir -p "$dest/trainer"
for w in "$wheels"/*.whl; do
  "$PY" -m zipfile -e "$w" "$dest"
done
for w in "$wheels"/trainer/*.whl; do
  "$PY" -m zipfile -e "$w" "$dest/trainer"
done
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
find "$dest/torchao" -name "*.so" -delete
PYTHONPATH="$dest" "$PY" -c "from torchtitan.distributed.cudagraph import CUDAGraphWrapper" ||
  { echo "torchtitan_wrapper.sh: torchtitan's CUDA-graph wrapper does not import from $dest"; exit 1; }
PYTHONPATH="$dest" "$PY" -c "from torchao.float8 import convert_to_float8_training" ||
  { echo "torchtitan_wrapper.sh: torchao's float8 training does not import from $dest"; exit 1; }
PYTHONPATH="$dest/trainer:$dest" "$PY" -c "import tokenizers, torchdata.stateful_dataloader
from torch.utils.tensorboard import SummaryWriter" ||
  { echo "torchtitan_wrapper.sh: the trainer's packages do not import from $dest/trainer"; exit 1; }
echo "torchtitan 0.3.0's CUDA-graph wrapper and torchao 0.18.0's float8 training in $dest, its trainer's" \
  "packages in $dest/trainer ($(du -sh "$dest" | cut -f1)); carry it to the GPU machine"
