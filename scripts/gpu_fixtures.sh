#!/usr/bin/env bash
# Builds the committed fixtures on the GPU machine (transformers + torch there) and packs them into
# $OUT/fixtures.tgz, to be unpacked into fixtures/ here.
#   scripts/gpu_fixtures.sh all        train the default model, build the random model, dump references
#   scripts/gpu_fixtures.sh reference  only dump references, for the models already in fixtures/
#   scripts/gpu_fixtures.sh arch       build the architecture models (Qwen3-MoE, Qwen2, Llama, Mistral)
#                                      from fixtures/default-model and dump their references:
#                                      $OUT/arch-models.tgz (arch/<name>/...) and
#                                      $OUT/arch-reference.tgz (reference/arch-*), both to be
#                                      unpacked into fixtures/ here
# all and reference need the Qwen3 tokenizer fetched by scripts/fetch_qwen3_tokenizer.sh (carry .cache).
set -euo pipefail
export PYTHONUNBUFFERED=1
stage="${1:-all}"
work=/tmp/kvdiff-fixtures
rm -rf "$work" && mkdir -p "$work/reference"
pack() {
  tar czf "$OUT/models.tgz" -C "$work" --exclude reference .
  tar czf "$OUT/reference.tgz" -C "$work" reference
}
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
if [ "$stage" = arch ]; then
  python3 scripts/make_arch_models.py fixtures/default-model "$work/arch"
  # name:template set of scripts/hf_reference.py
  for model in qwen3-moe:qwen qwen2:qwen llama3:llama mistral:mistral; do
    name=${model%%:*}
    python3 scripts/hf_reference.py template "$work/arch/$name" "$work/reference/arch-$name-chat-template.json" "${model#*:}"
    python3 scripts/hf_reference.py taps "$work/arch/$name" "$work/reference/arch-$name" 12 arch
  done
  tar czf "$OUT/arch-models.tgz" -C "$work" arch
  (cd "$work" && tar czf "$OUT/arch-reference.tgz" reference/arch-*)
  du -sh "$work"/arch/* "$work"/reference/arch-* "$OUT"/arch-models.tgz "$OUT"/arch-reference.tgz
  exit 0
fi
if [ "$stage" = all ]; then
  python3 scripts/train_default_model.py .cache/qwen3-tokenizer "$work/default-model" --steps "${STEPS:-5000}"
  pack
  python3 scripts/make_random_model.py "$work/default-model" "$work/random-model"
  pack
else
  cp -r fixtures/default-model fixtures/random-model "$work/"
fi
python3 scripts/hf_reference.py template .cache/qwen3-tokenizer "$work/reference/qwen3-chat-template.json"
python3 scripts/hf_reference.py template "$work/default-model" "$work/reference/default-chat-template.json"
python3 scripts/hf_reference.py taps "$work/default-model" "$work/reference/default-model" 24 task
python3 scripts/hf_reference.py taps "$work/random-model" "$work/reference/random-model" 16 short
pack
du -sh "$work"/* "$work"/reference/*
