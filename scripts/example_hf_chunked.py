"""The walkthrough of docs/commands/diff.md: an engine that prefills a prompt in chunks through HF transformers'
KV cache, captured for `kvdiff diff`. `--bug restart` feeds every chunk after the first position
ids that restart from 0 (the classic chunk-reuse bug).

  python3 scripts/example_hf_chunked.py MODEL_DIR OUT_DIR [--bug restart]
  kvdiff diff --model MODEL_DIR OUT_DIR
"""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import kvdiff_capture as kc  # noqa: E402

model_dir, out = sys.argv[1], sys.argv[2]
bug = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--bug" else None
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
chunks = ["<|im_start|>system\nAlways answer in lowercase.<|im_end|>\n",
          "<|im_start|>user\nSome facts: Hugo's pet is parrot. Mia's city is lima.<|im_end|>\n",
          "<|im_start|>user\nTell me Mia's city.<|im_end|>\n<|im_start|>assistant\n"]
cache, start = DynamicCache(config=model.config), 0
with torch.no_grad(), kc.capture(model, out):
    for text in chunks:
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)], device=model.device)
        n = ids.shape[1]
        positions = torch.arange(start, start + n, device=model.device)[None]
        if bug == "restart":
            positions = positions - start
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True).logits
        start += n
    for _ in range(8):  # greedy decode
        nxt = logits[0, -1].argmax().view(1, 1)
        logits = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                       position_ids=torch.tensor([[start]], device=model.device)).logits
        start += 1
print(f"captured {start} positions to {out}")
