#!/usr/bin/env bash
# Wall clock of whole commands on the GPU machine (binaries built elsewhere and carried), on the
# benchmark model of scripts/bench_cuda.sh (Qwen3-0.6B's shape, 512-token prompt, 64 tokens):
#   a cold run (no kernel cache), warm kvdiff generate and compare (wall and in-process), the
#   start-up phases (KVDIFF_TIMING), the same two commands with cuBLAS for the GEMMs
#   (KVDIFF_CUDA_GEMM=cublas, the peer of kernels/gemm.cu), and HF transformers doing the
#   generate job from a cold python3 (import, load, generate). Prints a table last.
#   scripts/bench_startup.sh [KVDIFF_BINARY]
set -uo pipefail
bin=${1:-.out/bin/kvdiff}
w=/tmp/kvdiff-bench
mkdir -p "$w"
export KVDIFF_CACHE_DIR=/tmp/kvdiff-startup-cache
[ -f "$w/model/config.json" ] ||
  python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$w/model" "$w/prompt.json" > /dev/null
gen=("$bin" generate --backend cuda --model "$w/model" --max-new-tokens 64 "$w/prompt.json")
cmp=("$bin" compare --backend cuda --model "$w/model" --reference standard --paths chunk-reuse:rerotate
  --taps 'L*' --tolerance fixed --rtol 0.05 --max-new-tokens 64 "$w/prompt.json")
# wall ms, then kvdiff's own in-process ms (its last "... N ms" on stderr)
wall() {
  local t0 t1
  t0=$(date +%s%N)
  "$@" > /dev/null 2> "$w/last.err"
  t1=$(date +%s%N)
  echo "$(( (t1 - t0) / 1000000 )) $(grep -oE '[0-9]+ ms' "$w/last.err" | tail -1 | cut -d' ' -f1)"
}
rm -rf "$KVDIFF_CACHE_DIR"
cold=$(wall "${gen[@]}")
g=(); c=()
for _ in 1 2 3; do g+=("$(wall "${gen[@]}")"); done
for _ in 1 2 3; do c+=("$(wall "${cmp[@]}")"); done
# cuBLAS's GEMMs: its kernels cached per shape as in a repeated run (one untimed compare).
gb=(); cb=()
KVDIFF_CUDA_GEMM=cublas "${cmp[@]}" > /dev/null 2>&1
for _ in 1 2 3; do gb+=("$(KVDIFF_CUDA_GEMM=cublas wall "${gen[@]}")"); done
for _ in 1 2 3; do cb+=("$(KVDIFF_CUDA_GEMM=cublas wall "${cmp[@]}")"); done
echo "start-up phases, generate (KVDIFF_TIMING):"
KVDIFF_TIMING=1 "${gen[@]}" 2>&1 > /dev/null | grep -E "startup" | sort
# KVDIFF_BENCH_SKIP_HF=1 leaves the (minute-long) HF run out.
hf=0
if [ -z "${KVDIFF_BENCH_SKIP_HF:-}" ]; then
  t0=$(date +%s%N)
  python3 scripts/bench_hf.py time "$w/model" "$w/prompt.json" 64 > "$w/hf.json" 2> /dev/null
  hf=$(( ($(date +%s%N) - t0) / 1000000 ))
fi
median() { printf '%s\n' "$@" | sort -n | sed -n 2p; }
gw=$(median "${g[@]%% *}"); gi=$(median "${g[@]##* }")
cw=$(median "${c[@]%% *}"); ci=$(median "${c[@]##* }")
gbw=$(median "${gb[@]%% *}"); gbi=$(median "${gb[@]##* }")
cbw=$(median "${cb[@]%% *}"); cbi=$(median "${cb[@]##* }")
echo
printf '%-52s %10s %12s\n' "run (median of 3)" "wall ms" "in-process ms"
printf '%-52s %10s %12s\n' "kvdiff generate --backend cuda, cold kernel cache" "${cold%% *}" "${cold##* }"
printf '%-52s %10s %12s\n' "kvdiff generate --backend cuda" "$gw" "$gi"
printf '%-52s %10s %12s\n' "kvdiff compare --backend cuda (2 paths + invariant)" "$cw" "$ci"
printf '%-52s %10s %12s\n' "same generate, cuBLAS GEMMs (KVDIFF_CUDA_GEMM=cublas)" "$gbw" "$gbi"
printf '%-52s %10s %12s\n' "same compare, cuBLAS GEMMs" "$cbw" "$cbi"
printf '%-52s %10s %12s\n' "HF transformers from a cold python3, generate" "$hf" "-"
echo "HF wall / kvdiff generate wall: $(python3 -c "print(round($hf / $gw, 1))")"
echo "cuBLAS wall / own-GEMM wall: generate $(python3 -c "print(round($gbw / $gw, 2))"), compare $(python3 -c "print(round($cbw / $cw, 2))")"
