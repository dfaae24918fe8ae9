#!/usr/bin/env bash
# Decode GEMVs for several sides at once, at Qwen3-8B's and Qwen3-0.6B's shapes: time per call,
# per side, weight GB/s, whether each side's output has the single kernel's bits, and how far
# the kernels before are from kvdiff's (scripts/bench_gemv_sides.cu). Built for the default
# passes of five sides and for sixteen (one tensor-core tile's inputs), then as PTX for sm_75,
# which the driver compiles for this GPU with the FP32-pipe path of GPUs before sm_80 (the
# tensor cores left out; that path is the kernels before's, so its distance to them is 0).
# Needs nvcc and one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TMPDIR:-/tmp}/bench_gemv_sides
for sides in 5 16; do
  nvcc -O3 -arch=sm_90 -DMAX_SIDES=$sides -o "$bin-$sides" scripts/bench_gemv_sides.cu
  echo "== Qwen3-8B, MAX_SIDES $sides"
  "$bin-$sides" 4096 12288 151936 4096 1024
  echo "== Qwen3-0.6B, MAX_SIDES $sides"
  "$bin-$sides" 1024 3072 151936 2048 1024
done
nvcc -O3 -gencode arch=compute_75,code=compute_75 -DMAX_SIDES=5 -o "$bin-sm75" scripts/bench_gemv_sides.cu
echo "== Qwen3-0.6B, MAX_SIDES 5, the path before sm_80"
"$bin-sm75" 1024 3072 151936 2048 1024
