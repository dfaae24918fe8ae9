#!/usr/bin/env bash
# Coverage-guided fuzzing of kvdiff's loaders and parsers with cargo-fuzz (nightly toolchain,
# `cargo install cargo-fuzz`). Runs every target (or those named) for SECS seconds each, growing
# fixtures/fuzz/<target>/, then minimises that corpus. tests/it/fuzz.rs replays and mutates the same
# corpus on stable in every `cargo test`.
#   scripts/fuzz.sh [SECS] [TARGET...]      default: 600 s, all targets
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(safetensors index config prompt spec)
for t in "${targets[@]}"; do
    corpus=fixtures/fuzz/$t
    work=$(mktemp -d)
    cp "$corpus"/* "$work"/
    echo "== $t: ${secs}s"
    cargo +nightly fuzz run --fuzz-dir scripts/fuzz "$t" "$work" -- \
        -max_total_time="$secs" -max_len=65536 -print_final_stats=1 2>&1 |
        grep --line-buffered -E "^(stat::|#[0-9]+ *DONE|==[0-9]+== ERROR|SUMMARY)" || true
    # Keep a minimal corpus: only inputs that add coverage (seeds are always kept).
    cargo +nightly fuzz cmin --fuzz-dir scripts/fuzz "$t" "$work" >/dev/null 2>&1 || true
    find "$corpus" -type f ! -name 'seed-*' -delete
    for f in "$work"/*; do
        cmp -s "$f" "$corpus/$(basename "$f")" 2>/dev/null || cp "$f" "$corpus/"
    done
    rm -rf "$work"
    # Keep the repository lean: the 300 smallest inputs besides the seeds.
    ls -S -r "$corpus" | grep -v '^seed-' | tail -n +301 | sed "s|^|$corpus/|" | xargs -r rm -f
    echo "== $t: corpus $(ls "$corpus" | wc -l) files"
done
