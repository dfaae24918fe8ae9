"""An HF transformers dump far out in the positions (runs on the GPU machine): a random Qwen3
(head_dim 128, rope_theta 1e6: the angles of Qwen3's own RoPE) in DTYPE prefills TOKENS random
token ids in one pass and decodes 4 greedy steps, captured with kvdiff_capture. A clean engine
whose RoPE angles carry f32's rounding, which grows with the position: what
`scripts/gpu_tests.sh positions` holds to kvdiff's reference with replay on.

  replay_long_prompt.py DEFAULT_MODEL_DIR MODEL_OUT DUMP_OUT TOKENS [DTYPE] [cast|llama3]

With `llama3`, the model is a Llama with Llama 3's RoPE scaling (θ = 500000, factor 8 over 8,192
original positions), whose inverse frequencies HF computes with a few more f32 operations.

The model is saved in DTYPE and loaded with `from_pretrained(dtype=DTYPE)`, as a checkpoint is
served. With `cast`, the model built in f32 is cast with `model.to(DTYPE)` instead: that casts
RoPE's `inv_freq` buffer too, so every angle is off by up to 2^-9 of itself in bf16, a bug that
grows with the position.
"""
import json
import os
import shutil
import sys

import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import kvdiff_capture as kc  # noqa: E402

src, model_dir, out, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
    sys.argv[5] if len(sys.argv) > 5 else "float32"]
how = sys.argv[6] if len(sys.argv) > 6 else ""
cast = how == "cast"
os.makedirs(model_dir, exist_ok=True)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if os.path.exists(os.path.join(src, name)):
        shutil.copy(os.path.join(src, name), model_dir)
vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
shape = dict(vocab_size=vocab, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             max_position_embeddings=max(8192, tokens + 64), rms_norm_eps=1e-6, tie_word_embeddings=False)
torch.manual_seed(5)
if how == "llama3":
    model = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
else:
    model = Qwen3ForCausalLM(Qwen3Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
model.to(dtype).save_pretrained(model_dir)
if cast:
    model = model.to(dtype)
else:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
model = model.to("cuda").eval()
g = torch.Generator().manual_seed(9)
ids = torch.randint(0, vocab - 16, (1, tokens), generator=g).to("cuda")
with torch.no_grad(), kc.capture(model, out, model_name=model_dir):
    out_ = model(input_ids=ids, use_cache=True)
    cache, logits = out_.past_key_values, out_.logits
    for step in range(4):
        nxt = logits[:, -1].argmax(-1).view(1, 1)
        logits = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                       position_ids=torch.full((1, 1), tokens + step, device="cuda")).logits
    torch.cuda.synchronize()
print(json.dumps({"tokens": tokens, "dtype": str(dtype), "cast": cast,
                  "family": how or "qwen3", "inv_freq": str(model.model.rotary_emb.inv_freq.dtype)}))
