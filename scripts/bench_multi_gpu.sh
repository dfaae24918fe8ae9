#!/usr/bin/env bash
# kvdiff's CUDA reference across GPUs (docs/multi-gpu.md), on a machine with two or more GPUs
# (binaries built elsewhere and carried; .cache/qwen3-tokenizer carried). Random bf16 models held
# in memory files (scripts/bench_big.py serve), the 512-token chat prompt, the default command:
#   kvdiff compare --backend cuda --model M --max-new-tokens 64 PROMPT
# Rows:
#   32b one / two   Qwen3-32B's shape on GPU 0 alone, then forced over two (--devices 0,1): the
#                   JSON reports must be byte for byte alike (same verdicts, same numbers)
#   70b             Llama-3-70B's shape (141 GB), which no single GPU holds: placed by kvdiff
#                   over both; cold (empty kvdiff cache) and warm
#   hf              HF transformers generate of the same 512 + 64 tokens, device_map="auto"
#   diff            kvdiff diff --backend cuda of that HF model's dump (the prompt prefilled in
#                   three chunks through its KV cache, 8 decode steps), wall and verdict
#   floor           weights over measured bandwidths (HBM, peer, pinned host to device)
#   scripts/bench_multi_gpu.sh [KVDIFF_BINARY] [SHAPES...]   (default: 32b 70b; BENCH_SKIP_HF=1
#   leaves out the hf and diff rows; BENCH_READERS="8 16" adds a warm run for each count of
#   weight reader threads, KVDIFF_WEIGHT_READERS)
set -uo pipefail
bin=${1:-.out/bin/kvdiff}
shift || true
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(32b 70b)
w=/tmp/kvdiff-multi
rm -rf "$w"
mkdir -p "$w"
export KVDIFF_CACHE_DIR=$w/cache
say() { echo "[$(date +%T)] $*" >&2; }
python3 scripts/bench_big.py floor > "$w/floor.json" 2> "$w/floor.err"
run() {  # label model extra-args...: "wall_ms exit"
  local label=$1 m=$2; shift 2
  local t0 t1
  t0=$(date +%s%N)
  KVDIFF_TIMING=1 timeout 400 "$bin" -v compare --backend cuda --model "$m" --max-new-tokens 64 \
    --json "$w/$label.json" "$@" "$w/prompt-${label%%-*}.json" > "$w/$label.out" 2> "$w/$label.err"
  local rc=$?
  t1=$(date +%s%N)
  echo "$(( (t1 - t0) / 1000000 )) $rc"
}
rows=()
for shape in "${shapes[@]}"; do
  m=$w/model-$shape
  say "build $shape"
  python3 scripts/bench_big.py serve "$shape" "$m" .cache/qwen3-tokenizer "$w/prompt-$shape.json" \
    > "$w/serve-$shape.json" 2> "$w/serve-$shape.err" &
  server=$!
  for _ in $(seq 600); do [ -f "$m/ready" ] || ! kill -0 $server 2> /dev/null && break; sleep 1; done
  if [ ! -f "$m/ready" ]; then tail -5 "$w/serve-$shape.err"; rows+=("$shape build-failed"); continue; fi
  cat "$w/serve-$shape.json" >&2
  rm -rf "$KVDIFF_CACHE_DIR"
  if [ "$shape" = 32b ]; then
    say "32b on GPU 0"; one=$(run "$shape-one" "$m" --devices 0)
    say "32b over GPUs 0,1"; two=$(run "$shape-two" "$m" --devices 0,1)
    same=no; cmp -s "$w/$shape-one.json" "$w/$shape-two.json" && same=yes
    rows+=("32b one=$one two=$two reports-alike=$same")
  else
    say "$shape cold"; cold=$(run "$shape-cold" "$m")
    if [ "${cold#* }" != 0 ] && grep -q "cannot be calibrated on the GPU" "$w/$shape-cold.err"; then
      # GPU 0 kept too little free beside its layers: more of it kept free, as the error says.
      export KVDIFF_HOME_RESERVE_GIB=${BENCH_HOME_RESERVE_GIB:-40}
      say "$shape cold, KVDIFF_HOME_RESERVE_GIB=$KVDIFF_HOME_RESERVE_GIB"; cold=$(run "$shape-cold" "$m")
    fi
    say "$shape warm"; warm=$(run "$shape-warm" "$m")
    for r in ${BENCH_READERS:-}; do
      say "$shape warm, KVDIFF_WEIGHT_READERS=$r"
      rows+=("$shape warm readers=$r: $(KVDIFF_WEIGHT_READERS=$r run "$shape-warm-r$r" "$m")")
    done
    if [ "${BENCH_SKIP_HF:-0}" = 1 ]; then
      rows+=("$shape cold=$cold warm=$warm")
    else
      say "$shape HF"
      python3 scripts/bench_big.py hf "$m" "$w/prompt-$shape.json" 64 "$w/dump-$shape" > "$w/hf-$shape.json" \
        2> "$w/hf-$shape.err" || tail -5 "$w/hf-$shape.err"
      say "$shape diff of the HF dump ($(du -sh "$w/dump-$shape" 2> /dev/null | cut -f1))"
      t0=$(date +%s%N)
      KVDIFF_TIMING=1 timeout 400 "$bin" -v diff --backend cuda --model "$m" --json "$w/$shape-diff.json" \
        "$w/dump-$shape" > "$w/$shape-diff.out" 2> "$w/$shape-diff.err"
      rc=$?
      t1=$(date +%s%N)
      rm -rf "$w/dump-$shape"
      rows+=("$shape cold=$cold warm=$warm diff=\"$(( (t1 - t0) / 1000000 )) $rc\" hf=$(cat "$w/hf-$shape.json" 2> /dev/null)")
    fi
  fi
  for f in "$w/$shape"-*.err; do
    echo "--- $f" >&2
    grep -E "placed|kvdiff memory|verdict|EQUIVALENT|DIVERGED|startup: (GPU|weights)|^kvdiff: |compare: (noise|lockstep|prefill|decode)|error|fix:" "$f" | head -20 >&2
  done
  kill $server 2> /dev/null; wait $server 2> /dev/null
done
echo
echo "floor: $(cat "$w/floor.json")"
printf '%s\n' "${rows[@]}"
for f in "$w"/*.out; do echo "--- $f"; grep -E "EQUIVALENT|DIVERGED|verdict" "$f" | head -12; done
