#!/usr/bin/env bash
# The tensor-core attention kernels (scripts/bench_attention_mma.cu) built for sm_90
# (`mma.sync`) and for sm_90a (warpgroup MMAs), at Qwen3-0.6B's and Qwen3-8B's attention shapes:
# the passes of a 512-token compare and of a 16k-token one. Prints µs a launch for both builds,
# their ratio, and whether every output (attention outputs, statistics, probabilities, diff
# summaries) has the same bits in both. Needs nvcc and one H100 or H200.
#   scripts/bench_attention_mma.sh [MMA_WG_STEPS | -DNAME=VALUE ...]
# Each MMA_WG_STEPS given adds an sm_90a build with that many dimension steps a commit group
# in the attention passes (kernels/attention_mma.cu; -DMMA_DIFF_WG_STEPS=N sets the diff's),
# each -DNAME=VALUE one with that macro (v1, v2, ... in the table),
# timed beside the others (its bits checked against sm_90's too).
# BASE=DIR adds the sm_90a build of another tree's kernels/ and scripts/ (an earlier commit's,
# from `git archive`), timed and bit-checked beside today's.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${TMPDIR:-/tmp}/bench_attention_mma
builds=(sm_90 sm_90a)
nvcc -O3 -arch=sm_90 -std=c++17 -o "$bin-sm_90" scripts/bench_attention_mma.cu &
nvcc -O3 -arch=sm_90a -std=c++17 -o "$bin-sm_90a" scripts/bench_attention_mma.cu &
if [ -n "${BASE:-}" ]; then
  builds+=(base)
  nvcc -O3 -arch=sm_90a -std=c++17 -o "$bin-base" "$BASE/scripts/bench_attention_mma.cu" &
fi
n=0
for v in "$@"; do
  case $v in
    -D*) name=v$((n += 1)) flag=$v ;;
    *) name=steps$v flag=-DMMA_WG_STEPS=$v ;;
  esac
  builds+=($name)
  nvcc -O3 -arch=sm_90a -std=c++17 $flag -o "$bin-$name" scripts/bench_attention_mma.cu &
done
wait
status=0
printf '%-34s' case; for b in "${builds[@]}"; do printf ' %12s' "$b us"; done
printf ' %7s  %s\n' ratio outputs
for heads in 16 32; do
  for c in "whole 512 0" "imaged 512 0" "whole 16 560" "whole 1024 15360" \
           "imaged 1024 15360" "whole 8192 0" "imaged 8192 0" "split 16 560" \
           "split 100 400" "diff 512 0" "diff 100 400" "diff 8192 8192"; do
    set -- $c
    r=()
    bits="same bits"
    for b in "${builds[@]}"; do
      line=$("$bin-$b" $heads 8 $1 $2 $3 "$bin-$b.dump") || { status=1; echo "$line"; }
      r+=("$(echo "$line" | grep -oE '[0-9.]+ us' | cut -d' ' -f1)")
      echo "$line" | grep -q DIFFER && { status=1; echo "$b: $line"; }
      cmp -s "$bin-sm_90.dump" "$bin-$b.dump" || { bits="BITS DIFFER ($b)"; status=1; }
    done
    printf '%-34s' "$1 heads $heads n $2 base $3"; printf ' %12s' "${r[@]}"
    printf ' %7s  %s\n' "$(python3 -c "print(f'{${r[1]}/${r[0]}:.2f}')")" "$bits"
  done
done
exit $status
