#!/usr/bin/env bash
# The CPU backend against this machine's limits, one run (benches/cpu.rs): a random-weight model
# of Qwen3-0.6B's shape; prefill GFLOP/s against matrixmultiply's SGEMM on the prefill's own
# shapes, decode GB/s against a parallel read of a buffer as large as the weights. Table last.
#   scripts/bench_cpu.sh [TOKENS,...]      (default 128,512; 1024 takes about a minute on 2 cores)
#   KVDIFF_BENCH_COMPARE=1024 scripts/bench_cpu.sh 128   also the long-prompt comparison of
#                                          scripts/bench_long.sh on the CPU (about 100 s at 1024)
#   KVDIFF_BENCH_REPLAY=490 scripts/bench_cpu.sh   only blame by replay's host work on one layer of
#                                          Qwen3-8B's shape, 490 tokens, one thread and all
set -euo pipefail
cd "$(dirname "$0")/.."
KVDIFF_BENCH_TOKENS=${1:-128,512} cargo bench --bench cpu 2>&1 | grep -vE "^\s+(Compiling|Finished|Running)"
