"""Hugging Face transformers: hooks on the modules of Qwen3, Qwen3-MoE, Qwen2, Llama and Mistral
models, and the modeling module's `apply_rotary_pos_emb` wrapped for `q_rope`/`k_rope`."""

from __future__ import annotations

import sys
from typing import Any

from ..writer import Capture
from .hooks import Hooks


def _rows(x, heads=None):
    """[batch, seq, ...] -> [batch*seq, ...]; with heads, the last axis split into heads."""
    x = x.reshape(-1, *x.shape[2:])
    if heads is not None:
        x = x.reshape(x.shape[0], heads, -1)
    return x


def hf_adapter(cap: Capture, model: Any) -> Hooks:
    """Hugging Face transformers Qwen3, Qwen3-MoE, Qwen2, Llama and Mistral: every tap kvdiff
    names (`q`/`k` after q_norm/k_norm where the family has them, else the projections with their
    bias; `router_logits` and `experts` on sparse layers); `attn_probs` only under eager attention
    (sdpa/flash return none: the report lists them as not provided)."""
    import torch
    h = Hooks()
    inner = model.model
    cfg = model.config
    kv_heads = cfg.num_key_value_heads
    heads = cfg.num_attention_heads

    def pre(_m, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        b, s = ids.shape
        pos_ids, cache_pos = kwargs.get("position_ids"), kwargs.get("cache_position")
        past = kwargs.get("past_key_values")
        if pos_ids is None:
            if cache_pos is None:
                start = past.get_seq_length() if past is not None else 0
                cache_pos = torch.arange(start, start + s)
            pos_ids = cache_pos.reshape(1, -1).expand(b, -1)
        seq = [i for i in range(b) for _ in range(s)] if b > 1 else None
        cap.begin(ids.reshape(-1), rope_positions=pos_ids.reshape(-1), seq=seq)
        cap._batch = (b, s)

    def post(_m, _args, _kwargs, out):
        logits = getattr(out, "logits", None)
        if logits is not None:
            b, s = cap._batch
            kept = logits.shape[1]
            pos = cap.positions()
            rows = [pos[i * s + j] for i in range(b) for j in range(s - kept, s)]
            seq = [i for i in range(b) for _ in range(kept)] if b > 1 else None
            cap.tap("logits", _rows(logits), positions=rows if kept != s else None, seq=seq if kept != s else None)
        cap.end()

    h.handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
    h.handles.append(model.register_forward_hook(post, with_kwargs=True))

    def out_hook(name, fn=lambda o: _rows(o)):
        def hook(_m, _inp, out):
            cap.tap(name, fn(out))
        return hook

    def in_hook(name):
        def hook(_m, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            cap.tap(name, _rows(x))
        return hook

    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    b_of = lambda w: w.shape[0]  # noqa: E731
    add = h.handles.append
    add(inner.embed_tokens.register_forward_hook(out_hook("embed")))
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn

        def set_layer(_m, _a, _k, i=i):
            cap.layer = i
        add(layer.register_forward_pre_hook(in_hook(f"L{i}.resid_in"), with_kwargs=True))
        add(a.register_forward_pre_hook(set_layer, with_kwargs=True))
        add(layer.input_layernorm.register_forward_hook(out_hook(f"L{i}.attn_norm")))
        if getattr(a, "q_norm", None) is not None:
            add(a.q_norm.register_forward_hook(out_hook(f"L{i}.q")))
            add(a.k_norm.register_forward_hook(out_hook(f"L{i}.k")))
        else:
            add(a.q_proj.register_forward_hook(out_hook(f"L{i}.q", lambda o: _rows(o, heads))))
            add(a.k_proj.register_forward_hook(out_hook(f"L{i}.k", lambda o: _rows(o, kv_heads))))
        add(a.v_proj.register_forward_hook(out_hook(f"L{i}.v", lambda o: _rows(o, kv_heads))))
        router = getattr(layer.mlp, "gate", None)
        if router is not None and hasattr(layer.mlp, "experts"):
            # transformers 5's top-k router returns (logits, weights, chosen ids) per token.
            def routed(_m, _inp, out, i=i):
                logits, chosen = out[0], out[-1]
                cap.tap(f"L{i}.router_logits", logits.reshape(-1, logits.shape[-1]))
                cap.tap(f"L{i}.experts", chosen.reshape(-1, chosen.shape[-1]).float())
            add(router.register_forward_hook(routed))

        def probs(_m, _inp, out, i=i):
            w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if w is not None:
                # A sliding-window cache keeps only the last keys: its columns end at the
                # call's last position, so they are moved right to stand at their positions.
                pos = cap.positions()
                missing = (max(pos) + 1 - w.shape[-1]) if pos and b_of(w) == 1 else 0
                if missing > 0:
                    w = torch.nn.functional.pad(w, (missing, 0))
                cap.tap(f"L{i}.attn_probs", w.permute(0, 2, 1, 3).reshape(-1, w.shape[1], w.shape[3]))
        add(a.register_forward_hook(probs))
        add(a.o_proj.register_forward_pre_hook(in_hook(f"L{i}.attn_out"), with_kwargs=True))
        add(a.o_proj.register_forward_hook(out_hook(f"L{i}.o_proj")))
        add(layer.post_attention_layernorm.register_forward_pre_hook(in_hook(f"L{i}.resid_mid"), with_kwargs=True))
        add(layer.post_attention_layernorm.register_forward_hook(out_hook(f"L{i}.mlp_norm")))
        add(layer.mlp.register_forward_hook(out_hook(f"L{i}.mlp_out")))
        add(layer.register_forward_hook(out_hook(f"L{i}.resid_out", lambda o: _rows(first(o)))))
    add(inner.norm.register_forward_hook(out_hook("final_norm")))

    # q and k after RoPE: the modeling module's own function, wrapped while the capture runs.
    module = sys.modules[type(inner.layers[0].self_attn).__module__]
    original = module.apply_rotary_pos_emb

    def rotary(q, k, *args, **kwargs):
        qr, kr = original(q, k, *args, **kwargs)
        if cap.layer is not None:
            cap.tap(f"L{cap.layer}.q_rope", qr.transpose(1, 2).reshape(-1, qr.shape[1], qr.shape[3]))
            cap.tap(f"L{cap.layer}.k_rope", kr.transpose(1, 2).reshape(-1, kr.shape[1], kr.shape[3]))
        return qr, kr
    module.apply_rotary_pos_emb = rotary
    h.undo.append(lambda: setattr(module, "apply_rotary_pos_emb", original))
    return h
