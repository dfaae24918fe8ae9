#!/usr/bin/env bash
# Prefill GEMM tiles at Qwen3-8B's shapes (scripts/bench_gemm_tiles.cu; arguments: hidden,
# intermediate, q and kv widths of another model). Needs nvcc, one GPU.
#   env GEMM_BEFORE=FILE: an earlier gemm.cu without its kernels, whose tiles are timed beside
#   (and must give the bits of) today's, e.g.
#   git show REV:kernels/gemm.cu | sed '/^#define GEMM_KERNEL/,$d' > /tmp/gemm_before.cuh
#   env BENCH_ONLY=down:16: one shape at one row count.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TMPDIR:-/tmp}/bench_gemm_tiles
before=()
[ -n "${GEMM_BEFORE:-}" ] && before=(-DBEFORE="\"$(realpath "$GEMM_BEFORE")\"")
nvcc -O3 -arch=sm_90 "${before[@]}" -o "$bin" scripts/bench_gemm_tiles.cu
"$bin" "$@"
