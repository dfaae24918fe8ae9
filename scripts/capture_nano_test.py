"""kvdiff_capture's nano-vllm adapter on a model laid out as nano-vllm lays out Qwen3 (merged
`qkv_proj` and `gate_up_proj`, RMSNorm fused with the residual add, `rotary_emb(positions, q,
k)`, `attn(q, k, v)` over a paged-style cache, packed variable-length batches described by a
context object, `compute_logits` keeping each sequence's last token), with weights copied from
a Hugging Face folder. Two sequences run packed in every forward call (continuous batching),
prefill then greedy decode; `kvdiff diff --seq N` must find each equivalent to kvdiff's
reference. Needs torch and transformers (GPU machine); nano-vllm itself is not needed.

  python3 scripts/capture_nano_test.py KVDIFF_BINARY MODEL_DIR
"""
import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdiff_capture as kc  # noqa: E402


@dataclass
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor = None
    seq_of_token: list = None


_CTX = Context()
# The adapter reads nano-vllm's context through nanovllm.utils.context.get_context.
for name in ("nanovllm", "nanovllm.utils", "nanovllm.utils.context"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["nanovllm.utils.context"].get_context = lambda: _CTX


class RMSNorm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight.clone()), eps

    def norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def forward(self, x, residual=None):
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x


class Rotary(nn.Module):
    def __init__(self, inv_freq):
        super().__init__()
        self.inv_freq = inv_freq

    def forward(self, positions, q, k):
        f = positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]

        def rot(x):
            a, b = x.chunk(2, -1)
            return x * cos + torch.cat([-b, a], -1) * sin
        return rot(q), rot(k)


class Attention(nn.Module):
    def __init__(self, heads, kv_heads, hd):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hd
        self.cache = {}

    def forward(self, q, k, v):
        out = torch.empty_like(q)
        for s in sorted(set(_CTX.seq_of_token)):
            rows = [i for i, x in enumerate(_CTX.seq_of_token) if x == s]
            kc_, vc_ = self.cache.get(s, (k[:0], v[:0]))
            kc_, vc_ = torch.cat([kc_, k[rows]]), torch.cat([vc_, v[rows]])
            self.cache[s] = (kc_, vc_)
            n, total = len(rows), kc_.shape[0]
            rep = self.heads // self.kv_heads
            kk, vv = kc_.repeat_interleave(rep, 1), vc_.repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", q[rows], kk) / self.hd ** 0.5
            mask = torch.arange(total)[None] > (total - n + torch.arange(n))[:, None]
            scores = scores.masked_fill(mask.to(scores.device)[None], float("-inf"))
            out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
        return out


class SelfAttn(nn.Module):
    def __init__(self, hf, cfg):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=False)
        self.qkv_proj.weight.data = torch.cat([hf.q_proj.weight, hf.k_proj.weight, hf.v_proj.weight])
        self.o_proj = hf.o_proj
        self.q_norm = RMSNorm(hf.q_norm.weight, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hf.k_norm.weight, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions, h):
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(h).split([q_size, kv_size, kv_size], -1)
        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(o.flatten(1, -1))


class SiluAndMul(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, -1)
        return F.silu(a) * b


class MLP(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.gate_up_proj = nn.Linear(hf.gate_proj.in_features, 2 * hf.gate_proj.out_features, bias=False)
        self.gate_up_proj.weight.data = torch.cat([hf.gate_proj.weight, hf.up_proj.weight])
        self.down_proj, self.act_fn = hf.down_proj, SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Layer(nn.Module):
    def __init__(self, hf, cfg, rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(hf.input_layernorm.weight, cfg.rms_norm_eps)
        self.self_attn = SelfAttn(hf.self_attn, cfg)
        self.self_attn.rotary_emb = rotary  # one instance shared by every layer, as nano-vllm does
        self.post_attention_layernorm = RMSNorm(hf.post_attention_layernorm.weight, cfg.rms_norm_eps)
        self.mlp = MLP(hf.mlp)

    def forward(self, positions, h, residual):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Model(nn.Module):
    def __init__(self, hf):
        super().__init__()
        cfg = hf.config
        rotary = Rotary(hf.model.rotary_emb.inv_freq.float())
        self.embed_tokens = hf.model.embed_tokens
        self.layers = nn.ModuleList([Layer(l, cfg, rotary) for l in hf.model.layers])
        self.norm = RMSNorm(hf.model.norm.weight, cfg.rms_norm_eps)

    def forward(self, input_ids, positions):
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h, _ = self.norm(h, residual)
        return h


class ForCausalLM(nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.model, self.lm_head = Model(hf), hf.lm_head

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, h):
        if _CTX.is_prefill:
            h = h[_CTX.cu_seqlens_q[1:] - 1]
        return self.lm_head(h)


def main():
    kvdiff, model_dir = sys.argv[1], sys.argv[2]
    torch.backends.cuda.matmul.allow_tf32 = False
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    m = ForCausalLM(hf).to("cuda").eval()
    convs = [[{"role": "user", "content": "Hugo's pet is parrot. What is Hugo's pet?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a city."}]]
    prompts = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for c in convs]
    out = "/tmp/kvdiff-nano-dump"
    with torch.no_grad(), kc.capture(m, out, engine="nano-vllm-layout", model_name=os.path.abspath(model_dir)):
        # Packed prefill of both sequences, then one token per sequence per step.
        ids = torch.tensor(prompts[0] + prompts[1], device="cuda")
        pos = torch.tensor(list(range(len(prompts[0]))) + list(range(len(prompts[1]))), device="cuda")
        _CTX.is_prefill = True
        _CTX.cu_seqlens_q = torch.tensor([0, len(prompts[0]), len(prompts[0]) + len(prompts[1])], device="cuda")
        _CTX.seq_of_token = [0] * len(prompts[0]) + [1] * len(prompts[1])
        nxt = m.compute_logits(m(ids, pos)).argmax(-1)
        _CTX.is_prefill, _CTX.seq_of_token = False, [0, 1]
        lens = [len(p) for p in prompts]
        for step in range(8):
            pos = torch.tensor([lens[0] + step, lens[1] + step], device="cuda")
            nxt = m.compute_logits(m(nxt, pos)).argmax(-1)
    print(sorted(os.listdir(out))[:4], "...")
    ok = True
    for seq in ("0", "1"):
        r = subprocess.run([kvdiff, "diff", "--seq", seq, "--json", f"{out}-{seq}.json", out],
                           capture_output=True, text=True)
        report = json.load(open(f"{out}-{seq}.json")) if r.returncode in (0, 1) else None
        engine = report["engine"] if report else {}
        verdict = [x for x in r.stdout.splitlines() if x.startswith("==")] or [r.stderr.strip()]
        print(f"nano-vllm layout, sequence {seq}: exit {r.returncode}; {verdict[0]}")
        print(f"  compared {len(engine.get('compared', []))} taps; not provided: {engine.get('not_provided', [])[:3]}...")
        ok &= r.returncode == 0
    sys.exit(0 if ok else 1)


main()
