#!/usr/bin/env bash
# Fixed cost of two tide_bench_cuda builds, side by side in one call on one GPU (docs/notes/
# fixed_cost.md: the host time per run() follows the lease, so versions compare only within a
# call). Ranks as threads of one process (one CUDA context), every run checked bitwise by the bench.
#
#   scripts/fixed_cost_side_by_side.sh BEFORE_BIN AFTER_BIN [ROUNDS]    (default 3 rounds)
#
# Per round and build: the 1 MiB all-gather and reduce-scatter at W = 2; once per build: the
# 1 MiB all-gather and reduce-scatter at W = 8, the 4 MiB all-gathers at W = 2 and 8, the
# 512 x 64 KiB and the experts (384 x 3 MiB) all-gathers at W = 2; then AFTER_BIN's driver-call
# costs (tide_bench_cuda calls). Prints one line per measurement, sorted by build, so the rounds of
# one case stand together. BEFORE_ARGS / AFTER_ARGS (default empty) are added to that build's
# runs: one binary against itself with two options, e.g. "--delivery push" and
# "--delivery cast_to_peers".
set -uo pipefail
[[ $# -ge 2 && -x $1 && -x $2 ]] || { echo "usage: $0 BEFORE_BIN AFTER_BIN [ROUNDS]" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=32
# A stuck wait must become the executor's own error (naming rank, bucket, phase, epoch) before the
# 90 s limit below kills the run; its default is 120 s.
export TIDE_TIMEOUT_MS=${TIDE_TIMEOUT_MS:-30000}
declare -A BIN=([before]=$1 [after]=$2)
declare -A ARGS=([before]=${BEFORE_ARGS:-} [after]=${AFTER_ARGS:-})
ROUNDS=${3:-3}

# One bench row as "<time> us; host <t> us; <check>". A row is: label (several words), W, bytes
# ("1.0 MiB"), time(us), ...: the time is the number after the first "W bytes" pair.
# A run that prints no row leaves its whole output in $OUT/no_row_<n>.log, and its exit status
# (124: timed out) in the line, so a failure can be told from a hang.
LOGS=${OUT:-.}
NO_ROW=0
row() { # name, then the bench's arguments
  local name=$1; shift
  local output line time rc
  output=$(timeout 90 "$@" 2>&1); rc=$?
  line=$(grep -E "^(1 param|512 params|qwen3-moe experts)" <<<"$output" | head -1)
  if [[ -z $line ]]; then
    NO_ROW=$((NO_ROW + 1))
    printf '%s\n' "$*" "$output" >"$LOGS/no_row_$NO_ROW.log"
    echo "$name: no row (exit $rc; output in $LOGS/no_row_$NO_ROW.log)"
    return
  fi
  time=$(grep -oE ' [0-9]+ +[0-9.]+ [KMGT]?i?B +[0-9.]+' <<<"$line" | head -1 | awk '{print $NF}')
  echo "$name: $time us; $(grep -o 'host [0-9.]* us' <<<"$line"); $(grep -oE 'ok \(bitwise\)|FAIL: [0-9]+ wrong elements' <<<"$line")"
}

{
  for ((r = 1; r <= ROUNDS; ++r)); do
    for v in before after; do
      # shellcheck disable=SC2086
      row "$v ag 1 MiB W=2" "${BIN[$v]}" sweep --collective ag --world 2 --min-mib 1 --max-mib 1 --threads ${ARGS[$v]}
      # shellcheck disable=SC2086
      row "$v rs 1 MiB W=2" "${BIN[$v]}" sweep --collective rs --world 2 --min-mib 1 --max-mib 1 --threads ${ARGS[$v]}
    done
  done
  for v in before after; do
    # shellcheck disable=SC2086
    for w in 2 8; do
      if [[ $w == 8 ]]; then
        for c in ag rs; do
          row "$v $c 1 MiB W=8" "${BIN[$v]}" sweep --collective $c --world 8 --min-mib 1 --max-mib 1 --threads ${ARGS[$v]}
        done
      fi
      row "$v ag 4 MiB W=$w" "${BIN[$v]}" sweep --collective ag --world "$w" --min-mib 4 --max-mib 4 --threads ${ARGS[$v]}
    done
    for b in small experts; do
      # shellcheck disable=SC2086
      row "$v ag $b W=2" "${BIN[$v]}" bucket --bucket "$b" --collective ag --world 2 --threads ${ARGS[$v]}
    done
  done
} | sort -s -t: -k1,1
timeout 60 "${BIN[after]}" calls 2>&1 | grep -A11 "^# Host time"
