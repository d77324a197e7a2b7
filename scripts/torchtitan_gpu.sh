#!/usr/bin/env bash
# torchtitan's own trainer with TIDE, captured, with validation, on ONE GPU: 2 ranks as processes
# sharing it. torchtitan 0.3.0's debug model (`--module tide.torchtitan --config llama3_debugmodel`)
# with its defaults (CUDA graphs on, its default reshard policy; the partial_dtensor backend, as
# its default one does not run: see common_args), a seed, validation every --val-freq steps (and
# at step 1, as torchtitan does) for --val-steps steps; then the same run with
# --training.disable_cuda_graphs. Every logged training loss and gradient norm and every
# validation loss must be bitwise equal, and every param group TIDE's on every rank. The last line says so:
#   torchtitan captured vs uncaptured: PASS (10 train steps, 6 validations, bitwise, ...)
# or FAIL with the first differing value. Where values differ, the uncaptured run runs once more
# (the control): if it does not reproduce itself either, the difference is not the capture's, and
# the control's line says so.
#
#   scripts/torchtitan_gpu.sh [--dry-run] [--cpu] [--steps N] [--val-freq N] [--val-steps N]
#                             [--out DIR] [-- TORCHTITAN_FLAG ...]
#
#   --dry-run    check the arguments and that the shims import, parse both runs' command lines
#                with torchtitan's own ConfigManager where torchtitan imports, print the commands;
#                runs nothing, needs no GPU
#   --cpu        the same plumbing on CPU ranks (torchtitan_cpu.py's CPU shims): both runs
#                uncaptured (no CUDA graphs on CPU), 256-token sequences; checks assets, shims,
#                recording and comparison, not the capture
#   --steps N    training steps (default 10: step 1 warms up, 2 captures, the rest replay)
#   --val-freq N validate every N steps (default 2)
#   --val-steps N validation steps each time (default 3)
#   --out DIR    logs, records and the local data set (default titan-gpu-out/)
#   -- FLAGS     appended to every torchtitan command line (e.g. -- --parallelism.spmd_backend full_dtensor)
#
# The runs: python -m torch.distributed.run --nproc_per_node 2 tests/python/torchtitan_shared_gpu.py
# --module tide.torchtitan ...: that driver calls torchtitan.train.main() (what `-m torchtitan.train`
# runs) after its launcher-side shims, which stay out of the product (its docstring lists them:
# gloo for the process group, as NCCL refuses two ranks on one GPU; torch.distributed.set_timeout
# where torch lacks it; for a torch older than torchtitan 0.3.0's, as the GPU machine's 2.11, each
# where torch lacks the thing: a stand-in for torch.distributed.fsdp.DataParallelMeshDims, and the
# debug config's chunked loss run unchunked (2.11's FSDP2 cannot run it: the dry run names the
# loss); a stand-in for `datasets` where that is not installed), and records what the
# trainer logs as float.hex. Every rank is on cuda:0: one GPU is made visible.
# The tokenizer and data sets are made here (nothing is downloaded): torchtitan_cpu.make_assets.
#
# Environment: PYTHON (default python3: tide installed, with CUDA), TIDE_TITAN_PATH (default
# build-titan/: scripts/torchtitan_wrapper.sh's folder, put on PYTHONPATH with its trainer/
# subfolder where it exists), RUN_TIMEOUT (seconds per run, default 600), CUDA_VISIBLE_DEVICES
# (its first GPU is the one used; default 0).
# Exit status: 0 PASS; 1 FAIL (values differ, or a run failed); 2 bad arguments or missing pieces.
set -uo pipefail
# NVLink multicast can take a shared host's GPUs out of service: nothing this script starts uses it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
TIMEOUT=${RUN_TIMEOUT:-600}
NPROC=2

usage() {
  echo "usage: scripts/torchtitan_gpu.sh [--dry-run] [--cpu] [--steps N] [--val-freq N] [--val-steps N] [--out DIR] [-- TORCHTITAN_FLAG ...]"
}
fail_usage() {
  echo "torchtitan_gpu.sh: $*" >&2
  usage >&2
  exit 2
}

DRY=false CPU=false STEPS=10 VAL_FREQ=2 VAL_STEPS=3 OUT=$ROOT/titan-gpu-out EXTRA=()
while (($#)); do
  case $1 in
    --dry-run) DRY=true ;;
    --cpu) CPU=true ;;
    --steps | --val-freq | --val-steps | --out)
      [[ $# -ge 2 && -n $2 ]] || fail_usage "$1: expected a value"
      if [[ $1 != --out ]] && ! [[ $2 =~ ^[1-9][0-9]*$ ]]; then fail_usage "$1 '$2': expected a positive integer"; fi
      case $1 in --steps) STEPS=$2 ;; --val-freq) VAL_FREQ=$2 ;; --val-steps) VAL_STEPS=$2 ;; --out) OUT=$2 ;; esac
      shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h | --help) usage; exit 0 ;;
    *) fail_usage "unknown argument '$1'" ;;
  esac
  shift
done
((STEPS >= 3)) || fail_usage "--steps $STEPS: expected 3 or more (warm-up, capture, then replays)"
# torchtitan validates at step 1 and at every multiple of --val-freq (Validator.should_validate).
VALIDATIONS=$(( 1 + STEPS / VAL_FREQ - (VAL_FREQ == 1 ? 1 : 0) ))
OUT=$(realpath -m "$OUT")

# torchtitan and what its trainer imports, carried to a machine that reaches no registry.
TITAN=${TIDE_TITAN_PATH:-$ROOT/build-titan}
if [[ -d $TITAN ]]; then
  PYTHONPATH="$TITAN${PYTHONPATH:+:$PYTHONPATH}"
  [[ -d $TITAN/trainer ]] && PYTHONPATH="$TITAN/trainer:$PYTHONPATH"
  export PYTHONPATH
fi
DRIVER=tests/python/torchtitan_shared_gpu.py
ASSETS=$OUT/assets
if $CPU; then
  # CPU ranks: torchtitan_cpu.py's shims; no CUDA graphs on CPU, so both runs are uncaptured.
  DEVICE_ENV=(CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1)
  MODES=(first second)
  FIRST=(--training.disable_cuda_graphs) SECOND=(--training.disable_cuda_graphs)
  SIZE=(--training.seq_len 256 --training.local_batch_size 2)
  LABEL="torchtitan on CPU, first vs second (both uncaptured: a check of the plumbing, not the capture)"
  DOCS=400
else
  DEVICE_ENV=(CUDA_VISIBLE_DEVICES="$(cut -d, -f1 <<<"${CUDA_VISIBLE_DEVICES:-0}")")
  MODES=(captured uncaptured)
  FIRST=() SECOND=(--training.disable_cuda_graphs)
  SIZE=()  # the debug config's own: 8 sequences of 2048 tokens per rank and step
  LABEL="torchtitan captured vs uncaptured"
  DOCS=4000  # about 0.9 M tokens: 10 steps of 8 x 2048 tokens on each of 2 ranks
fi
# The trainer's arguments, apart from the mode's; both runs get the same. The DTensor backend is
# partial_dtensor, not torchtitan 0.3.0's default spmd_types: with that one its parallelize passes
# fully_shard dp_mesh_dims over parameters it left plain, and torch 2.13's fully_shard refuses them
# ("all parameters must be DTensors on the full SPMD mesh"), stock as with TIDE (TIDE is enabled
# later); tests/python/test_torchtitan.py runs partial_dtensor and full_dtensor. torch 2.11's
# fully_shard has no dp_mesh_dims at all: there only partial_dtensor runs. `-- FLAGS` come
# last and override it.
common_args() {
  printf '%s\n' --module tide.torchtitan --config llama3_debugmodel --parallelism.spmd_backend partial_dtensor \
    --hf_assets_path "$ASSETS/tokenizer" --dataloader.dataset_path "$ASSETS/c4_test" \
    --training.steps "$STEPS" --metrics.log_freq 1 --debug.seed 42 --checkpoint.no-enable \
    --validator.enable --validator.freq "$VAL_FREQ" --validator.steps "$VAL_STEPS" \
    --validator.dataloader.dataset c4_test --validator.dataloader.dataset_path "$ASSETS/validation/c4_test" \
    "${SIZE[@]}"
}
mapfile -t COMMON < <(common_args)
mode_args() {  # mode_args MODE: the flags of that run
  local flags
  case $1 in captured | first) flags=("${FIRST[@]}") ;; *) flags=("${SECOND[@]}") ;; esac
  ((${#flags[@]} == 0)) || printf '%s\n' "${flags[@]}"
}
run_command() {  # run_command MODE RECORD: the command line of one run
  local flags
  mapfile -t flags < <(mode_args "$1")
  printf '%s\n' env "${DEVICE_ENV[@]}" TIDE_TITAN_OUT="$2" timeout "$TIMEOUT" "$PY" -m torch.distributed.run \
    --standalone --nproc_per_node "$NPROC" "$DRIVER" "${COMMON[@]}" "${flags[@]}" --dump_folder "$OUT/dump-$1" "${EXTRA[@]}"
}
show() { printf '  %q' "$@"; echo; }
MAKE_ASSETS='import sys; sys.path.insert(0, "tests/python"); import torchtitan_cpu as t
t.make_assets(sys.argv[1], docs=int(sys.argv[2])); t.make_assets(sys.argv[1] + "/validation", docs=int(sys.argv[2]) // 4, seed=1)'
COMPARE='import sys; sys.path.insert(0, "tests/python"); import torchtitan_shared_gpu as m; sys.exit(m.compare_main(sys.argv[1:]))'

if $DRY; then
  echo "== dry run: $LABEL, W = $NPROC, $STEPS steps, $VALIDATIONS validations of $VAL_STEPS steps; out $OUT"
  echo "== PYTHONPATH=${PYTHONPATH:-}"
  rc=0
  if ! CUDA_VISIBLE_DEVICES= "$PY" -c 'import torchtitan' 2>/dev/null; then
    echo "  NOT CHECKED here: torchtitan does not import with $PY (PYTHON: a Python with torchtitan 0.3.0," \
      "e.g. scripts/torchtitan_check.sh's .venv-titan/bin/python; or TIDE_TITAN_PATH)"
  elif ! CUDA_VISIBLE_DEVICES= "$PY" -c 'import sys; sys.path.insert(0, "tests/python"); import torchtitan_shared_gpu, torchtitan_cpu'; then
    echo "  CHECK FAILED: the driver and its shims ($DRIVER) do not import with $PY"; rc=2
  else
    for mode in "${MODES[@]}"; do
      mapfile -t flags < <(mode_args "$mode")
      parsed=$(CUDA_VISIBLE_DEVICES= "$PY" -c 'import sys; sys.path.insert(0, "tests/python"); import torchtitan_shared_gpu as m
print(m.parse_only(sys.argv[1:]))' "${COMMON[@]}" "${flags[@]}" --dump_folder "$OUT/dump-$mode" "${EXTRA[@]}" 2>&1)
      if [[ $? == 0 ]]; then echo "  $mode: torchtitan parses it: ${parsed##*$'\n'}"
      else echo "  CHECK FAILED: torchtitan does not parse the $mode run's arguments: ${parsed: -600}"; rc=2; fi
    done
  fi
  echo "== would run:"
  show "$PY" -c "$MAKE_ASSETS" "$ASSETS" "$DOCS"
  for mode in "${MODES[@]}"; do
    mapfile -t cmd < <(run_command "$mode" "$OUT/$mode")
    show "${cmd[@]}"
  done
  show "$PY" -c "$COMPARE" "$LABEL" "$OUT/${MODES[0]}" "$OUT/${MODES[1]}" "$NPROC" "$STEPS" "$VALIDATIONS"
  exit $rc
fi

mkdir -p "$OUT"
if ! $CPU; then
  ready=$("$PY" -c 'import torch, tide; print(torch.cuda.is_available() and tide.cuda_built)' 2>&1 | tail -1)
  [[ $ready == True ]] || { echo "$LABEL: FAIL (needs a GPU and a CUDA build of TIDE with $PY: $ready)"; exit 2; }
fi
if ! "$PY" -c 'import torchtitan, triton' 2>/dev/null; then
  echo "$LABEL: FAIL (torchtitan or triton does not import with $PY: scripts/torchtitan_wrapper.sh makes build-titan/)"
  exit 2
fi
echo "== assets: $ASSETS"
"$PY" -c "$MAKE_ASSETS" "$ASSETS" "$DOCS" || { echo "$LABEL: FAIL (the local data set was not made)"; exit 2; }
run() {  # run MODE: one run, its output in OUT/MODE.log, its records in OUT/MODE.rank<r>
  local cmd
  rm -f "$OUT/$1".rank*
  mapfile -t cmd < <(run_command "$1" "$OUT/$1")
  echo "== $1:"; show "${cmd[@]}"
  local start=$SECONDS
  (cd "$ROOT" && "${cmd[@]}") >"$OUT/$1.log" 2>&1
  local rc=$?
  echo "== $1: exit $rc in $((SECONDS - start)) s (log: $OUT/$1.log)"
  ((rc == 0)) || { grep -E "Error|error:|Traceback|tide" "$OUT/$1.log" | tail -25; tail -5 "$OUT/$1.log"; }
  return $rc
}
compare() {  # compare LABEL A B
  "$PY" -c "$COMPARE" "$1" "$OUT/$2" "$OUT/$3" "$NPROC" "$STEPS" "$VALIDATIONS"
}
failed=()
for mode in "${MODES[@]}"; do run "$mode" || failed+=("$mode"); done
if ((${#failed[@]})); then
  echo "$LABEL: FAIL (the ${failed[*]} run(s) failed: $OUT/${failed[0]}.log)"
  exit 1
fi
compare "$LABEL" "${MODES[0]}" "${MODES[1]}"
status=$?
if ((status == 1)); then
  # Values differ: is the reference reproducible at all? A second uncaptured run tells.
  if run "${MODES[1]}-again"; then
    compare "control: ${MODES[1]} vs ${MODES[1]} again" "${MODES[1]}" "${MODES[1]}-again" ||
      echo "control: the ${MODES[1]} run does not reproduce itself: the difference above is not (only) the capture's"
  fi
  compare "$LABEL" "${MODES[0]}" "${MODES[1]}"  # the verdict, last
fi
((status == 0)) && exit 0 || exit 1
