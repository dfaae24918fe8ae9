"""HF transformers' `generate()` as people configure it, captured with kvdiff_capture and held to
kvdiff's reference by `kvdiff diff` (GPU machine: torch + transformers; kvdiff built elsewhere).

Axes, on two families (MODELS: one in bfloat16, one in float32):
  cache      default, static, offloaded, and the family's sliding-window cache where it has one
  attention  eager, sdpa
  batch      one prompt; three prompts of different lengths left-padded; the same right-padded
             (right3), and right-padded with position ids taken from the mask in every call
             (right3-ids: generate() continues a right-padded row's decode ids from its pad's
             filler id, as transformers' own warning about right padding says; kvdiff names that)
  chunk      prefill_chunk_size off, 16
  compile    off; on (the user's own torch.compile(model.forward))
Cases in each configuration:
  clean      every sequence EQUIVALENT
  rope-freq  RoPE's inverse frequencies off by 2 % past the first     -> L0.q_rope/k_rope, step 0
  restart    (configurations that chunk) the second prefill chunk's position ids restart at 0
                                                                       -> L0.q_rope/k_rope at its first row
A configuration transformers refuses (a cache it does not offer) is listed as n/a.

  python3 scripts/capture_hf_matrix.py KVDIFF_BINARY [OUT_DIR]
Each (family, compile) runs in a process of its own; `kvdiff diff` runs beside generation on the
host's cores. Exit 1 on a false alarm or a fault not named; a markdown table last (OUT_DIR/
hf-matrix.md), and every row as JSON (OUT_DIR/hf-matrix.jsonl).
"""
import concurrent.futures as cf
import itertools
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = [("mistral", "fixtures/arch/mistral", "bfloat16"), ("qwen3", "fixtures/default-model", "float32")]
SLIDING = {"mistral"}
"""The families whose config has a sliding window."""
CACHES = ["default", "static", "offloaded", "sliding"]
ATTENTION = ["eager", "sdpa"]
BATCHES = ["one", "left3", "right3", "right3-ids"]
CHUNKS = [None, 16]
WORK = "/tmp/kvdiff-hf-matrix"
STEPS = 6
FACTS = "Anna keeps a blue kite. Sam lives in Lima. Mia has a cat named Ivy. Leo cooks rice. "
# Three lengths, less than a prefill chunk apart: every sequence has real rows in the first chunk
# and fills the second, where the restart is planted.
QUESTION = "Where does Sam live, and what does Leo cook?"


def conversations():
    return [[{"role": "user", "content": "Hi. " * k + "Note these facts. " + FACTS * 3 + QUESTION}]
            for k in (0, 1, 3)]


def diff(kvdiff, model_dir, dump):
    """`kvdiff diff` of every sequence: [(seq, exit code, first divergence or None, rope ids)]."""
    report = dump + ".json"
    p = subprocess.run([kvdiff, "diff", "-q", "--model", model_dir, "--json", report, dump],
                       capture_output=True, text=True)
    if p.returncode not in (0, 1):
        return [(None, p.returncode, ("error", p.stderr.strip().splitlines()[-1:]), None)]
    files = sorted(f for f in os.listdir(os.path.dirname(report))
                   if f.startswith(os.path.basename(dump) + ".") and f.endswith(".json"))
    out = []
    for f in files:
        r = json.load(open(os.path.join(os.path.dirname(report), f)))
        seq = f.split(".seq-")[1].split(".")[0] if ".seq-" in f else "0"
        d = r["paths"][0]["first_divergence"]
        code = r["outcome"]["exit_code"]
        out.append((int(seq), code, (d["step"], d["tap"], d["position"]) if d else None,
                    r["engine"].get("rope_position_ids")))
    return out


def part(family, compile_on, kvdiff, out):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sys.path.insert(0, HERE)
    import kvdiff_capture as kc

    torch.backends.cuda.matmul.allow_tf32 = False
    name, mdir, dtype = next(m for m in MODELS if m[0] == family)
    mdir = os.path.join(ROOT, mdir)
    sliding = json.load(open(os.path.join(mdir, "config.json"))).get("sliding_window")
    tok = AutoTokenizer.from_pretrained(mdir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations()]
    pool = cf.ThreadPoolExecutor(max_workers=6)
    pending, rows = [], []
    models = {}
    dynamo = None
    if compile_on:
        import torch._dynamo.utils as du
        dynamo = du.counters
    for attn in ATTENTION:
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=getattr(torch, dtype), attn_implementation=attn)
        model = model.to("cuda").eval()
        if compile_on:
            model.forward = torch.compile(model.forward)
        models[attn] = model
    rotary_saved = {a: m.model.rotary_emb.inv_freq.clone() for a, m in models.items()}
    for cache, attn, batch, chunk in itertools.product(CACHES, ATTENTION, BATCHES, CHUNKS):
        if cache == "sliding" and not sliding:
            continue
        model = models[attn]
        for case in ("clean", "rope-freq", "restart"):
            if case == "restart" and chunk is None:
                continue
            config = dict(family=family, dtype=dtype, cache=cache, attention=attn, batch=batch,
                          chunk=chunk or "off", compile="on" if compile_on else "off", case=case)
            tag = "-".join(str(v) for v in config.values())
            dump = os.path.join(WORK, tag)
            tok.padding_side = "right" if batch.startswith("right") else "left"
            fed = texts[-1:] if batch == "one" else texts
            enc = tok(fed, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
            kw = dict(max_new_tokens=STEPS, do_sample=False, pad_token_id=tok.pad_token_id)
            if cache == "sliding":
                kw["cache_implementation"] = "sliding_window"
            elif cache != "default":
                kw["cache_implementation"] = cache
            if chunk:
                kw["prefill_chunk_size"] = chunk
            hooks = []
            if batch == "right3-ids":
                # Every row's position id counted over the mask, decode steps included.
                full = torch.cat([enc["attention_mask"], torch.ones(len(fed), STEPS + 1, dtype=torch.long,
                                                                    device="cuda")], 1)
                by_slot = full.cumsum(-1) - 1

                def mask_ids(_m, args, kwargs):
                    ids, at = kwargs.get("input_ids"), kwargs.get("cache_position")
                    if ids is None or kwargs.get("position_ids") is None:
                        return None
                    if at is None:
                        past = kwargs.get("past_key_values")
                        start = past.get_seq_length() if past is not None else 0
                        at = torch.arange(start, start + ids.shape[1], device=ids.device)
                    kwargs["position_ids"] = by_slot[:, at.reshape(-1)]
                    return args, kwargs
                hooks.append(model.register_forward_pre_hook(mask_ids, with_kwargs=True))
            rotary = model.model.rotary_emb
            if case == "rope-freq":
                rotary.inv_freq[1:] *= 1.02
            if case == "restart":
                calls = []

                def restart(_m, args, kwargs):
                    ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
                    if ids is None or pos is None or ids.shape[1] == 1:
                        return None
                    calls.append(1)
                    if len(calls) == 2:  # the second prefill chunk: its ids restart at 0
                        kwargs["position_ids"] = pos - pos[:, :1].clamp(min=0)
                        return args, kwargs
                    return None
                hooks.append(model.register_forward_pre_hook(restart, with_kwargs=True))
            t0 = time.time()
            graphs0 = dynamo["stats"]["unique_graphs"] if dynamo is not None else 0
            try:
                with torch.no_grad(), kc.capture(model, dump, engine=f"hf-generate-{dtype}"):
                    model.generate(**enc, **kw)
                err = None
            except Exception as e:  # a configuration transformers does not offer, or a refusal
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:140]}"
                if os.environ.get("MATRIX_TRACE"):
                    traceback.print_exc()
            finally:
                for h in hooks:
                    h.remove()
                rotary.inv_freq.copy_(rotary_saved[attn])
            config["capture_s"] = round(time.time() - t0, 2)
            # Graphs dynamo compiled during this run: after the first runs, none (no recompile
            # per tap).
            config["graphs_compiled"] = (dynamo["stats"]["unique_graphs"] - graphs0) if dynamo is not None else None
            # Where each sequence's second chunk starts: its first real row at slot 16 or later.
            firsts = [sum(m[:chunk]) if chunk else None for m in enc["attention_mask"].tolist()]
            if err is not None:
                config["error"] = err
                rows.append(config)
                continue
            config["firsts"] = firsts
            pending.append((config, firsts, pool.submit(diff, kvdiff, mdir, dump)))
    for config, firsts, fut in pending:
        results = fut.result()
        config["sequences"] = [[s, c, list(d) if d else None, (rope or [])[:3]] for s, c, d, rope in results]
        config["ok"] = judge(config, results, firsts)
        rows.append(config)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def right_padding_finding(config, site, rope):
    """What generate() itself computes otherwise for a right-padded row, after a prompt that is
    equivalent (transformers warns that right padding gives wrong generations): its decode steps
    feed RoPE the pad's filler id + k (named with the ids fed), and a sliding window counts the
    pad slots, so that a decode row attends fewer of its keys (named at its attention)."""
    if site is None or site[0] < 1:
        return False
    if config["batch"] == "right3":
        return bool(rope)
    return config["batch"] == "right3-ids" and config["family"] in SLIDING and \
        site[1].split(".")[-1] in ("attn_probs", "attn_out")


def judge(config, results, firsts):
    """A clean run: every sequence equivalent. A fault: every sequence named at RoPE (step 0),
    the restart at its second chunk's first row."""
    if not results or results[0][0] is None:
        return False
    for seq, code, site, rope in results:
        if config["case"] == "clean":
            if code != 0 and not right_padding_finding(config, site, rope):
                return False
            continue
        if code != 1 or site is None or site[0] != 0 or site[1] not in ("L0.q_rope", "L0.k_rope"):
            return False
        if config["case"] == "restart" and firsts[seq] is not None and site[2] != firsts[seq]:
            return False
    return True


def table(rows):
    """Markdown: a line per family, cache, attention and batch; each cell over its prefill
    chunking (off, 16) and compile (off, on) runs: how many came out as they must, and how."""
    by = {}
    for r in rows:
        key = (r["family"], r["dtype"], r["cache"], r["attention"], r["batch"])
        by.setdefault(key, {}).setdefault(r["case"], []).append(r)
    lines = ["| family | dtype | cache | attention | batch | clean | RoPE frequencies off | positions restart (chunk 2) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(runs):
        if not runs:
            return "–"
        errors = [r for r in runs if "error" in r]
        if errors:
            return f"n/a ({errors[0]['error'].split(':')[0]})"
        ok = sum(bool(r["ok"]) for r in runs)
        if runs[0]["case"] == "clean":
            named = sorted({q[2][1] for r in runs for q in r["sequences"] if q[2]})
            what = "EQUIVALENT" if not named else "prompt EQUIVALENT, generate()'s own decode named at " + ", ".join(named)
            return f"{what} {ok}/{len(runs)}" if ok == len(runs) else f"**FALSE ALARM** in {len(runs) - ok} of {len(runs)}"
        sites = sorted({q[2][1] for r in runs for q in r["sequences"] if q[2]})
        return f"named {ok}/{len(runs)} ({', '.join(sites)})" if ok == len(runs) else f"**MISSED** in {len(runs) - ok} of {len(runs)}"
    for key in sorted(by):
        cases = by[key]
        lines.append("| " + " | ".join(key) + " | " +
                     " | ".join(cell(cases.get(c, [])) for c in ("clean", "rope-freq", "restart")) + " |")
    return "\n".join(lines)


def summary(rows):
    ran = [r for r in rows if "error" not in r]
    clean = [r for r in ran if r["case"] == "clean"]
    faults = [r for r in ran if r["case"] != "clean"]
    hf_right = sum(1 for r in clean if r["ok"] and any(q[2] for q in r["sequences"]))
    return (f"clean runs {len(clean)}, false alarms {sum(not r['ok'] for r in clean)} (generate()'s own "
            f"right-padding differences named: {hf_right}); planted faults {len(faults)}, missed "
            f"{sum(not r['ok'] for r in faults)}; n/a {len(rows) - len(ran)}")


def rejudge(rows):
    """Clean runs judged again (a table from an earlier run's rows under today's rules)."""
    for r in rows:
        if "error" not in r and r["case"] == "clean":
            r["ok"] = all(c == 0 or right_padding_finding(r, d, rope) for _, c, d, rope in r["sequences"])
    return rows


def main():
    if sys.argv[1] == "--part":
        part(sys.argv[2], sys.argv[3] == "on", sys.argv[4], sys.argv[5])
        return
    if sys.argv[1] == "--table":
        rows = rejudge([json.loads(line) for line in open(sys.argv[2])])
        print(table(rows) + "\n\n" + summary(rows))
        return
    kvdiff, out = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "/tmp")
    os.makedirs(WORK, exist_ok=True)
    procs = []
    for (family, _, _), compile_on in itertools.product(MODELS, ("off", "on")):
        part_out = os.path.join(WORK, f"{family}-{compile_on}.jsonl")
        log = open(part_out + ".log", "w")
        procs.append((part_out, subprocess.Popen([sys.executable, __file__, "--part", family, compile_on, kvdiff, part_out],
                                                 stdout=log, stderr=subprocess.STDOUT)))
    rows = []
    for part_out, p in procs:
        p.wait()
        if p.returncode != 0 or not os.path.exists(part_out):
            print(f"part {part_out} failed:\n" + open(part_out + ".log").read()[-3000:])
            continue
        rows += [json.loads(line) for line in open(part_out)]
    with open(os.path.join(out, "hf-matrix.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    md = table(rows)
    open(os.path.join(out, "hf-matrix.md"), "w").write(md + "\n")
    bad = [r for r in rows if "error" not in r and not r["ok"]]
    print(md)
    print("\n" + summary(rows) + f"; parts failed {sum(p.returncode != 0 for _, p in procs)}")
    for r in bad[:20]:
        print("NOT OK:", json.dumps(r))
    sys.exit(1 if bad or any(p.returncode != 0 for _, p in procs) else 0)


main()
