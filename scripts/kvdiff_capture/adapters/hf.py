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


def slot_positions(mask: Any, b: int, length: int) -> Any:
    """`[b, slots]`: each cache slot's position in its sequence (the real tokens before it), -1
    for padding; from a 2-D attention mask, or None without one (no padding)."""
    import torch
    if mask is None or getattr(mask, "dim", lambda: 0)() != 2 or mask.shape[0] != b or mask.shape[1] < length:
        return None
    m = mask.to(torch.long)
    return torch.where(m > 0, m.cumsum(-1) - 1, torch.full_like(m, -1))


def key_positions(slots: Any, b: int, q: int, kv: int, positions: Any) -> Any:
    """`[b*q, kv]`: each attention column's key position, -1 for padding and unused slots.

    A cache as long as the mask holds slot j in column j; a static cache's columns past the
    mask are unused; a sliding-window cache shorter than the mask holds its last `kv` slots."""
    import torch
    if slots is None:
        # No padding: slots are positions; the call's last row ends the keys.
        last = max(positions) + 1 if positions else kv
        slots = torch.arange(last).reshape(1, -1).expand(b, -1)
    length = slots.shape[1]
    start = max(length - kv, 0)
    cols = torch.arange(start, start + kv, device=slots.device)
    keys = torch.full((b, kv), -1, dtype=torch.long, device=slots.device)
    inside = cols < length
    keys[:, inside] = slots[:, cols[inside]]
    return keys.unsqueeze(1).expand(b, q, kv).reshape(b * q, kv)


def hf_adapter(cap: Capture, model: Any) -> Hooks:
    """Hugging Face transformers Qwen3, Qwen3-MoE, Qwen2, Llama and Mistral: every tap kvdiff
    names (`q`/`k` after q_norm/k_norm where the family has them, else the projections with their
    bias; `router_logits` and `experts` on sparse layers); `attn_probs` only under eager attention
    (sdpa/flash return none: the report lists them as not provided)."""
    import torch
    # Hooks and taps run as plain Python even inside a compiled forward: traced, their side
    # effects would cost a recompile per tap (and a CUDA graph would skip them).
    eager = getattr(getattr(torch, "compiler", None), "disable", lambda f: f)
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
        if cache_pos is None:
            start = past.get_seq_length() if past is not None else 0
            cache_pos = torch.arange(start, start + s, device=ids.device)
        if pos_ids is None:
            pos_ids = cache_pos.reshape(1, -1).expand(b, -1)
        seq = [i for i in range(b) for _ in range(s)] if b > 1 else None
        # The mask may run past this call (a chunked prefill hands the whole prompt's): its
        # slots end with the call's last row, where the keys end.
        ends = int(cache_pos.max()) + 1
        mask = kwargs.get("attention_mask")
        if mask is None or getattr(mask, "dim", lambda: 0)() != 2:
            # generate() hands a static or sliding-window cache's forward a 4-D mask built from
            # its 2-D one, which prepare_inputs_for_generation saw.
            mask = cap._mask2d
        slots = slot_positions(mask, b, ends)
        if slots is not None:
            slots = slots[:, :ends]
        real, positions = None, None
        if slots is not None:
            # Each row's place in its sequence counts the real tokens before it: left and right
            # padding, and a batch's different lengths, take no position.
            at = cache_pos.reshape(-1).to(slots.device)
            positions = slots[:, at]
            real = positions >= 0
            positions, real = positions.reshape(-1), real.reshape(-1)
        cap.begin(ids.reshape(-1), positions=positions, rope_positions=pos_ids.reshape(-1), seq=seq,
                  mask=real)
        cap._batch = (b, s)
        cap._slots = slots

    def post(_m, _args, _kwargs, out):
        logits = getattr(out, "logits", None)
        if logits is not None:
            b, s = cap._batch
            kept = logits.shape[1]
            pos = cap.positions()
            # The kept rows (the last of each batch row in a prefill); a padding row among them
            # (right padding) has no position and is dropped.
            rows = [pos[i * s + j] for i in range(b) for j in range(s - kept, s)]
            seq = [i for i in range(b) for _ in range(kept)] if b > 1 else None
            cap.tap("logits", _rows(logits), positions=rows if kept != s else None, seq=seq if kept != s else None)
        cap._mask2d = None
        cap.end()

    cap._mask2d = None
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is not None:
        def prepare_seen(*args, **kwargs):
            m = kwargs.get("attention_mask")
            cap._mask2d = m if m is not None and getattr(m, "dim", lambda: 0)() == 2 else None
            return prepare(*args, **kwargs)
        model.prepare_inputs_for_generation = prepare_seen
        h.undo.append(lambda: model.__dict__.pop("prepare_inputs_for_generation", None))
    cap.hooked = True
    cap.expected = ["embed", *(f"L{i}.resid_in" for i in range(len(inner.layers))), "final_norm"]
    # generate() compiles the forward of a static cache's decode steps into CUDA graphs, where
    # no hook runs: the capture runs them eagerly (the same kernels, uncompiled) and says so.
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "disable_compile") and not gen.disable_compile:
        gen.disable_compile = True
        h.undo.append(lambda: setattr(gen, "disable_compile", False))
    h.handles.append(model.register_forward_pre_hook(eager(pre), with_kwargs=True))
    h.handles.append(model.register_forward_hook(eager(post), with_kwargs=True))

    def out_hook(name, fn=lambda o: _rows(o)):
        def hook(_m, _inp, out):
            cap.tap(name, fn(out))
        return eager(hook)

    def in_hook(name):
        def hook(_m, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            cap.tap(name, _rows(x))
        return eager(hook)

    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    add = h.handles.append
    add(inner.embed_tokens.register_forward_hook(out_hook("embed")))
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn

        def set_layer(_m, _a, _k, i=i):
            cap.layer = i
        add(layer.register_forward_pre_hook(in_hook(f"L{i}.resid_in"), with_kwargs=True))
        add(a.register_forward_pre_hook(eager(set_layer), with_kwargs=True))
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
            add(router.register_forward_hook(eager(routed)))

        def probs(_m, _inp, out, i=i):
            w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if w is not None:
                rows = w.permute(0, 2, 1, 3).reshape(-1, w.shape[1], w.shape[3])
                keys = key_positions(cap._slots, w.shape[0], w.shape[2], w.shape[3], cap.positions())
                cap.tap(f"L{i}.attn_probs", rows, key_positions=keys)
        add(a.register_forward_hook(eager(probs)))
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

    @eager
    def rotated(qr, kr):
        if cap.layer is not None:
            cap.tap(f"L{cap.layer}.q_rope", qr.transpose(1, 2).reshape(-1, qr.shape[1], qr.shape[3]))
            cap.tap(f"L{cap.layer}.k_rope", kr.transpose(1, 2).reshape(-1, kr.shape[1], kr.shape[3]))

    def rotary(q, k, *args, **kwargs):
        qr, kr = original(q, k, *args, **kwargs)
        rotated(qr, kr)
        return qr, kr
    module.apply_rotary_pos_emb = rotary
    h.undo.append(lambda: setattr(module, "apply_rotary_pos_emb", original))
    return h
