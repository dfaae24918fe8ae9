#!/usr/bin/env bash
# Sweep throughput (cases per second) on the GPU machine, binaries built elsewhere and carried:
#   - the default model on the CPU with every core, for the README's 2-core vs all-cores rows;
#   - a random-weight model of Qwen3-0.6B's shape on the GPU (bench_hf.py builds it), cases run
#     back to back on one GPU, with a pinned noise profile and with per-conversation calibration.
# Each row is what `kvdiff sweep` prints at its end; the table comes last.
#   [SWEEP_ROWS=gpu|cpu] [ROW_SECS=120] scripts/bench_sweep.sh [KVDIFF_BINARY]
# SWEEP_ROWS=cpu runs only the CPU rows (no torch needed): run it once per binary to compare two.
set -euo pipefail
bin=${1:-target/release/kvdiff}
work=/tmp/kvdiff-bench-sweep
rm -rf "$work" && mkdir -p "$work"
# A cold calibration cache for every run, so rows are comparable between runs and binaries.
export KVDIFF_CACHE_DIR="$work/cache"
say() { echo "[$(date +%T)] $*" >&2; }
model=/tmp/kvdiff-bench/model
if [ "${SWEEP_ROWS:-all}" != cpu ] && [ ! -f "$model/config.json" ]; then
  say "build the 0.6B-shaped model"
  mkdir -p /tmp/kvdiff-bench
  python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$model" /tmp/kvdiff-bench/prompt.json > /dev/null
fi
head -n 100 fixtures/prompt-set.jsonl > "$work/set100.jsonl"
rows=()
row() {  # name, then the sweep arguments; kvdiff's own "N cases ... cases/s" line, or, when the
         # row's time runs out first, the cases its JSONL holds over the time spent
  local name=$1; shift
  local out=${*: -2:1}
  say "$name"
  local t0 t1
  t0=$(date +%s%N)
  timeout -s INT "${ROW_SECS:-120}" "$bin" sweep "$@" 2> "$work/err" > /dev/null || true
  t1=$(date +%s%N)
  local line
  line=$(grep -E "cases/s" "$work/err" | tail -1 || true)
  if [ -z "$line" ]; then
    line=$(python3 -c '
import json, sys
ids = {(j["case"], j["chunking"]) for j in map(json.loads, filter(str.strip, open(sys.argv[1])))}
s = float(sys.argv[2]) / 1e9
print(f"{len(ids)} cases in {s:.1f} s (stopped at the time limit): {len(ids) / s:.2f} cases/s")' "$out" "$((t1 - t0))" 2>&1 || tail -3 "$work/err")
  fi
  rows+=("$(printf '%-72s %s' "$name" "${line#kvdiff: }")")
}
cores=$(nproc)
if [ "${SWEEP_ROWS:-all}" != gpu ]; then
"$bin" calibrate -q --out "$work/profile-default.json" fixtures/prompts/two-contexts.txt
row "default model, cpu, cascade, pinned profile, $cores threads" \
  --paths cascade --chunkings random:1 --max-new-tokens 4 --threads "$cores" \
  --noise-profile "$work/profile-default.json" \
  --out "$work/cpu-cascade.jsonl" fixtures/prompt-set.jsonl
row "default model, cpu, every path + invariants, per conversation, $cores threads" \
  --chunkings random:1 --threads "$cores" --out "$work/cpu-all.jsonl" fixtures/prompt-set.jsonl
fi
if [ "${SWEEP_ROWS:-all}" != cpu ]; then
"$bin" calibrate -q --backend cuda --model "$model" --out "$work/profile-06b.json" \
  /tmp/kvdiff-bench/prompt.json 2> "$work/calibrate.err" || cat "$work/calibrate.err" >&2
row "0.6B shape, cuda, cascade, pinned profile, 100 conversations x 2 chunkings" \
  --backend cuda --model "$model" --paths cascade --chunkings random:1 --max-new-tokens 4 \
  --noise-profile "$work/profile-06b.json" --out "$work/gpu-cascade.jsonl" "$work/set100.jsonl"
row "0.6B shape, cuda, every path + invariants, pinned profile, 100 conversations x 2" \
  --backend cuda --model "$model" --chunkings random:1 \
  --noise-profile "$work/profile-06b.json" --out "$work/gpu-all.jsonl" "$work/set100.jsonl"
row "0.6B shape, cuda, cascade, calibrated per conversation, 100 conversations x 2" \
  --backend cuda --model "$model" --paths cascade --chunkings random:1 --max-new-tokens 4 \
  --out "$work/gpu-cascade-cal.jsonl" "$work/set100.jsonl"
fi
for f in "$work"/*.jsonl; do
  [ "$f" = "$work/set100.jsonl" ] && continue
  echo "== $(basename "$f")"
  "$bin" sweep summarize --worst 2 "$f" 2>&1 | head -12
done
echo
printf '%s\n' "${rows[@]}"
