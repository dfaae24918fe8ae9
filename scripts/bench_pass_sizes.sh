#!/usr/bin/env bash
# How many decode steps one joint pass should take (`KVDIFF_CUDA_MAX_SIDES`): the warm default
# compare (every path, 512 + 64 tokens) on random bf16 models of Qwen3-8B's and Qwen3-0.6B's
# shapes, with passes of at most 3, 4, 5 and 10 sides, alternating with a baseline binary
# (another commit's kvdiff, or the same one at its default), two rounds. Prints wall and
# lockstep time per run, and whether each JSON report is byte for byte the baseline's.
# On the GPU machine, binaries built elsewhere and carried (scripts/stage_gpu_binaries.sh):
#   scripts/bench_pass_sizes.sh [KVDIFF_BINARY] [BASELINE_BINARY] [SHAPES...]   (8b 0.6b)
set -uo pipefail
bin=${1:-.out/bin/kvdiff}
base=${2:-$bin}
shift 2 || shift $#
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(8b 0.6b)
w=/tmp/kvdiff-calibration
mkdir -p "$w"
one() {  # label binary shape [env...]: one warm run, its own kvdiff cache per label
  local label=$1 b=$2 s=$3
  shift 3
  local t0 t1 rc
  t0=$(date +%s%N)
  env "$@" KVDIFF_CACHE_DIR="$w/cache-$label" "$b" -vv compare --backend cuda --model "$w/model-$s" \
    --max-new-tokens 64 --json "$w/pass-$label-$s.json" "$w/prompt-$s.json" > /dev/null 2> "$w/pass-$label-$s.err"
  rc=$?
  t1=$(date +%s%N)
  printf '%-5s %-9s exit %d  wall %6d ms  lockstep %s ms\n' "$s" "$label" "$rc" $(((t1 - t0) / 1000000)) \
    "$(grep -o 'paths compared together in [0-9.]*' "$w/pass-$label-$s.err" | grep -o '[0-9.]*$')"
}
# label, binary, environment
configs=("baseline $base X=1" "sides-3 $bin KVDIFF_CUDA_MAX_SIDES=3" "sides-4 $bin KVDIFF_CUDA_MAX_SIDES=4"
  "sides-5 $bin KVDIFF_CUDA_MAX_SIDES=5" "sides-10 $bin KVDIFF_CUDA_MAX_SIDES=10")
for s in "${shapes[@]}"; do
  [ -f "$w/model-$s/config.json" ] ||
    python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$w/model-$s" "$w/prompt-$s.json" "$s" > /dev/null
  cat "$w/model-$s"/*.safetensors > /dev/null
  # A first run per setting compiles its kernels and calibrates; the rounds after are warm.
  for round in 0 1 2; do
    for c in "${configs[@]}"; do
      read -r label b e <<< "$c"
      if [ "$round" = 0 ]; then one "$label" "$b" "$s" "$e" > /dev/null; else one "$label" "$b" "$s" "$e"; fi
    done
  done
  for c in "${configs[@]:1}"; do
    l=${c%% *}
    if cmp -s "$w/pass-baseline-$s.json" "$w/pass-$l-$s.json"; then
      echo "$s $l: report as the baseline's"
    else
      echo "$s $l: report DIFFERS from the baseline's"
    fi
  done
done
