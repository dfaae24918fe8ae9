"""Benchmark peer and fixture builder for scripts/bench_cuda.sh (runs on the GPU machine).

  bench_hf.py build TOKENIZER_DIR OUT_DIR PROMPT_FILE [SHAPE]
                                                         random Qwen3-0.6B-shaped model (SHAPE 4b,
                                                         8b: Qwen3-4B's, Qwen3-8B's) + 512-token prompt
  bench_hf.py time MODEL_DIR PROMPT_FILE NEW_TOKENS [sdpa]
                                                         HF transformers timings, JSON on stdout
                                                         (sdpa: that one only)
  bench_hf.py ceilings                                   measured bandwidth and bf16 GEMM rate, JSON
  bench_hf.py prompt MODEL_DIR TOKENS PROMPT_FILE        a system + two contexts + query prompt of
                                                         about TOKENS tokens (RAG-like), JSON on stdout

The model has Qwen3-0.6B's shapes (hidden 1024, 28 layers, 16 heads over 8 KV heads, head_dim 128,
intermediate 3072, vocab 151936, tied embeddings) and seeded random weights in bf16.
"""
import json
import shutil
import statistics
import sys
import time

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

PROMPT_TOKENS = 512


# Model shapes `build` makes: Qwen3-0.6B's (the benchmark's), Qwen3-4B's, where a decode step
# streams 8 GB of weights and is bound by it, and Qwen3-8B's (16 GB, untied), the calibration
# benchmark's large model.
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, tie_word_embeddings=False),
}


def build(tok_dir, out_dir, prompt_file, shape="0.6b"):
    torch.manual_seed(0)
    shape_args = {"tie_word_embeddings": True, **SHAPES[shape]}
    cfg = Qwen3Config(
        vocab_size=151936, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, eos_token_id=151645,
        bos_token_id=151643, torch_dtype="bfloat16", **shape_args,
    )
    # Made in bf16 directly: an 8B model in f32 would take 32 GB of GPU memory on the way.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tok_dir}/{f}", f"{out_dir}/{f}")
    tok = AutoTokenizer.from_pretrained(out_dir)
    # System prompt, two context turns and a query; the query grows until the chat-templated
    # prompt is PROMPT_TOKENS long.
    words = "the quick brown fox jumps over the lazy dog near a river bank".split()
    system = "You are a careful assistant. Answer in one short sentence."
    ctx1 = "Facts: " + " ".join(words * 12)
    ctx2 = "More facts: " + " ".join(reversed(words * 12))

    def messages(k):
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": ctx1},
            {"role": "assistant", "content": "ok."},
            {"role": "user", "content": ctx2},
            {"role": "assistant", "content": "ok."},
            {"role": "user", "content": "Question: " + " ".join((words * 100)[:k])},
        ]

    def length(k):
        text = tok.apply_chat_template(messages(k), add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    lo, hi = 0, 1200  # the longest query with length(k) <= PROMPT_TOKENS, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(mid) <= PROMPT_TOKENS:
            lo = mid
        else:
            hi = mid - 1
    k = lo
    with open(prompt_file, "w") as f:
        json.dump({"messages": messages(k)}, f)
    print(json.dumps({"prompt_tokens": length(k)}))


def rag_prompt(model_dir, tokens, prompt_file):
    """Two long contexts (each about 45 % of the prompt) between a system prompt and a query."""
    tokens = int(tokens)
    tok = AutoTokenizer.from_pretrained(model_dir)
    words = ("the river rises in the northern hills and runs past seven old mills before it "
             "reaches the harbour where ships wait for the tide").split()

    def messages(k):
        ctx = lambda i: " ".join((words * (k // len(words) + 2))[i:i + k])
        return [
            {"role": "system", "content": "You are a careful assistant. Answer from the documents."},
            {"role": "user", "content": "Document 1: " + ctx(0)},
            {"role": "assistant", "content": "ok."},
            {"role": "user", "content": "Document 2: " + ctx(5)},
            {"role": "assistant", "content": "ok."},
            {"role": "user", "content": "Question: where do the ships wait?"},
        ]

    def length(k):
        text = tok.apply_chat_template(messages(k), add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    lo, hi = 0, tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(mid) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    with open(prompt_file, "w") as f:
        json.dump({"messages": messages(lo)}, f)
    print(json.dumps({"prompt_tokens": length(lo)}))


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_hf(model_dir, prompt_file, new_tokens, only=None):
    new_tokens = int(new_tokens)
    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = json.load(open(prompt_file))["messages"]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].cuda()
    out = {"prompt_tokens": ids.shape[1]}
    for impl, hidden in (("sdpa", False), ("eager", True)):
        if only is not None and impl != only:
            continue
        model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 attn_implementation=impl).cuda().eval()
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        if hidden:
            kw.update(output_hidden_states=True, return_dict_in_generate=True)
        with torch.no_grad():
            out[f"hf_{impl}{'_hidden' if hidden else ''}_s"] = timed(
                lambda: model.generate(ids, **kw), 3)
        del model
        torch.cuda.empty_cache()
    print(json.dumps(out))


def ceilings():
    n = 1 << 28  # 512 MiB of bf16 each way
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), 20)
    bandwidth = 2 * a.numel() * 2 / t
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    t = timed(lambda: x @ y, 20)
    print(json.dumps({"bandwidth_Bps": bandwidth, "bf16_flops": 2 * m ** 3 / t}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "build":
        build(*sys.argv[2:6])
    elif cmd == "time":
        time_hf(*sys.argv[2:6])
    elif cmd == "prompt":
        rag_prompt(*sys.argv[2:5])
    elif cmd == "ceilings":
        ceilings()
    else:
        sys.exit(f"unknown command {cmd}")
