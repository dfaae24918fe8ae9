#!/usr/bin/env bash
# Start-up measurement on the GPU machine.
set +e
tar xJf .out/pack/bin.tar.xz -C .out
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 KVDIFF_CACHE_DIR=/tmp/kc
bin=.out/bin/kvdiff
w=/tmp/kvdiff-bench; mkdir -p $w
python3 scripts/bench_hf.py build .cache/qwen3-tokenizer $w/model $w/prompt.json > $w/build.json 2>/dev/null
cat /dev/null > $OUT/walls.txt
wall() { local t0=$(date +%s%N); "$@" > /dev/null 2>$OUT/last.err; local rc=$?; local t1=$(date +%s%N); echo "$(( (t1-t0)/1000000 )) ms rc=$rc"; }
echo "cold (no kernel cache):"; rm -rf /tmp/kc; wall $bin generate --backend cuda --model $w/model --max-new-tokens 64 $w/prompt.json
for i in 1 2 3; do echo "generate warm: $(wall $bin generate --backend cuda --model $w/model --max-new-tokens 64 $w/prompt.json)"; done
for i in 1 2 3; do echo "compare warm: $(wall $bin compare --backend cuda --model $w/model --reference standard --paths chunk-reuse:rerotate --taps 'L*' --tolerance fixed --rtol 0.05 --max-new-tokens 64 $w/prompt.json)"; done
KVDIFF_TIMING=1 $bin generate --backend cuda --model $w/model --max-new-tokens 64 $w/prompt.json 2>&1 >/dev/null | tail -30
KVDIFF_TIMING=1 $bin compare --backend cuda --model $w/model --reference standard --paths chunk-reuse:rerotate --taps 'L*' --tolerance fixed --rtol 0.05 --max-new-tokens 64 $w/prompt.json 2>&1 >/dev/null | grep -A40 "kvdiff timing"
echo "HF cold python (import, load, generate):"; wall python3 scripts/bench_hf.py time $w/model $w/prompt.json 64
