#!/usr/bin/env bash
# What the default answer costs on the GPU machine (binaries built elsewhere and carried): random
# bf16 models of Qwen3-0.6B's and Qwen3-8B's shapes, the 512-token chat prompt of
# scripts/bench_cuda.sh, and the default command a user runs first:
#   kvdiff compare --backend cuda --model M --max-new-tokens 64 PROMPT   (every path, every tap,
#                                                                          auto tolerance)
# and, at the 0.6B shape, scripts/bench_cuda.sh's auto-tolerance command (`--paths
# chunk-reuse:rerotate --taps 'L*'`, row "0.6b/rerotate"). Per row, in one run on one GPU:
#   cold        empty kvdiff cache (kernels compiled, noise model calibrated on the GPU oracle)
#   warm        the same command again (kernels and calibration from the cache)
#   other-n     --max-new-tokens 32 after it: must reuse the calibration (-v says so)
#   one-by-one  warm, each path in a lockstep of its own (KVDIFF_LANES=0: the references run
#               again for every path, as before paths ran together; the peer of "warm")
#   cold-cpu    empty cache, KVDIFF_GPU_ORACLE=0: the calibration on the CPU oracle (the peer;
#               BENCH_CPU_ORACLE=0 leaves it out, a minute at the 8B shape)
#   hf-sdpa     HF transformers bf16 generate of the same 512 + 64 tokens (sdpa), for scale
# and the noise model's own share of the cold run (its KVDIFF_TIMING span). Prints a table last.
#   scripts/bench_calibration.sh [KVDIFF_BINARY] [ROWS...]   (default rows: 0.6b 0.6b/rerotate 8b)
set -uo pipefail
bin=${1:-.out/bin/kvdiff}
shift || true
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(0.6b 0.6b/rerotate 8b)
w=/tmp/kvdiff-calibration
mkdir -p "$w"
export KVDIFF_CACHE_DIR=$w/cache
say() { echo "[$(date +%T)] $*" >&2; }
rows=()
for row in "${shapes[@]}"; do
  shape=${row%%/*}
  args=()
  [ "$row" = "$shape" ] || args=(--paths chunk-reuse:rerotate --taps 'L*')
  m=$w/model-$shape
  if [ ! -f "$m/config.json" ]; then
    say "build $shape"
    python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$m" "$w/prompt-$shape.json" "$shape" > /dev/null
  fi
  # Pages the weights in, as a user's second look at a model would find them.
  cat "$m"/*.safetensors > /dev/null
  run() {  # label, extra env..., -- args...: wall seconds; stderr kept
    local label=$1; shift
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    local t0 t1
    t0=$(date +%s%N)
    env "${envs[@]}" KVDIFF_TIMING=1 timeout 300 "$bin" -v compare --backend cuda --model "$m" \
      "${args[@]}" "$@" "$w/prompt-$shape.json" > "$w/${row/\//-}-$label.out" 2> "$w/${row/\//-}-$label.err"
    local rc=$?
    t1=$(date +%s%N)
    echo "$(( (t1 - t0) / 1000000 )) $rc"
  }
  calib_ms() {  # the noise model's span of a run's KVDIFF_TIMING table (ms; 0 when cached)
    grep -E "compare: noise model \(auto tolerance\)" "$w/${row/\//-}-$1.err" | grep -oE '[0-9.]+ ms' |
      cut -d' ' -f1 | awk '{s += $1} END {printf "%.0f", s}'
  }
  rm -rf "$KVDIFF_CACHE_DIR"
  say "$row cold"
  cold=$(run cold -- --max-new-tokens 64)
  say "$row warm"
  warm=$(run warm -- --max-new-tokens 64)
  say "$row one-by-one"
  alone=$(run alone KVDIFF_LANES=0 -- --max-new-tokens 64)
  say "$row other-n"
  other=$(run other -- --max-new-tokens 32)
  grep -E "noise model" "$w/${row/\//-}-other.err" >&2
  reused=$(grep -c "noise model reused" "$w/${row/\//-}-other.err")
  cpu="0 -"
  if [ "${BENCH_CPU_ORACLE:-1}" != 0 ]; then
    rm -rf "$KVDIFF_CACHE_DIR"
    say "$row cold, CPU oracle"
    cpu=$(run cold-cpu KVDIFF_GPU_ORACLE=0 -- --max-new-tokens 64)
  fi
  say "$row HF"
  hf=$(python3 scripts/bench_hf.py time "$m" "$w/prompt-$shape.json" 64 sdpa 2> /dev/null |
    python3 -c 'import json,sys; print(round(json.load(sys.stdin)["hf_sdpa_s"] * 1000))')
  for r in cold warm alone other cold-cpu; do
    echo "--- $row $r: exit and timing" >&2
    grep -E "^kvdiff: (compared|noise)|calibration|cuBLAS|startup: (GPU|kernels|NVRTC|weights)|verdict|EQUIVALENT|DIVERGED" \
      "$w/${row/\//-}-$r.err" | head -24 >&2
  done
  rows+=("$row ${cold% *} $(calib_ms cold) ${warm% *} ${alone% *} ${other% *} $reused ${cpu% *} $(calib_ms cold-cpu) ${hf:-nan} ${cold#* }${warm#* }${alone#* }${other#* }${cpu#* }")
done
printf '%s\n' "${rows[@]}" > "$w/rows"
python3 - "$w/rows" <<'PY'
import sys
print("\ndefault compare --backend cuda, 512 + 64 tokens (wall ms; calib = the noise model's KVDIFF_TIMING span)")
print(f"{'row':<13} {'cold':>7} {'calib':>6} {'share':>6} {'warm':>7} {'one-by-one':>10} {'other-n':>8} {'reused':>6} "
      f"{'cold CPU oracle':>16} {'its calib':>9} {'HF sdpa':>8} {'exits':>6}")
for line in open(sys.argv[1]):
    s, cold, cal, warm, alone, other, reused, cpu, cpucal, hf, rcs = line.split()
    share = 100 * float(cal) / max(float(cold), 1)
    print(f"{s:<13} {cold:>7} {cal:>6} {share:>5.1f}% {warm:>7} {alone:>10} {other:>8} {reused:>6} {cpu:>16} "
          f"{cpucal:>9} {hf:>8} {rcs:>6}")
PY
