"""How often blame by replay raises a false alarm: clean bf16 engine dumps (the CPU's emulation of
a bf16 engine, `kvdiff dump --precision bf16`), one per conversation of fixtures/prompt-set.jsonl
and model, each held to kvdiff's reference by `kvdiff diff`. A correct engine is never DIVERGED;
the table gives, per model, the runs, the alarms (by test), and the margins: the most any op added
over the run, as a share of its bound, and the aggregate test's largest RMS at one value over the
rows, as a share of its bound (1.0 would be an alarm).

  python3 scripts/replay_false_alarms.py KVDIFF_BINARY [CONVERSATIONS] [--models a,b] [--out FILE]

No torch needed. Exit 1 if any clean run is DIVERGED.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "default": None,
    "random-model": "fixtures/random-model",
    "qwen2": "fixtures/arch/qwen2",
    "mistral": "fixtures/arch/mistral",
}


def one(kvdiff, model, conv, work, profile):
    """(exit code, the first divergence's test or None, the margin) of one clean run."""
    d = os.path.join(work, conv["id"])
    prompt = d + ".json"
    with open(prompt, "w") as f:
        json.dump({"messages": conv["messages"]}, f)
    m = ["--model", os.path.join(ROOT, model)] if model else []
    o = subprocess.run([kvdiff, "dump", "-q", "--precision", "bf16", "--max-new-tokens", "4",
                        "--out", d, *m, prompt], capture_output=True, text=True)
    if o.returncode != 0:
        return None  # a prompt the model cannot take (too long): not a run
    report = d + ".report.json"
    o = subprocess.run([kvdiff, "diff", "-q", "--noise-profile", profile, "--json", report, *m, d],
                       capture_output=True, text=True)
    if o.returncode not in (0, 1):
        return ("error", o.stderr.strip()[-200:], 0.0, "-", 0.0, "-")
    r = json.load(open(report))
    first = r["paths"][0]["first_divergence"]
    rep = r["engine"].get("replay") or {"per_op": [], "bound_max": 1, "bound_rms": 1}
    margin, where = 0.0, "-"
    for p in rep["per_op"]:
        for share, what in ((p["max"] / rep["bound_max"], "at a value"), (p["rms"] / rep["bound_rms"], "over a row")):
            if share > margin:
                margin, where = share, f"{p['op']} {what} ({conv['id']}, {p['at']})"
    worst = rep.get("systematic_worst")
    agg = worst[0] / rep["systematic_bound"] if worst else 0.0
    agg_at = f"{worst[1]} ({conv['id']})" if worst else "-"
    return (o.returncode, first and f"{first['test']} {first['tap']} step {first['step']} position {first['position']}",
            margin, where, agg, agg_at)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kvdiff")
    ap.add_argument("conversations", nargs="?", default=os.path.join(ROOT, "fixtures/prompt-set.jsonl"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out")
    a = ap.parse_args()
    kvdiff = os.path.abspath(a.kvdiff)
    convs = [json.loads(line) for line in open(a.conversations) if line.strip()]
    rows, alarms = [], 0
    with tempfile.TemporaryDirectory() as work:
        for name in a.models.split(","):
            model = MODELS[name]
            mdir = os.path.join(work, name)
            os.makedirs(mdir)
            profile = os.path.join(mdir, "profile.json")
            m = ["--model", os.path.join(ROOT, model)] if model else []
            subprocess.run([kvdiff, "calibrate", "-q", "--out", profile, *m,
                            os.path.join(ROOT, "fixtures/prompts/two-contexts.txt")], check=True)
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
                got = [g for g in ex.map(lambda c: one(kvdiff, model, c, mdir, profile), convs) if g]
            diverged = [g for g in got if g[0] != 0]
            alarms += len(diverged)
            by_test = {}
            for g in diverged:
                by_test[str(g[1]).split(" ")[0]] = by_test.get(str(g[1]).split(" ")[0], 0) + 1
            margins = sorted(g[2] for g in got)
            worst = max(got, key=lambda g: g[2])[3] if got else "-"
            agg = max(got, key=lambda g: g[4]) if got else (0, 0, 0, 0, 0.0, "-")
            aggs = sorted(g[4] for g in got)
            rows.append((name, len(got), len(diverged), by_test, margins[-1] if margins else 0.0,
                         margins[len(margins) // 2] if margins else 0.0, worst, agg[4],
                         aggs[len(aggs) // 2] if aggs else 0.0, agg[5], [g[1] for g in diverged][:3]))
            print(rows[-1], flush=True)
    print("\n| model | clean runs | DIVERGED | by test | largest margin | median margin | the largest: op, run, site "
          "| aggregate test: largest | median | where |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, n, bad, by_test, worst, median, where, agg, agg_med, agg_at, _ in rows:
        print(f"| {name} | {n} | {bad} | {by_test or '-'} | {worst:.2f} | {median:.2f} | {where} "
              f"| {agg:.2f} | {agg_med:.2f} | {agg_at} |")
    total = sum(r[1] for r in rows)
    print(f"\n{alarms} false alarms in {total} clean runs (the margin is the most any op added, "
          f"as a share of its bound; the aggregate test's, its largest RMS at a value over the rows, as a share of its bound)")
    if a.out:
        json.dump(rows, open(a.out, "w"))
    sys.exit(1 if alarms else 0)


main()
