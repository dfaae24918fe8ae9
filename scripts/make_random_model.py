"""Builds the second conformance model: a random-weight Qwen3 with shapes unlike the default model's
(16 query heads over 2 KV heads, head_dim 128 > hidden/heads, untied lm_head, rope_theta 10000),
stored as f16 in two shards with model.safetensors.index.json. It reuses the default model's
tokenizer files so the same prompts run on it.

Usage: python3 scripts/make_random_model.py DEFAULT_MODEL_DIR OUT_DIR
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM


def main():
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out)
    vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
    kwargs = dict(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.05)
    try:
        config = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kwargs)
    except TypeError:
        config = Qwen3Config(rope_theta=10000.0, **kwargs)
    torch.manual_seed(7)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Norm weights away from 1 so that a skipped or misplaced norm shows.
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.config.torch_dtype = torch.float16
    config.save_pretrained(out)
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    names = sorted(sd)
    half = len(names) // 2
    weight_map = {}
    total = 0
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, os.path.join(out, fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += sd[k].numel() * 2
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(out, "model.safetensors.index.json"), "w"), indent=2)
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg["dtype"] = "float16"
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    print(f"random model: {sum(v.numel() for v in sd.values())} params in {out}")


if __name__ == "__main__":
    main()
