"""An engine's dump for scripts/bench_diff.sh (runs on the GPU machine): HF transformers in bf16
(sdpa) prefilling the benchmark's chat prompt in three chunks through its KV cache, then greedy
decode steps, captured with kvdiff_capture as a user's engine would be.

  bench_diff.py MODEL_DIR PROMPT_FILE OUT_DIR [SEQUENCES] [DECODE_STEPS]

SEQUENCES > 1 runs that many copies of the prompt as one batch (a batched capture, one sequence
per row). Prints the capture's seconds as JSON.
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import kvdiff_capture as kc  # noqa: E402

model_dir, prompt_file, out = sys.argv[1:4]
seqs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 8
tok = AutoTokenizer.from_pretrained(model_dir)
messages = json.load(open(prompt_file))["messages"]
ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
if isinstance(ids, dict) or hasattr(ids, "input_ids"):
    ids = ids["input_ids"]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
model = model.to("cuda").eval()
n = len(ids)
cuts = [0, n // 3, 2 * n // 3, n]
t0 = time.time()
cache, start = DynamicCache(config=model.config), 0
with torch.no_grad(), kc.capture(model, out):
    for a, b in zip(cuts, cuts[1:]):
        chunk = torch.tensor([ids[a:b]] * seqs, device="cuda")
        positions = torch.arange(a, b, device="cuda")[None].expand(seqs, -1)
        logits = model(input_ids=chunk, past_key_values=cache, position_ids=positions, use_cache=True).logits
        start = b
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1).view(seqs, 1)
        logits = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                       position_ids=torch.full((seqs, 1), start, device="cuda")).logits
        start += 1
    torch.cuda.synchronize()
print(json.dumps({"capture_s": round(time.time() - t0, 2), "prompt_tokens": n, "sequences": seqs}))
