#!/usr/bin/env bash
# Copies the release kvdiff, the integration-test binary (its cuda:: tests) and the library's
# unit tests (the GPU oracle's products among them), stripped, into .out/bin and
# compressed into .out/pack/bin.tar.xz, the one to carry to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release
executable() {  # the test executable of cargo target kind $1 (`test` or `lib`)
  cargo test --no-run --message-format=json "--$([ "$1" = lib ] && echo lib || echo "test=it")" 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and sys.argv[1] in m["target"]["kind"]:
        print(m["executable"])' "$1"
}
test_bin=$(executable test)
lib_bin=$(executable lib)
mkdir -p .out/bin
cp target/release/kvdiff .out/bin/kvdiff
cp "$test_bin" .out/bin/cuda-tests
cp "$lib_bin" .out/bin/lib-tests
strip .out/bin/kvdiff .out/bin/cuda-tests .out/bin/lib-tests
mkdir -p .out/pack
tar cJf .out/pack/bin.tar.xz -C .out bin
ls -la .out/bin .out/pack
