"""A reference too big for one GPU: HF transformers loaded with `device_map="auto"` (its layers
spread over every GPU there is and the CPU) captured as the reference dump, and an engine's dump
held to it with the two-dump form `kvdiff diff REF ENGINE` (GPU machine: torch, transformers,
accelerate; kvdiff built elsewhere and carried).

The reference is the default model in float32, its memory capped so that accelerate places
layers on several devices (two GPUs where there are two, else the GPU and the CPU). The engine
is the same model in bfloat16 on one GPU, fed the reference's tokens, clean and with its
chunks' position ids restarting at 0.

  python3 scripts/capture_device_map_test.py KVDIFF_BINARY
Exit 1 if a case does not come out as expected; a table last.
"""
import json
import os
import shutil
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdiff_capture as kc  # noqa: E402

KVDIFF = sys.argv[1]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "fixtures", "default-model")
WORK = "/tmp/kvdiff-device-map"
MESSAGES = [
    {"role": "system", "content": "Always answer in lowercase."},
    {"role": "user", "content": "Some facts: Hugo's pet is parrot. Mia's city is lima."},
    {"role": "assistant", "content": "ok."},
    {"role": "user", "content": "Tell me Mia's city."},
]
STEPS = 8


def run(model, ids, out, cut, feed=None, restart=False):
    """The prompt prefilled in two pieces at `cut`, then decode steps fed `feed` (the
    reference's tokens) or the model's own greedy ones; everything captured."""
    dev = model.get_input_embeddings().weight.device
    cache = DynamicCache(config=model.config)
    tokens = []
    with torch.no_grad(), kc.capture(model, out, model_name=MODEL, prompt=MESSAGES):
        for a, b in ((0, cut), (cut, len(ids))):
            start = 0 if restart and a > 0 else a
            pos = torch.arange(start, start + b - a, device=dev)[None]
            logits = model(torch.tensor([ids[a:b]], device=dev), past_key_values=cache,
                           use_cache=True, position_ids=pos).logits
        for s in range(STEPS):
            t = int(logits[0, -1].argmax()) if feed is None else feed[s]
            tokens.append(t)
            n = len(ids) + s
            logits = model(torch.tensor([[t]], device=dev), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[n]], device=dev)).logits
    return tokens


def diff(*dumps):
    report = os.path.join(WORK, "r.json")
    o = subprocess.run([KVDIFF, "diff", "-q", "--json", report, *dumps], capture_output=True, text=True)
    if o.returncode not in (0, 1):
        return o.returncode, f"exit {o.returncode}: {o.stderr.strip()[-200:]}"
    r = json.load(open(report))
    d = r["paths"][0]["first_divergence"]
    return o.returncode, ("EQUIVALENT" if d is None else f"{d['tap']} step {d['step']} position {d['position']}")


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    tok = AutoTokenizer.from_pretrained(MODEL)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    cut = len(ids) // 2
    gpus = torch.cuda.device_count()
    # The default model is 13.6 MB in f32: a few MB per GPU leaves layers for the next device.
    budget = {i: "4MiB" for i in range(gpus)}
    budget["cpu"] = "2GiB"
    ref_model = AutoModelForCausalLM.from_pretrained(
        MODEL, dtype=torch.float32, device_map="auto", max_memory=budget, attn_implementation="eager")
    placed = sorted({str(d) for d in ref_model.hf_device_map.values()})
    ref = os.path.join(WORK, "reference")
    fed = run(ref_model, ids, ref, cut)
    engine = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16, attn_implementation="eager").to("cuda:0")
    rows = [("reference against kvdiff's own", diff(ref), 0, "EQUIVALENT")]
    for name, restart, want_code, want in (("clean", False, 0, "EQUIVALENT"),
                                           ("positions restart at 0", True, 1, f"L0.q_rope step 0 position {cut}")):
        out = os.path.join(WORK, name.replace(" ", "-"))
        run(engine, ids, out, cut, feed=fed, restart=restart)
        rows.append((f"engine (bf16, 1 GPU) {name} vs reference", diff(ref, out), want_code, want))
    print(f"\nreference placed on {placed} ({gpus} GPU(s) here)\n")
    print("| case | kvdiff diff says | as expected |\n| --- | --- | --- |")
    bad = 0
    for name, (code, said), want_code, want in rows:
        ok = code == want_code and said == want
        bad += not ok
        print(f"| {name} | {said} | {'yes' if ok else 'NO'} |")
    multi = len(placed) > 1
    print(f"\nlayers spread over several devices: {'yes' if multi else 'NO'}")
    sys.exit(1 if bad or not multi else 0)


main()
