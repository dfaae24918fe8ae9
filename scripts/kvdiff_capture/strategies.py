"""Hypothesis strategies for an engine's own random-chunking tests: chunk boundaries for a
prompt, conversations from a prompt set, and prompts with the ids kvdiff's reference feeds (for
the prompt check). Needs `hypothesis` (pip install hypothesis).

    from hypothesis import given, settings
    from kvdiff_capture.strategies import chunkings

    @given(cuts=chunkings(len(IDS)))
    @settings(max_examples=25, deadline=None)
    def test_any_chunking_is_equivalent(kvdiff, cuts):
        with kvdiff.capture(None, engine="my-engine", model_name=MODEL, prompt=PROMPT):
            engine.generate(IDS, chunk_starts=cuts)

Each strategy shrinks toward the simplest failing case: fewer chunk boundaries, each as early
as it can be; the first conversation of the set; and so on. A failure's message carries the
`kvdiff diff` command that reruns it, and Hypothesis prints the drawn chunking.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Union

from hypothesis import strategies as st

from .check import _tokens

Messages = List[Dict[str, Any]]


def chunkings(n_tokens: int, *, max_chunks: Optional[int] = None, min_chunk: int = 1,
              first: int = 0) -> st.SearchStrategy[List[int]]:
    """Chunk boundaries for a prompt of `n_tokens`: the ascending positions where a new chunk
    starts (none: the whole prompt in one call). Every chunk has at least `min_chunk` tokens;
    at most `max_chunks` chunks; no boundary before `first` (a prefix kept whole). Shrinks
    toward fewer boundaries, each as early as it can be."""
    if n_tokens < 1 or min_chunk < 1:
        raise ValueError("chunkings needs n_tokens >= 1 and min_chunk >= 1")
    lo = max(first, min_chunk)
    hi = n_tokens - min_chunk
    most = (max_chunks - 1) if max_chunks is not None else None
    if hi < lo or most == 0:
        return st.just([])

    def spaced(cuts: List[int]) -> bool:
        return all(b - a >= min_chunk for a, b in zip(cuts, cuts[1:]))

    cuts = st.lists(st.integers(lo, hi), unique=True, max_size=most).map(sorted)
    return cuts.filter(spaced) if min_chunk > 1 else cuts


def load_prompt_set(prompt_set: Union[str, os.PathLike, Sequence[Any]]) -> List[Messages]:
    """A prompt set as message lists: a JSONL file ({"messages": [...]} per line), a folder of
    `.json` prompt files, or a list of message lists / {"messages": ...} dicts."""
    if isinstance(prompt_set, (str, os.PathLike)):
        path = Path(prompt_set)
        if not path.exists():
            raise ValueError(f"no prompt set {path}: give a JSONL file or a folder of .json prompt files")
        sources = ([(f, f.read_text()) for f in sorted(path.glob("*.json"))] if path.is_dir() else
                   [(f"{path}:{i + 1}", line) for i, line in enumerate(path.read_text().splitlines())
                    if line.strip()])
        items = []
        for where, text in sources:
            try:
                items.append(json.loads(text))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e}): fix the conversation there") from None
    else:
        items = list(prompt_set)
    out = [m if isinstance(m, list) else m["messages"] for m in items]
    if not out:
        raise ValueError(f"{prompt_set}: no conversations")
    return out


def conversations(prompt_set: Union[str, os.PathLike, Sequence[Any]]) -> st.SearchStrategy[Messages]:
    """A conversation (a message list) drawn from a prompt set; shrinks toward the first."""
    return st.sampled_from(load_prompt_set(prompt_set))


class Prompt(NamedTuple):
    """A conversation and the ids kvdiff's reference feeds for it (the chat template with the
    generation prompt). Pass `messages` to `capture(..., prompt=...)`: `kvdiff diff` then holds
    the engine's prompt ids to these and names the first token where they part."""
    messages: Messages
    ids: List[int]
    text: str


def prompts(prompt_set: Union[str, os.PathLike, Sequence[Any]],
            model: Optional[Union[str, os.PathLike]] = None) -> st.SearchStrategy[Prompt]:
    """A conversation from a prompt set with its reference ids (`kvdiff tokens`, run once per
    conversation), for the prompt check and for engines that take ids."""
    cache: Dict[str, Prompt] = {}

    def tokenized(messages: Messages) -> Prompt:
        key = json.dumps(messages, sort_keys=True)
        if key not in cache:
            t = _tokens(messages, model)
            cache[key] = Prompt(messages, t["ids"], t["text"])
        return cache[key]

    return conversations(prompt_set).map(tokenized)


def chunked_prompts(prompt_set: Union[str, os.PathLike, Sequence[Any]],
                    model: Optional[Union[str, os.PathLike]] = None, *,
                    max_chunks: Optional[int] = None,
                    min_chunk: int = 1) -> st.SearchStrategy[tuple]:
    """(Prompt, chunk boundaries) pairs: a conversation from the set and a chunking of its ids."""
    return prompts(prompt_set, model).flatmap(
        lambda p: st.tuples(st.just(p), chunkings(len(p.ids), max_chunks=max_chunks,
                                                  min_chunk=min_chunk)))
