"""The dump writer: forward calls (`begin` ... `tap` ... `end`) turned into the files of a kvdiff
dump (docs/dump-format.md), one safetensors file per call, sequence and step.

Works on torch tensors (written with safetensors.torch) and on plain nested lists (written by
hand, no dependency at all), so engines without torch and the tests need nothing installed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import struct
import sys
from array import array
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

FORMAT = "kvdiff-dump"
VERSION = 1

Ints = Union[Sequence[int], Any]  # a list of ints or a 1-D torch tensor
Messages = Union[List[Dict[str, Any]], Dict[str, Any]]

_active: Optional["Capture"] = None


def active() -> Optional["Capture"]:
    """The capture `tap()` writes to, if any."""
    return _active


def set_active(cap: Optional["Capture"]) -> None:
    global _active
    _active = cap


def tap(name: str, tensor: Any, positions: Optional[Ints] = None, seq: Optional[Ints] = None,
        key_positions: Any = None) -> None:
    """Adds `tensor` (rows = the current call's tokens, or `positions`) to the active capture
    (`Capture.tap` says what `key_positions` does). Costs nothing outside a capture, so engines
    may leave the calls in."""
    if _active is not None:
        _active.tap(name, tensor, positions=positions, seq=seq, key_positions=key_positions)


def begin(tokens: Ints, positions: Optional[Ints] = None, **kw: Any) -> None:
    """`Capture.begin` on the active capture; nothing outside a capture."""
    if _active is not None:
        _active.begin(tokens, positions, **kw)


def end() -> None:
    """`Capture.end` on the active capture; nothing outside a capture."""
    if _active is not None:
        _active.end()


def _is_numpy(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "numpy"


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _flatten(x: Any) -> Tuple[List[int], List[Any]]:
    """A nested list as (shape, flat values)."""
    if not isinstance(x, (list, tuple)):
        return [], [x]
    if not x:
        return [0], []
    shapes: Optional[List[int]] = None
    flat: List[Any] = []
    for item in x:
        s, f = _flatten(item)
        if shapes is not None and s != shapes:
            raise ValueError("ragged nested list")
        shapes = s
        flat.extend(f)
    return [len(x)] + (shapes or []), flat


def save_plain(path: str, tensors: Mapping[str, Tuple[str, List[int], List[Any]]],
               metadata: Mapping[str, str]) -> None:
    """safetensors written by hand: tensors are (dtype, shape, flat list)."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata)}
    blobs, offset = [], 0
    for name, (dtype, shape, flat) in tensors.items():
        if _is_numpy(flat):
            data = flat.astype({"F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4"}[dtype]).tobytes()
        else:
            code = {"F32": "f", "F64": "d", "I64": "q", "I32": "i"}[dtype]
            blob = array(code, flat)
            if sys.byteorder != "little":
                blob.byteswap()
            data = blob.tobytes()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


def prompt_meta(prompt: Any) -> Dict[str, Any]:
    """A prompt as meta.json stores it: `{"messages": [...]}` (the JSON prompt-file shape kvdiff
    reads), from a message list, such a dict, or a path to a `.json` prompt file."""
    if isinstance(prompt, (str, os.PathLike)):
        with open(prompt, encoding="utf-8") as f:
            prompt = json.load(f)
    if isinstance(prompt, list):
        prompt = {"messages": prompt}
    if not isinstance(prompt, dict) or not isinstance(prompt.get("messages"), list):
        raise ValueError('prompt must be a list of {"role", "content"} messages or {"messages": [...]}')
    for m in prompt["messages"]:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f'every message needs "role" and "content": {m!r}')
    return json.loads(json.dumps(prompt))


class Capture:
    """A dump being written: forward calls (`begin` ... `tap` ... `end`) and `close`.

    Files go to `out_dir` + ".partial" and are moved into place by `close()`; a run that fails
    leaves nothing half-written under `out_dir`.

    Rows are matched by position, so each row's position must be its true place in its sequence,
    whatever position ids the engine fed RoPE (those go to `rope_positions`). Step 0 holds a
    sequence's prompt (its first `prompt_len` positions), step k its k-th decoded token.
    """

    def __init__(self, out_dir: Union[str, os.PathLike], engine: str = "engine",
                 dtype: Optional[str] = None, model: Optional[str] = None,
                 prompt_len: Optional[int] = None, taps: Union[str, Iterable[str]] = "*",
                 tp_rank: Optional[int] = None, tp_size: Optional[int] = None,
                 overwrite: bool = False, prompt: Any = None, kv_cache: Optional[str] = None,
                 joined: bool = False) -> None:
        if kv_cache not in (None, "float16", "bfloat16", "float32", "f16", "bf16", "f32"):
            raise ValueError(f"kv_cache={kv_cache!r}: float16, bfloat16 or float32 (the dtype the "
                             "cache stores K and V in; a quantized cache is not held to its rounding)")
        self.out_dir = os.fspath(out_dir)
        self.prompt = prompt_meta(prompt) if prompt is not None else None
        self.partial = self.out_dir + ".partial"
        # A tensor-parallel rank other than the one that owns the dump writes its files into the
        # owner's folder, and leaves meta.json and the final rename to it.
        self.joined = joined
        if joined:
            if not os.path.isdir(self.partial):
                raise FileNotFoundError(f"{self.partial} does not exist: rank 0's capture must open it first")
        else:
            if os.path.exists(self.out_dir) and not overwrite:
                raise FileExistsError(f"{self.out_dir} exists: choose another folder or pass overwrite=True")
            shutil.rmtree(self.partial, ignore_errors=True)
            os.makedirs(self.partial)
        self.engine, self.dtype, self.model = engine, dtype, model
        # The dtype the engine's KV cache holds K and V in, where narrower than `dtype`
        # (llama.cpp's default f16 cache): kvdiff holds attention to that rounding.
        self.kv_cache = kv_cache
        # Every sequence's prompt length when given; else learned per sequence from its calls.
        self.fixed_prompt_len = prompt_len
        self.prompt_len: Dict[int, int] = {}
        self.prompt_growing: Dict[int, bool] = {}
        self.known_prompt_len: Set[int] = set()
        if isinstance(taps, str):
            self.patterns = [p.strip() for p in taps.split(",") if p.strip()]
        else:
            self.patterns = list(taps)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.calls = 0
        self.next_index: Dict[int, int] = {}
        self.written: Dict[int, Set[int]] = {}
        self.current: Optional[Dict[str, Any]] = None
        self.layer: Optional[int] = None  # set by adapters: the layer a shared module runs for
        # Set by adapters: hooks begin and end every forward call, and these taps (where
        # wanted) come out of every one. A call that breaks either ran where hooks cannot.
        self.hooked = False
        self.expected: List[str] = []

    def wants(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def begin(self, tokens: Ints, positions: Optional[Ints] = None,
              rope_positions: Optional[Ints] = None, seq: Optional[Ints] = None,
              prompt_len: Optional[Union[int, Mapping[int, int]]] = None,
              recompute: Iterable[int] = (), mask: Optional[Ints] = None) -> None:
        """Starts one forward call.

        tokens: the call's token ids, one per row.
        positions: each row's place in its sequence (default: continuing where the sequence's
            last call ended). Take them from the engine's own bookkeeping (cached-token counts,
            context lengths), never from the ids it fed RoPE: a chunk fed the wrong ids must keep
            its true place for the report to name it.
        rope_positions: the position ids the engine fed RoPE; kept when they differ.
        seq: each row's sequence id (batched engines); stable across calls.
        prompt_len: the prompt length of every sequence in the call (an int, or {seq: n}), when
            the engine knows it; otherwise calls of several tokens before a sequence's first
            one-token call are its prompt.
        recompute: sequences whose rows already written are computed again in this call (a
            preempted sequence prefilled anew): those rows are not written twice; the rest land
            at their decode steps.
        mask: each row's attention-mask value (1: a token of its sequence, 0: padding). Padding
            rows are no rows of any sequence: they are never written and take no position, so
            a left-padded sequence starts at position 0 as it would alone.
        """
        token_list = self._ints(tokens)
        seqs = self._ints(seq) if seq is not None else [0] * len(token_list)
        real = [v != 0 for v in self._ints(mask)] if mask is not None else [True] * len(token_list)
        if len(real) != len(token_list):
            raise ValueError(f"{len(token_list)} tokens but {len(real)} mask values")
        if positions is None:
            pos: List[int] = []
            for s, r in zip(seqs, real):
                i = self.next_index.get(s, 0)
                pos.append(i if r else -1)
                self.next_index[s] = i + 1 if r else i
        else:
            pos = [p if r else -1 for p, r in zip(self._ints(positions), real)]
            for s, p in zip(seqs, pos):
                self.next_index[s] = max(self.next_index.get(s, 0), p + 1)
        if len(pos) != len(token_list) or len(seqs) != len(token_list):
            raise ValueError(f"{len(token_list)} tokens but {len(pos)} positions and {len(seqs)} sequence ids")
        if prompt_len is not None:
            lens = prompt_len if isinstance(prompt_len, Mapping) else {s: int(prompt_len) for s in set(seqs)}
            for s, n in lens.items():
                self.prompt_len[int(s)] = int(n)
                self.known_prompt_len.add(int(s))
        self.current = {"tokens": token_list, "positions": pos, "seq": seqs, "tensors": {},
                        "recompute": set(int(s) for s in recompute), "real": real}
        if rope_positions is not None:
            rope = self._ints(rope_positions)
            if any(r != p for r, p, ok in zip(rope, pos, real) if ok):
                self.current["rope_positions"] = rope

    def cached_prefix(self, seq: int, tokens: Ints) -> None:
        """The first `len(tokens)` tokens of sequence `seq`, which the engine took from its KV
        cache (a prefix-cache hit) instead of computing them in this capture: written as rows of
        step 0 without taps, so that the reference can run them; only the rows the engine
        computes are compared. Rows already written are left as they are."""
        ids = self._ints(tokens)
        done = self.written.setdefault(seq, set())
        rows = [p for p in range(len(ids)) if p not in done]
        if not rows:
            return
        self.next_index[seq] = max(self.next_index.get(seq, 0), len(ids))
        meta, rank = self._file_meta(0)
        name = f"step-0000.call-{self.calls:05d}.cached.seq-{seq}{rank}.safetensors"
        tensors = {"tokens": ("I64", [len(rows)], [ids[p] for p in rows]),
                   "positions": ("I64", [len(rows)], rows),
                   "seq": ("I64", [len(rows)], [seq] * len(rows))}
        save_plain(os.path.join(self.partial, name), tensors, meta)
        done.update(rows)

    def positions(self) -> List[int]:
        return self.current["positions"] if self.current else []

    def sequences(self) -> List[int]:
        return self.current["seq"] if self.current else []

    def tap(self, name: str, tensor: Any, positions: Optional[Ints] = None,
            seq: Optional[Ints] = None, key_positions: Any = None) -> None:
        """Adds `tensor` to the call: one row per token (or per `positions`, with `seq`).

        key_positions: for attention probabilities `[rows, heads, columns]` over a cache laid
        out otherwise than by position (left padding, a static or sliding-window cache), each
        row's key position per column, -1 for a column that holds no key of its sequence
        (padding, an unused slot). Columns are written at their key positions; the others are
        dropped, never compared as keys.
        """
        if self.current is None or not self.wants(name):
            return
        t = self.current["tensors"]
        if _is_numpy(tensor):
            import numpy as np
            # A copy, as for torch (engines reuse their buffers), in f32.
            tensor = np.array(tensor, dtype=np.float32)
            if _is_numpy(key_positions):
                key_positions = np.array(key_positions, dtype=np.int64)
        if _is_torch(tensor):
            import torch
            tensor = tensor.detach()
            if tensor.dtype.is_floating_point and tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                tensor = tensor.float()
            # A copy: engines reuse and modify buffers in place after the hook returns.
            tensor = tensor.to("cpu", copy=True).contiguous()
        t[name] = tensor
        if key_positions is not None:
            keys = key_positions
            if _is_torch(keys):
                keys = keys.detach().to("cpu").long()
            t[name + ".keys"] = keys
        if positions is not None:
            t[name + ".positions"] = self._ints(positions)
            if seq is not None:
                t[name + ".seq"] = self._ints(seq)

    def end(self) -> None:
        """Writes the call: one file per sequence and step in it."""
        c, self.current = self.current, None
        if c is None and self.hooked:
            raise RuntimeError(SKIPPED_HOOKS + " (a forward call ended that no hook saw begin)")
        if c is None or not c["tokens"]:
            return
        expected = [n for n in self.expected if self.wants(n)]
        if expected and not any(n in c["tensors"] for n in expected):
            raise RuntimeError(SKIPPED_HOOKS + f" (a forward call of {len(c['tokens'])} tokens wrote none of {expected[:3]})")
        for s in sorted(set(c["seq"])):
            self._write_seq(c, s)
        self.calls += 1

    def _plen(self, s: int, rows: List[int], pos: List[int]) -> int:
        if self.fixed_prompt_len is not None:
            return self.fixed_prompt_len
        plen = self.prompt_len.get(s)
        if s in self.known_prompt_len:
            return plen  # type: ignore[return-value]
        if plen is None or (self.prompt_growing.get(s, True) and len(rows) > 1):
            # Calls of several tokens before the sequence's first one-token call are its
            # prompt's pieces (a chunked prefill); pass prompt_len when a piece is one token.
            plen = self.prompt_len[s] = max(plen or 0, max(pos) + 1)
        if len(rows) == 1:
            self.prompt_growing[s] = False
        return plen

    def _write_seq(self, c: Dict[str, Any], s: int) -> None:
        rows = [i for i, q in enumerate(c["seq"]) if q == s and c["real"][i]]
        if not rows:
            return
        done = self.written.setdefault(s, set())
        if s in c["recompute"]:
            rows = [i for i in rows if c["positions"][i] not in done]
            if not rows:
                return
        pos = [c["positions"][i] for i in rows]
        plen = self._plen(s, rows, pos)
        by_step: Dict[int, List[int]] = {}
        for i, p in zip(rows, pos):
            by_step.setdefault(0 if p < plen else p - plen + 1, []).append(i)
        for step, step_rows in sorted(by_step.items()):
            self._write_file(c, s, step, step_rows, len(by_step) > 1)
        done.update(pos)

    def _file_meta(self, step: int) -> Tuple[Dict[str, str], str]:
        """A step file's metadata (its step, and its tensor-parallel rank where there is one) and
        the rank's part of its name."""
        meta = {"step": str(step)}
        if self.tp_size is not None:
            meta.update(tp_rank=str(self.tp_rank or 0), tp_size=str(self.tp_size))
        return meta, (f".rank-{self.tp_rank}" if self.tp_rank is not None else "")

    def _write_file(self, c: Dict[str, Any], s: int, step: int, rows: List[int], split: bool) -> None:
        meta, rank = self._file_meta(step)
        part = f".step-{step:04d}" if split else ""
        name = f"step-{step:04d}.call-{self.calls:05d}{part}.seq-{s}{rank}.safetensors"
        batched = len(set(c["seq"])) > 1 or s != 0
        every = len(c["tokens"])
        pos = [c["positions"][i] for i in rows]
        tensors: Dict[str, Any] = {"tokens": [c["tokens"][i] for i in rows], "positions": pos}
        if batched:
            tensors["seq"] = [s] * len(rows)
        if "rope_positions" in c:
            tensors["rope_positions"] = [c["rope_positions"][i] for i in rows]
        wanted = set(pos)
        for k, v in c["tensors"].items():
            if k.endswith((".positions", ".seq", ".keys")):
                continue
            own_pos, own_seq = c["tensors"].get(k + ".positions"), c["tensors"].get(k + ".seq")
            if own_pos is not None:
                seqs = own_seq if own_seq is not None else [c["seq"][0]] * len(own_pos)
                keep = [i for i, q in enumerate(seqs) if q == s and own_pos[i] in wanted]
                if not keep:
                    continue
                tensors[k + ".positions"] = [own_pos[i] for i in keep]
                if batched:
                    tensors[k + ".seq"] = [s] * len(keep)
            else:
                n = v.shape[0] if _is_torch(v) or _is_numpy(v) else len(v)
                if n != every:
                    raise ValueError(f"{k} has {n} rows, the call {every} tokens: pass positions=")
                keep = rows
            tensors[k] = _take(v, keep)
            keys = c["tensors"].get(k + ".keys")
            if keys is not None:
                tensors[k] = _place_keys(tensors[k], _take(keys, keep))
        path = os.path.join(self.partial, name)
        if any(_is_torch(v) for v in tensors.values()):
            import torch
            from safetensors.torch import save_file
            out = {k: (v if _is_torch(v) else torch.tensor(v, dtype=torch.int64)) for k, v in tensors.items()}
            save_file(out, path, metadata=meta)
        else:
            plain = {}
            for k, v in tensors.items():
                shape, flat = (list(v.shape), v.reshape(-1)) if _is_numpy(v) else _flatten(v)
                is_int = k in ("tokens", "positions", "seq", "rope_positions") or k.endswith((".positions", ".seq"))
                plain[k] = ("I64" if is_int else "F32", shape, flat)
            save_plain(path, plain, meta)

    def marker(self, state: str) -> str:
        """The file a joined rank leaves in the dump's folder when it opened, closed or failed."""
        return os.path.join(self.partial, f".rank-{self.tp_rank}.{state}")

    def close(self, ok: bool = True) -> None:
        if self.joined:
            # Rank 0 waits for this, then writes meta.json and renames the folder (or drops it).
            if os.path.isdir(self.partial):
                marker = self.marker("closed" if ok else "failed")
                with open(marker + ".tmp", "w") as f:
                    f.write("" if ok else "the block raised in this rank")
                os.replace(marker + ".tmp", marker)
            return
        if not ok:
            shutil.rmtree(self.partial, ignore_errors=True)
            return
        for name in os.listdir(self.partial):
            if name.startswith(".rank-"):
                os.remove(os.path.join(self.partial, name))
        meta: Dict[str, Any] = {"format": FORMAT, "version": VERSION, "engine": self.engine,
                                "dtype": self.dtype or "float32"}
        if self.model is not None:
            meta["model"] = self.model
        if self.kv_cache is not None:
            meta["kv_cache"] = self.kv_cache
        if self.prompt is not None:
            meta["prompt"] = self.prompt
        with open(os.path.join(self.partial, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        shutil.rmtree(self.out_dir, ignore_errors=True)
        os.replace(self.partial, self.out_dir)

    @staticmethod
    def _ints(x: Any) -> List[int]:
        if _is_torch(x):
            return [int(v) for v in x.detach().reshape(-1).tolist()]
        if _is_numpy(x):
            return [int(v) for v in x.reshape(-1).tolist()]
        return [int(v) for v in x]


SKIPPED_HOOKS = ("the engine ran a forward pass where the capture's hooks cannot run (a CUDA graph "
                 "or a compiled region): fix: run it eagerly while capturing (nano-vllm: "
                 "LLM(..., enforce_eager=True); torch.compile: no mode='reduce-overhead' around "
                 "the capture; see docs/engine-debugging.md#compiled-and-graph-captured-forwards)")


def _place_keys(v: Any, keys: Any) -> Any:
    """Attention rows `[rows, heads, columns]` rewritten so that column p holds key position p:
    each row's columns moved to their `keys` (-1: dropped), as wide as the largest key + 1."""
    if _is_torch(v):
        import torch
        keys = keys.to(v.device)
        width = int(keys.max().item()) + 1 if keys.numel() else 0
        rows, heads, cols = v.shape
        where = torch.where(keys >= 0, keys, torch.full_like(keys, width))
        out = torch.zeros(rows, heads, width + 1, dtype=v.dtype, device=v.device)
        out.scatter_(2, where.unsqueeze(1).expand(rows, heads, cols), v)
        return out[:, :, :width].contiguous()
    if _is_numpy(v):
        import numpy as np
        keys = np.asarray(keys, dtype=np.int64)
        width = int(keys.max()) + 1 if keys.size else 0
        rows, heads, cols = v.shape
        where = np.where(keys >= 0, keys, width)
        out = np.zeros((rows, heads, width + 1), dtype=v.dtype)
        np.put_along_axis(out, np.broadcast_to(where[:, None, :], (rows, heads, cols)), v, axis=2)
        return out[:, :, :width]
    width = max((max(k) for k in keys if k), default=-1) + 1
    out = []
    for row, k in zip(v, keys):
        placed = []
        for head in row:
            h = [0.0] * width
            for value, p in zip(head, k):
                if p >= 0:
                    h[p] = value
            placed.append(h)
        out.append(placed)
    return out


def _take(v: Any, rows: List[int]) -> Any:
    """Rows `rows` of a torch tensor, a numpy array or a list."""
    if _is_numpy(v):
        return v[rows]
    if _is_torch(v):
        import torch
        if rows == list(range(v.shape[0])):
            return v
        return v.index_select(0, torch.tensor(rows, dtype=torch.long)).contiguous()
    return [v[i] for i in rows]
