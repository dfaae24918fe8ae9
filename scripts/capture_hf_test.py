"""HF transformers' Qwen3 captured with kvdiff_capture and held to kvdiff's reference by
`kvdiff diff` (GPU machine: torch + transformers; kvdiff built elsewhere and carried).

For each model (the embedded default model's folder, fixtures/random-model and the families in
fixtures/arch: Qwen3-MoE, Qwen2, Llama 3, Mistral; CAPTURE_MODELS=name,name picks some), in
float32 and in bfloat16 on CUDA, eager attention:
  standard   the prompt in one forward call, then 16 greedy decode steps     -> EQUIVALENT
  chunked    the prompt in three calls through past_key_values, then 16     -> EQUIVALENT
  restart    chunks 2 and 3 fed position ids restarting from 0              -> L0.q_rope at chunk 2
  no-cache   chunk 2 fed a fresh cache (it does not see chunk 1)            -> L0.attn_probs at chunk 2
  inv-freq   the rotary inv_freq computed in bf16, on a 200-token prompt       -> L0.q_rope
  inv-freq-short  the same on the ~60-token prompt                          -> L0.q_rope or k_rope
  template   message 2's first two template tokens left out, the conversation captured with
             the dump                                                       -> the prompt check
Every float32 case but the template's is diffed a second time against the f32 GPU reference
(`--backend cuda`), which must give the CPU reference's exit code and first divergence.
Then the timing row: a model of Qwen3-0.6B's shape (random bf16 weights, scripts/bench_hf.py),
512 prompt tokens + 64 decode steps, capture time vs `kvdiff diff --backend cuda` time.

  python3 scripts/capture_hf_test.py KVDIFF_BINARY [OUT_DIR]
Exit 1 if any case does not come out as expected; a table last.
"""
import json
import os
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdiff_capture as kc  # noqa: E402

KVDIFF = sys.argv[1]
OUT = sys.argv[2] if len(sys.argv) > 2 else "/tmp"
WORK = "/tmp/kvdiff-capture"
MESSAGES = [
    {"role": "system", "content": "Always answer in lowercase."},
    {"role": "user", "content": "Some facts: Hugo's pet is parrot. Mia's city is lima."},
    {"role": "assistant", "content": "ok."},
    {"role": "user", "content": "Tell me Mia's city."},
]


def prompt_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def run(model, ids, out, cuts, bug=None, steps=16, prompt=None):
    """Prefill in pieces at `cuts`, then greedy decode, all captured (with the conversation
    `prompt`, for the prompt check, when given)."""
    dev = model.device
    cache = DynamicCache(config=model.config)
    bounds = [0] + cuts + [len(ids)]
    rotary = model.model.rotary_emb
    saved = rotary.inv_freq.clone()
    if bug in ("inv-freq", "inv-freq-short"):
        rotary.inv_freq.copy_(saved.to(torch.bfloat16).to(saved.dtype))
    try:
        with torch.no_grad(), kc.capture(model, out, engine=f"hf-{model.dtype}".replace("torch.", ""), prompt=prompt):
            for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
                piece = torch.tensor([ids[a:b]], device=dev)
                pos = torch.arange(a, b, device=dev)[None]
                kw = dict(past_key_values=cache, use_cache=True, position_ids=pos)
                if bug == "restart" and k > 0:
                    kw["position_ids"] = pos - a
                if bug == "no-cache" and k == 1:
                    kw["past_key_values"] = DynamicCache(config=model.config)
                logits = model(input_ids=piece, **kw).logits
            nxt = logits[0, -1].argmax()
            for s in range(steps):
                p = len(ids) + s
                logits = model(input_ids=nxt.view(1, 1), past_key_values=cache, use_cache=True,
                               position_ids=torch.tensor([[p]], device=dev)).logits
                nxt = logits[0, -1].argmax()
    finally:
        rotary.inv_freq.copy_(saved)


def long_ids(tok, most):
    """A prompt of at least most - 24 tokens and at most `most`: where a bug that grows with the
    position shows beyond bf16 rounding."""
    words = "anna keeps a blue kite near the old mill by the river".split()
    k = 1
    while True:
        m = [{"role": "user", "content": "Facts: " + " ".join(words * (k + 1)) + ". What does Anna keep?"}]
        if len(prompt_ids(tok, m)) > most:
            return prompt_ids(tok, [{"role": "user", "content": "Facts: " + " ".join(words * k) + ". What does Anna keep?"}])
        k += 1


def kvdiff_diff(model_dir, dump, extra=(), dumps=None, env=None, report=None):
    report = report or dump + ".json"
    t0 = time.time()
    p = subprocess.run([KVDIFF, "diff", "--model", model_dir, "--json", report, *extra, *(dumps or [dump])],
                       capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if env:
        print(p.stderr[-3000:], flush=True)
    if p.returncode not in (0, 1):
        return p.returncode, None, wall, p.stderr.strip().splitlines()[:2]
    r = json.load(open(report))
    d = r["paths"][0]["first_divergence"]
    site = (d["step"], d["tap"], d["position"]) if d else None
    return p.returncode, site, wall, r


def model_limit(mdir):
    return json.load(open(f"{mdir}/config.json"))["max_position_embeddings"]


def known_limit():
    """(model, dtype, case) whose expectation kvdiff may not meet, and why: on the families' tiny
    models (heads 16 or 32 wide, RoPE scaled by 2 to 8, at most 256 positions) bf16-rounded
    inverse frequencies move RoPE by about bf16's own rounding; on the CPU's bf16 emulation the
    aggregate test measures the bug at 1.6u RMS at two head dims (qwen2: named), 0.94u (mistral,
    llama3) and nothing above clean runs (qwen3-moe), where 1.5u is an alarm; Mistral's is named
    on the 200-token prompt only. A case listed here that is named anyway counts as expected."""
    return {(f"arch/{a}", "bfloat16", c) for a in ("qwen3-moe", "llama3")
            for c in ("inv-freq", "inv-freq-short")} | {("arch/mistral", "bfloat16", "inv-freq-short")}


def print_rows(rows):
    print()
    print(f"{'model':16} {'dtype':9} {'case':9} {'exit':>4} {'first divergence':34} {'expected':24} ok  capture s  diff s")
    for name, dname, case, code, site, want, ok, cap, wall, extra in rows:
        mark = "known" if ok == "known" else ("yes" if ok else "NO ")
        print(f"{name:16} {dname:9} {case:9} {code:>4} {str(site):34} {str(want):24} {mark:3} "
              f"{cap:8.2f} {wall:7.2f}  {extra}")


def main():
    os.makedirs(WORK, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows, failed = [], 0
    models = [("default-model", "fixtures/default-model"), ("random-model", "fixtures/random-model")]
    models += [(f"arch/{a}", f"fixtures/arch/{a}") for a in ("qwen3-moe", "qwen2", "llama3", "mistral")]
    if os.environ.get("CAPTURE_MODELS"):
        keep = os.environ["CAPTURE_MODELS"].split(",")
        models = [m for m in models if m[0] in keep]
    for name, mdir in (models if not os.environ.get("CAPTURE_TIMING_ONLY") else []):
        tok = AutoTokenizer.from_pretrained(mdir)
        ids = prompt_ids(tok, MESSAGES)
        n = len(ids)
        longer = long_ids(tok, model_limit(mdir) - 24)
        cuts = [n // 3, 2 * n // 3]
        # The seed's template bug: the engine's prompt lacks the first two template tokens of
        # message 2 (where message 1's rendering ends); the prompt check must name them there.
        try:
            sys_ids = tok.encode(tok.apply_chat_template(MESSAGES[:1], tokenize=False), add_special_tokens=False)
        except Exception:  # a template that refuses a lone system message (Mistral's)
            sys_ids = None
        head = len(sys_ids) if sys_ids and ids[:len(sys_ids)] == sys_ids else None
        for dtype in (torch.float32, torch.bfloat16):
            model = AutoModelForCausalLM.from_pretrained(mdir, dtype=dtype, attn_implementation="eager")
            model = model.to("cuda").eval()
            dname = str(dtype).replace("torch.", "")
            for case, c, bug, want in [
                ("standard", [], None, None),
                ("chunked", cuts, None, None),
                ("restart", cuts, "restart", ("L0.q_rope", cuts[0])),
                ("no-cache", cuts, "no-cache", ("L0.attn_probs", cuts[0])),
                ("inv-freq", [], "inv-freq", ("L0.q_rope", None)),
                # The same bug on the short prompt: in bf16 it stays inside the row test's
                # tolerance, and only RoPE rerun on the engine's own q and k names it.
                ("inv-freq-short", [], "inv-freq-short", ("L0.q_rope|L0.k_rope", None)),
                ("template", [], "template", ("prompt", head)),
            ]:
                if bug == "template" and head is None:
                    continue
                dump = f"{WORK}/{name.replace('/', '-')}-{dname}-{case}"
                t0 = time.time()
                fed = longer if bug == "inv-freq" else ids
                if bug == "template":
                    fed = ids[:head] + ids[head + 2:]
                run(model, fed, dump, c, bug, prompt=MESSAGES if bug == "template" else None)
                cap_s = time.time() - t0
                code, site, wall, r = kvdiff_diff(os.path.abspath(mdir), dump)
                if bug == "template":
                    part = (r.get("prompt_check") or {}).get("first_difference") if isinstance(r, dict) else None
                    ok = code == 1 and site is None and part is not None and part["kind"] == "missing" \
                        and head <= part["position"] <= head + 2
                    site = ("prompt", part["position"]) if part else site
                elif want is None:
                    ok = code == 0 and site is None
                else:
                    ok = code == 1 and site is not None and site[0] == 0 and site[1] in want[0].split("|") and \
                        (want[1] is None or site[2] == want[1])
                if not ok and (name, dname, case) in known_limit():
                    ok = "known"
                # An f32 engine held to the f32 GPU reference (`--backend cuda`, its default for
                # f32 dumps) must come out as against the CPU's f32 reference: same exit, same
                # step, tap and position. Experts have no f32 GPU reference.
                gpu_ref = ""
                if dtype == torch.float32 and bug != "template" and "moe" not in name:
                    gcode, gsite, _, gr = kvdiff_diff(os.path.abspath(mdir), dump, ["--backend", "cuda"],
                                                      report=dump + ".gpu-reference.json")
                    ref = gr.get("reference") if isinstance(gr, dict) else gr
                    same = (gcode, gsite) == (code, site) and ref == "kvdiff standard@cuda (f32)"
                    gpu_ref = " f32 GPU reference: " + ("same" if same else f"exit {gcode} at {gsite} ({ref})")
                    ok = ok if same else False
                    # The bf16 GPU reference on the same dump, for the record: bf16's bounds.
                    bcode, bsite, _, _ = kvdiff_diff(os.path.abspath(mdir), dump,
                                                     ["--backend", "cuda", "--precision", "bf16"],
                                                     report=dump + ".bf16-reference.json")
                    gpu_ref += "; bf16 GPU reference: " + ("same" if (bcode, bsite) == (code, site)
                                                           else f"exit {bcode} at {bsite}")
                failed += not ok
                extra = ""
                if r is not None and isinstance(r, dict):
                    e = r.get("engine", {})
                    ids_fed = e.get("rope_position_ids", [])[:2]
                    extra = f"rope ids {ids_fed}" if ids_fed else ""
                    tf = r["paths"][0].get("first_token_divergence")
                    if tf:
                        extra += f" token@step{tf['step']}{' near-tie' if tf['near_tie'] else ''}"
                else:
                    extra = str(r)
                extra += gpu_ref
                rows.append((name, dname, case, code, site, want, ok, cap_s, wall, extra))
                print(rows[-1], flush=True)
            del model
            torch.cuda.empty_cache()

    if os.environ.get("CAPTURE_SKIP_TIMING"):
        print_rows(rows)
        sys.exit(1 if failed else 0)
    # Capture vs diff time at Qwen3-0.6B's shape, 512 + 64 tokens.
    big = "/tmp/kvdiff-bench/model"
    if not os.path.exists(f"{big}/config.json"):
        os.makedirs("/tmp/kvdiff-bench", exist_ok=True)
        subprocess.run([sys.executable, "scripts/bench_hf.py", "build", ".cache/qwen3-tokenizer", big,
                        "/tmp/kvdiff-bench/prompt.json"], check=True, stdout=subprocess.DEVNULL)
    tok = AutoTokenizer.from_pretrained(big)
    messages = json.load(open("/tmp/kvdiff-bench/prompt.json"))
    messages = messages["messages"] if isinstance(messages, dict) else messages
    ids = prompt_ids(tok, messages)
    model = AutoModelForCausalLM.from_pretrained(big, dtype=torch.bfloat16, attn_implementation="eager")
    model = model.to("cuda").eval()
    dump = f"{WORK}/qwen3-0.6b-shape"
    run(model, ids[:8], dump + "-warm", [], None, 2)
    torch.cuda.synchronize()
    t0 = time.time()
    run(model, ids, dump, [], None, 64)
    cap_s = time.time() - t0
    size = sum(os.path.getsize(os.path.join(dump, f)) for f in os.listdir(dump))
    timing = []
    env = dict(os.environ, KVDIFF_TIMING="1")
    for backend in (["cuda", "cpu"] if os.environ.get("CAPTURE_CPU_TOO") else ["cuda"]):
        code, site, wall, r = kvdiff_diff(big, dump, ["--backend", backend, "-v"], env=env)
        timing.append((backend, code, site, wall))
    profile = f"{WORK}/profile.json"
    subprocess.run([KVDIFF, "calibrate", "-q", "--backend", "cuda", "--model", big, "--out", profile,
                    "/tmp/kvdiff-bench/prompt.json"], check=True)
    code, site, wall, r = kvdiff_diff(big, dump, ["--backend", "cuda", "--noise-profile", profile, "-v"], env=env)
    timing.append(("cuda, noise profile pinned (kvdiff calibrate, once per model)", code, site, wall))
    code, site, wall, r = kvdiff_diff(big, dump, ["--backend", "cuda", "--noise-profile", profile, "--no-replay", "-v"],
                                      env=env)
    timing.append(("cuda, noise profile pinned, --no-replay (taps compared only)", code, site, wall))
    code, site, wall, r = kvdiff_diff(big, dump, ["--tolerance", "fixed", "-v"], dumps=[dump, dump], env=env)
    timing.append(("none (the dump against itself, fixed tolerance)", code, site, wall))
    print_rows(rows)
    print(f"\nQwen3-0.6B shape, bf16 eager, {len(ids)} prompt tokens + 64 steps: capture {cap_s:.2f} s "
          f"({size / 1e6:.0f} MB dump)")
    for backend, code, site, wall in timing:
        print(f"  kvdiff diff --backend {backend}: {wall:.2f} s wall, exit {code}, first divergence {site}; "
              f"capture / diff = {cap_s / wall:.2f}")
    json.dump({"rows": [list(map(str, r)) for r in rows], "capture_s": cap_s, "dump_mb": size / 1e6,
               "diff": timing}, open(f"{OUT}/capture-hf.json", "w"), indent=1)
    sys.exit(1 if failed else 0)


main()
