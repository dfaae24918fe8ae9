#!/usr/bin/env bash
# Prefill GEMM tiles at Qwen3-8B's shapes (scripts/bench_gemm_tiles.cu). Needs nvcc, one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TMPDIR:-/tmp}/bench_gemm_tiles
nvcc -O3 -arch=sm_90 -o "$bin" scripts/bench_gemm_tiles.cu
"$bin" "$@"
