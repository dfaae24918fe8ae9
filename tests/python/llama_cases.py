"""llama.cpp runs of kvdiff's small models, each captured through kvdiff_capture's llama.cpp
adapter as an application drives llama.cpp: whole prompts, micro-batches, two sequences in one
batch, a saved and restored state, chunk reuse with and without the position shift, a chunk fed
to another sequence's id, and a prompt missing template tokens. tests/python/test_llama_cpp.py
holds each to kvdiff's reference; docs/llama-cpp.md shows their reports."""

import ctypes
import os
from contextlib import contextmanager

import numpy as np
import llama_cpp

import kvdiff_capture as kc
from kvdiff_capture.adapters.llama_cpp import LlamaCppHooks

# llama.cpp's log lines silenced (the callback kept alive: llama.cpp holds only its pointer).
_QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)
llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()

KV_TYPES = {"float32": llama_cpp.GGML_TYPE_F32, "float16": llama_cpp.GGML_TYPE_F16}


class Llama:
    """One GGUF loaded once; a context per run (its parameters are the run's)."""

    def __init__(self, gguf, hf_dir, dtype):
        mp = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(os.fsencode(gguf), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.hf_dir, self.dtype = str(hf_dir), dtype

    @contextmanager
    def run(self, out, n_ubatch=512, kv="float32", prompt=None, unified=False):
        """A fresh context with the capture's hooks, inside a capture writing `out`.
        `unified`: one KV buffer for every sequence (llama.cpp's default keeps a stream per
        sequence)."""
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 512, 512, n_ubatch, 4
        params.n_threads = params.n_threads_batch = 2
        params.type_k = params.type_v = KV_TYPES[kv]
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.kv_unified = unified
        with kc.capture(None, out, engine="llama.cpp", model_name=self.hf_dir, dtype=self.dtype,
                        prompt=prompt, kv_cache=kv if kv != self.dtype else None) as cap:
            hooks = LlamaCppHooks(cap, params)
            ctx = llama_cpp.llama_init_from_model(self.model, params)
            if not ctx:
                raise RuntimeError("llama.cpp could not make a context")
            try:
                yield Run(self, ctx, hooks, cap)
            finally:
                llama_cpp.llama_free(ctx)


class Run:
    def __init__(self, llama, ctx, hooks, cap):
        self.llama, self.ctx, self.hooks, self.cap = llama, ctx, hooks, cap
        self.mem = llama_cpp.llama_get_memory(ctx)

    def decode(self, tokens, fed_positions, fed_seqs, logits=None, **meant):
        """One llama_decode: what llama.cpp is fed, and (`positions`, `seqs`) what is meant."""
        self.hooks.decode(self.ctx, tokens, fed_positions, fed_seqs, logits, **meant)

    def argmax(self, i=-1):
        row = llama_cpp.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.llama.n_vocab,))))

    def greedy(self, seq, at, steps, plen, first=None, fed_seq=None, fed_at=None):
        """`steps` decode steps of sequence `seq` from position `at` (fed from `fed_at`), one
        token per call."""
        tok = self.argmax() if first is None else first
        fed_at = at if fed_at is None else fed_at
        for k in range(steps):
            self.decode([tok], [fed_at + k], [seq if fed_seq is None else fed_seq], [True],
                        positions=[at + k], seqs=[seq], prompt_len=plen)
            tok = self.argmax()


def whole(llama, ids, out, n_ubatch=512, kv="float32", steps=3, prompt=None):
    """The prompt in one llama_decode (llama.cpp splits it into micro-batches of n_ubatch), then
    greedy decode."""
    with llama.run(out, n_ubatch=n_ubatch, kv=kv, prompt=prompt) as r:
        n = len(ids)
        r.decode(ids, list(range(n)), [0] * n, prompt_len=n)
        r.greedy(0, n, steps, n)


def two_sequences(llama, a, b, out, steps=3):
    """Two prompts in one batch (sequences 0 and 1), then each decode step of both in one batch."""
    with llama.run(out) as r:
        toks = a + b
        pos = list(range(len(a))) + list(range(len(b)))
        seqs = [0] * len(a) + [1] * len(b)
        logits = [i == len(a) - 1 or i == len(toks) - 1 for i in range(len(toks))]
        r.decode(toks, pos, seqs, logits, prompt_len={0: len(a), 1: len(b)})
        nxt = [r.argmax(len(a) - 1), r.argmax(len(toks) - 1)]
        for k in range(steps):
            r.decode(nxt, [len(a) + k, len(b) + k], [0, 1], [True, True],
                     prompt_len={0: len(a), 1: len(b)})
            nxt = [r.argmax(0), r.argmax(1)]


def saved_and_restored(llama, ids, out, steps=3):
    """The prompt prefilled, the sequence's state saved, the memory cleared, the state restored
    into the sequence, then decode."""
    with llama.run(out) as r:
        n = len(ids)
        r.decode(ids, list(range(n)), [0] * n, prompt_len=n)
        first = r.argmax()
        size = llama_cpp.llama_state_seq_get_size(r.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        got = llama_cpp.llama_state_seq_get_data(r.ctx, buf, size, 0)
        llama_cpp.llama_memory_seq_rm(r.mem, 0, -1, -1)
        if llama_cpp.llama_state_seq_set_data(r.ctx, buf, got, 0) == 0:
            raise RuntimeError("llama.cpp could not restore the sequence's state")
        r.greedy(0, n, steps, n, first=first)


def chunk_reuse(llama, ids, cut, end, out, shift, steps=3, unified=True):
    """Chunk reuse as llama.cpp applications build it: the prompt's head [0, cut) prefilled in
    sequence 0; the document chunk [cut, end) prefilled alone as sequence 1 at positions 0..n
    (a cached chunk); copied into sequence 0 with llama_memory_seq_cp, after a
    llama_memory_seq_add that moves it to its place (`shift`), or without it (the bug); then the
    rest of the prompt and decode in sequence 0, at the positions llama.cpp continues the
    sequence from (its last position + 1, as llama.cpp assigns them itself to a batch without
    positions; it refuses any other). The chunk's own prefill is written as sequence 1 (exact
    for what it is), and sequence 0 takes the chunk's rows from its cache. With a KV stream per
    sequence (`unified=False`, llama.cpp's default), llama_memory_seq_cp copies the chunk's
    whole stream over sequence 0's, which loses the head."""
    with llama.run(out, unified=unified) as r:
        n = len(ids)
        chunk = ids[cut:end]
        r.decode(ids[:cut], list(range(cut)), [0] * cut, prompt_len={0: n})
        r.decode(chunk, list(range(len(chunk))), [1] * len(chunk), prompt_len={1: len(chunk)})
        if shift:
            llama_cpp.llama_memory_seq_add(r.mem, 1, -1, -1, cut)
        llama_cpp.llama_memory_seq_cp(r.mem, 1, 0, -1, -1)
        r.cap.cached_prefix(0, ids[:end])
        rest = ids[end:]
        at = llama_cpp.llama_memory_seq_pos_max(r.mem, 0) + 1
        r.decode(rest, list(range(at, at + len(rest))), [0] * len(rest),
                 positions=list(range(end, n)), prompt_len={0: n})
        r.greedy(0, n, steps, {0: n}, fed_at=at + len(rest))


def wrong_sequence(llama, a, b, cut, out, steps=2):
    """Two conversations of equal length prefilled up to `cut` as sequences 0 and 1; then the
    rest of conversation b fed with sequence 0's id (the bug), rows meant for sequence 1."""
    assert len(a) == len(b)
    n = len(a)
    with llama.run(out) as r:
        plen = {0: n, 1: n}
        r.decode(a[:cut] + b[:cut], list(range(cut)) * 2, [0] * cut + [1] * cut,
                 [False] * (2 * cut), prompt_len=plen)
        rest = b[cut:]
        r.decode(rest, list(range(cut, n)), [0] * len(rest), seqs=[1] * len(rest), prompt_len=plen)
        r.greedy(1, n, steps, plen, fed_seq=0)
