#!/usr/bin/env bash
# What `kvdiff diff --backend cuda` costs at the 8B shape (runs on the GPU machine, binaries built
# elsewhere): a random bf16 model of Qwen3-8B's shape, an HF transformers bf16 engine's dump of
# the benchmark's 512-token chat prompt prefilled in three chunks plus 8 decode steps
# (scripts/bench_diff.py), one sequence and a batch of four. Rows, each one run on one GPU:
#   first       empty kvdiff cache: the noise model calibrated, then the diff with replay
#   warm        the same again (calibration cached)
#   no-replay   warm, --no-replay
#   host-replay warm, KVDIFF_REPLAY_ON_HOST=1: a bf16 engine's ops replayed on the host's f32
#               weights (the peer of the GPU replay)
#   4 seqs      warm, the batch of four sequences (one model load for all)
# with BASELINE (an earlier build) beside it for warm and no-replay; the engine's own capture
# time for scale. Prints a table last.
#   scripts/bench_diff.sh [KVDIFF_BINARY] [BASELINE_BINARY]
set -uo pipefail
bin=${1:-.out/bin/kvdiff}
base=${2:-}
w=/tmp/kvdiff-diff-bench
mkdir -p "$w"
export KVDIFF_CACHE_DIR=$w/cache
say() { echo "[$(date +%T)] $*" >&2; }
m=$w/model-8b
if [ ! -f "$m/config.json" ] || [ ! -f "$w/prompt.json" ]; then
  say "build 8b"
  python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$m" "$w/prompt.json" 8b > /dev/null
fi
cat "$m"/*.safetensors > /dev/null
for n in 1 4; do
  if [ ! -f "$w/dump-$n/meta.json" ]; then
    say "capture $n"
    rm -rf "$w/dump-$n"
    python3 scripts/bench_diff.py "$m" "$w/prompt.json" "$w/dump-$n" "$n" > "$w/capture-$n.json"
  fi
done
run() {  # label, binary, dump, extra env..., -- args...: "wall_ms exit"
  local label=$1 b=$2 d=$3; shift 3
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local t0 t1
  t0=$(date +%s%N)
  env "${envs[@]}" KVDIFF_TIMING=1 timeout 240 "$b" -v diff --backend cuda --model "$m" "$@" \
    "$w/dump-$d" > "$w/$label.out" 2> "$w/$label.err"
  local rc=$?
  t1=$(date +%s%N)
  echo "$(( (t1 - t0) / 1000000 )) $rc"
}
rows=()
rm -rf "$KVDIFF_CACHE_DIR"
say "new first"; first=$(run new-first "$bin" 1 --)
say "new warm"; warm=$(run new-warm "$bin" 1 --)
say "new no-replay"; norep=$(run new-norep "$bin" 1 -- --no-replay)
say "new 4 seqs"; four=$(run new-four "$bin" 4 --)
say "new host replay"; host=$(run new-host "$bin" 1 KVDIFF_REPLAY_ON_HOST=1 --)
# The default compare on the same model and prompt, first run (empty cache), for the breakdown of
# its phases (KVDIFF_TIMING) beside the diff's.
rm -rf "$KVDIFF_CACHE_DIR"
say "compare first"
t0=$(date +%s%N)
KVDIFF_TIMING=1 timeout 240 "$bin" -v compare --backend cuda --model "$m" --max-new-tokens 64 \
  "$w/prompt.json" > "$w/compare-first.out" 2> "$w/compare-first.err"
compare_rc=$?
compare_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
rows+=("new ${first% *} ${warm% *} ${norep% *} ${host% *} ${four% *} ${first#* }${warm#* }${norep#* }${host#* }${four#* }")
if [ -n "$base" ]; then
  say "baseline warm"; bwarm=$(run base-warm "$base" 1 --)
  say "baseline no-replay"; bnorep=$(run base-norep "$base" 1 -- --no-replay)
  rows+=("baseline - ${bwarm% *} ${bnorep% *} - - ${bwarm#* }${bnorep#* }")
fi
for f in "$w"/*.err; do
  echo "--- $(basename "$f" .err)" >&2
  grep -E "^kvdiff: (diffed|no replay|replay:|loading)|EQUIVALENT|DIVERGED|verdict" "$f" | head -6 >&2
  awk '/ x +[0-9.]+ ms/ {for (i = 1; i <= NF; i++) if ($i == "x") print $(i + 1), $0}' "$f" |
    sort -rn | head -14 | cut -d' ' -f2- >&2
done
grep -h "" "$w"/*.out | grep -E "EQUIVALENT|DIVERGED|^engine" | head -8 >&2
cap1=$(python3 -c "import json; print(json.load(open('$w/capture-1.json'))['capture_s'])")
cap4=$(python3 -c "import json; print(json.load(open('$w/capture-4.json'))['capture_s'])")
echo
echo "kvdiff diff --backend cuda, 8B shape, HF bf16 dump of 512 tokens in 3 chunks + 8 steps (wall ms)"
echo "engine capture: 1 sequence ${cap1} s, 4 sequences ${cap4} s"
echo "default compare --backend cuda, first run: ${compare_ms} ms (exit ${compare_rc})"
printf '%-9s %7s %7s %10s %12s %8s %6s\n' build first warm no-replay host-replay "4 seqs" exits
for r in "${rows[@]}"; do
  # shellcheck disable=SC2086
  printf '%-9s %7s %7s %10s %12s %8s %6s\n' $r
done
