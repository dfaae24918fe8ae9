#!/usr/bin/env bash
# The tensor-core prefill attention's whole and split forms (scripts/bench_prefill_attention.cu)
# at Qwen3-0.6B's and Qwen3-8B's attention shapes, for the passes of the 512 + 64-token default
# compare (a 16-token chunk late in the prompt, a ~100-token chunk, the whole prompt) and of a
# 16k-token prompt, built for softmax segments starting 64 and 128 keys wide (MMA_SEG) and for
# one segment (no fold). Needs nvcc and one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TMPDIR:-/tmp}/bench_prefill_attention
status=0
for seg in 64 128 1048576; do
  nvcc -O3 -arch=sm_90 -std=c++17 -DMMA_SEG=$seg -o "$bin-$seg" scripts/bench_prefill_attention.cu &
done
wait
for seg in 64 128 1048576; do
  for heads in 16 32; do
    for shape in "16 560" "16 256" "100 400" "176 0" "512 0" "1024 15360"; do
      "$bin-$seg" $heads 8 $shape || status=1
    done
  done
done
exit $status
