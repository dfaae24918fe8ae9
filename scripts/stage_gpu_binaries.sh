#!/usr/bin/env bash
# Copies the release kvdiff and the integration-test binary (its cuda:: tests), stripped, into .out/bin and
# compressed into .out/pack/bin.tar.xz, the one to carry to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release
test_bin=$(cargo test --no-run --message-format=json --test it 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "it" and m.get("executable"):
        print(m["executable"])')
mkdir -p .out/bin
cp target/release/kvdiff .out/bin/kvdiff
cp "$test_bin" .out/bin/cuda-tests
strip .out/bin/kvdiff .out/bin/cuda-tests
mkdir -p .out/pack
tar cJf .out/pack/bin.tar.xz -C .out bin
ls -la .out/bin .out/pack
