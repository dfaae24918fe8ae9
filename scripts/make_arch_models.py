"""Builds the architecture conformance models: four tiny random-weight checkpoints made with HF
transformers' own classes and written by its own save_pretrained, so that every file is laid out
as transformers writes it (transformers 5 always writes safetensors; a Qwen3-MoE checkpoint is
written with the per-expert names mlp.experts.{e}.{gate,up,down}_proj.weight that Hub
checkpoints use, which transformers fuses on load and splits again on save):

  qwen3-moe  Qwen3MoeForCausalLM  hidden 64, 3 layers, 6 heads over 2 KV heads, head_dim 16,
             8 experts top-2 (moe_intermediate 32, norm_topk_prob), layer 1 dense (intermediate
             96), untied lm_head, YaRN RoPE (factor 4 over 32 positions), bf16
  qwen2      Qwen2ForCausalLM     hidden 96, 2 layers, 6 heads over 2 KV heads, q/k/v bias,
             layer 1 slides over 12 tokens (max_window_layers 1), tied embeddings, f32 in shards
             with model.safetensors.index.json
  llama3     LlamaForCausalLM     hidden 96, 2 layers, 6 heads over 2 KV heads, intermediate 160,
             Llama 3 RoPE scaling, tied embeddings, no bias, bf16
  mistral    MistralForCausalLM   hidden 64, 2 layers, 4 heads over 1 KV head, head_dim 32,
             intermediate 128, every layer slides over 10 tokens, linear RoPE scaling (factor
             2), untied lm_head, f32

Weights are seeded: norms 1 + 0.3*randn, everything else (biases included) 0.05*randn. Each
model gets the default model's tokenizer with its family's special tokens added and its family's
chat template (fixtures/templates/), vocab_size = len(tokenizer), eos_token_id = the
family's end token. Every checkpoint is reloaded with from_pretrained and compared with the
model it was saved from.

Usage: python3 scripts/make_arch_models.py DEFAULT_MODEL_DIR OUT_ROOT [NAME ...]
       (torch and transformers are imported only to build; --help needs neither)
"""

import json
import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE_DIR = os.path.join(HERE, "..", "fixtures", "templates")

# Tokenizer changes per family: the special tokens added (in this order, after the default
# tokenizer's 852), and which of them are the named bos/eos/pad tokens. The Qwen families keep
# the default tokenizer, which already has <|endoftext|>, <|im_start|> and <|im_end|>.
FAMILIES = {
    "qwen": {"add": [], "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
             # config ids as in the default model's config.json
             "config_bos": "<|endoftext|>"},
    "llama": {"add": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
              "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None,
              "config_bos": "<|begin_of_text|>"},
    "mistral": {"add": ["<s>", "</s>", "[INST]", "[/INST]"], "bos": "<s>", "eos": "</s>", "pad": None,
                "config_bos": "<s>"},
}

# Chat templates, as their models ship them (fixtures/templates/SOURCES.md says where each
# comes from). None: the default model's own (Qwen3's).
TEMPLATES = {
    "qwen3": None,
    "qwen2.5": "qwen2.5-instruct.jinja",
    "llama3": "llama3.2-instruct.jinja",
    "mistral": "mistral-7b-instruct-v0.3.jinja",
}

MODELS = {
    "qwen3-moe": {
        "architecture": "Qwen3MoeForCausalLM", "config": "Qwen3MoeConfig", "family": "qwen",
        "template": "qwen3", "seed": 301, "dtype": "bfloat16", "max_shard_size": None,
        "config_kwargs": dict(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
            # Qwen3MoeConfig has no head_dim field: it is kept as an extra attribute (as for the
            # Hub's Qwen3-MoE configs), read by Qwen3MoeAttention and the rope functions.
            head_dim=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
            decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
            tie_word_embeddings=False, max_position_embeddings=128, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                             "original_max_position_embeddings": 32},
        ),
    },
    "qwen2": {
        "architecture": "Qwen2ForCausalLM", "config": "Qwen2Config", "family": "qwen",
        "template": "qwen2.5", "seed": 302, "dtype": "float32", "max_shard_size": "200KB",
        "config_kwargs": dict(
            hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=256,
            rms_norm_eps=1e-6,
            # layer_types is derived in Qwen2Config.__post_init__: layer i slides when
            # use_sliding_window and i >= max_window_layers, so exactly layer 1 does.
            use_sliding_window=True, sliding_window=12, max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    },
    "llama3": {
        "architecture": "LlamaForCausalLM", "config": "LlamaConfig", "family": "llama",
        "template": "llama3", "seed": 303, "dtype": "bfloat16", "max_shard_size": None,
        "config_kwargs": dict(
            hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=160, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
            max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32},
        ),
    },
    "mistral": {
        "architecture": "MistralForCausalLM", "config": "MistralConfig", "family": "mistral",
        "template": "mistral", "seed": 304, "dtype": "float32", "max_shard_size": None,
        "config_kwargs": dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, intermediate_size=128, tie_word_embeddings=False,
            max_position_embeddings=256, rms_norm_eps=1e-5, sliding_window=10,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    },
}

# What each saved config.json must say (checked after saving).
EXPECT_CONFIG = {
    "qwen3-moe": {"model_type": "qwen3_moe", "head_dim": 16, "mlp_only_layers": [1],
                  "norm_topk_prob": True, "tie_word_embeddings": False, "dtype": "bfloat16"},
    "qwen2": {"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"],
              "use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1,
              "tie_word_embeddings": True, "dtype": "float32"},
    "llama3": {"model_type": "llama", "head_dim": 16, "tie_word_embeddings": True, "attention_bias": False,
               "mlp_bias": False, "dtype": "bfloat16"},
    "mistral": {"model_type": "mistral", "head_dim": 32, "sliding_window": 10, "tie_word_embeddings": False,
                "dtype": "float32"},
}

MAX_BYTES = 1_000_000


def template_text(key, default_dir):
    name = TEMPLATES[key]
    path = os.path.join(default_dir, "chat_template.jinja") if name is None else os.path.join(TEMPLATE_DIR, name)
    with open(path, encoding="utf-8") as f:
        return f.read()


def make_tokenizer(default_dir, spec):
    from transformers import AutoTokenizer

    fam = FAMILIES[spec["family"]]
    tok = AutoTokenizer.from_pretrained(default_dir)
    if fam["add"]:
        added = tok.add_special_tokens({"extra_special_tokens": fam["add"]})
        assert added == len(fam["add"]), f"added {added} of {fam['add']}"
        tok.bos_token = fam["bos"]
        tok.eos_token = fam["eos"]
        tok.pad_token = fam["pad"]
        # The named ones are bos/eos; the rest stay listed as extra special tokens.
        tok.extra_special_tokens = [t for t in fam["add"] if t not in (fam["bos"], fam["eos"], fam["pad"])]
    assert tok.eos_token == fam["eos"] and tok.pad_token == fam["pad"], (tok.eos_token, tok.pad_token)
    tok.chat_template = template_text(spec["template"], default_dir)
    return tok


def token_id(tok, token):
    if token is None:
        return None
    i = tok.convert_tokens_to_ids(token)
    assert isinstance(i, int) and tok.convert_ids_to_tokens(i) == token, (token, i)
    return i


def fill_weights(model, seed):
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                # Norm weights away from 1 so that a skipped or misplaced norm shows.
                p.copy_(1.0 + 0.3 * noise)
            else:
                # Biases too, so that a missing bias shows.
                p.copy_(0.05 * noise)


FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def weight_files(out):
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = json.load(open(index))["weight_map"]
        return sorted(set(weight_map.values())), weight_map
    return ["model.safetensors"], None


def split_fused_experts(out):
    """Rewrites fused expert tensors ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) under the Hub's
    per-expert names. Only a fallback: transformers 5.17's save_pretrained already does this."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files, weight_map = weight_files(out)
    changed = False
    for fname in files:
        path = os.path.join(out, fname)
        with safe_open(path, "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        new = {}
        for k, t in tensors.items():
            m = FUSED_EXPERTS.match(k)
            if not m:
                new[k] = t
                continue
            changed = True
            prefix, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)  # gate first: see Qwen3MoeExperts.forward
                    new[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    new[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
                else:
                    new[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        if changed:
            save_file(new, path, metadata=meta)
            if weight_map is not None:
                for k in tensors:
                    weight_map.pop(k, None)
                weight_map.update({k: fname for k in new})
    if changed and weight_map is not None:
        index = os.path.join(out, "model.safetensors.index.json")
        data = json.load(open(index))
        data["weight_map"] = dict(sorted(weight_map.items()))
        json.dump(data, open(index, "w"), indent=2)
    return changed


def check_saved(name, spec, out, model, tok):
    """The files as written, then a from_pretrained round trip against the saved model."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.load(open(os.path.join(out, "config.json")))
    for key, want in EXPECT_CONFIG[name].items():
        assert cfg.get(key) == want, f"{name}: config.json {key} = {cfg.get(key)!r}, expected {want!r}"
    assert cfg["architectures"] == [spec["architecture"]], cfg["architectures"]
    assert cfg["vocab_size"] == len(tok), (cfg["vocab_size"], len(tok))
    rope = cfg["rope_parameters"]
    for key, want in spec["config_kwargs"]["rope_parameters"].items():
        assert rope.get(key) == want, f"{name}: rope_parameters {rope} lacks {key}={want}"
    files, weight_map = weight_files(out)
    keys = []
    for fname in files:
        with safe_open(os.path.join(out, fname), "pt") as f:
            keys += list(f.keys())
    if spec["max_shard_size"]:
        assert len(files) >= 2, f"{name}: expected shards, got {files}"
        assert sorted(weight_map) == sorted(keys), f"{name}: index weight_map does not match the shards"
    if spec["config"] == "Qwen3MoeConfig":
        fused = [k for k in keys if FUSED_EXPERTS.match(k)]
        per_expert = [k for k in keys if PER_EXPERT.search(k)]
        n_sparse = sum(1 for i in range(cfg["num_hidden_layers"]) if i not in cfg["mlp_only_layers"])
        assert not fused and len(per_expert) == 3 * cfg.get("num_experts", cfg.get("num_local_experts")) * n_sparse, \
            f"{name}: expert tensors {fused or per_expert[:4]}"
    tied = spec["config_kwargs"]["tie_word_embeddings"]
    assert ("lm_head.weight" in keys) == (not tied), f"{name}: lm_head.weight stored: {'lm_head.weight' in keys}"

    dtype = getattr(torch, spec["dtype"])
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    assert type(reloaded).__name__ == spec["architecture"], type(reloaded).__name__
    mine, theirs = model.state_dict(), reloaded.state_dict()
    assert sorted(mine) == sorted(theirs), set(mine) ^ set(theirs)
    for k in mine:
        assert mine[k].dtype == theirs[k].dtype == dtype, (k, mine[k].dtype, theirs[k].dtype)
        assert torch.equal(mine[k], theirs[k]), f"{name}: {k} changed in the save/load round trip"
    rtok = AutoTokenizer.from_pretrained(out)
    assert len(rtok) == len(tok) and rtok.chat_template == tok.chat_template
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(reloaded.config, key) == cfg.get(key), (key, getattr(reloaded.config, key), cfg.get(key))
    assert rtok.eos_token_id == cfg["eos_token_id"], (rtok.eos_token_id, cfg["eos_token_id"])

    layers = reloaded.model.layers
    notes = []
    if spec["config"] == "Qwen3MoeConfig":
        kinds = [type(layer.mlp).__name__ for layer in layers]
        assert kinds == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"], kinds
        assert layers[0].self_attn.head_dim == 16
        notes.append(f"yarn attention_scaling {reloaded.model.rotary_emb.attention_scaling:.6f}")
        notes.append("experts " + ("num_experts" if "num_experts" in cfg else "num_local_experts") + " in config.json")
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in layers]
    if spec["config"] == "Qwen2Config":
        assert windows == [None, 12], windows
        assert layers[0].self_attn.q_proj.bias is not None and layers[0].self_attn.o_proj.bias is None
    if spec["config"] == "MistralConfig":
        assert layers[0].self_attn.head_dim == 32
        notes.append(f"sliding_window {reloaded.config.sliding_window} on every layer")
    return files, keys, notes


def build(name, default_dir, out_root):
    import torch
    import transformers

    spec = MODELS[name]
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    tok = make_tokenizer(default_dir, spec)
    fam = FAMILIES[spec["family"]]
    kwargs = dict(spec["config_kwargs"], vocab_size=len(tok), initializer_range=0.05,
                  bos_token_id=token_id(tok, fam["config_bos"]), eos_token_id=token_id(tok, fam["eos"]),
                  pad_token_id=token_id(tok, fam["pad"]))
    config = getattr(transformers, spec["config"])(**kwargs)
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, spec["architecture"])(config)
    fill_weights(model, spec["seed"])
    model = model.to(getattr(torch, spec["dtype"])).eval()
    save_kwargs = {"max_shard_size": spec["max_shard_size"]} if spec["max_shard_size"] else {}
    model.save_pretrained(out, **save_kwargs)
    tok.save_pretrained(out)
    if spec["config"] == "Qwen3MoeConfig" and split_fused_experts(out):
        print(f"{name}: save_pretrained kept the fused experts; rewrote them per expert")
    files, keys, notes = check_saved(name, spec, out, model, tok)
    params = sum(p.numel() for p in model.parameters())
    disk = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
    weight_bytes = sum(disk[f] for f in files)
    total = sum(disk.values())
    assert total < MAX_BYTES, f"{name}: {total} bytes on disk"
    print(f"{name}: {spec['architecture']}, {params} params ({spec['dtype']}), vocab {len(tok)}, "
          f"{len(keys)} tensors in {len(files)} weight file(s) of {weight_bytes} bytes; "
          f"{len(disk)} files, {total} bytes: {', '.join(f'{f} {b}' for f, b in disk.items())}"
          + (f"; {'; '.join(notes)}" if notes else ""))


def main():
    args = sys.argv[1:]
    if len(args) < 2 or args[0] in ("-h", "--help") or any(a not in MODELS for a in args[2:]):
        print(__doc__.strip())
        print(f"models: {', '.join(MODELS)}")
        sys.exit(0 if args[:1] in (["-h"], ["--help"]) else 2)
    default_dir, out_root = args[0], args[1]
    os.makedirs(out_root, exist_ok=True)
    for name in args[2:] or MODELS:
        build(name, default_dir, out_root)


if __name__ == "__main__":
    main()
