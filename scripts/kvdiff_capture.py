"""kvdiff_capture: an engine's tensors written as a kvdiff dump, for `kvdiff diff`.

Writes the dump format kvdiff reads (format "kvdiff-dump", version 1; docs/dump-format.md
is the spec): one safetensors file per forward call, tensors named by kvdiff's
taps (`embed`, `L{i}.q_rope`, `logits`, ...), rows `[token, ...]` matched by position, and a
`meta.json`. Needs torch and safetensors for torch tensors; plain Python lists need neither.

Hugging Face transformers (Qwen3; eager attention for `attn_probs`):

    import kvdiff_capture as kc
    with kc.capture(model, "dump/"):
        out = model(input_ids, past_key_values=cache, use_cache=True)   # any forward calls
    # then: kvdiff diff dump/      (kvdiff's own reference on the same tokens)

nano-vllm layouts (merged `qkv_proj`/`gate_up_proj`, packed batches, `positions`) are hooked the
same way: `kc.capture(llm.model_runner.model, "dump/", engine="nano-vllm")`.

Any other engine: one call per tensor, anywhere in its code:

    with kc.capture(None, "dump/", engine="my-engine", dtype="bfloat16") as cap:
        cap.begin(tokens, positions)          # one forward call: its tokens and their positions
        kc.tap("L0.q_rope", q)                # [tokens, heads, head_dim], rows as in begin()
        cap.end()

Positions are each row's place in its sequence (what kvdiff matches rows by); the position ids
the engine fed RoPE go to `rope_positions` when they differ, and the report names them. By
default a capture numbers tokens in the order they are fed (a chunk fed with the wrong position
ids or without the cache keeps its true place). Step 0 is the prompt (the first `prompt_len`
positions; by default the first call's), then one step per decoded token.
"""

import fnmatch
import json
import os
import shutil
import struct
import sys
from array import array
from contextlib import contextmanager

FORMAT = "kvdiff-dump"
VERSION = 1

_active = None


def tap(name, tensor, positions=None, seq=None):
    """Adds `tensor` (rows = the current call's tokens, or `positions`) to the active capture."""
    if _active is not None:
        _active.tap(name, tensor, positions=positions, seq=seq)


def _is_torch(x):
    return type(x).__module__.startswith("torch")


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
              "int64": "I64", "int32": "I32"}


def _flatten(x):
    """A nested list as (shape, flat values)."""
    if not isinstance(x, (list, tuple)):
        return [], [x]
    if not x:
        return [0], []
    shapes, flat = None, []
    for item in x:
        s, f = _flatten(item)
        if shapes is not None and s != shapes:
            raise ValueError("ragged nested list")
        shapes = s
        flat.extend(f)
    return [len(x)] + shapes, flat


def _save_plain(path, tensors, metadata):
    """safetensors written by hand: tensors are (dtype, shape, flat list)."""
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, (dtype, shape, flat) in tensors.items():
        code = {"F32": "f", "F64": "d", "I64": "q", "I32": "i"}[dtype]
        blob = array(code, flat)
        if sys.byteorder != "little":
            blob.byteswap()
        blob = blob.tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


class Capture:
    """A dump being written: forward calls (`begin` ... `tap` ... `end`) and `close`.

    Files go to `out_dir` + ".partial" and are moved into place by `close()`; a run that fails
    leaves nothing half-written under `out_dir`.
    """

    def __init__(self, out_dir, engine="engine", dtype=None, model=None, prompt_len=None,
                 taps="*", tp_rank=None, tp_size=None, overwrite=False):
        self.out_dir = os.fspath(out_dir)
        if os.path.exists(self.out_dir) and not overwrite:
            raise FileExistsError(f"{self.out_dir} exists: choose another folder or pass overwrite=True")
        self.partial = self.out_dir + ".partial"
        shutil.rmtree(self.partial, ignore_errors=True)
        os.makedirs(self.partial)
        self.engine, self.dtype, self.model = engine, dtype, model
        # Every sequence's prompt length when given; else learned per sequence from its calls.
        self.fixed_prompt_len = prompt_len
        self.prompt_len, self.prompt_growing = {}, {}
        self.patterns = [p.strip() for p in taps.split(",") if p.strip()] if isinstance(taps, str) else list(taps)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.calls = 0
        self.next_index = {}
        self.current = None
        self.layer = None  # set by adapters: the layer a shared module is running for

    def wants(self, name):
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def begin(self, tokens, positions=None, rope_positions=None, seq=None):
        """Starts one forward call: its token ids, each row's position in its sequence (default:
        continuing where the sequence's last call ended), the position ids RoPE got (if they
        differ), and each row's sequence id (batched engines)."""
        tokens = self._ints(tokens)
        seq = self._ints(seq) if seq is not None else [0] * len(tokens)
        if positions is None:
            positions = []
            for s in seq:
                i = self.next_index.get(s, 0)
                positions.append(i)
                self.next_index[s] = i + 1
        else:
            positions = self._ints(positions)
            for s, p in zip(seq, positions):
                self.next_index[s] = max(self.next_index.get(s, 0), p + 1)
        if len(positions) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {len(positions)} positions")
        self.current = {"tokens": tokens, "positions": positions, "seq": seq, "tensors": {}}
        if rope_positions is not None:
            self.current["rope_positions"] = self._ints(rope_positions)

    def positions(self):
        return self.current["positions"] if self.current else []

    def tap(self, name, tensor, positions=None, seq=None):
        if self.current is None or not self.wants(name):
            return
        t = self.current["tensors"]
        if _is_torch(tensor):
            tensor = tensor.detach()
            if tensor.dtype.is_floating_point and tensor.dtype not in _TORCH_KEEP():
                tensor = tensor.float()
            # A copy: engines reuse and modify buffers in place after the hook returns.
            tensor = tensor.to("cpu", copy=True).contiguous()
        t[name] = tensor
        if positions is not None:
            t[name + ".positions"] = self._ints(positions)
            if seq is not None:
                t[name + ".seq"] = self._ints(seq)

    def end(self):
        """Writes the call: one file per sequence in it, each at that sequence's step (step 0
        holds its prompt's positions, step k its k-th decoded token)."""
        c, self.current = self.current, None
        if c is None or not c["tokens"]:
            return
        for s in sorted(set(c["seq"])):
            self._write_seq(c, s)
        self.calls += 1

    def _write_seq(self, c, s):
        rows = [i for i, q in enumerate(c["seq"]) if q == s]
        pos = [c["positions"][i] for i in rows]
        lo, hi = min(pos), max(pos)
        plen = self.fixed_prompt_len or self.prompt_len.get(s)
        if self.fixed_prompt_len is None:
            if plen is None or (self.prompt_growing.get(s, True) and len(rows) > 1):
                # Calls of several tokens before the sequence's first one-token call are its
                # prompt's pieces (a chunked prefill); pass prompt_len when a piece is one token.
                plen = self.prompt_len[s] = max(plen or 0, hi + 1)
            if len(rows) == 1:
                self.prompt_growing[s] = False
        step = 0 if hi < plen else lo - plen + 1
        meta = {"step": str(step)}
        rank = f".rank-{self.tp_rank}" if self.tp_rank is not None else ""
        if self.tp_size is not None:
            meta.update(tp_rank=str(self.tp_rank or 0), tp_size=str(self.tp_size))
        name = f"step-{step:04d}.call-{self.calls:05d}.seq-{s}{rank}.safetensors"
        batched = len(set(c["seq"])) > 1 or s != 0
        every = len(c["tokens"])
        tensors = {"tokens": [c["tokens"][i] for i in rows], "positions": pos}
        if batched:
            tensors["seq"] = [s] * len(rows)
        if "rope_positions" in c:
            tensors["rope_positions"] = [c["rope_positions"][i] for i in rows]
        for k, v in c["tensors"].items():
            if k.endswith((".positions", ".seq")):
                continue
            own_pos, own_seq = c["tensors"].get(k + ".positions"), c["tensors"].get(k + ".seq")
            if own_pos is not None:
                seqs = own_seq if own_seq is not None else [c["seq"][0]] * len(own_pos)
                keep = [i for i, q in enumerate(seqs) if q == s]
                if not keep:
                    continue
                tensors[k + ".positions"] = [own_pos[i] for i in keep]
                if batched:
                    tensors[k + ".seq"] = [s] * len(keep)
            else:
                n = v.shape[0] if _is_torch(v) else len(v)
                if n != every:
                    raise ValueError(f"{k} has {n} rows, the call {every} tokens: pass positions=")
                keep = rows
            tensors[k] = _take(v, keep)
        path = os.path.join(self.partial, name)
        if any(_is_torch(v) for v in tensors.values()):
            import torch
            from safetensors.torch import save_file
            out = {k: (v if _is_torch(v) else torch.tensor(v, dtype=torch.int64)) for k, v in tensors.items()}
            save_file(out, path, metadata=meta)
        else:
            plain = {}
            for k, v in tensors.items():
                shape, flat = _flatten(v)
                is_int = k in ("tokens", "positions", "seq", "rope_positions") or k.endswith((".positions", ".seq"))
                plain[k] = ("I64" if is_int else "F32", shape, flat)
            _save_plain(path, plain, meta)

    def close(self, ok=True):
        if not ok:
            shutil.rmtree(self.partial, ignore_errors=True)
            return
        meta = {"format": FORMAT, "version": VERSION, "engine": self.engine,
                "dtype": self.dtype or "float32"}
        if self.model is not None:
            meta["model"] = self.model
        with open(os.path.join(self.partial, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        shutil.rmtree(self.out_dir, ignore_errors=True)
        os.replace(self.partial, self.out_dir)

    @staticmethod
    def _ints(x):
        if _is_torch(x):
            return [int(v) for v in x.detach().reshape(-1).tolist()]
        return [int(v) for v in x]


def _take(v, rows):
    """Rows `rows` of a torch tensor or a list."""
    if _is_torch(v):
        import torch
        if rows == list(range(v.shape[0])):
            return v
        return v.index_select(0, torch.tensor(rows, dtype=torch.long)).contiguous()
    return [v[i] for i in rows]


def _TORCH_KEEP():
    import torch
    return (torch.float32, torch.bfloat16, torch.float16)


def _dtype_name(model):
    try:
        return str(next(model.parameters()).dtype).replace("torch.", "")
    except Exception:
        return None


def _model_name(model):
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_name_or_path", None) or getattr(cfg, "model", None)


@contextmanager
def capture(model, out_dir, engine=None, taps="*", prompt_len=None, dtype=None, overwrite=True,
            adapter=None, model_name=None):
    """Hooks `model` (Hugging Face Qwen3, or a nano-vllm layout; None: only `tap()` calls) and
    writes every forward call under it to `out_dir`, a kvdiff dump. Yields the Capture."""
    global _active
    tp_rank = tp_size = None
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            tp_rank, tp_size = dist.get_rank(), dist.get_world_size()
            out_dir = os.fspath(out_dir)
    except ImportError:
        pass
    kind = adapter or (_detect(model) if model is not None else None)
    cap = Capture(out_dir, engine=engine or kind or "engine", dtype=dtype or (_dtype_name(model) if model is not None else None),
                  model=model_name or (_model_name(model) if model is not None else None), prompt_len=prompt_len,
                  taps=taps, tp_rank=tp_rank, tp_size=tp_size, overwrite=overwrite)
    hooks = ADAPTERS[kind](cap, model) if kind else None
    _active, ok = cap, False
    try:
        yield cap
        ok = True
    finally:
        _active = None
        if hooks is not None:
            hooks.remove()
        cap.close(ok)


def _detect(model):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("no model.model.layers: pass adapter=..., or model=None and call tap()")
    attn = layers[0].self_attn
    if hasattr(attn, "qkv_proj"):
        return "nano-vllm"
    if hasattr(attn, "q_proj"):
        return "hf-transformers"
    raise ValueError("unknown attention layout: register an adapter in kvdiff_capture.ADAPTERS")


class _Hooks:
    def __init__(self):
        self.handles, self.undo = [], []

    def remove(self):
        for h in self.handles:
            h.remove()
        for u in reversed(self.undo):
            u()


def _rows(x, heads=None):
    """[batch, seq, ...] -> [batch*seq, ...]; with heads, the last axis split into heads."""
    x = x.reshape(-1, *x.shape[2:])
    if heads is not None:
        x = x.reshape(x.shape[0], heads, -1)
    return x


def hf_adapter(cap, model):
    """Hugging Face transformers Qwen3, Qwen3-MoE, Qwen2, Llama and Mistral: every tap kvdiff
    names (`q`/`k` after q_norm/k_norm where the family has them, else the projections with their
    bias; `router_logits` and `experts` on sparse layers); `attn_probs` only under eager attention
    (sdpa/flash return none: the report lists them as not provided)."""
    import torch
    h = _Hooks()
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


def nano_vllm_adapter(cap, model):
    """nano-vllm's Qwen3ForCausalLM layout: flattened `[tokens, hidden]` batches with a
    `positions` argument, merged `qkv_proj` and `gate_up_proj`, RMSNorm fused with the
    residual add (`norm(x, residual) -> (normed, x + residual)`), `attn(q, k, v)` after RoPE,
    logits from `compute_logits` (the last token of each sequence in a prefill). Sequences of a
    packed batch are told apart by `cu_seqlens_q` of nano-vllm's context (prefill) or one token
    each (decode): `seq` is the index in the batch. Under tensor parallelism each rank writes its
    own files (tp_rank, tp_size) with its heads; kvdiff joins them. Run with enforce_eager=True:
    hooks do not fire inside CUDA graphs.
    """
    h = _Hooks()
    inner = model.model
    add = h.handles.append

    def context():
        try:
            from nanovllm.utils.context import get_context
            return get_context()
        except ImportError:
            return None

    def pre(_m, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        ctx = context()
        n = ids.shape[0]
        seq = None
        if ctx is not None and getattr(ctx, "cu_seqlens_q", None) is not None and ctx.is_prefill:
            cu = [int(x) for x in ctx.cu_seqlens_q.tolist()]
            seq = [i for i in range(len(cu) - 1) for _ in range(cu[i + 1] - cu[i])]
        elif n > 1 and ctx is not None and not ctx.is_prefill:
            seq = list(range(n))
        cap.begin(ids, positions=positions, seq=seq)
        cap._seq = seq or [0] * n

    add(inner.register_forward_pre_hook(pre, with_kwargs=True))

    def logits_hook(_m, args, out):
        # compute_logits(hidden) keeps the last token of each sequence in a prefill.
        pos, seq = cap.positions(), cap._seq
        last = {}
        for p, s in zip(pos, seq):
            last[s] = max(last.get(s, -1), p)
        rows = [last[s] for s in sorted(last)]
        if out is not None and out.shape[0] == len(pos):
            cap.tap("logits", out)
        elif out is not None:
            cap.tap("logits", out, positions=rows, seq=sorted(last))
        cap.end()

    if hasattr(model, "compute_logits"):
        original = model.compute_logits

        def compute_logits(hidden, *a, **k):
            out = original(hidden, *a, **k)
            logits_hook(None, (hidden,), out)
            return out
        model.compute_logits = compute_logits
        h.undo.append(lambda: setattr(model, "compute_logits", original))
    else:
        add(inner.register_forward_hook(lambda m, a, o: cap.end()))

    def summed(name):
        def hook(_m, args, kwargs):
            x = args[0] if args else kwargs.get("x")
            res = args[1] if len(args) > 1 else kwargs.get("residual")
            cap.tap(name, x if res is None else x + res)
        return hook

    def normed(name):
        def hook(_m, _inp, out):
            cap.tap(name, out[0] if isinstance(out, tuple) else out)
        return hook

    add(inner.embed_tokens.register_forward_hook(lambda m, i, o: cap.tap("embed", o)))
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn
        heads, kv_heads, hd = a.num_heads, a.num_kv_heads, a.head_dim
        add(layer.input_layernorm.register_forward_pre_hook(summed(f"L{i}.resid_in"), with_kwargs=True))
        add(layer.input_layernorm.register_forward_hook(normed(f"L{i}.attn_norm")))
        add(a.q_norm.register_forward_hook(lambda m, i_, o, i=i: cap.tap(f"L{i}.q", o.reshape(o.shape[0], -1, o.shape[-1]))))
        add(a.k_norm.register_forward_hook(lambda m, i_, o, i=i: cap.tap(f"L{i}.k", o.reshape(o.shape[0], -1, o.shape[-1]))))

        def qkv(_m, _inp, out, i=i, heads=heads, kv_heads=kv_heads, hd=hd):
            v = out[:, (heads + kv_heads) * hd:]
            cap.tap(f"L{i}.v", v.reshape(v.shape[0], kv_heads, hd))
        add(a.qkv_proj.register_forward_hook(qkv))

        def attn_in(_m, args, kwargs, i=i):
            q = args[0] if args else kwargs["q"]
            k = args[1] if len(args) > 1 else kwargs["k"]
            cap.tap(f"L{i}.q_rope", q.reshape(q.shape[0], -1, q.shape[-1]))
            cap.tap(f"L{i}.k_rope", k.reshape(k.shape[0], -1, k.shape[-1]))
        add(a.attn.register_forward_pre_hook(attn_in, with_kwargs=True))
        add(a.o_proj.register_forward_pre_hook(lambda m, args, kw, i=i: cap.tap(f"L{i}.attn_out", args[0] if args else kw["x"]), with_kwargs=True))
        add(a.o_proj.register_forward_hook(lambda m, i_, o, i=i: cap.tap(f"L{i}.o_proj", o)))
        add(layer.post_attention_layernorm.register_forward_pre_hook(summed(f"L{i}.resid_mid"), with_kwargs=True))
        add(layer.post_attention_layernorm.register_forward_hook(normed(f"L{i}.mlp_norm")))
        add(layer.mlp.register_forward_hook(lambda m, i_, o, i=i: cap.tap(f"L{i}.mlp_out", o)))

        def resid_out(_m, _inp, out, i=i):
            hs, res = out if isinstance(out, tuple) else (out, None)
            cap.tap(f"L{i}.resid_out", hs if res is None else hs + res)
        add(layer.register_forward_hook(resid_out))
    add(inner.norm.register_forward_hook(normed("final_norm")))
    return h


# Adapters by name: a function (capture, model) -> object with remove(). Add one for another
# engine's module layout, and pass adapter="name" to capture().
ADAPTERS = {"hf-transformers": hf_adapter, "nano-vllm": nano_vllm_adapter}
