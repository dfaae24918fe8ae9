#!/usr/bin/env bash
# Decode GEMVs for several sides at once, at Qwen3-8B's and Qwen3-0.6B's shapes: time per call,
# per side, weight GB/s, and whether each side's output has the single kernel's bits.
# Needs nvcc and one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TMPDIR:-/tmp}/bench_gemv_sides
nvcc -O3 -arch=sm_90 -o "$bin" scripts/bench_gemv_sides.cu
echo "== Qwen3-8B"
"$bin" 4096 12288 151936 4096 1024
echo "== Qwen3-0.6B"
"$bin" 1024 3072 151936 2048 1024
