#!/usr/bin/env bash
# The CUDA benchmark (GPU machine; binaries built elsewhere and carried): a random-weight model of
# Qwen3-0.6B's shape, a 512-token chat prompt, 64 greedy tokens. Times, in one run:
#   kvdiff generate --backend cuda                       (one path)
#   kvdiff compare --backend cuda standard vs chunk-reuse:rerotate, every layer's taps diffed
#   HF transformers bf16 generate: sdpa, and eager with output_hidden_states
# and the floor: weights read per decode token over measured bandwidth plus prefill FLOPs over
# the measured bf16 GEMM rate. Prints a table last; full numbers in $OUT/bench.json.
#   scripts/bench_cuda.sh [KVDIFF_BINARY]
set -euo pipefail
export PYTHONUNBUFFERED=1
bin=${1:-target/release/kvdiff}
out=${OUT:-/tmp}
work=/tmp/kvdiff-bench
rm -rf "$work" && mkdir -p "$work"
say() { echo "[$(date +%T)] $*" >&2; }
say build
python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$work/model" "$work/prompt.json" > "$work/build.json"
say ceilings
python3 scripts/bench_hf.py ceilings > "$work/ceilings.json"
say "kvdiff runs"
ms() { grep -oE '[0-9.]+ ms' "$1" | tail -1 | cut -d' ' -f1; }
run_timed() {  # name, repeats, command...: in-process ms and wall seconds per repeat
  local name=$1 reps=$2; shift 2
  if [ "$name" = generate ]; then  # warm-up: compiles and caches the PTX, fills the page cache
    say "$name (warm-up)"
    timeout 100 "$@" > /dev/null 2> "$work/$name.err" || { cat "$work/$name.err"; exit 1; }
  fi
  for _ in $(seq "$reps"); do
    local t0 t1
    t0=$(date +%s%N)
    timeout 100 "$@" > "$work/$name.out" 2> "$work/$name.err" || true
    t1=$(date +%s%N)
    echo "$(ms "$work/$name.err") $(( (t1 - t0) / 1000000 ))"
  done > "$work/$name.times"
  say "$name: $(tr '\n' ' ' < "$work/$name.times")"
  cat "$work/$name.err" >&2
}
model=(--model "$work/model")
run_timed generate 5 "$bin" generate --backend cuda "${model[@]}" --max-new-tokens 64 "$work/prompt.json"
KVDIFF_CUDA_GRAPHS=0 run_timed generate_eager 3 "$bin" generate --backend cuda "${model[@]}" --max-new-tokens 64 "$work/prompt.json"
run_timed compare 3 "$bin" compare --backend cuda "${model[@]}" --reference standard \
  --paths chunk-reuse:rerotate --taps 'L*' --tolerance fixed --rtol 0.05 --max-new-tokens 64 \
  --json "$work/compare.json" "$work/prompt.json"
KVDIFF_CUDA_SIDE_STREAM=0 run_timed compare_one_stream 3 "$bin" compare --backend cuda "${model[@]}" \
  --reference standard --paths chunk-reuse:rerotate --taps 'L*' --tolerance fixed --rtol 0.05 \
  --max-new-tokens 64 "$work/prompt.json"
run_timed compare_auto 1 "$bin" compare --backend cuda "${model[@]}" --reference standard \
  --paths chunk-reuse:rerotate --taps 'L*' --max-new-tokens 64 "$work/prompt.json"
say "phase timings (KVDIFF_TIMING)"
KVDIFF_TIMING=1 "$bin" generate --backend cuda "${model[@]}" --max-new-tokens 64 "$work/prompt.json" 2>&1 >/dev/null | grep -A12 "kvdiff timing" >&2
KVDIFF_TIMING=1 "$bin" compare --backend cuda "${model[@]}" --reference standard \
  --paths chunk-reuse:rerotate --taps 'L*' --tolerance fixed --rtol 0.05 --max-new-tokens 64 \
  "$work/prompt.json" 2>&1 >/dev/null | grep -A16 "kvdiff timing" >&2
say "profiles (every operation synchronised)"
KVDIFF_CUDA_PROFILE=1 "$bin" generate --backend cuda "${model[@]}" --max-new-tokens 64 "$work/prompt.json" 2>&1 >/dev/null | head -14 >&2
KVDIFF_CUDA_PROFILE=1 "$bin" compare --backend cuda "${model[@]}" --reference standard \
  --paths chunk-reuse:rerotate --taps 'L*' --tolerance fixed --rtol 0.05 --max-new-tokens 64 \
  "$work/prompt.json" 2>&1 >/dev/null | grep -A14 "CUDA profile" >&2
say "HF transformers"
python3 scripts/bench_hf.py time "$work/model" "$work/prompt.json" 64 > "$work/hf.json"
python3 - "$work" "$out" <<'PY'
import json, statistics, sys
work, out = sys.argv[1], sys.argv[2]
load = lambda n: json.load(open(f"{work}/{n}.json"))
hf, ceil, build = load("hf"), load("ceilings"), load("build")
def times(name):
    rows = [l.split() for l in open(f"{work}/{name}.times") if l.strip()]
    return statistics.median(float(r[0]) / 1e3 for r in rows), statistics.median(float(r[1]) / 1e3 for r in rows)
gen, gen_wall = times("generate")
gen_eager, gen_eager_wall = times("generate_eager")
cmp_, cmp_wall = times("compare")
cmp_auto, cmp_auto_wall = times("compare_auto")
cmp_one, cmp_one_wall = times("compare_one_stream")
h, L, i, v, qd, kvd = 1024, 28, 3072, 151936, 2048, 1024
params_layer = (qd + 2 * kvd) * h + h * qd + 3 * i * h
weight_bytes = 2 * (L * params_layer + v * h)
flops_token = 2 * (L * params_layer + v * h)
p = build["prompt_tokens"]
floor_prefill = p * flops_token / ceil["bf16_flops"]
floor_decode = 64 * weight_bytes / ceil["bandwidth_Bps"]
floor = floor_prefill + floor_decode
rows = [
    ("kvdiff generate (cuda)", gen, gen_wall),
    ("  same, decode steps without CUDA graphs", gen_eager, gen_eager_wall),
    ("kvdiff compare std vs rerotate, L* taps", cmp_, cmp_wall),
    ("  same, reference steps on the main stream", cmp_one, cmp_one_wall),
    ("  same, with auto tolerance learning", cmp_auto, cmp_auto_wall),
    ("HF generate sdpa", hf["hf_sdpa_s"], None),
    ("HF generate eager + hidden states", hf["hf_eager_hidden_s"], None),
    ("floor, one path (prefill + 64 tokens)", floor, None),
]
res = dict(rows=[dict(name=n, s=s, wall_s=w) for n, s, w in rows], ceilings=ceil, hf=hf,
           prompt_tokens=p, weight_bytes=weight_bytes, floor_prefill_s=floor_prefill,
           floor_decode_s=floor_decode)
json.dump(res, open(f"{out}/bench.json", "w"), indent=1)
print(f"\nprompt {p} tokens + 64 greedy; bandwidth {ceil['bandwidth_Bps']/1e12:.2f} TB/s, "
      f"bf16 GEMM {ceil['bf16_flops']/1e12:.0f} TFLOP/s")
print(f"{'what':44} {'in-process s':>12} {'wall s':>8} {'x floor':>8}")
for n, s, w in rows:
    print(f"{n:44} {s:12.4f} {(w if w else float('nan')):8.3f} {s / floor:8.1f}")
print(f"HF sdpa / kvdiff generate: {hf['hf_sdpa_s'] / gen:.2f}x   graphs speed-up: {gen_eager / gen:.2f}x   side-stream speed-up: {cmp_one / cmp_:.2f}x")
print(f"HF sdpa / kvdiff compare: {hf['hf_sdpa_s'] / cmp_:.2f}x   "
      f"HF eager+hidden / kvdiff compare: {hf['hf_eager_hidden_s'] / cmp_:.2f}x")
PY
