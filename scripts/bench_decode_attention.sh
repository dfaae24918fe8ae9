#!/usr/bin/env bash
# The head-128 decode attention (q/k norm and RoPE folded in) with a block per query head
# against a block per GQA group, for one step alone and passes of 1 to 8 sides, at Qwen3-8B's
# and Qwen3-0.6B's attention shapes: time per launch, and whether every side keeps the
# per-head block's bits. Over the 512 + 64-token default compare's cache with the sides kernel
# built for 2, 3 (the default) and 4 blocks an SM (its registers; ptxas' spills shown), then
# over 16k keys. Needs nvcc and one GPU.
#   scripts/bench_decode_attention.sh [quick]   (quick: leaves out the 16k keys)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TMPDIR:-/tmp}/bench_decode_attention
status=0
for blocks in 2 3 4; do
  nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v -DDECODE_ROPE_SIDES_BLOCKS=$blocks -o "$bin-$blocks" \
    scripts/bench_decode_attention.cu 2>&1 | grep -A1 "attention_decode_128_rope_sides" |
    grep -oE "[0-9]+ bytes spill stores" | head -1 | sed "s/^/sides kernel, $blocks blocks an SM: /" || true
done
for blocks in 2 3 4; do
  echo "== sides kernel built for $blocks blocks an SM"
  echo "-- Qwen3-8B (32 heads, 8 KV heads)"
  "$bin-$blocks" 32 8 576 || status=1
  echo "-- Qwen3-0.6B (16 heads, 8 KV heads)"
  "$bin-$blocks" 16 8 576 || status=1
done
if [ "${1:-}" != quick ]; then
  echo "== 16384 keys, 2 blocks an SM"
  "$bin-2" 32 8 16384 || status=1
  "$bin-2" 16 8 16384 || status=1
fi
exit $status
