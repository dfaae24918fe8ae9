"""Models larger than one GPU, for scripts/bench_multi_gpu.sh (GPU machine; `hf`, `floor` and
the prompt need torch and transformers, the weights nothing: tests/python/test_bench_big.py).

  bench_big.py serve SHAPE OUT_DIR TOKENIZER_DIR PROMPT_FILE
      A random bf16 model of SHAPE (70b: Llama-3-70B's, 32b: Qwen3-32B's) in OUT_DIR, and a
      512-token chat prompt. Its safetensors shards live in memory files (memfd) this process
      holds, linked from OUT_DIR, so a 141 GB model needs no disk: it writes OUT_DIR/ready and
      keeps the files until it is killed. Every matrix is read, from a place of its own, out of
      one 256 MiB block of random values (`random_bf16`); every norm weight is 1.
  bench_big.py hf MODEL_DIR PROMPT_FILE NEW_TOKENS [DUMP_DIR]
      HF transformers generate of the same tokens with device_map="auto" over every GPU: load
      time, then a first and a second generate. With DUMP_DIR, the same model then prefills the
      prompt in three chunks through its KV cache and takes 8 greedy decode steps, captured by
      kvdiff_capture into DUMP_DIR (an engine's dump at this size, for `kvdiff diff`). JSON on
      stdout.
  bench_big.py floor MODEL_DIR
      Measured: each GPU's memory bandwidth, the peer read bandwidth GPU 1 -> GPU 0, and pinned
      host -> device bandwidth. JSON on stdout.
"""
import json
import os
import random
import shutil
import signal
import struct
import sys
import time
import zlib

SHAPES = {
    # Llama-3-70B: 80 layers, hidden 8192, 64 heads over 8 KV heads, intermediate 28672,
    # untied. The vocabulary is the Qwen3 tokenizer's (the one the benchmarks carry).
    "70b": dict(arch="LlamaForCausalLM", model_type="llama", hidden_size=8192, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=28672,
                rope_theta=500000.0, rms_norm_eps=1e-5, qk_norm=False),
    # Qwen3-32B: 64 layers, hidden 5120, 64 heads over 8 KV heads, intermediate 25600, untied.
    "32b": dict(arch="Qwen3ForCausalLM", model_type="qwen3", hidden_size=5120, num_hidden_layers=64,
                num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=25600,
                rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True),
}
VOCAB = 151936
LAYERS_PER_SHARD = 4
# The random block every weight matrix is read from: 2^27 - 1 bf16 values (256 MiB).
BLOCK_VALUES = (1 << 27) - 1


def prod(dims):
    out = 1
    for d in dims:
        out *= d
    return out


def random_bf16(count, seed):
    """`count` bf16 values, little-endian: a random sign and a magnitude uniform over
    [2^-6, 2^-5) (about 0.016 to 0.031, standard deviation 0.024, near a 0.02 init), built from
    random bytes with byte-wide table lookups (no numpy or torch needed)."""
    rng = random.Random(seed)
    lo = bytes(0x80 | (b & 0x7F) for b in range(256))  # exponent's low bit 1, 7 mantissa bits
    hi = bytes((b & 0x80) | 0x3C for b in range(256))  # sign, exponent's high bits (121 = 0x79)
    out = bytearray(2 * count)
    out[0::2] = rng.randbytes(count).translate(lo)
    out[1::2] = rng.randbytes(count).translate(hi)
    return bytes(out)


def tensors(s):
    """(name, shape) of every tensor, in shard order: embeddings, layers, norm and head."""
    h, i, qd, kvd = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"] * s["head_dim"], \
        s["num_key_value_heads"] * s["head_dim"]
    yield "model.embed_tokens.weight", (VOCAB, h)
    for l in range(s["num_hidden_layers"]):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        if s["qk_norm"]:
            yield p + "self_attn.q_norm.weight", (s["head_dim"],)
            yield p + "self_attn.k_norm.weight", (s["head_dim"],)
        yield p + "self_attn.q_proj.weight", (qd, h)
        yield p + "self_attn.k_proj.weight", (kvd, h)
        yield p + "self_attn.v_proj.weight", (kvd, h)
        yield p + "self_attn.o_proj.weight", (h, qd)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (VOCAB, h)


def shard_of(name, s):
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // LAYERS_PER_SHARD
    return 0 if name.startswith("model.embed") else (s["num_hidden_layers"] - 1) // LAYERS_PER_SHARD


def write_model(s, out):
    """The weights of shape `s` in memory files this process holds, linked from `out`, with
    their index and the config: (bytes, shards, the files' descriptors)."""
    shards = {}
    for name, dims in tensors(s):
        shards.setdefault(shard_of(name, s), []).append((name, dims))
    n = len(shards)
    weight_map, total, fds = {}, 0, []
    # Headers first, each memory file sized whole; then every tensor written at its offset by
    # a pool of threads, straight from one block of random bf16 values (a 141 GB model in
    # seconds: drawing every value, on the GPU and through the host, took 106-149 s).
    jobs = []
    for k in sorted(shards):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        header, off = {}, 0
        for name, dims in shards[k]:
            size = 2 * prod(dims)
            header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [off, off + size]}
            off += size
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        fd = os.memfd_create(fname)
        fds.append(fd)
        os.ftruncate(fd, 8 + len(raw) + off)
        os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
        for name, dims in shards[k]:
            jobs.append((fd, 8 + len(raw) + header[name]["data_offsets"][0], name, 2 * prod(dims)))
        total += off
        link = os.path.join(out, fname)
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(f"/proc/{os.getpid()}/fd/{fd}", link)
    block = random_bf16(BLOCK_VALUES, seed=0)
    ones = struct.pack("<H", 0x3F80) * (1 << 16)

    def write(job):
        fd, at, name, size = job
        # Each tensor starts at its own place in the block (an odd number of values long, so
        # a matrix's rows do not repeat in step) and wraps around it.
        src = memoryview(ones if name.endswith("norm.weight") else block)
        pos = 0 if name.endswith("norm.weight") else 2 * (zlib.crc32(name.encode()) % BLOCK_VALUES)
        while size:
            piece = src[pos:pos + size]
            w = os.pwrite(fd, piece, at)
            at, size, pos = at + w, size - w, (pos + w) % len(src)

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(write, jobs))
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(out, "model.safetensors.index.json"), "w"))
    cfg = {"architectures": [s["arch"]], "model_type": s["model_type"], "hidden_size": s["hidden_size"],
           "intermediate_size": s["intermediate_size"], "num_hidden_layers": s["num_hidden_layers"],
           "num_attention_heads": s["num_attention_heads"], "num_key_value_heads": s["num_key_value_heads"],
           "head_dim": s["head_dim"], "vocab_size": VOCAB, "max_position_embeddings": 8192,
           "rms_norm_eps": s["rms_norm_eps"], "rope_theta": s["rope_theta"], "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "dtype": "bfloat16",
           "bos_token_id": 151643, "eos_token_id": 151645, "attention_bias": False,
           "mlp_bias": False}
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
    return total, n, fds


def serve(shape, out, tok_dir, prompt_file):
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    total, n, _fds = write_model(SHAPES[shape], out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out, f))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_hf import PROMPT_TOKENS  # noqa: F401  (the same 512-token prompt)
    import bench_hf
    import io
    import contextlib
    with contextlib.redirect_stdout(io.StringIO()):
        bench_hf.rag_prompt(out, PROMPT_TOKENS, prompt_file)
    print(json.dumps({"shape": shape, "bytes": total, "shards": n, "seconds": round(time.time() - t0, 1)}),
          flush=True)
    open(os.path.join(out, "ready"), "w").close()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


def hf(model_dir, prompt_file, new_tokens, dump_dir=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    new_tokens = int(new_tokens)
    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = json.load(open(prompt_file))["messages"]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].cuda()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="auto",
                                                 attn_implementation="sdpa").eval()
    torch.cuda.synchronize()
    out = {"prompt_tokens": ids.shape[1], "hf_load_s": time.perf_counter() - t,
           "devices": sorted({str(p.device) for p in model.parameters()})}
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    for label in ("hf_generate_first_s", "hf_generate_s")[:0 if os.environ.get("BENCH_HF_GENERATE") == "0" else 2]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        out[label] = time.perf_counter() - t
    if dump_dir:
        out["capture_s"] = capture_chunked(model, ids, dump_dir)
    print(json.dumps(out))


def capture_chunked(model, ids, dump_dir, steps=8):
    """The prompt prefilled in three chunks through the KV cache, then greedy steps, captured."""
    import torch
    from transformers import DynamicCache
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kvdiff_capture as kc
    n = ids.shape[1]
    cuts = [0, n // 3, 2 * n // 3, n]
    cache = DynamicCache(config=model.config)
    t = time.perf_counter()
    with torch.no_grad(), kc.capture(model, dump_dir):
        for a, b in zip(cuts, cuts[1:]):
            pos = torch.arange(a, b, device=ids.device)[None]
            logits = model(input_ids=ids[:, a:b], past_key_values=cache, position_ids=pos,
                           use_cache=True).logits
        for k in range(steps):
            nxt = logits[:, -1].argmax(-1).view(1, 1).to(ids.device)
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                           position_ids=torch.full((1, 1), n + k, device=ids.device)).logits
        torch.cuda.synchronize()
    return time.perf_counter() - t


def timed(fn, reps=10):
    import torch
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def floor():
    import torch
    n = 1 << 29  # 1 GiB of bf16
    out = {}
    for d in range(torch.cuda.device_count()):
        a = torch.empty(n, dtype=torch.bfloat16, device=f"cuda:{d}")
        b = torch.empty_like(a)
        out[f"hbm_{d}_Bps"] = 2 * 2 * n / timed(lambda: b.copy_(a))
        del a, b
    if torch.cuda.device_count() > 1:
        src = torch.empty(n, dtype=torch.bfloat16, device="cuda:1")
        dst = torch.empty(n, dtype=torch.bfloat16, device="cuda:0")
        with torch.cuda.device(0):
            out["peer_1_to_0_Bps"] = 2 * n / timed(lambda: dst.copy_(src))
    host = torch.empty(n, dtype=torch.bfloat16).pin_memory()
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda:0")
    out["h2d_pinned_Bps"] = 2 * n / timed(lambda: dev.copy_(host, non_blocking=True), 5)
    print(json.dumps(out))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "serve":
        serve(*sys.argv[2:6])
    elif cmd == "hf":
        hf(*sys.argv[2:6])
    elif cmd == "floor":
        floor()
    else:
        sys.exit(__doc__)
