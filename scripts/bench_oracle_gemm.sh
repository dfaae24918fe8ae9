#!/usr/bin/env bash
# The GPU oracle's products against cuBLAS (scripts/bench_oracle_gemm.cu) at a model's shapes:
# `bench_oracle_gemm.sh [HIDDEN INTER Q_DIM KV_DIM ROWS]` (default Qwen3-8B's, 128 rows).
# Needs nvcc and cuBLAS, one GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TMPDIR:-/tmp}/bench_oracle_gemm
nvcc -O3 -arch=sm_90 -o "$bin" scripts/bench_oracle_gemm.cu -lcublas
"$bin" "$@"
