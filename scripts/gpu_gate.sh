#!/usr/bin/env bash
# The GPU gate: run it on a GPU machine whenever src/, python/ or bench/ changed. It does what a
# user does there and ends with one verdict line:
#   build    pip install --no-build-isolation . (the package as a user builds it), then checks the
#            extension: what ldd lists, and that it exports PyInit__tide alone (a static libstdc++
#            exported beside torch's crashed tide.fsdp: issue 14)
#   cpp      the C++ GPU tests (scripts/gpu_suite.sh tests)
#   python   pytest: the extension checks, the CUDA scenarios of tests/python/test_fsdp.py and
#            test_fsdp_lifetime.py (ranks as processes sharing the GPU), test_fsdp_cuda_graphs.py (captured
#            steps vs run-by-run ones; stepped by torchtitan's own CUDAGraphWrapper where
#            scripts/torchtitan_wrapper.sh made build-titan/), test_fsdp_cuda_graphs_between.py (what
#            users do between replays), test_fsdp_cuda.py (skips without 2 GPUs),
#            the CLI tests
#   bench    tide-bench fsdp with its defaults, the README's command: stock FSDP2 vs TIDE (on one GPU:
#            2 ranks sharing it)
#   presets  tide-bench fsdp --cuda-graphs --compute-only --mps on every GPU preset (8b-layers,
#            70b-layers, qwen3-moe-layers, wan-layers): every group handled, captured vs run by run
#            bitwise, no collective called from Python in the timed captured steps, a compute-only
#            column, the ranks under a private MPS server
#   titan    torchtitan's own trainer with --module tide.torchtitan on this GPU, 2 ranks sharing it:
#            captured (its default) with validation vs --training.disable_cuda_graphs, training and
#            validation losses bitwise (scripts/torchtitan_gpu.sh); needs build-titan/ with its
#            trainer/ folder (scripts/torchtitan_wrapper.sh), and fails saying so without it
#   sanitize compute-sanitizer memcheck, racecheck, synccheck (scripts/gpu_suite.sh sanitize)
#
#   scripts/gpu_gate.sh first second    the whole gate in two invocations (FIRST and SECOND below),
#                                       each within ten minutes on one H100 (docs/testing.md has
#                                       the stage times)
#   scripts/gpu_gate.sh [stage ...]     (default: every stage, in that order, in one invocation)
#   scripts/gpu_gate.sh a+b+c           stages a, b and c side by side (each one's output in
#                                       $OUT/gate_stage_<name>.txt), then their results
#   scripts/gpu_gate.sh verdict         the verdict line over the stages run so far
#   scripts/gpu_gate.sh digest          the sources digest the verdict line names
#   scripts/gpu_gate.sh touched BASE    (where git is) the stages a change since commit BASE touches
#                                       (none: nothing to run); GATE_ONLY="$(scripts/gpu_gate.sh
#                                       touched BASE)" then limits first, second and the verdict to them
#
# Stages record their result and the sources digest in $GATE_DIR (default build-gate/), so the
# gate can run as several invocations on the same machine; the verdict line counts a stage that has
# not run, or ran on other sources, as not passed. Logs go to $OUT (default gpu-out/).
# A fresh machine has no records: carry $GATE_DIR with the tree (records count for their digest).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/gpu-out}
GATE_DIR=${GATE_DIR:-$ROOT/build-gate}
mkdir -p "$OUT" "$GATE_DIR"
# Absolute: stages run their commands from /tmp, where a relative OUT names another folder.
OUT=$(cd "$OUT" && pwd) GATE_DIR=$(cd "$GATE_DIR" && pwd)
STAGES=(build cpp python bench presets titan sanitize)
# The two invocations: pytest's processes, torchtitan's ranks and the C++ tests side by side (small
# models; the compute-sanitizer tools reuse cpp's binaries), then the 8B- and 70B-layer presets and
# the stock comparison one after the other, beside nothing (torchtitan's ranks beside pytest and the
# bench ran out of memory at set_device on an 80 GB H100).
FIRST=(build python+titan+cpp sanitize)
SECOND=(presets bench verdict)
# GATE_ONLY: the stages to run (and judge) of those; default all.
read -ra ONLY <<<"${GATE_ONLY:-${STAGES[*]}}"
((${#ONLY[@]})) || { echo "GATE_ONLY: names no stage (unset it for every stage)" >&2; exit 2; }
PY=${PYTHON:-python3}
say() { echo "== gate: $*"; }
record() { printf '%s\n%s\n' "$2" "$DIGEST" >"$GATE_DIR/$1"; say "$1: $2"; }
# A stage's recorded result; "not run" if none, "stale" if it ran on other sources.
result() {
  [[ -f "$GATE_DIR/$1" ]] || { echo "not run"; return; }
  local r digest; { read -r r; read -r digest; } <"$GATE_DIR/$1"
  [[ "$digest" == "$DIGEST" ]] && echo "$r" || echo "stale (ran on sources $digest: $r)"
}

stage_build() {
  say "build: $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)')"
  say "build: CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-} ($(${CXX:-c++} --version | head -1))"
  if ! "$PY" -m pip install --no-build-isolation . >"$OUT/gate_build.log" 2>&1; then
    tail -30 "$OUT/gate_build.log"; record build "FAIL (pip install; see gate_build.log)"; return
  fi
  local so
  so=$(cd /tmp && "$PY" -c 'import tide._tide as t; print(t.__file__)') || { record build "FAIL (import)"; return; }
  say "build: ldd $so"; ldd "$so" | sed 's/^/    /'
  local exported
  exported=$(cd /tmp && "$PY" -c "import sys; sys.path.insert(0, '$ROOT/tests/python')
from test_extension import defined_dynamic_symbols as d; print(' '.join(d('$so')))")
  if [[ "$exported" != "PyInit__tide" ]]; then
    record build "FAIL (the extension exports $(wc -w <<<"$exported") symbols, not PyInit__tide alone)"; return
  fi
  local cuda_built
  cuda_built=$(cd /tmp && "$PY" -c 'import tide; print(tide.cuda_built)')
  [[ "$cuda_built" == True ]] || { record build "FAIL (built without CUDA)"; return; }
  record build "PASS (exports PyInit__tide alone; libstdc++ $(ldd "$so" | grep -q libstdc++ && echo shared || echo static, hidden))"
}

stage_cpp() {
  OUT="$OUT" bash scripts/gpu_suite.sh tests >"$OUT/gate_cpp.log" 2>&1
  local rc=$? summary
  summary=$(grep -E "^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \]" "$OUT/gpu_tests.log" 2>/dev/null | tr '\n' ' ')
  tail -15 "$OUT/gate_cpp.log"
  [[ $rc == 0 ]] && record cpp "PASS ($summary)" || record cpp "FAIL (exit $rc: $summary)"
}

stage_python() {
  # Six pytest processes side by side: test_fsdp.py's W = 3 and W = 4 worlds each in their own (a
  # world trains once per process, for all its tests), test_fsdp_lifetime.py in one,
  # test_fsdp_cuda_graphs_between.py in one, test_fsdp_capture_rule.py in one, everything else in
  # the first. PYTEST_SPLIT=0: one process.
  local select="${PYTEST_K:-cuda or extension or two_gpus}" parts=()
  if [[ ${PYTEST_SPLIT:-1} == 1 ]]; then
    parts=("($select) and not cuda-W3 and not cuda-W4 and not test_fsdp_lifetime and not between and not capture_rule"
           "($select) and cuda-W3" "($select) and cuda-W4" "($select) and test_fsdp_lifetime"
           "($select) and between" "($select) and capture_rule")
  else
    parts=("$select")
  fi
  # torchtitan's own CUDA-graph wrapper drives the captured steps where scripts/torchtitan_wrapper.sh
  # put it (the GPU machine reaches no registry; the folder is carried with the tree).
  local titan="${TIDE_TITAN_PATH:-$ROOT/build-titan}" wrapper pythonpath="${PYTHONPATH:-}"
  if [[ -d "$titan" ]]; then
    pythonpath="$titan${pythonpath:+:$pythonpath}"
    wrapper=$(cd /tmp && PYTHONPATH="$pythonpath" "$PY" -c "from torchtitan.distributed.cudagraph import CUDAGraphWrapper
from importlib.metadata import version; print('torchtitan', version('torchtitan'), 'CUDAGraphWrapper')" 2>&1 |
      tail -1) || true
    [[ $wrapper == torchtitan* ]] ||
      wrapper="CapturedStep (torchtitan's wrapper does not import from $titan, which the tests then fail on: $wrapper)"
  else
    wrapper="CapturedStep (no $titan: scripts/torchtitan_wrapper.sh)"
  fi
  say "python: captured steps stepped by $wrapper"
  local pids=() i
  for i in "${!parts[@]}"; do
    # Outside the source tree, so `import tide` is the installed package, as for a user.
    (cd /tmp && PYTHONPATH="$pythonpath" timeout "${PYTEST_TIMEOUT:-540}" "$PY" -m pytest -q -rs -p no:cacheprovider \
       "$ROOT/tests/python/test_extension.py" "$ROOT/tests/python/test_fsdp_cuda.py" \
       "$ROOT/tests/python/test_fsdp.py" "$ROOT/tests/python/test_fsdp_lifetime.py" \
       "$ROOT/tests/python/test_bench_cli.py" "$ROOT/tests/python/test_fsdp_cuda_graphs.py" \
       "$ROOT/tests/python/test_fsdp_cuda_graphs_between.py" "$ROOT/tests/python/test_fsdp_capture_rule.py" \
       -k "${parts[$i]}") \
      >"$OUT/gate_python_$i.log" 2>&1 &
    pids+=($!)
  done
  local rc=0 passed=0 skipped=0 lines=()
  for i in "${!parts[@]}"; do
    wait "${pids[$i]}" || rc=$?
    local line; line=$(tail -1 "$OUT/gate_python_$i.log")
    tail -12 "$OUT/gate_python_$i.log"
    grep -qE "[0-9]+ passed" <<<"$line" || { [[ $rc == 0 ]] && rc=5; }
    passed=$((passed + $(grep -oE "[0-9]+ passed" <<<"$line" | grep -oE "[0-9]+" || echo 0)))
    skipped=$((skipped + $(grep -oE "[0-9]+ skipped" <<<"$line" | grep -oE "[0-9]+" || echo 0)))
    lines+=("${line//=/}")
  done
  for i in "${!parts[@]}"; do cat "$OUT/gate_python_$i.log"; done >"$OUT/gate_python.log"
  # The CUDA scenarios must have run, not skipped: a gate that skipped them proved nothing.
  if grep -q "SKIPPED.*test_fsdp.py.*needs a CUDA build" "$OUT/gate_python.log"; then rc=6; fi
  local summary="$passed passed, $skipped skipped in ${#parts[@]} processes:$(printf ' [%s]' "${lines[@]}"); captured steps by $wrapper"
  [[ $rc == 0 ]] && record python "PASS ($summary)" || record python "FAIL (exit $rc: $summary)"
}

fsdp_runs() {
  # `tide-bench fsdp` runs, each "<label>:<check>:<flags...>", its JSON checked, recorded as stage
  # $1. check: stock (stock FSDP2 vs TIDE: no layout copies under TIDE, bitwise at W = 2),
  # cuda_graphs (TIDE run by run vs captured: every timed step a replay, no TIDE collective called
  # from Python in them, bitwise), or floor (cuda_graphs, a compute-only column, ranks under MPS).
  local stage=$1 rc=0 checks=() run
  shift
  for run in "$@"; do
    local label=${run%%:*} rest=${run#*:}
    local mode=${rest%%:*} flags=(${rest#*:})
    local log="$OUT/gate_${stage}_$label.log" json="$OUT/gate_${stage}_$label.json"
    (cd /tmp && timeout "${BENCH_TIMEOUT:-540}" tide-bench fsdp --no-progress "${flags[@]}" --json "$json") \
      >"$log" 2>&1
    local exit=$?
    tail -20 "$log"
    if [[ $exit != 0 ]]; then checks+=("$label: exit $exit"); rc=1; continue; fi
    local check
    check=$("$PY" - "$json" "$mode" "$label" <<'EOF'
import json, sys
d, mode, label = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
bad = []
if mode == "stock":
    t, s = d["tide"], d["stock"]
    if t["layout_copy_mib"] != 0 or not s["layout_copy_mib"] > 0:
        bad.append(f"layout copies stock {s['layout_copy_mib']} TIDE {t['layout_copy_mib']}")
    done = f"copies {s['layout_copy_mib']:.0f} -> 0 MiB"
else:  # every timed step a replay: no TIDE collective called from Python (run by run: some)
    t = d["tide_captured"]
    if t["loop_collectives"] != 0 or not d["tide"]["loop_collectives"] > 0:
        bad.append(f"{t['replays']} replays, collectives from Python in the timed steps: "
                   f"{t['loop_collectives']} captured, {d['tide']['loop_collectives']} run by run")
    done = (f"{t['replays']} replays, host ms per step {d['tide']['host_ms']:.2f} -> "
            f"{t['host_ms']:.2f}, step ms {d['tide']['step_ms']:.2f} -> {t['step_ms']:.2f}")
    if mode == "floor":
        floor = d.get("compute_only")
        if floor is None or floor["step_ms"] is None:
            bad.append("no compute-only column")
        else:
            done += f" (compute-only {floor['step_ms']:.2f})"
        mps = d.get("mps")  # ranks sharing a GPU: under MPS, else the exposure is the emulation's
        if mps is None or (mps["requested"] and not mps["used"]):
            bad.append(f"not under MPS: {(mps or {}).get('why') or 'no mps field in the JSON'}")
if not t["tide_buckets"] or t["tide_fallbacks"]:
    bad.append(f"handled {t['tide_buckets']} groups, fallbacks {t['tide_fallbacks']}")
if d["max_abs_diff"] != 0.0 and (d["world"] == 2 or mode != "stock"):
    bad.append(f"not bitwise: max diff {d['max_abs_diff']}")
print(f"{label}: " + ("; ".join(bad) or f"W = {d['world']}, {d['model']}, {t['tide_buckets']} groups, "
                      f"{done}, max diff {d['max_abs_diff']:.1e}"))
sys.exit(1 if bad else 0)
EOF
) || { rc=1; [[ -n $check ]] || check="$label: the JSON check failed (see above)"; }
    checks+=("$check")
  done
  local summary; summary=$(printf '%s; ' "${checks[@]}"); summary=${summary%; }
  [[ $rc == 0 ]] && record "$stage" "PASS ($summary)" || record "$stage" "FAIL ($summary)"
}

stage_bench() {
  # The README's command, tide-bench fsdp with its defaults: stock FSDP2 vs TIDE. (Its captured
  # steps are the presets stage's 8b-layers run.)
  fsdp_runs bench "stock:stock:"
}

stage_presets() {
  # Each GPU preset captured, with its compute-only floor: what BENCHMARKS.md's exposed-communication
  # table is made of.
  local runs=() model
  for model in ${GATE_PRESETS:-8b-layers 70b-layers qwen3-moe-layers wan-layers}; do
    runs+=("$model:floor:--model $model --cuda-graphs --compute-only --mps")
  done
  fsdp_runs presets "${runs[@]}"
}

stage_titan() {
  # The README's GPU recipe as a user runs it: torchtitan's trainer, captured, validating between
  # replays, against the same run uncaptured (scripts/torchtitan_gpu.sh prints one verdict line).
  local titan="${TIDE_TITAN_PATH:-$ROOT/build-titan}"
  if [[ ! -d $titan/trainer ]]; then
    record titan "FAIL (not run: no $titan/trainer, the trainer's packages: scripts/torchtitan_wrapper.sh makes it)"
    return
  fi
  (cd "$ROOT" && TIDE_TITAN_PATH="$titan" PYTHON="$PY" bash scripts/torchtitan_gpu.sh --out "$OUT/titan") \
    >"$OUT/gate_titan.log" 2>&1
  local rc=$? line
  tail -25 "$OUT/gate_titan.log"
  line=$(grep -E "^torchtitan captured vs uncaptured: (PASS|FAIL)" "$OUT/gate_titan.log" | tail -1)
  line=${line#torchtitan captured vs uncaptured: }
  if [[ $rc == 0 && $line == PASS* ]]; then
    record titan "PASS (captured vs uncaptured: ${line#PASS (}"
  else
    record titan "FAIL (exit $rc: ${line:-no verdict line; see gate_titan.log})"
  fi
}

stage_sanitize() {
  # The three tools side by side when the cpp stage built the binaries (each checks one process at
  # a time; the GPU has room for three): a third of the wall time. One after another otherwise, as
  # gpu_suite.sh builds them first.
  local tools=(${SANITIZER_TOOLS:-memcheck racecheck synccheck}) pids=() rc=0 tool
  if [[ -x "$ROOT/build-gpu/tide_gpu_tests" ]]; then
    for tool in "${tools[@]}"; do
      mkdir -p "$OUT/sanitize_$tool"
      TIDE_PREBUILT="$ROOT/build-gpu" SANITIZER_TOOLS=$tool OUT="$OUT/sanitize_$tool" \
        bash scripts/gpu_suite.sh sanitize >"$OUT/gate_sanitize_$tool.log" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    for tool in "${tools[@]}"; do cat "$OUT/gate_sanitize_$tool.log"; done >"$OUT/gate_sanitize.log"
  else
    OUT="$OUT" bash scripts/gpu_suite.sh sanitize >"$OUT/gate_sanitize.log" 2>&1 || rc=$?
  fi
  grep "compute-sanitizer .* exit" "$OUT/gate_sanitize.log"
  [[ $rc == 0 ]] && record sanitize "PASS (${tools[*]})" || record sanitize "FAIL (exit $rc)"
}

# What was tested, independent of a .git that may not travel with the tree: a digest of the
# sources (scripts/gpu_gate.sh digest prints it here, to compare with a checkout).
sources_digest() {
  (cd "$ROOT" && find CMakeLists.txt pyproject.toml include src python bench -type f \
     -not -path '*/__pycache__/*' -not -name '*.pyc' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12)
}

verdict() {
  local all=PASS parts=() only=""
  [[ "${ONLY[*]}" == "${STAGES[*]}" ]] || only=" (only the stages GATE_ONLY names)"
  for s in "${ONLY[@]}"; do
    local r; r=$(result "$s")
    [[ "$r" == PASS* ]] || all=FAIL
    parts+=("$s ${r%% (*}")
  done
  local gpu; gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
  echo "GPU GATE $all$only: $(IFS=','; echo "${parts[*]}" | sed 's/,/, /g') [$gpu, $(date -u +%F), sources $DIGEST]"
  for s in "${ONLY[@]}"; do echo "  $s: $(result "$s")"; done
  [[ $all == PASS ]]
}

# touched BASE: the stages that a change since BASE (git diff BASE, the working tree included)
# touches. The C++ core, the build and the gate itself touch every stage.
touched() {
  local base=$1 f stages=()
  git -C "$ROOT" rev-parse --verify -q "$base^{commit}" >/dev/null || { echo "touched: '$base' is no commit here" >&2; exit 2; }
  add() { local s; for s in "$@"; do [[ " ${stages[*]} " == *" $s "* ]] || stages+=("$s"); done; }
  while read -r f; do
    case $f in
      src/* | include/* | CMakeLists.txt | pyproject.toml | scripts/gpu_gate.sh | scripts/gpu_suite.sh) add "${STAGES[@]}" ;;
      bench/*) add build cpp ;;
      tests/gpu/* | testing/* | tests/CMakeLists.txt) add build cpp sanitize ;;
      python/*) add build python bench presets titan ;;
      scripts/torchtitan_wrapper.sh) add build python titan ;;
      scripts/torchtitan_gpu.sh | tests/python/torchtitan_*) add build titan ;;
      tests/python/*) add build python ;;
    esac
  done < <(git -C "$ROOT" diff --name-only "$base" -- .; git -C "$ROOT" ls-files --others --exclude-standard)
  local s out=()
  for s in "${STAGES[@]}"; do [[ " ${stages[*]} " == *" $s "* ]] && out+=("$s"); done
  echo "${out[*]}"
}

if [[ $# == 0 ]]; then
  rm -f "$GATE_DIR"/*
  set -- "${STAGES[@]}" verdict
fi
if [[ $1 == touched ]]; then
  [[ $# == 2 ]] || { echo "usage: $0 touched BASE" >&2; exit 2; }
  touched "$2"
  exit
fi
# The sources do not change while the gate runs: their digest, once.
DIGEST=$(sources_digest)
usage() { echo "usage: $0 [first|second|build|cpp|python|bench|presets|titan|sanitize|verdict|digest|a+b ...|touched BASE]"; exit 2; }
is_stage() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }
for s in "${ONLY[@]}"; do is_stage "$s" || { echo "GATE_ONLY: '$s' is no stage (${STAGES[*]})" >&2; exit 2; }; done
selected() { [[ " ${ONLY[*]} " == *" $1 "* ]]; }
# first and second: their steps, each step's stages limited to GATE_ONLY's.
expand() {
  local step s kept
  for step in "$@"; do
    [[ $step == verdict ]] && { echo verdict; continue; }
    kept=()
    IFS=+ read -ra group <<<"$step"
    for s in "${group[@]}"; do selected "$s" && kept+=("$s"); done
    ((${#kept[@]})) && (IFS=+; echo "${kept[*]}")
  done
}
steps=()
for arg in "$@"; do
  case $arg in
    first) mapfile -t -O "${#steps[@]}" steps < <(expand "${FIRST[@]}") ;;
    second) mapfile -t -O "${#steps[@]}" steps < <(expand "${SECOND[@]}") ;;
    *) steps+=("$arg") ;;
  esac
done
rc=0
for stage in "${steps[@]}"; do
  start=$SECONDS
  if [[ "$stage" == *+* ]]; then
    [[ "$stage" =~ ^[a-z]+(\+[a-z]+)+$ ]] || usage
    IFS=+ read -ra group <<<"$stage"
    for s in "${group[@]}"; do is_stage "$s" || usage; done
    pids=()
    for s in "${group[@]}"; do "stage_$s" >"$OUT/gate_stage_$s.txt" 2>&1 & pids+=($!); done
    for pid in "${pids[@]}"; do wait "$pid"; done
    for s in "${group[@]}"; do say "$s: $(result "$s")"; done
    say "$stage: $((SECONDS - start)) s"
    continue
  fi
  case "$stage" in
    build|cpp|python|bench|presets|titan|sanitize) "stage_$stage"; say "$stage: $((SECONDS - start)) s" ;;
    verdict) verdict || rc=1 ;;
    digest) echo "$DIGEST" ;;
    *) usage ;;
  esac
done
exit $rc
