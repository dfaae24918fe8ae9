"""llama.cpp, through llama-cpp-python's low-level API: the graph eval callback (`cb_eval` in the
context parameters) reads each named tensor of every micro-batch as llama.cpp computes it, and
each row is placed at the batch row the application declared (its sequence and position),
found by the token and position the micro-batch's graph was fed, never by the order rows reach
the graph. Rows of several sequences with the same token at the same position are told apart by
their order in the batch, which llama.cpp keeps within each sequence. docs/llama-cpp.md shows it
end to end.

    import llama_cpp, kvdiff_capture as kc
    from kvdiff_capture.adapters.llama_cpp import LlamaCppHooks

    params = llama_cpp.llama_context_default_params()
    with kc.capture(None, "dump/", engine="llama.cpp", model_name=HF_DIR, dtype="float32") as cap:
        hooks = LlamaCppHooks(cap, params)          # before the context is made
        ctx = llama_cpp.llama_init_from_model(model, params)
        hooks.decode(ctx, tokens, positions, seqs)    # one llama_decode, captured
    # kvdiff diff dump/

The names llama.cpp gives its tensors, and the taps they are (`-N` is the layer):

| llama.cpp | kvdiff | |
| --- | --- | --- |
| `embd` (the token embeddings' GET_ROWS) | `embed`, `L0.resid_in` | the first node of a micro-batch |
| `attn_norm-N` | `LN.attn_norm` | |
| `Qcur_normed-N`, `Kcur_normed-N` | `LN.q`, `LN.k` | families with q/k norms (Qwen3) |
| `Qcur-N`, `Kcur-N` (not RoPE) | `LN.q`, `LN.k` | families without them (Llama); the last such node |
| `Qcur-N`, `Kcur-N` (the ROPE op) | `LN.q_rope`, `LN.k_rope` | the name repeats: the op tells them apart |
| `Vcur-N` | `LN.v` | the last node of that name |
| `kqv_out-N` | `LN.attn_out` | |
| `attn_out-N`, or the matmul by `blk.N.attn_output.weight` | `LN.o_proj` | named in some families (Llama), unnamed in others (Qwen3) |
| `ffn_inp-N` | `LN.resid_mid` | |
| `ffn_norm-N` | `LN.mlp_norm` | |
| `ffn_out-N` | `LN.mlp_out` | |
| `l_out-N` | `LN.resid_out`, `L(N+1).resid_in` | |
| `result_norm`, `result_output` | `final_norm`, `logits` | |

Not given: `attn_probs` (`kq_soft_max-N`'s columns are KV-cache cells, whose positions llama.cpp
does not expose, and a flash-attention context never forms them). In the last layer llama.cpp
keeps only the rows whose logits were asked for (`inp_out_ids`), so from `ffn_inp` of that layer
on, only those rows are written.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
GGML_ROPE_TYPE_NEOX = 2


class _Tensor(ctypes.Structure):
    """The head of ggml's `struct ggml_tensor` (ggml.h), as far as the fields read here."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


def _ggml_base() -> ctypes.CDLL:
    """libggml-base, beside the libllama llama-cpp-python loaded ($LLAMA_CPP_LIB_PATH for a
    build of one's own)."""
    import llama_cpp
    folder = os.environ.get("LLAMA_CPP_LIB_PATH") or os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            lib = ctypes.CDLL(path)
            break
    else:
        raise RuntimeError(f"no libggml-base in {folder}: fix: install llama-cpp-python built from source, "
                           "or point LLAMA_CPP_LIB_PATH at your llama.cpp build's library folder")
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_is_contiguous.restype = ctypes.c_bool
    lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


_SIMPLE = {"attn_norm": "attn_norm", "Qcur_normed": "q", "Kcur_normed": "k", "kqv_out": "attn_out",
           "attn_out": "o_proj", "ffn_inp": "resid_mid", "ffn_norm": "mlp_norm", "ffn_out": "mlp_out",
           "l_out": "resid_out"}


class _Ubatch:
    """What one micro-batch's graph gave: its tokens and fed positions, then its taps."""

    def __init__(self, tokens: List[int]) -> None:
        self.tokens = tokens
        self.positions: Optional[List[int]] = None
        self.taps: Dict[str, np.ndarray] = {}
        # RoPE over adjacent pairs (GGML_ROPE_TYPE_NORM): llama.cpp's converter permuted the
        # q/k weights of such families (Llama, Mistral) so that each head's dims interleave
        # its halves; kvdiff's taps hold them in Hugging Face's order.
        self.interleaved = False


class LlamaCppHooks:
    """A llama.cpp context's eval callback, writing to a kvdiff capture.

    Install it into the context parameters before `llama_init_from_model`, then run each
    `llama_decode` through `decode` (or call `begin`, `llama_decode`, `end` yourself)."""

    def __init__(self, cap: Any, params: Any) -> None:
        import llama_cpp
        self.cap = cap
        self.lib = _ggml_base()
        self.ubatches: List[_Ubatch] = []
        self.batch: Optional[List[Tuple[int, int, int, bool]]] = None
        self.error: Optional[BaseException] = None
        # Kept here: llama.cpp holds only the C pointer.
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval)
        params.cb_eval = self._callback
        params.cb_eval_user_data = None

    # -- the eval callback --------------------------------------------------------------

    def _tap_of(self, t: _Tensor) -> Optional[str]:
        name = t.name.decode(errors="replace")
        op = self.lib.ggml_op_name(t.op).decode()
        if name in ("embd", "inp_embd") and op == "GET_ROWS":
            return "embed"
        if name in ("result_norm", "result_output"):
            return {"result_norm": "final_norm", "result_output": "logits"}[name]
        base, _, layer = name.rpartition("-")
        if not layer.isdigit():
            if op == "MUL_MAT" and t.src[0]:
                w = _Tensor.from_address(t.src[0]).name.decode(errors="replace")
                if w.startswith("blk.") and w.endswith(".attn_output.weight"):
                    return f"L{w.split('.')[1]}.o_proj"
            return None
        if base in _SIMPLE:
            return f"L{layer}.{_SIMPLE[base]}"
        if base in ("Qcur", "Kcur"):
            which = "q" if base == "Qcur" else "k"
            return f"L{layer}.{which}_rope" if op == "ROPE" else f"L{layer}.{which}_pre"
        if base == "Vcur":
            return f"L{layer}.v"
        return None

    def _read(self, ptr: int, heads: bool) -> Optional[np.ndarray]:
        """The tensor as `[rows, heads, dim]` (`heads`) or `[rows, width]`, in f32."""
        t = _Tensor.from_address(ptr)
        if t.type not in (GGML_TYPE_F32, GGML_TYPE_F16) or not self.lib.ggml_is_contiguous(ptr):
            return None
        ne = [int(d) for d in t.ne]
        if ne[3] != 1 or (not heads and ne[2] != 1):
            return None
        n = self.lib.ggml_nbytes(ptr)
        buf = (ctypes.c_uint8 * n)()
        self.lib.ggml_backend_tensor_get(ptr, buf, 0, n)
        dtype = np.float32 if t.type == GGML_TYPE_F32 else np.float16
        shape = (ne[2], ne[1], ne[0]) if heads else (ne[1], ne[0])
        return np.frombuffer(buf, dtype=dtype).astype(np.float32).reshape(shape)

    def _ints(self, ptr: int) -> List[int]:
        t = _Tensor.from_address(ptr)
        n = int(t.ne[0])
        buf = (ctypes.c_int32 * n)()
        self.lib.ggml_backend_tensor_get(ptr, buf, 0, 4 * n)
        return list(buf)

    def _eval(self, ptr: int, ask: bool, _user: Any) -> bool:
        if self.batch is None or not ptr:
            return False
        t = _Tensor.from_address(ptr)
        tap = self._tap_of(t)
        if tap is None:
            return False
        if ask:
            return True
        try:
            if tap == "embed":  # the first node of a micro-batch's graph: its token ids
                self.ubatches.append(_Ubatch(self._ints(t.src[1]) if t.src[1] else []))
            if not self.ubatches:
                return True
            u = self.ubatches[-1]
            if tap.endswith("_rope") and u.positions is None and t.src[1]:
                u.positions = self._ints(t.src[1])
                u.interleaved = (t.op_params[2] & GGML_ROPE_TYPE_NEOX) == 0
            kind = tap.rsplit(".", 1)[-1]
            value = self._read(ptr, heads=kind in ("q", "k", "v", "q_rope", "k_rope", "q_pre", "k_pre"))
            if value is not None:
                u.taps[tap] = value  # a name given twice: the later node is the tap
        except Exception as e:  # a callback must not raise into C
            self.error = e
        return True

    # -- forward calls ------------------------------------------------------------------

    def begin(self, tokens: Sequence[int], fed_positions: Sequence[int], fed_seqs: Sequence[int],
              logits: Sequence[bool], positions: Optional[Sequence[int]] = None,
              seqs: Optional[Sequence[int]] = None, prompt_len: Any = None) -> None:
        """One llama_decode's batch: what llama.cpp is fed (tokens, positions, sequence ids,
        which rows give logits), and each row's place as the application means it
        (`positions`, `seqs`; default: as fed)."""
        positions = list(fed_positions if positions is None else positions)
        seqs = list(fed_seqs if seqs is None else seqs)
        self.batch = list(zip([int(x) for x in tokens], [int(p) for p in fed_positions],
                              [int(s) for s in fed_seqs], [bool(x) for x in logits]))
        self.meant = list(zip(positions, seqs))
        self.ubatches = []
        self.error = None
        self.cap.begin(list(tokens), positions, seq=seqs,
                       rope_positions=[int(p) for p in fed_positions], prompt_len=prompt_len)

    def end(self) -> None:
        """Places every micro-batch's rows at their batch rows and writes the call."""
        if self.error is not None:
            raise RuntimeError(f"the llama.cpp eval callback failed: {self.error}")
        used = [False] * len(self.batch)
        per_tap: Dict[str, Tuple[List[np.ndarray], List[int], List[int]]] = {}
        for u in self.ubatches:
            rows = []
            fed = u.positions or []
            for r, tok in enumerate(u.tokens):
                pos = fed[r] if r < len(fed) else None
                match = next((i for i, (bt, bp, _, _) in enumerate(self.batch)
                              if not used[i] and bt == tok and (pos is None or bp == pos)), None)
                if match is None:
                    raise RuntimeError(f"a micro-batch row (token {tok}, position {pos}) is no row of "
                                       "the batch begin() declared: declare what llama_decode is fed")
                used[match] = True
                rows.append(match)
            outputs = [i for i in rows if self.batch[i][3]]
            taps = dict(u.taps)
            if u.interleaved:
                for name, value in taps.items():
                    if name.rsplit(".", 1)[-1] in ("q", "k", "q_rope", "k_rope", "q_pre", "k_pre") and value.ndim == 3:
                        d = value.shape[-1]
                        taps[name] = value.reshape(*value.shape[:-1], d // 2, 2).swapaxes(-1, -2).reshape(value.shape)
            for kind in ("q", "k"):
                for name in [n for n in taps if n.endswith(f".{kind}_pre")]:
                    layer = name.split(".")[0]
                    taps.setdefault(f"{layer}.{kind}", taps[name])
                    del taps[name]
            for name, value in list(taps.items()):
                if name.endswith(".resid_out"):
                    nxt = f"L{int(name[1:].split('.')[0]) + 1}.resid_in"
                    taps.setdefault(nxt, value)
            if "embed" in taps:
                taps.setdefault("L0.resid_in", taps["embed"])
            for name, value in taps.items():
                if value.shape[0] == len(rows):
                    which = rows
                elif value.shape[0] == len(outputs):
                    which = outputs
                else:
                    continue
                vals, pos, seq = per_tap.setdefault(name, ([], [], []))
                vals.append(value)
                pos.extend(self.meant[i][0] for i in which)
                seq.extend(self.meant[i][1] for i in which)
        for name, (vals, pos, seq) in per_tap.items():
            self.cap.tap(name, np.concatenate(vals), positions=pos, seq=seq)
        self.batch = None
        self.cap.end()

    def decode(self, ctx: Any, tokens: Sequence[int], fed_positions: Sequence[int],
               fed_seqs: Sequence[int], logits: Optional[Sequence[bool]] = None, **meant: Any) -> None:
        """`begin`, one `llama_decode` of that batch, `end`. `logits`: rows whose logits are
        kept (default: the last)."""
        import llama_cpp
        n = len(tokens)
        logits = list(logits) if logits is not None else [i == n - 1 for i in range(n)]
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        try:
            for i in range(n):
                batch.token[i] = int(tokens[i])
                batch.pos[i] = int(fed_positions[i])
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = int(fed_seqs[i])
                batch.logits[i] = bool(logits[i])
            batch.n_tokens = n
            self.begin(tokens, fed_positions, fed_seqs, logits, **meant)
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                self.batch = None
                raise RuntimeError(f"llama_decode returned {rc}")
            self.end()
        finally:
            llama_cpp.llama_batch_free(batch)
