#!/usr/bin/env bash
# What holding each layer to its own depth's noise changes (docs/noise-model.md), on the GPU
# machine (binaries built elsewhere and carried; .cache/qwen3-tokenizer carried). Random bf16
# models of Qwen3-0.6B's and Qwen3-8B's shapes, the 512-token chat prompt, the default
# `compare --backend cuda`, each run twice: per-layer thresholds (the default) and every layer
# held to its kind's (KVDIFF_LAYER_TOLERANCE=0).
#   clean     both must be EQUIVALENT on every exact path (no false alarm); L0's thresholds
#             against the kinds'
#   faults    every planted fault (KVDIFF_FAULT): each exact path's first divergence both ways,
#             and which test found it (row, replay, aggregate)
#   sweep     `sweep --backend cuda --replay` over the prompt set's random chunkings on the
#             default model: no exact path may diverge
#   scripts/bench_layer_tolerance.sh [KVDIFF_BINARY] [SHAPES...]   (default: 0.6b 8b)
set -uo pipefail
bin=${1:-.out/bin/kvdiff}
shift || true
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(0.6b 8b)
w=/tmp/kvdiff-layer-tol
mkdir -p "$w"
export KVDIFF_CACHE_DIR=$w/cache
# FAULTS (space-separated) narrows the planted faults; SWEEP=0 leaves the sweep out.
read -r -a faults <<< "${FAULTS:-local-key-positions cached-mask-off-by-one chunk-ignores-cache fused-norm-without-residual rope-frequencies-bf16 decode-kv-slot-off-by-one decode-position-off-by-one rerotate-wrong-sign rerotate-stores-rotated global-key-ignores-position blend-wrong-slot}"
say() { echo "[$(date +%T)] $*" >&2; }
for shape in "${shapes[@]}"; do
  m=$w/model-$shape
  say "build $shape"
  [ -f "$m/config.json" ] ||
    python3 scripts/bench_hf.py build .cache/qwen3-tokenizer "$m" "$w/prompt-$shape.json" "$shape" > /dev/null
  for f in clean "${faults[@]}"; do
    for mode in layer kind; do
      env $([ "$f" = clean ] || echo "KVDIFF_FAULT=$f") $([ "$mode" = kind ] && echo KVDIFF_LAYER_TOLERANCE=0) \
        timeout "${RUN_SECS:-60}" "$bin" compare --backend cuda --model "$m" --max-new-tokens 64 \
        --json "$w/$shape-$f-$mode.json" "$w/prompt-$shape.json" > /dev/null 2> "$w/$shape-$f-$mode.err"
      say "$shape $f $mode: exit $?"
    done
  done
done
for s in $([ "${SWEEP:-1}" = 0 ] || echo default); do
  for mode in layer kind; do
    env $([ "$mode" = kind ] && echo KVDIFF_LAYER_TOLERANCE=0) timeout 300 "$bin" sweep --backend cuda --replay \
      --chunkings random:8 --seed 7 --out "$w/sweep-$mode.jsonl" fixtures/prompt-set.jsonl > /dev/null 2> "$w/sweep-$mode.err"
    echo "sweep ($mode): exit $?; $(tail -1 "$w/sweep-$mode.err")"
  done
done
python3 - "$w" "${shapes[@]}" <<'PY'
import json, os, sys
w, shapes = sys.argv[1], sys.argv[2:]
def load(p):
    return json.load(open(p)) if os.path.exists(p) else None
def firsts(r):
    out = {}
    for p in r["paths"]:
        d = p.get("first_divergence")
        if not p.get("exact"):
            continue
        out[p["path"]] = (f"{d['tap']} s{d['step']} p{d['position']} ({d['test']})" if d else "-")
    return out
for s in shapes:
    c, k = load(f"{w}/{s}-clean-layer.json"), load(f"{w}/{s}-clean-kind.json")
    if not c or not k:
        print(f"{s}: clean runs missing"); continue
    print(f"\n{s}: L0's thresholds, per layer against the kind's (rtol)")
    pl, rt = c["tolerance"].get("per_layer", {}), c["tolerance"]["rtol"]
    for kind in sorted(pl):
        l0 = pl[kind][0]
        print(f"  {kind:<11} L0 {l0:.2e}  kind {rt[kind]:.2e}  {rt[kind] / max(l0, 1e-30):6.1f}x smaller")
    for mode, r in (("layer", c), ("kind", k)):
        bad = [n for n, v in firsts(r).items() if v != "-"]
        print(f"  clean ({mode}): exact paths diverged: {bad or 'none'}")
    print(f"\n{s}: planted faults, first divergence of each exact path (per layer | per kind)")
    for f in sorted(x[len(s) + 1:-11] for x in os.listdir(w) if x.startswith(s + "-") and x.endswith("-layer.json")):
        if f == "clean":
            continue
        a, b = load(f"{w}/{s}-{f}-layer.json"), load(f"{w}/{s}-{f}-kind.json")
        if not a or not b:
            print(f"  {f}: missing"); continue
        fa, fb = firsts(a), firsts(b)
        for path in fa:
            if fa[path] != "-" or fb.get(path, "-") != "-":
                mark = "" if fa[path] == fb.get(path) else "   <- changed"
                print(f"  {f:<28} {path:<26} {fa[path]:<34} | {fb.get(path)}{mark}")
PY
