"""Dumps HF transformers' own Qwen3 (eager attention, float32) as the reference kvdiff is tested
against. Runs on the GPU machine (transformers 5.17); nothing here uses kvdiff code.

Usage:
  python3 scripts/hf_reference.py taps MODEL_DIR OUT_DIR NEW_TOKENS task|short
      For each reference conversation: the rendered chat text and ids, every tap kvdiff names
      (tensor names = tap names, f32, batch dim dropped, per-head tensors as [position, head, dim],
      attention probabilities as [head, query, key]) in OUT_DIR/<prompt>.safetensors, and the greedy
      continuation with its per-step logits in OUT_DIR/manifest.json / the safetensors file.
  python3 scripts/hf_reference.py template TOKENIZER_DIR OUT_JSON
      Chat-template rendering and token ids of transformers' apply_chat_template for the
      conversations below.
"""

import json
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3 import modeling_qwen3

TAP_PROMPTS = [
    ("task_upper", [
        {"role": "system", "content": "Always answer in uppercase."},
        {"role": "user", "content": "Remember this. Anna's color is blue. Ben's city is oslo."},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "What is Anna's color?"},
    ]),
    ("task_lower_two_contexts", [
        {"role": "system", "content": "Always answer in lowercase."},
        {"role": "user", "content": "Some facts: Hugo's pet is parrot."},
        {"role": "assistant", "content": "ok."},
        {"role": "user", "content": "Note the following. Mia's city is lima. Sam's color is green."},
        {"role": "assistant", "content": "ok."},
        {"role": "user", "content": "Tell me Mia's city."},
    ]),
    ("no_system", [
        {"role": "user", "content": "Here is what I know. Tara's pet is goat. Leo's color is red."},
        {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": "Which pet does Tara have?"},
    ]),
    ("unicode_think", [
        {"role": "system", "content": "你好，世界。 Be brief."},
        {"role": "user", "content": "Bonjour! 2+2?"},
        {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4"},
        {"role": "user", "content": "Und jetzt? 🙂"},
    ]),
]

# Short conversations for the wide random model, whose per-head taps are 16 heads x 128 wide.
SHORT_PROMPTS = [
    ("hello", [{"role": "user", "content": "Hello there"}]),
    ("system_fact", [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Anna's pet is cat. Yes?"}]),
    ("multi_turn", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Ok."},
                    {"role": "user", "content": "more"}]),
    ("unicode", [{"role": "user", "content": "你好 🙂 über"}]),
]

# Every prompt keeps these taps; the first prompt of a set keeps every tap (size budget).
ESSENTIAL = ("embed", "resid_out", "k_rope", "v", "attn_probs", "logits", "decode_logits")

TEMPLATE_CONVERSATIONS = [
    ("system_user", [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}], {}),
    ("user_only", [{"role": "user", "content": "Hello there"}], {}),
    ("multi_turn", [{"role": "system", "content": "Be concise."},
                    {"role": "user", "content": "Name a prime."},
                    {"role": "assistant", "content": "7"},
                    {"role": "user", "content": "Another one?"},
                    {"role": "assistant", "content": "11"},
                    {"role": "user", "content": "And the sum?"}], {}),
    ("empty_system", [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}], {}),
    ("unicode_chinese", [{"role": "system", "content": "你是一个乐于助人的助手。"},
                         {"role": "user", "content": "请用中文解释一下量子纠缠。 Ünïcödé — ok? 🚀"}], {}),
    ("think_history", [{"role": "user", "content": "What is 12*12?"},
                       {"role": "assistant", "content": "<think>\n12 times 12 is 144.\n</think>\n\n144"},
                       {"role": "user", "content": "And 13*13?"}], {}),
    ("think_after_last_query", [{"role": "user", "content": "Start."},
                                {"role": "assistant", "content": "<think>\nplan\n</think>\n\nDone."}], {}),
    ("newlines_and_spaces", [{"role": "system", "content": "  leading and trailing  \n\n"},
                             {"role": "user", "content": "line1\nline2\n\n\tindented\r\nend "}], {}),
    ("no_thinking", [{"role": "user", "content": "Quick answer please."}], {"enable_thinking": False}),
]


def render(tok, messages, kwargs):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = tok.encode(text, add_special_tokens=False)
    return text, ids


def cmd_template(tok_dir, out_json):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cases = []
    for name, messages, kwargs in TEMPLATE_CONVERSATIONS:
        text, ids = render(tok, messages, kwargs)
        cases.append({"name": name, "messages": messages, "kwargs": kwargs, "text": text, "ids": ids,
                      "decoded": tok.decode(ids)})
    json.dump({"transformers": transformers.__version__, "cases": cases}, open(out_json, "w"),
              ensure_ascii=False, indent=1)
    print(f"template references: {len(cases)} -> {out_json}")


def squeeze(t):
    return t.detach().float().cpu()[0].contiguous()


def cmd_taps(model_dir, out_dir, new_tokens, prompts):
    import os
    os.makedirs(out_dir, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model = model.to("cuda").eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = model.config
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    taps = {}
    hooks = []

    def out_hook(name, fn=lambda o: o):
        def h(_m, _inp, out):
            taps[name] = squeeze(fn(out))
        return h

    def in_hook(name):
        def h(_m, inp):
            taps[name] = squeeze(inp[0])
        return h

    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    hooks.append(model.model.embed_tokens.register_forward_hook(out_hook("embed")))
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(in_hook(f"L{i}.resid_in")))
        hooks.append(layer.input_layernorm.register_forward_hook(out_hook(f"L{i}.attn_norm")))
        hooks.append(layer.self_attn.q_norm.register_forward_hook(out_hook(f"L{i}.q")))
        hooks.append(layer.self_attn.k_norm.register_forward_hook(out_hook(f"L{i}.k")))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(out_hook(f"L{i}.v")))
        hooks.append(layer.self_attn.register_forward_hook(out_hook(f"L{i}.attn_probs", lambda o: o[1])))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(in_hook(f"L{i}.attn_out")))
        hooks.append(layer.self_attn.o_proj.register_forward_hook(out_hook(f"L{i}.o_proj")))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(in_hook(f"L{i}.resid_mid")))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(out_hook(f"L{i}.mlp_norm")))
        hooks.append(layer.mlp.register_forward_hook(out_hook(f"L{i}.mlp_out")))
        hooks.append(layer.register_forward_hook(out_hook(f"L{i}.resid_out", first)))
    hooks.append(model.model.norm.register_forward_hook(out_hook("final_norm")))

    manifest = {"transformers": transformers.__version__, "torch": torch.__version__,
                "attn_implementation": "eager", "dtype": "float32", "prompts": []}
    for index, (name, messages) in enumerate(prompts):
        text, ids = render(tok, messages, {})
        taps.clear()
        input_ids = torch.tensor([ids], device="cuda")
        n = len(ids)
        with torch.no_grad():
            out = model(input_ids=input_ids, use_cache=True, output_attentions=True)
        tensors = dict(taps)
        tensors["logits"] = squeeze(out.logits)
        cache = out.past_key_values
        # HF applies RoPE inside attention; q after RoPE is rebuilt with HF's own rotary module.
        pos = torch.arange(n, device="cuda")[None]
        cos, sin = model.model.rotary_emb(tensors["embed"][None].cuda(), pos)
        for i in range(cfg.num_hidden_layers):
            layer_cache = cache.layers[i] if hasattr(cache, "layers") else None
            k = layer_cache.keys if layer_cache is not None else cache.key_cache[i]
            v = layer_cache.values if layer_cache is not None else cache.value_cache[i]
            tensors[f"L{i}.k_rope"] = squeeze(k.transpose(1, 2))
            tensors[f"L{i}.v"] = squeeze(v.transpose(1, 2))
            q = tensors[f"L{i}.q"].cuda()[None].transpose(1, 2)
            q_rope, _ = modeling_qwen3.apply_rotary_pos_emb(q, q, cos, sin)
            tensors[f"L{i}.q_rope"] = squeeze(q_rope.transpose(1, 2))
        for i in range(cfg.num_hidden_layers):
            assert tensors[f"L{i}.q"].shape == (n, heads, hd), tensors[f"L{i}.q"].shape
            assert tensors[f"L{i}.k_rope"].shape == (n, kv_heads, hd)
            assert tensors[f"L{i}.attn_probs"].shape == (heads, n, n)
        with torch.no_grad():
            gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id or 0)
        new_ids = gen.sequences[0, n:].tolist()
        tensors["decode_logits"] = torch.stack([lg[0].float().cpu() for lg in gen.logits]).contiguous()
        if index > 0:
            tensors = {k: v for k, v in tensors.items() if k.split(".")[-1] in ESSENTIAL}
        save_file(tensors, os.path.join(out_dir, f"{name}.safetensors"))
        manifest["prompts"].append({"name": name, "messages": messages, "text": text, "input_ids": ids,
                                    "greedy_ids": new_ids, "greedy_text": tok.decode(new_ids)})
        print(f"{model_dir} {name}: {n} tokens, greedy {tok.decode(new_ids)!r}")
    for h in hooks:
        h.remove()
    json.dump(manifest, open(os.path.join(out_dir, "manifest.json"), "w"), ensure_ascii=False, indent=1)


def main():
    if sys.argv[1] == "template":
        cmd_template(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "taps":
        new_tokens = int(sys.argv[4])
        prompts = {"task": TAP_PROMPTS, "short": SHORT_PROMPTS}[sys.argv[5]]
        cmd_taps(sys.argv[2], sys.argv[3], new_tokens, prompts)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
