#!/usr/bin/env bash
# One kvdiff binary against another (a baseline commit's) on the default compare (every path,
# every tap, auto tolerance, 512 + 64 tokens) on random bf16 models of Qwen3-8B's and
# Qwen3-0.6B's shapes: a cold run each (a first run of the build on this machine: empty kvdiff
# cache and the driver's compile cache off, CUDA_CACHE_DISABLE=1, so NVRTC compiles every
# kernel the binary does not ship for the device), a run with only the kernels cached (a model
# never calibrated), then ROUNDS warm
# rounds alternating the two; KVDIFF_TIMING's tables kept in $BENCH_OUT. Prints wall and
# lockstep time per run and whether the JSON reports are byte for byte alike, the table last.
# On the GPU machine, binaries built elsewhere and carried (scripts/stage_gpu_binaries.sh):
#   scripts/bench_against.sh NEW_BINARY BASELINE_BINARY [SHAPES...]   (default: 8b 0.6b)
#   env: ROUNDS (3), BENCH_OUT (where the runs' stderr go; default /tmp/kvdiff-against),
#        BENCH_GAP (seconds between runs, 0.5)
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 NEW_BINARY BASELINE_BINARY [SHAPES...]" >&2; exit 2; }
new=$1 base=$2
shift 2
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(8b 0.6b)
w=/tmp/kvdiff-calibration out=${BENCH_OUT:-/tmp/kvdiff-against}
mkdir -p "$w" "$out"
table=()
one() {  # label binary shape round [VAR=value...]: wall ms and lockstep ms of one run
  local label=$1 b=$2 s=$3 r=$4 t0 t1 rc cache="$w/against-cache-$1"
  shift 4
  [ "$r" = calibration ] && cache="$w/against-cache-$label-calibration"
  # A run's GPU teardown ends after its exit (an heir holds it): none overlaps the next run.
  sleep "${BENCH_GAP:-0.5}"
  t0=$(date +%s%N)
  env "$@" KVDIFF_TIMING=1 KVDIFF_CACHE_DIR="$cache" "$b" -vv compare --backend cuda \
    --model "$w/model-$s" --max-new-tokens 64 --json "$out/$label-$s.json" "$w/prompt-$s.json" \
    > /dev/null 2> "$out/$label-$s-$r.err"
  rc=$?
  t1=$(date +%s%N)
  echo "$(((t1 - t0) / 1000000)) $rc $(grep -o 'paths compared together in [0-9.]*' "$out/$label-$s-$r.err" |
    grep -o '[0-9.]*$')"
}
for s in "${shapes[@]}"; do
  [ -f "$w/model-$s/config.json" ] ||
    python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$w/model-$s" "$w/prompt-$s.json" "$s" > /dev/null
  cat "$w/model-$s"/*.safetensors > /dev/null
  rm -rf "$w"/against-cache-*
  for label in base new; do
    b=$base
    [ "$label" = new ] && b=$new
    read -r ms rc lock <<< "$(one "$label" "$b" "$s" cold CUDA_CACHE_DISABLE=1)"
    table+=("$s $label cold: wall $ms ms, lockstep ${lock:-?} ms, exit $rc")
  done
  for label in base new; do
    b=$base
    [ "$label" = new ] && b=$new
    mkdir -p "$w/against-cache-$label-calibration"
    # A build shipping its cubins has none cached.
    cp "$w/against-cache-$label"/kernels-* "$w/against-cache-$label-calibration/" 2>/dev/null
    read -r ms rc lock <<< "$(one "$label" "$b" "$s" calibration)"
    table+=("$s $label kernels cached, calibrated: wall $ms ms, lockstep ${lock:-?} ms, exit $rc")
  done
  for r in $(seq "${ROUNDS:-3}"); do
    for label in base new; do
      b=$base
      [ "$label" = new ] && b=$new
      read -r ms rc lock <<< "$(one "$label" "$b" "$s" "$r")"
      table+=("$s $label warm $r: wall $ms ms, lockstep ${lock:-?} ms, exit $rc")
    done
  done
  if cmp -s "$out/base-$s.json" "$out/new-$s.json"; then
    table+=("$s: the reports are byte for byte alike")
  else
    table+=("$s: the reports DIFFER")
  fi
done
printf '%s\n' "${table[@]}"
