"""A small inference engine of the kind kvdiff checks: a Qwen3 forward pass in numpy (f32), a KV
cache, prefill in chunks and greedy decoding, with kvdiff_capture's calls left in (they cost
nothing outside a capture). It is the engine of the engine-CI example (docs/engine-ci.md): its
test file holds every chunking to kvdiff's reference, and `bug` plants the faults that chunked
prefill is known for, as a later commit of a real engine would.

    engine = TinyEngine("fixtures/default-model")
    engine.generate(ids, cuts=[16, 30], max_new_tokens=4)   # prompt prefilled in 3 chunks
"""

import json
import os
import struct

import numpy as np

import kvdiff_capture as kc

BUGS = {
    None: "none",
    "positions-restart": "every chunk after the first is rotated at local positions 0..n",
    "late-chunk-positions": "a chunk starting at position 16 or later restarts its positions "
                            "(a page-aligned prefix cache path), earlier chunks are right",
    "isolated-chunks": "every chunk attends only to itself, never to the cached context",
}


def load_safetensors(path):
    """{name: f32 array} of a safetensors file (bf16, f16 or f32), read by hand."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        lo, hi = h["data_offsets"]
        raw = data[lo:hi]
        if h["dtype"] == "BF16":
            a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif h["dtype"] == "F16":
            a = np.frombuffer(raw, np.float16).astype(np.float32)
        elif h["dtype"] == "F32":
            a = np.frombuffer(raw, np.float32)
        else:
            raise ValueError(f"{path}: {name} is {h['dtype']}; this engine reads bf16, f16, f32")
        out[name] = a.reshape(h["shape"])
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


class TinyEngine:
    def __init__(self, model_dir, bug=None):
        if bug not in BUGS:
            raise ValueError(f"no bug {bug!r}: one of {sorted(b for b in BUGS if b)}")
        self.bug = bug
        self.model_dir = os.fspath(model_dir)
        with open(os.path.join(self.model_dir, "config.json")) as f:
            c = json.load(f)
        if c.get("model_type") != "qwen3":
            raise ValueError(f"{model_dir}: a {c.get('model_type')} model; this engine runs qwen3")
        self.layers = c["num_hidden_layers"]
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.eps = c["rms_norm_eps"]
        theta = (c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        self.w = load_safetensors(os.path.join(self.model_dir, "model.safetensors"))
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def rope(self, x, positions):
        ang = np.outer(np.asarray(positions, np.float64), self.inv_freq)
        cos = np.concatenate([np.cos(ang)] * 2, axis=-1).astype(np.float32)[:, None, :]
        sin = np.concatenate([np.sin(ang)] * 2, axis=-1).astype(np.float32)[:, None, :]
        half = self.head_dim // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def forward(self, ids, positions, cache, prompt_len, rope_positions=None, own_keys_only=False):
        """One forward call over `ids` at `positions`, appending their K/V to `cache` (per
        layer: keys, values, their positions); returns the logits of the last row."""
        rope_positions = positions if rope_positions is None else rope_positions
        # The capture learns the prompt's length from the engine: a one-token chunk is no
        # decode step.
        kc.begin(ids, positions=positions, rope_positions=rope_positions, prompt_len=prompt_len)
        w, p = self.w, "model.layers."
        x = w["model.embed_tokens.weight"][ids]
        kc.tap("embed", x)
        t, hd = len(ids), self.head_dim
        group = self.heads // self.kv_heads
        for i in range(self.layers):
            kc.tap(f"L{i}.resid_in", x)
            h = rms_norm(x, w[f"{p}{i}.input_layernorm.weight"], self.eps)
            kc.tap(f"L{i}.attn_norm", h)
            a = f"{p}{i}.self_attn."
            q = (h @ w[a + "q_proj.weight"].T).reshape(t, self.heads, hd)
            k = (h @ w[a + "k_proj.weight"].T).reshape(t, self.kv_heads, hd)
            v = (h @ w[a + "v_proj.weight"].T).reshape(t, self.kv_heads, hd)
            q = rms_norm(q, w[a + "q_norm.weight"], self.eps)
            k = rms_norm(k, w[a + "k_norm.weight"], self.eps)
            kc.tap(f"L{i}.q", q)
            kc.tap(f"L{i}.k", k)
            kc.tap(f"L{i}.v", v)
            q, k = self.rope(q, rope_positions), self.rope(k, rope_positions)
            kc.tap(f"L{i}.q_rope", q)
            kc.tap(f"L{i}.k_rope", k)
            past_k, past_v, past_pos = cache[i]
            if own_keys_only:
                past_k, past_v, past_pos = past_k[:0], past_v[:0], past_pos[:0]
            keys = np.concatenate([past_k, k])
            values = np.concatenate([past_v, v])
            key_pos = np.concatenate([past_pos, np.asarray(positions)])
            cache[i] = (np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v]),
                        np.concatenate([cache[i][2], np.asarray(positions)]))
            kh = np.repeat(keys, group, axis=1)            # [keys, heads, hd]
            vh = np.repeat(values, group, axis=1)
            scores = np.einsum("thd,khd->thk", q, kh) / np.sqrt(hd)
            causal = key_pos[None, None, :] <= np.asarray(positions)[:, None, None]
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            kc.tap(f"L{i}.attn_probs", probs, key_positions=np.broadcast_to(key_pos, (t, len(key_pos))))
            out = np.einsum("thk,khd->thd", probs, vh).reshape(t, self.heads * hd)
            kc.tap(f"L{i}.attn_out", out)
            o = out @ w[a + "o_proj.weight"].T
            kc.tap(f"L{i}.o_proj", o)
            x = x + o
            kc.tap(f"L{i}.resid_mid", x)
            h = rms_norm(x, w[f"{p}{i}.post_attention_layernorm.weight"], self.eps)
            kc.tap(f"L{i}.mlp_norm", h)
            m = f"{p}{i}.mlp."
            gate = h @ w[m + "gate_proj.weight"].T
            up = h @ w[m + "up_proj.weight"].T
            mlp = (gate / (1.0 + np.exp(-gate)) * up) @ w[m + "down_proj.weight"].T
            kc.tap(f"L{i}.mlp_out", mlp)
            x = x + mlp
            kc.tap(f"L{i}.resid_out", x)
        x = rms_norm(x, w["model.norm.weight"], self.eps)
        kc.tap("final_norm", x)
        logits = x @ self.lm_head.T
        kc.tap("logits", logits)
        kc.end()
        return logits[-1]

    def generate(self, ids, cuts=(), max_new_tokens=4):
        """Greedy decoding of `ids`, its prompt prefilled in chunks that start at each of `cuts`
        (token positions, ascending); returns the new tokens."""
        ids = [int(i) for i in ids]
        bounds = [0] + sorted(int(c) for c in cuts if 0 < int(c) < len(ids)) + [len(ids)]
        cache = [(np.zeros((0, self.kv_heads, self.head_dim), np.float32),) * 2
                 + (np.zeros(0, np.int64),) for _ in range(self.layers)]
        logits = None
        for n, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            positions = list(range(lo, hi))
            rope = positions
            if self.bug == "positions-restart" and n > 0:
                rope = list(range(hi - lo))
            if self.bug == "late-chunk-positions" and n > 0 and lo >= 16:
                rope = list(range(hi - lo))
            own = self.bug == "isolated-chunks" and n > 0
            logits = self.forward(ids[lo:hi], positions, cache, len(ids), rope_positions=rope,
                                  own_keys_only=own)
        new = [int(np.argmax(logits))]
        while len(new) < max_new_tokens:
            logits = self.forward([new[-1]], [len(ids) + len(new) - 1], cache, len(ids))
            new.append(int(np.argmax(logits)))
        return new
