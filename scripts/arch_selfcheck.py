"""Torch-free checks of scripts/make_arch_models.py and scripts/hf_reference.py, runnable on a
machine without torch or transformers (needs jinja2; `regex` for the token counts, else skipped):

  - both scripts import without torch (torch is imported only by the commands that need it);
  - every chat template renders, the way transformers' apply_chat_template renders it (a sandboxed
    Jinja environment with trim_blocks, lstrip_blocks, tojson, raise_exception, strftime_now), every
    conversation of its template set and the `arch` prompts, and refuses exactly the conversations
    marked to be refused;
  - the Llama renderings carry the pinned date_string, not today's date;
  - token counts of the `arch` prompts under each model's tokenizer (a byte-level BPE re-implemented
    here and checked against the committed default-chat-template.json ids first): at most 40 tokens
    beyond the template's own (a one-empty-user-turn rendering: Llama 3's date header, Qwen2.5's
    default system prompt), and longer than the sliding windows;
  - the models' shapes: Qwen2's layer_types as Qwen2Config derives them, heads x head_dim, sizes
    under 1 MB, YaRN's default attention factor;
  - gpu_fixtures.sh's arch stage names every model with its template set;
  - where the stage's references are there (REFERENCE_DIR, default fixtures/reference:
    arch-<name>-chat-template.json and arch-<name>/manifest.json), this rendering and BPE give
    transformers' text and ids for every case and prompt, and refuse what it refused.

Usage: python3 scripts/arch_selfcheck.py [REPO_ROOT [REFERENCE_DIR]]
"""

import json
import math
import os
import sys
import unicodedata
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # the two scripts are imported, not compiled into scripts/__pycache__

import hf_reference as hr  # noqa: E402
import make_arch_models as mam  # noqa: E402

assert "torch" not in sys.modules and "transformers" not in sys.modules, "a script imports torch at the top"

# Which template set of hf_reference.py each model's references use (as gpu_fixtures.sh says).
TEMPLATE_SET = {"qwen3-moe": "qwen", "qwen2": "qwen", "llama3": "llama", "mistral": "mistral"}


def jinja_env():
    """transformers 5.17's utils/chat_template_utils._cached_compile_jinja_template, less the
    {% generation %} tracker."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Bpe:
    """The default model's byte-level BPE (tokenizer.json: NFC, a Split regex, ByteLevel without
    its own regex, BPE), with added tokens matched first, as the tokenizers library does."""

    def __init__(self, tokenizer_json, extra_special):
        import regex

        t = json.load(open(tokenizer_json, encoding="utf-8"))
        self.vocab = dict(t["model"]["vocab"])
        self.ranks = {tuple(m) if isinstance(m, list) else tuple(m.split(" ")): i
                      for i, m in enumerate(t["model"]["merges"])}
        self.added = {a["content"]: a["id"] for a in t["added_tokens"]}
        for tok in extra_special:
            self.added[tok] = len(self.vocab) + len(self.added)
        split = [p for p in t["pre_tokenizer"]["pretokenizers"] if p["type"] == "Split"][0]
        self.split = regex.compile(split["pattern"]["Regex"])
        self.special = regex.compile("|".join(regex.escape(a) for a in sorted(self.added, key=len, reverse=True)))
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        self.byte_char = {b: chr(c) for b, c in zip(bs, cs)}

    def _bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), math.inf), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [self.vocab[p] for p in parts]

    def encode(self, text):
        ids, pos = [], 0
        for m in list(self.special.finditer(text)) + [None]:
            chunk = text[pos:m.start()] if m else text[pos:]
            chunk = unicodedata.normalize("NFC", chunk)
            for piece in self.split.findall(chunk):
                ids += self._bpe("".join(self.byte_char[b] for b in piece.encode("utf-8")))
            if m:
                ids.append(self.added[m.group()])
                pos = m.end()
        return ids


def check_bpe(root):
    """The re-implemented BPE must reproduce transformers' ids for the committed references."""
    try:
        import regex  # noqa: F401
    except ImportError:
        print("token counts: skipped (no `regex` module)")
        return None
    bpe = Bpe(os.path.join(root, "fixtures/default-model/tokenizer.json"), [])
    refs = json.load(open(os.path.join(root, "fixtures/reference/default-chat-template.json"), encoding="utf-8"))
    for case in refs["cases"]:
        assert bpe.encode(case["text"]) == case["ids"], f"BPE re-implementation differs on {case['name']}"
    return len(refs["cases"])


def render(env, template, messages, kwargs, fam):
    ctx = {"bos_token": fam["bos"], "eos_token": fam["eos"], "pad_token": fam["pad"]}
    ctx = {k: v for k, v in ctx.items() if v is not None}
    return env.from_string(template).render(messages=messages, tools=None, documents=None,
                                            add_generation_prompt=True, **ctx, **kwargs)


def check_templates(root, env):
    import jinja2

    default_dir = os.path.join(root, "fixtures/default-model")
    today = datetime.now().strftime("%d %b %Y")
    for name, spec in mam.MODELS.items():
        fam = mam.FAMILIES[spec["family"]]
        if spec["family"] == "qwen":
            # The default tokenizer's named tokens (tokenizer_config.json) are what templates see.
            fam = dict(fam, bos=None)
        template = mam.template_text(spec["template"], default_dir)
        family = TEMPLATE_SET[name]
        rendered = 0
        for case, messages, kwargs in hr.TEMPLATE_SETS[family]:
            try:
                text = render(env, template, messages, kwargs, fam)
            except jinja2.exceptions.TemplateError as e:
                assert (family, case) in hr.EXPECT_ERROR, f"{name}/{case}: refused: {e}"
                print(f"{name}: {case} refused as expected: {e}")
                continue
            assert (family, case) not in hr.EXPECT_ERROR, f"{name}/{case}: accepted, must be refused"
            if "date_string" in kwargs:
                assert f"Today Date: {kwargs['date_string']}" in text, f"{name}/{case}: no pinned date"
            rendered += 1
        model_type = mam.EXPECT_CONFIG[name]["model_type"]
        tap_kwargs = hr.TAP_TEMPLATE_KWARGS.get(model_type, {})
        texts = {}
        for case, messages in hr.ARCH_PROMPTS:
            texts[case] = render(env, template, messages, tap_kwargs, fam)
            if spec["family"] == "llama":
                assert hr.LLAMA_DATE in texts[case] and (today == hr.LLAMA_DATE or today not in texts[case])
        print(f"{name}: {rendered} {family} template cases and {len(texts)} arch prompts render")
        texts["_empty"] = render(env, template, [{"role": "user", "content": ""}], tap_kwargs, fam)
        yield name, spec, texts


def check_token_counts(root, name, spec, texts, windows):
    fam = mam.FAMILIES[spec["family"]]
    bpe = Bpe(os.path.join(root, "fixtures/default-model/tokenizer.json"), fam["add"])
    counts = {case: len(bpe.encode(text)) for case, text in texts.items()}
    overhead = len(bpe.encode(texts["_empty"]))
    del counts["_empty"]
    print(f"{name}: arch prompt tokens {counts} (the template alone: {overhead}), "
          f"vocab {len(bpe.vocab) + len(bpe.added)}")
    for case, n in counts.items():
        assert n - overhead <= 40, f"{name}/{case}: {n} tokens"
        for w in windows:
            assert n > w, f"{name}/{case}: {n} tokens do not pass the sliding window {w}"


def check_shapes(name, spec, vocab):
    c = spec["config_kwargs"]
    hidden, heads, kv, layers = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    hd = c.get("head_dim") or hidden // heads
    attn_bias = spec["config"] == "Qwen2Config"  # q/k/v bias is hard-wired in Qwen2Attention
    attn = hidden * heads * hd * 2 + hidden * kv * hd * 2 + (heads * hd + 2 * kv * hd if attn_bias else 0)
    if spec["config"] == "Qwen3MoeConfig":
        attn += 2 * hd  # q_norm, k_norm
    params = vocab * hidden * (1 if c["tie_word_embeddings"] else 2) + hidden
    windows = []
    for i in range(layers):
        if spec["config"] == "Qwen3MoeConfig" and i not in c["mlp_only_layers"] and (i + 1) % c["decoder_sparse_step"] == 0:
            mlp = c["num_experts"] * 3 * hidden * c["moe_intermediate_size"] + c["num_experts"] * hidden
        else:
            mlp = 3 * hidden * c["intermediate_size"]
        params += attn + mlp + 2 * hidden
    if spec["config"] == "Qwen2Config":
        # Qwen2Config.__post_init__: sliding_attention where use_sliding_window and i >= max_window_layers.
        sw = c["sliding_window"] if c["use_sliding_window"] else None
        layer_types = ["sliding_attention" if sw is not None and i >= c["max_window_layers"] else "full_attention"
                       for i in range(layers)]
        assert layer_types == mam.EXPECT_CONFIG[name]["layer_types"], layer_types
        windows = [sw]
    if spec["config"] == "MistralConfig":
        windows = [c["sliding_window"]]
    nbytes = params * (2 if spec["dtype"] in ("bfloat16", "float16") else 4)
    assert nbytes < mam.MAX_BYTES * 0.9, f"{name}: about {nbytes} bytes of weights"
    extra = ""
    rope = c["rope_parameters"]
    if rope["rope_type"] == "yarn":
        extra = f", YaRN attention factor 0.1*ln({rope['factor']})+1 = {0.1 * math.log(rope['factor']) + 1:.6f}"
    print(f"{name}: {params} params, about {nbytes} bytes of {spec['dtype']} weights, "
          f"{heads} heads x {hd} over {kv} KV heads{extra}")
    return windows


def check_references(ref_dir, env, root):
    """The committed transformers renderings against this script's renderer and BPE."""
    import jinja2

    default_dir = os.path.join(root, "fixtures/default-model")
    checked = 0
    for name, spec in mam.MODELS.items():
        fam = mam.FAMILIES[spec["family"]]
        if spec["family"] == "qwen":
            fam = dict(fam, bos=None)
        template = mam.template_text(spec["template"], default_dir)
        bpe = Bpe(os.path.join(root, "fixtures/default-model/tokenizer.json"), fam["add"])
        path = os.path.join(ref_dir, f"arch-{name}-chat-template.json")
        if not os.path.exists(path):
            continue
        cases = [(c, c["messages"], c["kwargs"]) for c in json.load(open(path, encoding="utf-8"))["cases"]]
        manifest = json.load(open(os.path.join(ref_dir, f"arch-{name}", "manifest.json"), encoding="utf-8"))
        cases += [({"name": p["name"], "text": p["text"], "ids": p["input_ids"]}, p["messages"],
                   p.get("template_kwargs", {})) for p in manifest["prompts"]]
        for case, messages, kwargs in cases:
            try:
                text = render(env, template, messages, kwargs, fam)
            except jinja2.exceptions.TemplateError as e:
                assert case.get("error") == str(e), f"{name}/{case['name']}: refused here: {e}"
                continue
            assert "error" not in case, f"{name}/{case['name']}: transformers refused it, this renders it"
            assert text == case["text"], f"{name}/{case['name']}: text differs"
            assert bpe.encode(text) == case["ids"], f"{name}/{case['name']}: ids differ"
            checked += 1
    return checked


def check_gpu_script(root):
    text = open(os.path.join(root, "scripts/gpu_fixtures.sh")).read()
    line = [ln for ln in text.splitlines() if ln.strip().startswith("for model in")][0]
    pairs = dict(p.split(":") for p in line.split(" in ", 1)[1].split(";")[0].split())
    assert pairs == TEMPLATE_SET, pairs


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, ".."))
    env = jinja_env()
    bpe_cases = check_bpe(root)
    if bpe_cases:
        print(f"BPE re-implementation matches transformers' ids on {bpe_cases} committed cases")
    for name, spec, texts in check_templates(root, env):
        vocab = 852 + len(mam.FAMILIES[spec["family"]]["add"])
        windows = check_shapes(name, spec, vocab)
        if bpe_cases:
            check_token_counts(root, name, spec, texts, windows)
    check_gpu_script(root)
    ref_dir = os.path.abspath(sys.argv[2]) if len(sys.argv) > 2 else os.path.join(root, "fixtures/reference")
    if bpe_cases:
        n = check_references(ref_dir, env, root)
        print(f"transformers' renderings in {ref_dir}: {n} texts and ids reproduced" if n else
              f"no arch references in {ref_dir} yet")
    assert set(hr.ESSENTIAL) >= {"router_logits", "experts"}
    print("arch selfcheck: ok")


if __name__ == "__main__":
    main()
