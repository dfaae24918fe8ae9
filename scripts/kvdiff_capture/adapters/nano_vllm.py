"""nano-vllm (and its forks): hooks on its Qwen3 layout, rows placed by the engine's own
bookkeeping.

nano-vllm runs flattened `[tokens, hidden]` batches of several sequences, with merged
`qkv_proj`/`gate_up_proj`, RMSNorm fused with the residual add (`norm(x, residual) ->
(normed, x + residual)`), `attn(q, k, v)` after RoPE and logits from `compute_logits` (the last
token of each sequence in a prefill).

Each row's position comes from what the engine knows about its sequences, never from the
position ids it fed RoPE (those are recorded as `rope_positions`, and the report names a
difference): with the model runner at hand (capture the `LLM`, its engine or its
`model_runner`), from the sequences the scheduler handed `run(seqs, is_prefill)`: their ids,
cached-token counts, lengths and prompt lengths, so joins, finishes, preemption with a new
prefill and chunked prefill beside other sequences' decodes land in the right sequence and
position. With the model alone, from the attention context: a prefill piece starts at
`cu_seqlens_k - cu_seqlens_q` (its cached tokens), a decode row sits at `context_lens - 1`, and a
sequence is its slot in the batch (which moves when a sequence finishes: capture the runner).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..writer import Capture
from .hooks import Hooks


def runner_and_model(obj: Any) -> Tuple[Optional[Any], Any]:
    """(model runner or None, model) of an `LLM`/`LLMEngine`, a `ModelRunner` or a bare model."""
    runner = getattr(obj, "model_runner", None)
    if runner is None and hasattr(obj, "run") and hasattr(obj, "model") and hasattr(obj, "prepare_prefill"):
        runner = obj
    return runner, (runner.model if runner is not None else obj)


def _ints(t: Any) -> List[int]:
    return [int(x) for x in (t.tolist() if hasattr(t, "tolist") else t)]


def _context() -> Any:
    try:
        from nanovllm.utils.context import get_context
        return get_context()
    except ImportError:
        return None


def batch_of(seqs: Any, is_prefill: bool) -> Tuple[List[Tuple[int, int, int, int]], Dict[int, List[int]]]:
    """The scheduler's sequences of a `run` call as the capture keeps them: (id, cached tokens,
    length, prompt length) each, and the tokens a prefill found in the prefix cache, by id."""
    rows = [(int(s.seq_id), int(s.num_cached_tokens), len(s),
             int(getattr(s, "num_prompt_tokens", len(s)))) for s in seqs]
    cached = {int(s.seq_id): list(s.token_ids[:s.num_cached_tokens])
              for s in seqs if is_prefill and s.num_cached_tokens > 0}
    return rows, cached


class _Batch:
    """The sequences of the `run` call in flight: (id, cached tokens, length, prompt length)."""

    def __init__(self) -> None:
        self.seqs: Optional[List[Tuple[int, int, int, int]]] = None
        self.is_prefill = False
        # Each sequence's tokens the engine found in its prefix cache, by sequence id.
        self.cached: Dict[int, List[int]] = {}


def rows_from_sequences(seqs: List[Tuple[int, int, int, int]], is_prefill: bool,
                        cu_seqlens_q: Optional[List[int]]) -> Tuple[List[int], List[int], Dict[int, int], List[int]]:
    """(positions, sequence ids, prompt lengths, sequences computed again) of a batch, from the
    scheduler's sequences. A prefill piece starts at the sequence's cached tokens and holds as
    many rows as `cu_seqlens_q` gives it (all its uncached tokens without it); a decode row is
    the sequence's last token. A prefill of a sequence that already decoded (preempted, then
    prefilled anew) recomputes rows written before."""
    positions: List[int] = []
    ids: List[int] = []
    for i, (sid, cached, length, _plen) in enumerate(seqs):
        if is_prefill:
            n = cu_seqlens_q[i + 1] - cu_seqlens_q[i] if cu_seqlens_q else length - cached
            positions.extend(range(cached, cached + n))
            ids.extend([sid] * n)
        else:
            positions.append(length - 1)
            ids.append(sid)
    prompt_lens = {sid: plen for sid, _c, _l, plen in seqs}
    again = [sid for sid, _c, length, plen in seqs if is_prefill and length > plen]
    return positions, ids, prompt_lens, again


def rows_from_context(n: int, ctx: Any) -> Tuple[Optional[List[int]], Optional[List[int]]]:
    """(positions, slot ids) of a batch from the attention context alone; None for what the
    context does not tell (the capture then numbers rows in the order they are fed)."""
    if ctx is None:
        return None, None
    if ctx.is_prefill:
        cu_q, cu_k = getattr(ctx, "cu_seqlens_q", None), getattr(ctx, "cu_seqlens_k", None)
        if cu_q is None:
            return None, None
        q = _ints(cu_q)
        ids = [i for i in range(len(q) - 1) for _ in range(q[i + 1] - q[i])]
        if len(ids) != n:
            return None, None
        if cu_k is None:
            return None, ids
        k = _ints(cu_k)
        positions = [p for i in range(len(q) - 1)
                     for p in range(k[i + 1] - k[i] - (q[i + 1] - q[i]), k[i + 1] - k[i])]
        return positions, ids
    lens = getattr(ctx, "context_lens", None)
    if lens is None:
        return None, (list(range(n)) if n > 1 else None)
    lens = _ints(lens)[:n]
    if len(lens) != n:
        return None, None
    return [x - 1 for x in lens], list(range(n))


def nano_vllm_adapter(cap: Capture, target: Any, worker: bool = False) -> Hooks:
    """Hooks nano-vllm's model; with its runner, also `run` for the scheduler's sequences.
    Decode steps must run eagerly (`enforce_eager=True`): hooks do not fire inside CUDA graphs.
    Under tensor parallelism each rank writes its own files with its heads; kvdiff joins them.
    Given rank 0's runner of an engine with `tensor_parallel_size` > 1, the workers the engine
    spawned are hooked too (`nano_vllm_workers.py`); `worker` is set in those."""
    h = Hooks()
    runner, model = runner_and_model(target)
    if runner is not None and not getattr(runner, "enforce_eager", True):
        raise ValueError("nano-vllm replays decode steps as CUDA graphs, where hooks do not fire: "
                         "build the LLM with enforce_eager=True to capture it")
    spawned = (runner is not None and not worker and int(getattr(runner, "world_size", 1)) > 1
               and int(getattr(runner, "rank", 0)) == 0)
    if spawned:
        from .nano_vllm_workers import start_workers
        start_workers(cap, runner, h.undo)
    inner = model.model
    add = h.handles.append
    batch = _Batch()
    cap.hooked = True
    cap.expected = ["embed", *(f"L{i}.resid_in" for i in range(len(inner.layers))), "final_norm"]

    if runner is not None:
        original_run = runner.run

        def run(seqs: Any, is_prefill: bool, *args: Any, **kwargs: Any) -> Any:
            from .nano_vllm_workers import RunInfo
            info = args[-1] if args and isinstance(args[-1], RunInfo) else None
            if info is not None:
                # Rank 0's batch, sent with the call: a worker's copies of the sequences carry
                # no ids, and a decode step's carry only their last token.
                args = args[:-1]
                batch.seqs, batch.cached = info.seqs, info.cached
            else:
                batch.seqs, batch.cached = batch_of(seqs, bool(is_prefill))
            batch.is_prefill = bool(is_prefill)
            try:
                return original_run(seqs, is_prefill, *args, **kwargs)
            finally:
                batch.seqs = None
        runner.run = run
        h.undo.append(lambda: setattr(runner, "run", original_run))

    def pre(_m: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        fed = kwargs.get("positions", args[1] if len(args) > 1 else None)
        n = ids.shape[0]
        ctx = _context()
        positions: Optional[List[int]] = None
        seq: Optional[List[int]] = None
        prompt_lens: Optional[Dict[int, int]] = None
        again: List[int] = []
        if batch.seqs is not None:
            cu = _ints(ctx.cu_seqlens_q) if ctx is not None and getattr(ctx, "cu_seqlens_q", None) is not None else None
            positions, seq, prompt_lens, again = rows_from_sequences(batch.seqs, batch.is_prefill, cu)
            if len(positions) != n:
                positions = seq = prompt_lens = None
                again = []
            else:
                for sid, tokens in batch.cached.items():
                    cap.cached_prefix(sid, tokens)
        if positions is None:
            positions, seq = rows_from_context(n, ctx)
        cap.begin(ids, positions=positions, rope_positions=fed, seq=seq, prompt_len=prompt_lens,
                  recompute=again)

    add(inner.register_forward_pre_hook(pre, with_kwargs=True))

    def logits_done(out: Any) -> None:
        # compute_logits keeps the last token of each sequence in a prefill.
        pos, seqs = cap.positions(), cap.sequences()
        last: Dict[int, int] = {}
        for p, s in zip(pos, seqs):
            last[s] = max(last.get(s, -1), p)
        order = list(dict.fromkeys(seqs))
        if out is not None and out.shape[0] == len(pos):
            cap.tap("logits", out)
        elif out is not None and out.shape[0] == len(order):
            cap.tap("logits", out, positions=[last[s] for s in order], seq=order)
        cap.end()

    if hasattr(model, "compute_logits"):
        original_logits = model.compute_logits

        def compute_logits(hidden: Any, *a: Any, **k: Any) -> Any:
            out = original_logits(hidden, *a, **k)
            logits_done(out)
            return out
        model.compute_logits = compute_logits
        h.undo.append(lambda: setattr(model, "compute_logits", original_logits))
    else:
        add(inner.register_forward_hook(lambda m, a, o: cap.end()))

    def summed(name: str) -> Any:
        def hook(_m: Any, args: Any, kwargs: Any) -> None:
            x = args[0] if args else kwargs.get("x")
            res = args[1] if len(args) > 1 else kwargs.get("residual")
            cap.tap(name, x if res is None else x + res)
        return hook

    def normed(name: str) -> Any:
        def hook(_m: Any, _inp: Any, out: Any) -> None:
            cap.tap(name, out[0] if isinstance(out, tuple) else out)
        return hook

    def heads_of(name: str) -> Any:
        def hook(_m: Any, _inp: Any, o: Any) -> None:
            cap.tap(name, o.reshape(o.shape[0], -1, o.shape[-1]))
        return hook

    add(inner.embed_tokens.register_forward_hook(lambda m, i, o: cap.tap("embed", o)))
    for i, layer in enumerate(inner.layers):
        a = layer.self_attn
        heads, kv_heads, hd = a.num_heads, a.num_kv_heads, a.head_dim
        add(layer.input_layernorm.register_forward_pre_hook(summed(f"L{i}.resid_in"), with_kwargs=True))
        add(layer.input_layernorm.register_forward_hook(normed(f"L{i}.attn_norm")))
        add(a.q_norm.register_forward_hook(heads_of(f"L{i}.q")))
        add(a.k_norm.register_forward_hook(heads_of(f"L{i}.k")))

        def qkv(_m: Any, _inp: Any, out: Any, i: int = i, heads: int = heads, kv_heads: int = kv_heads, hd: int = hd) -> None:
            v = out[:, (heads + kv_heads) * hd:]
            cap.tap(f"L{i}.v", v.reshape(v.shape[0], kv_heads, hd))
        add(a.qkv_proj.register_forward_hook(qkv))

        def attn_in(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
            q = args[0] if args else kwargs["q"]
            k = args[1] if len(args) > 1 else kwargs["k"]
            cap.tap(f"L{i}.q_rope", q.reshape(q.shape[0], -1, q.shape[-1]))
            cap.tap(f"L{i}.k_rope", k.reshape(k.shape[0], -1, k.shape[-1]))
        add(a.attn.register_forward_pre_hook(attn_in, with_kwargs=True))
        add(a.o_proj.register_forward_pre_hook(
            lambda m, args, kw, i=i: cap.tap(f"L{i}.attn_out", args[0] if args else kw["x"]), with_kwargs=True))
        add(a.o_proj.register_forward_hook(lambda m, i_, o, i=i: cap.tap(f"L{i}.o_proj", o)))
        add(layer.post_attention_layernorm.register_forward_pre_hook(summed(f"L{i}.resid_mid"), with_kwargs=True))
        add(layer.post_attention_layernorm.register_forward_hook(normed(f"L{i}.mlp_norm")))
        add(layer.mlp.register_forward_hook(lambda m, i_, o, i=i: cap.tap(f"L{i}.mlp_out", o)))

        def resid_out(_m: Any, _inp: Any, out: Any, i: int = i) -> None:
            hs, res = out if isinstance(out, tuple) else (out, None)
            cap.tap(f"L{i}.resid_out", hs if res is None else hs + res)
        add(layer.register_forward_hook(resid_out))
    add(inner.norm.register_forward_hook(normed("final_norm")))
    return h
