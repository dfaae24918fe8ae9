"""kvdiff_capture: an engine's tensors written as a kvdiff dump, for `kvdiff diff`.

Writes the dump format kvdiff reads (format "kvdiff-dump", version 1; docs/dump-format.md is the
spec): one safetensors file per forward call, sequence and step, tensors named by kvdiff's taps
(`embed`, `L{i}.q_rope`, `logits`, ...), rows `[token, ...]` matched by position, and a
`meta.json`. torch and safetensors are needed only for torch tensors; plain lists need nothing.

Hugging Face transformers (any family kvdiff runs; eager attention for `attn_probs`)::

    import kvdiff_capture as kc
    with kc.capture(model, "dump/", prompt=messages):
        model.generate(...)                   # any forward calls
    # then: kvdiff diff dump/      (kvdiff's reference on the same tokens, the prompt checked)

nano-vllm: `kc.capture(llm, "dump/")` with the `LLM` built with `enforce_eager=True`; the
scheduler's sequences give each row its sequence and position. With `tensor_parallel_size` > 1
the workers the engine spawned are hooked too, through its own call channel; under torchrun each
rank opens the capture itself (docs/engine-debugging.md#tensor-parallel-engines).

Any other engine: one call per tensor, anywhere in its code::

    with kc.capture(None, "dump/", engine="my-engine", dtype="bfloat16") as cap:
        cap.begin(tokens, positions)          # one forward call: its tokens and their positions
        kc.tap("L0.q_rope", q)                # [tokens, heads, head_dim], rows as in begin()
        cap.end()
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, List, Optional, Union

from . import writer
from .adapters import ADAPTERS, Adapter, Hooks, detect, register_adapter
from .adapters.nano_vllm import runner_and_model
from .check import Divergence, KvdiffError, assert_equivalent, diff_command, prompt_ids
from .writer import FORMAT, VERSION, Capture, begin, end, tap

__version__ = "1.0.0"
"""The package's version; its major number is the dump format version it writes."""

__all__ = ["ADAPTERS", "Adapter", "Capture", "Divergence", "FORMAT", "Hooks", "KvdiffError",
           "VERSION", "__version__", "assert_equivalent", "begin", "capture", "detect",
           "diff_command", "end", "prompt_ids", "register_adapter", "tap"]


def _dtype_name(model: Any) -> Optional[str]:
    try:
        return str(next(model.parameters()).dtype).replace("torch.", "")
    except Exception:
        return None


def _model_name(model: Any) -> Optional[str]:
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", None) or getattr(cfg, "model", None)
    return name if isinstance(name, str) and name else None


def _barrier() -> None:
    import torch.distributed as dist
    dist.barrier()


def _all_ranks_ok(ok: bool, cap: Capture) -> bool:
    """Every rank's files written (each rank ran the block itself): rank 0 keeps the dump only if
    every rank got through its block, and says which did not."""
    import torch.distributed as dist
    if cap.joined:
        cap.close(ok)
    flags: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    failed = [r for r, f in enumerate(flags) if not f]
    if not cap.joined:
        cap.close(not failed)
        if failed and ok:
            raise RuntimeError(f"tensor-parallel ranks {failed} raised inside the capture block: "
                               f"no dump written to {cap.out_dir}")
    return not failed


@contextmanager
def capture(model: Any, out_dir: Union[str, os.PathLike], engine: Optional[str] = None,
            taps: Union[str, Iterable[str]] = "*", prompt_len: Optional[int] = None,
            dtype: Optional[str] = None, overwrite: bool = True, adapter: Optional[str] = None,
            model_name: Optional[str] = None, prompt: Any = None,
            kv_cache: Optional[str] = None) -> Iterator[Capture]:
    """Hooks `model` and writes every forward call under the block to `out_dir`, a kvdiff dump.

    model: an HF transformers model, a nano-vllm `LLM` (or its engine, runner or model), or None
        to write only what `tap()` calls and `Capture.begin`/`end` give.
    engine, dtype, model_name: meta.json's `engine`, `dtype` (how `kvdiff diff --tolerance auto`
        holds it) and `model` (the Hugging Face folder kvdiff loads); guessed from the model.
    taps: comma-separated globs of the taps to keep.
    prompt: the conversation the engine was asked to answer (a message list, `{"messages":
        [...]}` or a `.json` prompt file): `kvdiff diff` renders its chat template and names the
        first token where the engine's prompt parts from it.
    prompt_len: every sequence's prompt length, where the adapter cannot tell.
    kv_cache: the dtype the engine's KV cache stores K and V in, where it is narrower than the
        compute dtype (llama.cpp's default: "float16"): attention is held to that rounding.
    """
    tp_rank = tp_size = None
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            tp_rank, tp_size = dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    if adapter is not None and adapter not in ADAPTERS:
        raise ValueError(f"no adapter {adapter!r}: one of {sorted(ADAPTERS)}, or register_adapter()")
    kind = adapter or (detect(model) if model is not None else None)
    runner, inner = runner_and_model(model) if model is not None else (None, None)
    # nano-vllm's model has no config of its own: its runner's config names the folder.
    named = (_model_name(inner) if inner is not None else None) or _model_name(runner)
    # Ranks that each run this block themselves (torchrun) meet at its start and end, so that
    # rank 0 opens the folder first and renames it last. An engine whose rank 0 drives workers
    # it spawned (nano-vllm) is captured from rank 0 alone: its adapter hooks the workers.
    engine_workers = (kind == "nano-vllm" and runner is not None
                      and int(getattr(runner, "world_size", 1)) > 1)
    ranks_meet = tp_size is not None and not engine_workers
    if engine_workers:
        tp_rank, tp_size = 0, int(runner.world_size)
    joined = ranks_meet and tp_rank != 0
    if joined:
        _barrier()
    cap = Capture(out_dir, engine=engine or kind or "engine",
                  dtype=dtype or (_dtype_name(inner) if inner is not None else None),
                  model=model_name or named,
                  prompt_len=prompt_len, taps=taps, tp_rank=tp_rank, tp_size=tp_size,
                  overwrite=overwrite, prompt=prompt, kv_cache=kv_cache, joined=joined)
    if ranks_meet and not joined:
        _barrier()
    hooks: Optional[Any] = None
    ok = False
    try:
        hooks = ADAPTERS[kind](cap, model) if kind else None
        writer.set_active(cap)
        yield cap
        ok = True
    finally:
        writer.set_active(None)
        try:
            if hooks is not None:
                hooks.remove()
        finally:
            if ranks_meet:
                ok = _all_ranks_ok(ok, cap)
            else:
                cap.close(ok)
