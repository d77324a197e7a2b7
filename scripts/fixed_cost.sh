#!/usr/bin/env bash
# Issue 57's measurements in one command on a GPU machine: a small collective's fixed cost,
# operation by operation (`tide_bench_cuda breakdown`), then the 1 MiB AG / RS rows of BENCHMARKS
# (`sweep ... --cuda-graphs`) and the 512-param rows (`bucket --bucket small ... --cuda-graphs`),
# ranks as threads sharing GPU 0, for this tree and, where git knows it, for a base commit built
# beside it (BASE, default ac5779e: before the fused handshake), alternating, so both run on the same
# card in the same minutes. Logs under $OUT (default gpu-out/); the tables at the end.
#
#   scripts/fixed_cost.sh                 # BASE=ac5779e
#   BASE= scripts/fixed_cost.sh           # this tree only
#   TIDE_PREBUILT=dir scripts/fixed_cost.sh   # this tree's tide_bench_cuda already built in dir
#   TIDE_BASE_PREBUILT=dir BASE=ac5779e scripts/fixed_cost.sh   # the base's, built in dir (no .git there);
#                                         # BASE then only names it
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BASE=${BASE-ac5779e}
JOBS=${JOBS:-16}
say() { echo "== fixed_cost: $*"; }

build() {  # build <source dir> <build dir>
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_PYTHON=OFF -DTIDE_BUILD_TESTS=OFF \
    >"$2.log" 2>&1 && cmake --build "$2" -j"$JOBS" --target tide_bench_cuda >>"$2.log" 2>&1
}

NEW=""
if [[ -n "${TIDE_PREBUILT:-}" && -x "$TIDE_PREBUILT/tide_bench_cuda" ]]; then
  NEW=$TIDE_PREBUILT/tide_bench_cuda
else
  say "building this tree"
  build "$ROOT" "$ROOT/build-fixed-cost" || { tail -30 "$ROOT/build-fixed-cost.log"; exit 1; }
  NEW=$ROOT/build-fixed-cost/bench/cuda/tide_bench_cuda
fi
OLD=""
if [[ -n "${TIDE_BASE_PREBUILT:-}" && -x "$TIDE_BASE_PREBUILT/tide_bench_cuda" ]]; then
  OLD=$TIDE_BASE_PREBUILT/tide_bench_cuda
elif [[ -n "$BASE" ]] && git -C "$ROOT" rev-parse --verify -q "$BASE^{commit}" >/dev/null; then
  say "building base $BASE"
  rm -rf /tmp/tide-base && mkdir -p /tmp/tide-base &&
    git -C "$ROOT" archive "$BASE" | tar -x -C /tmp/tide-base &&
    build /tmp/tide-base /tmp/tide-base/build && OLD=/tmp/tide-base/build/bench/cuda/tide_bench_cuda ||
    say "base $BASE did not build; this tree only"
else
  say "no base (BASE='$BASE' unknown to git here): this tree only"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

say "breakdown (this tree)"
timeout 300 "$NEW" breakdown --world 2 --iters 200 --warmup 20 --rounds 3 >"$OUT/breakdown.log" 2>&1
echo "breakdown exit $?" >>"$OUT/breakdown.log"

# The BENCHMARKS rows: base and this tree alternating, 3 rounds of the 1 MiB rows, 1 of the 512-param.
rows() {  # rows <label> <binary> <round>
  for c in ag rs; do
    "$2" sweep --collective $c --world 2 --threads --min-mib 1 --max-mib 1 --iters 50 --warmup 5 \
      --cuda-graphs 2>&1 | grep -E "^coll " | sed "s/^/$1 round $3 /"
    if [[ $3 == 1 ]]; then
      "$2" bucket --bucket small --collective $c --world 2 --threads --iters 30 --warmup 3 \
        --cuda-graphs 2>&1 | grep -E "^coll " | sed "s/^/$1 round $3 /"
    fi
  done
}
: >"$OUT/fixed_cost_rows.log"
for round in 1 2 3; do
  [[ -n "$OLD" ]] && timeout 120 bash -c "$(declare -f rows); rows base $OLD $round" >>"$OUT/fixed_cost_rows.log" 2>&1
  timeout 120 bash -c "$(declare -f rows); rows new $NEW $round" >>"$OUT/fixed_cost_rows.log" 2>&1
done

echo
sed -n '/==== breakdown/,$p' "$OUT/breakdown.log"
echo
echo "# sweep / bucket rows (base = $BASE, new = this tree): label, W, bytes, us, busbw, SM, note"
cat "$OUT/fixed_cost_rows.log"
