#!/usr/bin/env bash
# The runs that need one GPU per rank, on a machine with N >= 2 GPUs of one host, one
# rank per GPU over NCCL. Each run's output goes to OUT/<run>-<case>.log; OUT/machine.txt names the
# commit, GPUs, driver, torch and NCCL every row was measured with; OUT/summary.txt lists each
# command and its result.
#
#   scripts/multi_gpu.sh [--dry-run] [--gpus N] [--only LIST] [--out DIR]
#
#   --dry-run    check the arguments, the GPUs here, that every subcommand and flag the runs use
#                exists (tide-bench's --help, tide_bench_cuda's argument parser, torchtitan's --help
#                where torchtitan imports), and print what would run; runs nothing, needs no GPU
#   --gpus N     the GPUs to use, N >= 2 (default: every GPU nvidia-smi lists)
#   --only LIST  comma-separated runs (default: all): fsdp, symm-mem, torchtitan, compare,
#                interference, virtual-nodes, hf
#   --out DIR    logs (default: multi-gpu-out/)
#
# Environment: PYTHON (default python3: tide installed, or PYTHONPATH=python with the extension
# built), TITAN_PYTHON (the Python with torchtitan 0.3.0 and torchao, default $PYTHON; e.g.
# scripts/torchtitan_check.sh's .venv-titan/bin/python), TIDE_BENCH_CUDA or TIDE_PREBUILT (a built
# tide_bench_cuda; else build-gpu/tide_bench_cuda, built there by this script when missing),
# TIDE_NCCL_LIB (default: PyTorch's libnccl), RUN_TIMEOUT (seconds per command, default 1800).
# Exit status: 0 when every command ran and passed (what is not implemented is listed, not
# counted); 1 when a command failed or could not run, or a check failed; 2 for bad arguments.
set -uo pipefail
# NVLink multicast can take a shared host's GPUs out of service; TIDE never uses it, and nothing
# this script starts may either (NCCL's NVLS, torch's symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
RUNS=(fsdp symm-mem torchtitan compare interference virtual-nodes hf)
PY=${PYTHON:-python3}
TITAN_PY=${TITAN_PYTHON:-$PY}
TIMEOUT=${RUN_TIMEOUT:-1800}

usage() {
  echo "usage: scripts/multi_gpu.sh [--dry-run] [--gpus N] [--only LIST] [--out DIR]"
  echo "  runs: ${RUNS[*]}"
}
fail_usage() {
  echo "multi_gpu.sh: $*" >&2
  usage >&2
  exit 2
}

DRY=false GPUS="" ONLY="" OUT=$ROOT/multi-gpu-out
while (($#)); do
  case $1 in
    --dry-run) DRY=true ;;
    --gpus | --only | --out)
      [[ $# -ge 2 && -n $2 ]] || fail_usage "$1: expected a value"
      case $1 in --gpus) GPUS=$2 ;; --only) ONLY=$2 ;; --out) OUT=$2 ;; esac
      shift ;;
    -h | --help) usage; exit 0 ;;
    *) fail_usage "unknown argument '$1'" ;;
  esac
  shift
done
if [[ -n $GPUS ]] && ! [[ $GPUS =~ ^[0-9]+$ && $GPUS -ge 2 ]]; then
  fail_usage "--gpus '$GPUS': expected an integer >= 2 (one rank per GPU)"
fi
SELECTED=("${RUNS[@]}")
if [[ -n $ONLY ]]; then
  IFS=, read -ra SELECTED <<<"$ONLY"
  for r in "${SELECTED[@]}"; do
    [[ " ${RUNS[*]} " == *" $r "* ]] || fail_usage "--only: unknown run '$r'"
  done
fi
selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

# ---- The machine. ----
HERE=0
if command -v nvidia-smi >/dev/null 2>&1; then
  HERE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
elif "$PY" -c 'import torch' 2>/dev/null; then
  HERE=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
fi
if [[ -z $GPUS ]]; then
  if ((HERE >= 2)); then
    GPUS=$HERE
  elif $DRY; then
    GPUS=2
    echo "== this machine has $HERE GPU(s): showing the runs at N = 2 (--gpus N for others)"
  else
    echo "multi_gpu.sh: this machine has $HERE GPU(s); these runs need 2 or more, one rank per GPU" >&2
    exit 2
  fi
elif ((GPUS > HERE)); then
  if $DRY; then
    echo "== this machine has $HERE GPU(s): the runs below need $GPUS"
  else
    echo "multi_gpu.sh: --gpus $GPUS: this machine has $HERE GPU(s)" >&2
    exit 2
  fi
fi
DEVICES=$(seq -s, 0 $((GPUS - 1)))
devices() { seq -s, 0 $(($1 - 1)); }  # the first $1 GPUs, for CUDA_VISIBLE_DEVICES

$DRY || mkdir -p "$OUT"
SUMMARY=()
record() { SUMMARY+=("$1"); echo "== $1"; }
MISSING=0

# ---- Checks: every subcommand and flag a run uses must exist. ----
need_bench_flags() {  # need_bench_flags SUBCOMMAND FLAG...: from tide-bench SUBCOMMAND --help
  local sub=$1 flag text
  shift
  text=$("$PY" -m tide.bench.cli "$sub" --help 2>&1)
  if [[ $text != *"usage: tide-bench $sub"* ]]; then
    echo "  CHECK FAILED: tide-bench $sub --help did not run with $PY: ${text:0:300}"
    MISSING=$((MISSING + 1))
    return
  fi
  for flag; do
    if ! grep -qE -- "(^|[ ,\[])$flag([ ,=]|$)" <<<"$text"; then
      echo "  CHECK FAILED: tide-bench $sub has no flag $flag"
      MISSING=$((MISSING + 1))
    fi
  done
}
need_cuda_flags() {  # need_cuda_flags MODE FLAG...: from tide_bench_cuda's argument parser
  local src=bench/cuda/bench_cuda.cpp mode=$1 flag
  shift
  if ! grep -qF "args.mode == \"$mode\"" "$src"; then
    echo "  CHECK FAILED: tide_bench_cuda has no mode $mode ($src)"
    MISSING=$((MISSING + 1))
  fi
  for flag; do
    if ! grep -qF "a == \"$flag\"" "$src"; then
      echo "  CHECK FAILED: tide_bench_cuda has no option $flag ($src)"
      MISSING=$((MISSING + 1))
    fi
  done
}
need_titan_flags() {  # need_titan_flags CONFIG FLAG...: torchtitan's own --help, where it imports
  local config=$1 flag flag_ text
  shift
  if ! "$TITAN_PY" -c 'import torchtitan' 2>/dev/null; then
    echo "  NOT CHECKED here: torchtitan does not import with $TITAN_PY (TITAN_PYTHON: a Python with" \
      "torchtitan 0.3.0, e.g. scripts/torchtitan_check.sh's .venv-titan/bin/python)"
    return
  fi
  # tyro's help spells a field's underscores as given or as dashes: compare both with underscores
  text=$("$TITAN_PY" -m torchtitan.config.manager --module llama3 --config "$config" --help 2>&1)
  if [[ $text != *usage* ]]; then
    echo "  CHECK FAILED: torchtitan's --help did not run with $TITAN_PY: ${text:0:300}"
    MISSING=$((MISSING + 1))
    return
  fi
  text=$(tr - _ <<<"$text")
  for flag; do
    flag_=$(tr - _ <<<"${flag//./\\.}")
    if ! grep -qE -- "(^|[^A-Za-z0-9_.])$flag_([^A-Za-z0-9_.]|$)" <<<"$text"; then
      echo "  CHECK FAILED: torchtitan's trainer has no flag $flag"
      MISSING=$((MISSING + 1))
    fi
  done
}

# ---- Running. ----
shown() {  # the command as one line to copy: an argument quoted where the shell needs it
  local a out=()
  for a; do
    if [[ $a =~ ^[A-Za-z0-9_./=,:+@%-]+$ ]]; then out+=("$a"); else out+=("'$a'"); fi
  done
  echo "${out[*]}"
}
step() {  # step NAME COMMAND...: prints the command; unless --dry-run, runs it into OUT/NAME.log
  local name=$1 rc
  shift
  echo "  \$ $(shown "$@")"
  $DRY && return 0
  timeout "$TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -25 "$OUT/$name.log"
  if ((rc == 0)); then record "PASS $name: $*"; else record "FAIL $name (exit $rc, log $OUT/$name.log): $*"; fi
}
not_implemented() {  # not_implemented RUN WHY...
  local run=$1
  shift
  record "NOT IMPLEMENTED $run: $*"
}

BENCH=(env CUDA_VISIBLE_DEVICES="$DEVICES" "$PY" -m tide.bench.cli)
CUDA_BIN=${TIDE_BENCH_CUDA:-}
if [[ -z $CUDA_BIN && -n ${TIDE_PREBUILT:-} && -x ${TIDE_PREBUILT}/tide_bench_cuda ]]; then
  CUDA_BIN=$TIDE_PREBUILT/tide_bench_cuda
fi
CUDA_BIN=${CUDA_BIN:-$ROOT/build-gpu/tide_bench_cuda}
cuda_bench_ready() {  # builds tide_bench_cuda where it is missing (not in a dry run)
  [[ -x $CUDA_BIN ]] && return 0
  echo "  tide_bench_cuda: not built at $CUDA_BIN: would build it (cmake, target tide_bench_cuda," \
    "into build-gpu/)"
  $DRY && return 0
  cmake -S "$ROOT" -B "$ROOT/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_PYTHON=OFF \
    -DTIDE_CUDA=ON >"$OUT/build.log" 2>&1 &&
    cmake --build "$ROOT/build-gpu" -j"$(nproc)" --target tide_bench_cuda >>"$OUT/build.log" 2>&1 &&
    cp "$ROOT/build-gpu/bench/cuda/tide_bench_cuda" "$CUDA_BIN" && return 0
  record "FAIL build of tide_bench_cuda (log $OUT/build.log)"
  return 1
}
if [[ -z ${TIDE_NCCL_LIB:-} ]]; then  # NCCL for tide_bench_cuda's baselines: PyTorch's wheel ships it
  SITES=$("$PY" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
  # shellcheck disable=SC2086
  NCCL=$(find $SITES /usr/lib/x86_64-linux-gnu /usr/local -name 'libnccl.so.2*' 2>/dev/null | head -1)
  [[ -n $NCCL ]] && export TIDE_NCCL_LIB=$NCCL
fi

echo "== multi_gpu.sh: N = $GPUS GPUs (one rank each), runs: ${SELECTED[*]}$($DRY && echo ', dry run')"
{
  echo "commit $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (uncommitted changes)')"
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
    echo "GPUs: none (no nvidia-smi)"
  "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL",
            ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")' 2>&1
  echo "tide_bench_cuda NCCL: ${TIDE_NCCL_LIB:-not found}"
  echo "environment: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
} | if $DRY; then cat; else tee "$OUT/machine.txt"; fi

# 1. tide-bench fsdp, one rank per GPU, one invocation per preset and size: stock FSDP2 over NCCL
#    and TIDE, each run by run and captured, and the compute-only reference (captured); at the
#    presets' defaults and at 8K tokens per GPU. Each JSON's row goes into OUT/fsdp-exposure.md
#    (python -m tide.bench.report exposure); the dry run reads a CPU run's JSON with that reader,
#    so a field it reads that tide-bench no longer writes fails it.
if selected fsdp; then
  echo "== 1. tide-bench fsdp at W = $GPUS"
  need_bench_flags fsdp --device --world --model --expert-shard-dim --cuda-graphs --compute-only \
    --seq --batch --json --no-progress
  jsons=()
  for model in 8b-layers 70b-layers qwen3-moe-layers wan-layers; do
    extra=()
    [[ $model == qwen3-moe-layers ]] && extra=(--expert-shard-dim 1)
    for size in default 8k; do
      tokens=()
      [[ $size == 8k ]] && tokens=(--seq 2048 --batch 4)
      step "fsdp-$model-$size" "${BENCH[@]}" fsdp --device cuda --world "$GPUS" --model "$model" \
        "${extra[@]}" "${tokens[@]}" --cuda-graphs --compute-only --no-progress \
        --json "$OUT/fsdp-$model-$size.json"
      [[ -f $OUT/fsdp-$model-$size.json ]] && jsons+=("$OUT/fsdp-$model-$size.json")
    done
  done
  if $DRY; then  # the reader against a real JSON: a CPU run's (stock, TIDE, compute-only)
    scratch=$(mktemp -d)
    if ! (cd /tmp && "$PY" -m tide.bench.cli fsdp --device cpu --world 2 --model tiny --steps 1 \
            --warmup 0 --compute-only --no-progress --json "$scratch/cpu.json") >"$scratch/cpu.log" 2>&1; then
      echo "  CHECK FAILED: the CPU run whose JSON the reader is checked on: $(tail -3 "$scratch/cpu.log")"
      MISSING=$((MISSING + 1))
    # (and the modes a real run must hold are modes tide-bench knows: no JSON needed for that)
    elif ! "$PY" -m tide.bench.report exposure --expect stock,tide,compute_only "$scratch/cpu.json" >/dev/null ||
         ! "$PY" -c "from tide.bench.report import exposure_rows; exposure_rows([])"; then
      echo "  CHECK FAILED: python -m tide.bench.report exposure does not read tide-bench fsdp's JSON"
      MISSING=$((MISSING + 1))
    else
      echo "  checked: python -m tide.bench.report exposure reads a CPU run's JSON (the captured modes'" \
        "fields are the same per mode)"
    fi
    rm -rf "$scratch"
  elif ((${#jsons[@]})); then
    if "$PY" -m tide.bench.report exposure "${jsons[@]}" >"$OUT/fsdp-exposure.md" 2>"$OUT/fsdp-exposure.err"; then
      cat "$OUT/fsdp-exposure.md"; record "PASS fsdp-exposure: $OUT/fsdp-exposure.md"
    else
      record "FAIL fsdp-exposure: $(cat "$OUT/fsdp-exposure.err")"
    fi
  fi
fi

# 2. FSDP2 with symmetric memory (torchtitan's enable_fsdp_symm_mem) as a peer.
if selected symm-mem; then
  echo "== 2. FSDP2 with symmetric memory"
  not_implemented symm-mem "tide-bench fsdp has no mode that runs FSDP2 with set_symm_mem_for_comm" \
    "(torch >= 2.12.1; torch here: $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none))"
fi

# 3. torchtitan's own trainer, one GPU per rank: stock (--module llama3) vs TIDE (--module
#    tide.torchtitan), torchtitan's defaults (captured steps on), validation on, 50 steps; the debug
#    model, and with its float8 converter. The tokenizer and data set are made here (nothing is
#    downloaded): tests/python/torchtitan_cpu.py's make_assets.
if selected torchtitan; then
  echo "== 3. torchtitan's trainer at W = $GPUS"
  ASSETS=$OUT/titan-assets
  need_titan_flags llama3_debugmodel --hf_assets_path --dataloader.dataset_path --training.steps \
    --validator.enable --validator.steps --validator.dataloader.dataset \
    --validator.dataloader.dataset_path --dump_folder
  # 8000 documents, about 1.8 M tokens: 5 validation steps of 8 x 2048 tokens on each of 8 ranks
  make_assets='import sys; sys.path.insert(0, "tests/python"); import torchtitan_cpu; '
  make_assets+='torchtitan_cpu.make_assets(sys.argv[1], docs=8000)'
  step titan-assets "$TITAN_PY" -c "$make_assets" "$ASSETS"
  for config in llama3_debugmodel llama3_debugmodel_float8; do
    for module in llama3 tide.torchtitan; do
      step "titan-$config-$module" env CUDA_VISIBLE_DEVICES="$DEVICES" "$TITAN_PY" -m torch.distributed.run \
        --standalone --nproc_per_node "$GPUS" -m torchtitan.train --module "$module" --config "$config" \
        --hf_assets_path "$ASSETS/tokenizer" --dataloader.dataset_path "$ASSETS/c4_test" \
        --training.steps 50 --validator.enable --validator.steps 5 \
        --validator.dataloader.dataset c4_test --validator.dataloader.dataset_path "$ASSETS/c4_test" \
        --dump_folder "$OUT/titan-$config-$module"
    done
  done
fi

# 4. TIDE's collectives against NCCL's (tide_bench_cuda compare: one rank per GPU, every visible
#    GPU up to 8; W is set by the GPUs made visible), 1 MiB to 1 GiB, run by run and replayed; the
#    1 MiB fixed cost and the many-param buckets (TIDE alone), run by run and replayed.
WORLDS=()
for w in 2 4 8; do ((w <= GPUS)) && WORLDS+=("$w"); done
if selected compare; then
  echo "== 4. tide_bench_cuda compare at W = ${WORLDS[*]}"
  need_cuda_flags compare --bucket --min-mib --max-mib --cuda-graphs
  need_cuda_flags sweep --collective --world --min-mib --max-mib --cuda-graphs
  need_cuda_flags bucket --bucket --collective --world --cuda-graphs
  echo "  (NCCL's rows: all-gather in bf16, the buckets' param dtype; reduce-scatter in fp32 and bf16)"
  if cuda_bench_ready; then
    for w in "${WORLDS[@]}"; do
      step "compare-w$w" env CUDA_VISIBLE_DEVICES="$(devices "$w")" "$CUDA_BIN" compare --bucket llama \
        --min-mib 1 --max-mib 1024 --cuda-graphs
      for c in ag rs; do
        step "fixed-cost-$c-w$w" env CUDA_VISIBLE_DEVICES="$(devices "$w")" "$CUDA_BIN" sweep --collective "$c" \
          --world "$w" --min-mib 1 --max-mib 1 --cuda-graphs
        for bucket in small experts; do
          step "bucket-$bucket-$c-w$w" env CUDA_VISIBLE_DEVICES="$(devices "$w")" "$CUDA_BIN" bucket \
            --bucket "$bucket" --collective "$c" --world "$w" --cuda-graphs
        done
      done
    done
  fi
  not_implemented compare "all-gather busbw against the copy engines' limit: no tide_bench_cuda mode" \
    "measures the copy engines' peer-to-peer rate (ceiling measures one GPU's HBM copies)"
fi

# 5. A GEMM beside TIDE's reduce-scatter and beside NCCL's, one rank per GPU.
if selected interference; then
  echo "== 5. tide-bench interference at W = $GPUS"
  need_bench_flags interference --device --world --json
  step interference "${BENCH[@]}" interference --device cuda --world "$GPUS" --json "$OUT/interference.json"
fi

# 6. Virtual nodes over NCCL (nodes x ranks per node), the default chunk; NCCL's own collective at
#    the same W is in the compare run's log.
if selected virtual-nodes; then
  echo "== 6. virtual nodes over NCCL"
  need_cuda_flags sweep --collective --world --nodes --transport --max-mib
  for shape in 2x2 2x4 4x2; do
    nodes=${shape%x*} w=$((${shape%x*} * ${shape#*x}))
    if ((w > GPUS)); then
      record "NOT RUN virtual-nodes $shape: needs $w GPUs, one rank each; N = $GPUS"
      continue
    fi
    cuda_bench_ready || break
    for c in ag rs; do
      step "virtual-nodes-$shape-$c" env CUDA_VISIBLE_DEVICES="$(devices "$w")" "$CUDA_BIN" sweep \
        --collective "$c" --world "$w" --nodes "$nodes" --transport nccl --max-mib 1024
    done
  done
fi

# 7. accelerate's FSDP2 prepare and the Hugging Face Trainer on GPUs.
if selected hf; then
  echo "== 7. accelerate and the Hugging Face Trainer"
  not_implemented hf "nothing runs them on GPUs: tests/python/test_huggingface.py runs accelerate's" \
    "fsdp2_prepare_model on 2 CPU ranks (gloo), not Accelerator.prepare on GPUs, and TIDE has no" \
    "Trainer callback"
fi

echo
echo "==== multi_gpu.sh summary (N = $GPUS)$($DRY && echo ', dry run: nothing ran')"
printf '%s\n' "${SUMMARY[@]}" | if $DRY; then cat; else tee "$OUT/summary.txt"; fi
if ((MISSING)); then
  echo "multi_gpu.sh: $MISSING check(s) failed: a command above uses a subcommand or flag that does not exist"
  exit 1
fi
$DRY && exit 0
grep -qE '^(FAIL|NOT RUN)' <<<"$(printf '%s\n' "${SUMMARY[@]}")" && exit 1
exit 0
