"""The adapter registry: how `capture()` hooks a model it is handed.

An adapter is a function `(capture, model) -> object with remove()` that registers hooks calling
`capture.begin()`, `capture.tap()` and `capture.end()`; `register_adapter` adds one for another
engine's module layout, and `capture(..., adapter="name")` picks it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from ..writer import Capture
from .hf import hf_adapter
from .hooks import Hooks
from .nano_vllm import nano_vllm_adapter, runner_and_model

Adapter = Callable[[Capture, Any], Any]

ADAPTERS: Dict[str, Adapter] = {"hf-transformers": hf_adapter, "nano-vllm": nano_vllm_adapter}


def register_adapter(name: str, adapter: Adapter) -> None:
    """Makes `adapter` available as `capture(..., adapter=name)`."""
    if not callable(adapter):
        raise TypeError(f"adapter {name!r} must be callable: (capture, model) -> object with remove()")
    ADAPTERS[name] = adapter


def detect(target: Any) -> str:
    """The adapter for `target`: nano-vllm for merged `qkv_proj` attention (or an object holding a
    `model_runner`), HF transformers for separate `q_proj`."""
    _runner, model = runner_and_model(target)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("no model.model.layers: pass adapter=..., or model=None and call tap()")
    attn = layers[0].self_attn
    if hasattr(attn, "qkv_proj"):
        return "nano-vllm"
    if hasattr(attn, "q_proj"):
        return "hf-transformers"
    raise ValueError("unknown attention layout: register an adapter with kvdiff_capture.register_adapter")


__all__ = ["ADAPTERS", "Adapter", "Hooks", "detect", "register_adapter"]
