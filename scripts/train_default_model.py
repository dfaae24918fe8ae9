"""Trains kvdiff's embedded default model: a tiny Qwen3 (about 3.4 M parameters) with its own
byte-level BPE that carries the Qwen chat special tokens, on the synthetic chat task of
chat_task.py. Runs on the GPU machine with transformers (HF's own Qwen3ForCausalLM, so the
architecture is transformers' by construction).

Usage: python3 scripts/train_default_model.py QWEN3_TOKENIZER_DIR OUT_DIR [--steps N]
Writes OUT_DIR/{config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, chat_template.jinja} and OUT_DIR/accuracy.json.
"""

import argparse
import json
import math
import os
import random
import sys
import time

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
import chat_task  # noqa: E402

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(chat_task.corpus_lines(random.Random(1), 20000), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def render_chatml(messages):
    """What the Qwen3 template renders for the task's conversations (checked against
    apply_chat_template at start-up); rendering through Jinja per example is too slow."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


COMPLETION = "<think>\n\n</think>\n\n{answer}<|im_end|>\n"


def encode_batch(raw, rng, n):
    examples = [chat_task.make_example(rng) for _ in range(n)]
    prompts = raw.encode_batch([render_chatml(m) for m, *_ in examples], add_special_tokens=False)
    comps = raw.encode_batch([COMPLETION.format(answer=a) for _, a, *_ in examples], add_special_tokens=False)
    return [(p.ids, c.ids, *ex) for p, c, ex in zip(prompts, comps, examples)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("qwen3_tokenizer_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    os.makedirs(args.out_dir, exist_ok=True)
    template = json.load(open(os.path.join(args.qwen3_tokenizer_dir, "tokenizer_config.json")))["chat_template"]

    raw = build_tokenizer(vocab_size=1024)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token=None, bos_token=None, clean_up_tokenization_spaces=False)
    tok.chat_template = template
    tok.model_max_length = 512
    tok.save_pretrained(args.out_dir)
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    print(f"vocab {len(tok)} eos {eos_id} pad {pad_id}", flush=True)

    cfg_kwargs = dict(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=pad_id, eos_token_id=eos_id,
                      pad_token_id=pad_id, attention_dropout=0.0)
    try:
        config = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **cfg_kwargs)
    except TypeError:
        config = Qwen3Config(rope_theta=1000000.0, **cfg_kwargs)
    config._attn_implementation = "sdpa"
    dev = "cuda"
    model = Qwen3ForCausalLM(config).to(dev)
    print(f"params {sum(p.numel() for p in model.parameters())}", flush=True)

    rng = random.Random(1234)
    check = random.Random(5)
    for _ in range(200):
        messages = chat_task.make_example(check)[0]
        assert render_chatml(messages) == tok.apply_chat_template(messages, tokenize=False,
                                                                  add_generation_prompt=True), messages
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warm = 200
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        # Fresh conversations every step: a fixed pool gets memorised instead of learned.
        batch = encode_batch(raw, rng, args.batch)
        width = max(len(p) + len(c) for p, c, *_ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, c, *_) in enumerate(batch):
            seq = p + c
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, len(p):len(seq)] = torch.tensor(c)
            mask[i, :len(seq)] = 1
        ids, labels, mask = ids.to(dev), labels.to(dev), mask.to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)

    model = model.to(torch.bfloat16).eval()
    model.config._attn_implementation = "eager"
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.do_sample = False
    model.save_pretrained(args.out_dir, safe_serialization=True)

    # Accuracy on fresh conversations, greedy, with the bf16 weights that are shipped.
    eval_rng = random.Random(99)
    totals = {"case": [0, 0], "fact": [0, 0], "exact": [0, 0]}
    per_case = {}
    samples = []
    for p, _, messages, answer, case, value in encode_batch(raw, eval_rng, 300):
        out = model.generate(torch.tensor([p], device=dev), attention_mask=torch.ones(1, len(p), device=dev,
                             dtype=torch.long), max_new_tokens=32, do_sample=False, eos_token_id=eos_id,
                             pad_token_id=pad_id)
        text = tok.decode(out[0, len(p):], skip_special_tokens=True).split("</think>")[-1].strip()
        ok_case = text == chat_task.apply_case(text, case) and any(ch.isalpha() for ch in text)
        if case == "plain":
            ok_case = text[:1].isupper() and not text.isupper()
        ok_fact = value in text.lower().rstrip(".").split()
        for k, ok in (("case", ok_case), ("fact", ok_fact), ("exact", text == answer)):
            totals[k][0] += int(ok)
            totals[k][1] += 1
        per_case.setdefault(case, [0, 0])
        per_case[case][0] += int(text == answer)
        per_case[case][1] += 1
        if text != answer and len(samples) < 8:
            samples.append({"messages": messages, "expected": answer, "got": text})
    acc = {k: v[0] / v[1] for k, v in totals.items()}
    acc["exact_by_case"] = {k: v[0] / v[1] for k, v in per_case.items()}
    acc["n"] = totals["exact"][1]
    acc["steps"] = args.steps
    acc["failures"] = samples
    json.dump(acc, open(os.path.join(args.out_dir, "accuracy.json"), "w"), indent=1)
    print(json.dumps({k: v for k, v in acc.items() if k != "failures"}), flush=True)


if __name__ == "__main__":
    main()
