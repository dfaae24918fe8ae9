"""The capture package under torchrun: every rank opens `kc.capture` itself and writes its own
heads; rank 0 opens the folder first and renames it last, and keeps it only if every rank got
through its block.

The engine here replays kvdiff's own dump of the default model as two tensor-parallel ranks
(each rank the half of every sharded tap's heads a real TP engine computes), so a clean run must
be EQUIVALENT; then rank 1 alone changes one head of `L0.q_rope` at position 5, which must be
named there, at a head of rank 1's half, with the report saying rank 1 holds it; and a rank that
raises inside its block must leave no dump.

  python3 scripts/capture_torchrun_test.py KVDIFF_BIN OUT_DIR     (torch installed; no GPU needed)
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROMPT = os.path.join(ROOT, "fixtures", "prompts", "no-system.json")
MODEL = os.path.join(ROOT, "fixtures", "default-model")
SHARDED = ("q", "k", "v", "q_rope", "k_rope", "attn_probs", "attn_out")


def rank_main(source, dump, fault):
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    sys.path.insert(0, HERE)
    import kvdiff_capture as kc

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = sorted(f for f in os.listdir(source) if f.endswith(".safetensors"))
    try:
        with kc.capture(None, dump, engine="torchrun-replay", dtype="float32", prompt_len=None) as cap:
            for f in steps:
                t = load_file(os.path.join(source, f))
                cap.begin(t["tokens"], positions=t["positions"])
                for name, x in t.items():
                    if name in ("tokens", "positions"):
                        continue
                    kind = name.rsplit(".", 1)[-1]
                    if name.startswith("L") and kind in SHARDED:
                        w = x.shape[1] // world
                        x = x[:, rank * w:(rank + 1) * w].clone()
                        if fault == "head" and rank == 1 and name == "L0.q_rope" and f == steps[0]:
                            x[5, 0, :] += 1.0
                    kc.tap(name, x)
                if fault == "raise" and rank == 1:
                    raise RuntimeError("rank 1 fails inside its block")
                cap.end()
    except RuntimeError as e:
        print(f"rank {rank}: {e}")
    dist.destroy_process_group()


def main():
    if sys.argv[1] == "--rank":
        rank_main(*sys.argv[2:5])
        return
    kvdiff, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    source = os.path.join(out, "kvdiff-dump")
    subprocess.run([kvdiff, "dump", "-q", "--max-new-tokens", "4", "--out", source, PROMPT], check=True)
    rows = []
    for fault in ("none", "head", "raise"):
        dump = os.path.join(out, f"torchrun-{fault}")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", "29533", __file__, "--rank", source, dump, fault],
                       check=True, env=env)
        if fault == "raise":
            ok = not os.path.exists(dump) and not os.path.exists(dump + ".partial")
            rows.append(("rank 1 raises inside its block", ok, "no dump left" if ok else "a dump was left"))
            continue
        files = sorted(os.listdir(dump))
        o = subprocess.run([kvdiff, "diff", "--model", MODEL, "--json", dump + ".json", dump],
                           capture_output=True, text=True)
        d = json.load(open(dump + ".json"))["paths"][0]["first_divergence"]
        if fault == "none":
            ok = o.returncode == 0 and d is None
            said = f"exit {o.returncode}, {len(files)} files"
        else:
            ok = (o.returncode == 1 and d["tap"] == "L0.q_rope" and d["position"] == 5
                  and d["head"] == 2 and d.get("tp_rank") == {"rank": 1, "of": 2})
            said = f"{d['tap']} position {d['position']} head {d['head']} rank {d.get('tp_rank')}"
        rows.append((f"fault: {fault}", ok, said))
    print("\n| torchrun, 2 ranks | as expected | what kvdiff said |\n| --- | --- | --- |")
    for name, ok, said in rows:
        print(f"| {name} | {'yes' if ok else 'NO'} | {said} |")
    failed = sum(1 for r in rows if not r[1])
    print(f"{len(rows) - failed} of {len(rows)} as expected")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
