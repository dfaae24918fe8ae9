#!/usr/bin/env bash
# Per-kernel GPU time of a decode step on the benchmark model (scripts/bench_hf.py), from Nsight
# Compute: every launch of two decode steps, each kernel timed on its own at ncu's locked clocks
# (slower than a real run, where programmatic dependent launch overlaps them; read the shares).
# On the GPU machine, binaries carried (scripts/stage_gpu_binaries.sh):
#   scripts/profile_kernels.sh [KVDIFF_BINARY]
set -euo pipefail
bin=${1:-.out/bin/kvdiff}
w=/tmp/kvdiff-bench
mkdir -p "$w"
export KVDIFF_CACHE_DIR=${KVDIFF_CACHE_DIR:-/tmp/kvdiff-startup-cache}
[ -f "$w/model/config.json" ] ||
  python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$w/model" "$w/prompt.json" > /dev/null
gen() { "$bin" generate --backend cuda --model "$w/model" --max-new-tokens "$1" "$w/prompt.json"; }
gen 1 > /dev/null 2>&1
metrics=gpu__time_duration.sum,dram__bytes_read.sum
# Kernels launched one by one, not as graph nodes, so that launches count the same both runs.
export KVDIFF_CUDA_GRAPHS=0
# Launches before the first decode step: start-up checks and the prefill (one token, no decode).
ncu --csv --metrics gpu__time_duration.sum "$bin" generate --backend cuda --model "$w/model" \
  --max-new-tokens 1 "$w/prompt.json" 2> /dev/null > "$w/ncu-prefill.csv"
skip=$(python3 -c '
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 3]
print(len({r[0] for r in rows[1:] if r[0].isdigit()}))' "$w/ncu-prefill.csv")
ncu --csv --launch-skip "$skip" --metrics "$metrics" "$bin" generate --backend cuda \
  --model "$w/model" --max-new-tokens 3 "$w/prompt.json" 2> /dev/null > "$w/ncu-decode.csv"
echo "two decode steps (after $skip launches of start-up and prefill), per kernel:"
python3 scripts/ncu_table.py "$w/ncu-decode.csv" 2
