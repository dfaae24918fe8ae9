"""Dumps HF transformers' own models (eager attention, float32) as the reference kvdiff is tested
against: Qwen3, Qwen3-MoE, Qwen2, Llama and Mistral. Runs on the GPU machine (transformers 5.17);
nothing here uses kvdiff code, and torch is imported only by the commands that need it.

Usage:
  python3 scripts/hf_reference.py taps MODEL_DIR OUT_DIR NEW_TOKENS task|short|arch
      For each reference conversation: the rendered chat text and ids, every tap kvdiff names
      (tensor names = tap names, f32, batch dim dropped, per-head tensors as [position, head, dim],
      attention probabilities as [head, query, key]) in OUT_DIR/<prompt>.safetensors, and the greedy
      continuation with its per-step logits in OUT_DIR/manifest.json / the safetensors file.
      A sparse-MoE layer adds L{i}.router_logits ([token, expert], pre-softmax) and L{i}.experts
      ([token, top_k], the chosen expert indices in top-k order, as float32).
  python3 scripts/hf_reference.py template TOKENIZER_DIR OUT_JSON [qwen|llama|mistral]
      Chat-template rendering and token ids of transformers' apply_chat_template for one family's
      conversations below (default qwen). A conversation the template must refuse is recorded
      as {"error": <the template's message>} instead of text and ids.
"""

import json
import os
import sys

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

# Short conversations that every family's template accepts (Qwen3, Qwen2.5, Llama 3, Mistral
# v0.3: a system message only first, then user/assistant alternating from a user), for the
# architecture models of scripts/make_arch_models.py. Each is longer than the sliding windows
# there (10 and 12 tokens), so sliding layers mask something.
ARCH_PROMPTS = [
    ("system_user", [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Anna's pet is a cat. What is Anna's pet?"}]),
    ("multi_turn", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "2+2?"}]),
    ("unicode", [{"role": "user", "content": "你好 🙂 über"}]),
]

PROMPT_SETS = {"task": TAP_PROMPTS, "short": SHORT_PROMPTS, "arch": ARCH_PROMPTS}

# Template variables a family's prompts are rendered with, by config model_type. Llama 3's
# template writes today's date (strftime_now) unless date_string is given.
LLAMA_DATE = "26 Jul 2024"
TAP_TEMPLATE_KWARGS = {"llama": {"date_string": LLAMA_DATE}}

# Every prompt keeps these taps; the first prompt of a set keeps every tap (size budget).
ESSENTIAL = ("embed", "resid_out", "k_rope", "v", "attn_probs", "logits", "decode_logits",
             "router_logits", "experts")

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

# Llama 3: date_string pinned so that the rendering does not depend on the day it runs.
LLAMA_TEMPLATE_CONVERSATIONS = [
    ("system_user", [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}],
     {"date_string": LLAMA_DATE}),
    ("user_only", [{"role": "user", "content": "Hello there"}], {"date_string": LLAMA_DATE}),
    ("multi_turn", [{"role": "system", "content": "Be concise."},
                    {"role": "user", "content": "Name a prime."},
                    {"role": "assistant", "content": "7"},
                    {"role": "user", "content": "Another one?"},
                    {"role": "assistant", "content": "11"},
                    {"role": "user", "content": "And the sum?"}], {"date_string": LLAMA_DATE}),
    ("multi_turn_no_system", [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "Hello."},
                              {"role": "user", "content": "2+2?"}], {"date_string": LLAMA_DATE}),
    ("trimmed", [{"role": "system", "content": "  leading and trailing  \n\n"},
                 {"role": "user", "content": "\n line1\nline2 \t\n"}], {"date_string": LLAMA_DATE}),
    ("unicode", [{"role": "user", "content": "请用中文解释一下量子纠缠。 Ünïcödé — ok? 🚀"}],
     {"date_string": LLAMA_DATE}),
    ("other_date", [{"role": "user", "content": "What day is it?"}], {"date_string": "01 Jan 2025"}),
]

# Mistral v0.3: a system message goes into the last user turn; roles must alternate.
MISTRAL_TEMPLATE_CONVERSATIONS = [
    ("user_only", [{"role": "user", "content": "Hello there"}], {}),
    ("system_user", [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is the capital of France?"}], {}),
    ("multi_turn", [{"role": "user", "content": "Name a prime."},
                    {"role": "assistant", "content": "7"},
                    {"role": "user", "content": "Another one?"},
                    {"role": "assistant", "content": "11"},
                    {"role": "user", "content": "And the sum?"}], {}),
    ("system_multi_turn", [{"role": "system", "content": "Be concise."},
                           {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": " Hello. \n"},
                           {"role": "user", "content": "2+2?"}], {}),
    ("unicode", [{"role": "user", "content": "请用中文解释一下量子纠缠。 Ünïcödé — ok? 🚀"}], {}),
    ("bad_order_user_user", [{"role": "user", "content": "hi"},
                             {"role": "user", "content": "hi again"}], {}),
]

TEMPLATE_SETS = {"qwen": TEMPLATE_CONVERSATIONS, "llama": LLAMA_TEMPLATE_CONVERSATIONS,
                 "mistral": MISTRAL_TEMPLATE_CONVERSATIONS}

# Conversations the family's template must refuse (raise_exception): recorded as {"error": ...}.
EXPECT_ERROR = {("mistral", "bad_order_user_user")}


def render(tok, messages, kwargs):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    ids = tok.encode(text, add_special_tokens=False)
    return text, ids


def cmd_template(tok_dir, out_json, family="qwen"):
    import jinja2
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    cases = []
    for name, messages, kwargs in TEMPLATE_SETS[family]:
        if (family, name) in EXPECT_ERROR:
            try:
                render(tok, messages, kwargs)
            except jinja2.exceptions.TemplateError as e:
                cases.append({"name": name, "messages": messages, "kwargs": kwargs, "error": str(e)})
                continue
            sys.exit(f"{tok_dir} {name}: the chat template accepted a conversation it must refuse")
        text, ids = render(tok, messages, kwargs)
        cases.append({"name": name, "messages": messages, "kwargs": kwargs, "text": text, "ids": ids,
                      "decoded": tok.decode(ids)})
    json.dump({"transformers": transformers.__version__, "cases": cases}, open(out_json, "w"),
              ensure_ascii=False, indent=1)
    print(f"template references ({family}): {len(cases)} -> {out_json}")


def squeeze(t):
    return t.detach().float().cpu()[0].contiguous()


def cmd_taps(model_dir, out_dir, new_tokens, prompts):
    import importlib

    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    os.makedirs(out_dir, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model_type = json.load(open(os.path.join(model_dir, "config.json")))["model_type"]
    load_kwargs = {}
    if model_type == "qwen3_moe":
        # The experts as the plain per-expert loop in f32 (transformers' default is grouped_mm).
        load_kwargs["experts_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 **load_kwargs)
    model = model.to("cuda").eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = model.config
    # The family's own modeling module: its apply_rotary_pos_emb rebuilds q after RoPE.
    family = importlib.import_module(type(model).__module__)
    layers = model.model.layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = layers[0].self_attn.head_dim
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

    def router_hook(i):
        # Qwen3MoeTopKRouter returns (router_logits, top-k weights, top-k indices) for the
        # flattened tokens: [tokens, experts], [tokens, top_k], [tokens, top_k].
        def h(_m, _inp, out):
            logits, _weights, indices = out
            taps[f"L{i}.router_logits"] = logits.detach().float().cpu().contiguous()
            taps[f"L{i}.experts"] = indices.detach().float().cpu().contiguous()
        return h

    per_head = lambda o: o.view(*o.shape[:-1], -1, hd)  # noqa: E731
    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    hooks.append(model.model.embed_tokens.register_forward_hook(out_hook("embed")))
    sparse_layers = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        hooks.append(layer.register_forward_pre_hook(in_hook(f"L{i}.resid_in")))
        hooks.append(layer.input_layernorm.register_forward_hook(out_hook(f"L{i}.attn_norm")))
        if hasattr(attn, "q_norm"):
            # Qwen3 / Qwen3-MoE: q and k are the per-head RMS-normed projections.
            hooks.append(attn.q_norm.register_forward_hook(out_hook(f"L{i}.q")))
            hooks.append(attn.k_norm.register_forward_hook(out_hook(f"L{i}.k")))
        else:
            # Qwen2 / Llama / Mistral: the projections themselves, bias included.
            hooks.append(attn.q_proj.register_forward_hook(out_hook(f"L{i}.q", per_head)))
            hooks.append(attn.k_proj.register_forward_hook(out_hook(f"L{i}.k", per_head)))
        hooks.append(attn.register_forward_hook(out_hook(f"L{i}.attn_probs", lambda o: o[1])))
        hooks.append(attn.o_proj.register_forward_pre_hook(in_hook(f"L{i}.attn_out")))
        hooks.append(attn.o_proj.register_forward_hook(out_hook(f"L{i}.o_proj")))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(in_hook(f"L{i}.resid_mid")))
        hooks.append(layer.post_attention_layernorm.register_forward_hook(out_hook(f"L{i}.mlp_norm")))
        hooks.append(layer.mlp.register_forward_hook(out_hook(f"L{i}.mlp_out")))
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            sparse_layers.append(i)
            hooks.append(layer.mlp.gate.register_forward_hook(router_hook(i)))
        hooks.append(layer.register_forward_hook(out_hook(f"L{i}.resid_out", first)))
    hooks.append(model.model.norm.register_forward_hook(out_hook("final_norm")))

    template_kwargs = TAP_TEMPLATE_KWARGS.get(model_type, {})
    manifest = {"transformers": transformers.__version__, "torch": torch.__version__,
                "architecture": type(model).__name__, "model_type": model_type,
                "attn_implementation": "eager", "dtype": "float32", "prompts": []}
    if load_kwargs:
        manifest.update(load_kwargs)
    for index, (name, messages) in enumerate(prompts):
        text, ids = render(tok, messages, template_kwargs)
        taps.clear()
        input_ids = torch.tensor([ids], device="cuda")
        n = len(ids)
        # k after RoPE and v as they go into the KV cache. A sliding-window layer's cache keeps
        # only the last window, so they are taken from the update call itself (the same tensors
        # a full layer's cache holds).
        cache = DynamicCache(config=cfg)
        cached = {}
        cache_update = cache.update

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            cached[layer_idx] = (key_states, value_states)
            return cache_update(key_states, value_states, layer_idx, *args, **kwargs)

        cache.update = update
        with torch.no_grad():
            out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, output_attentions=True)
        tensors = dict(taps)
        tensors["logits"] = squeeze(out.logits)
        # HF applies RoPE inside attention; q after RoPE is rebuilt with HF's own rotary module
        # (its cos/sin carry the rope type's attention scaling, e.g. YaRN's).
        pos = torch.arange(n, device="cuda")[None]
        cos, sin = model.model.rotary_emb(tensors["embed"][None].cuda(), pos)
        for i in range(cfg.num_hidden_layers):
            k, v = cached[i]
            tensors[f"L{i}.k_rope"] = squeeze(k.transpose(1, 2))
            tensors[f"L{i}.v"] = squeeze(v.transpose(1, 2))
            q = tensors[f"L{i}.q"].cuda()[None].transpose(1, 2)
            q_rope, _ = family.apply_rotary_pos_emb(q, q, cos, sin)
            tensors[f"L{i}.q_rope"] = squeeze(q_rope.transpose(1, 2))
        for i in range(cfg.num_hidden_layers):
            assert tensors[f"L{i}.q"].shape == (n, heads, hd), tensors[f"L{i}.q"].shape
            assert tensors[f"L{i}.k"].shape == (n, kv_heads, hd), tensors[f"L{i}.k"].shape
            assert tensors[f"L{i}.k_rope"].shape == (n, kv_heads, hd), tensors[f"L{i}.k_rope"].shape
            assert tensors[f"L{i}.v"].shape == (n, kv_heads, hd), tensors[f"L{i}.v"].shape
            assert tensors[f"L{i}.attn_probs"].shape == (heads, n, n), tensors[f"L{i}.attn_probs"].shape
            if i in sparse_layers:
                assert tensors[f"L{i}.router_logits"].shape == (n, cfg.num_experts)
                assert tensors[f"L{i}.experts"].shape == (n, cfg.num_experts_per_tok)
            else:
                assert f"L{i}.router_logits" not in tensors and f"L{i}.experts" not in tensors
        with torch.no_grad():
            gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id or 0)
        new_ids = gen.sequences[0, n:].tolist()
        tensors["decode_logits"] = torch.stack([lg[0].float().cpu() for lg in gen.logits]).contiguous()
        if index > 0:
            tensors = {k: v for k, v in tensors.items() if k.split(".")[-1] in ESSENTIAL}
        save_file(tensors, os.path.join(out_dir, f"{name}.safetensors"))
        entry = {"name": name, "messages": messages, "text": text, "input_ids": ids,
                 "greedy_ids": new_ids, "greedy_text": tok.decode(new_ids)}
        if template_kwargs:
            entry["template_kwargs"] = template_kwargs
        manifest["prompts"].append(entry)
        print(f"{model_dir} {name}: {n} tokens, greedy {tok.decode(new_ids)!r}")
    for h in hooks:
        h.remove()
    json.dump(manifest, open(os.path.join(out_dir, "manifest.json"), "w"), ensure_ascii=False, indent=1)


def main():
    args = sys.argv[1:]
    if len(args) in (3, 4) and args[0] == "template" and (len(args) == 3 or args[3] in TEMPLATE_SETS):
        cmd_template(*args[1:])
    elif len(args) == 5 and args[0] == "taps" and args[4] in PROMPT_SETS:
        cmd_taps(args[1], args[2], int(args[3]), PROMPT_SETS[args[4]])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
