"""The capture package on a real nano-vllm at tensor_parallel_size=2, held to kvdiff's reference.

nano-vllm-fork runs rank 0 in this process and rank 1 in a worker process it spawns (NCCL between
them). The capture is opened exactly as the README shows, `with kc.capture(llm, "dump/"):`,
after the engine and its worker exist; every case then runs `kvdiff diff` on the dump:

- clean runs (one prompt; a prefix-cache hit with a chunk over cached KV; continuous batching)
  must be EQUIVALENT;
- positions restarting per chunk (in every rank) must be named at `L0.q_rope` at the chunk's
  first token;
- a q_norm weight shard wrong in rank 1 alone must be named at `L0.q`, at a head of rank 1's
  half, and the report must say rank 1 holds it;
- the clean dump with rank 1's files removed must be refused (exit 2) naming rank 1.

Needs two GPUs and nano-vllm installed:

  python3 scripts/nano_vllm_tp_suite.py KVDIFF_BIN OUT_DIR

Everything at module level also runs in the worker nano-vllm spawns (it imports this file as its
main module), which is how the RoPE compatibility shim and the planted faults reach rank 1.
"""

import functools
import json
import os
import shutil
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = os.path.join(ROOT, "fixtures", "default-model")
BLOCK = 256
sys.path.insert(0, os.path.join(HERE, "nano_vllm"))  # the flash_attn stand-in
sys.path.insert(0, HERE)

import torch  # noqa: E402
import nanovllm.engine.model_runner as mr  # noqa: E402
import rope_compat  # noqa: E402  (scripts/nano_vllm/, on the path above)

rope_compat.install()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# nano-vllm-fork has each rank pick its rendezvous port alone (the first free one from 2333):
# rank 0's store, already listening there, pushes the worker to the next port, and both ranks
# wait forever. One port, chosen here and inherited by the worker through the environment.
os.environ.setdefault("KVDIFF_TP_PORT", str(_free_port()))
mr.find_available_port = lambda *_, **__: int(os.environ["KVDIFF_TP_PORT"])
# Its Sequence pickles only what the model runs on, yet ModelRunner.run reads the sampling
# fields in every rank: a worker's first call raises AttributeError. Class-level defaults (what
# a plain request has) let the worker's unpickled copies run.
mr.Sequence.cfg_scale, mr.Sequence.paired_seq = 1.0, None
mr.Sequence.logits_processor = mr.Sequence.logits_processor_update_state = None

SYSTEM = "Always answer in uppercase."
FACTS = ("Anna's color is blue. Sam's city is lima. Mia's pet is a cat. Leo's food is rice. "
         "Ivy's tree is an oak. Tom's car is red. Zoe's book is old. Max's shoe is black. ")


def conversation(n_facts, question="Tell me Anna's color."):
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Note the following. " + FACTS * n_facts},
            {"role": "assistant", "content": "ok."},
            {"role": "user", "content": question}]


# Planted faults, applied in the ranks a case names (`in_workers` carries one to the worker).
_original_prefill = mr.ModelRunner.prepare_prefill


def _positions_restart(self, seqs):
    input_ids, positions = _original_prefill(self, seqs)
    fed = [p for s in seqs for p in range(len(s) - s.num_cached_tokens)]
    return input_ids, torch.tensor(fed, dtype=torch.int64, device=positions.device)


def plant(fault, on, runner=None):
    """Applies (on=True) or undoes a fault in this process."""
    if runner is None:
        raise ValueError("plant needs the runner")
    if fault == "positions-restart":
        mr.ModelRunner.prepare_prefill = _positions_restart if on else _original_prefill
    elif fault == "q-norm-shard":
        # Rank 1's copy of layer 0's q_norm weight loaded from the wrong place: scaled.
        w = runner.model.model.layers[0].self_attn.q_norm.weight
        with torch.no_grad():
            w.mul_(1.5 if on else 1 / 1.5)
    return None


def diff(kvdiff, dump):
    report = dump + ".json"
    o = subprocess.run([kvdiff, "diff", "--model", MODEL, "--json", report, dump],
                       capture_output=True, text=True)
    with open(dump + ".txt", "w") as f:
        f.write(o.stdout + o.stderr)
    files = sorted(f for f in os.listdir(os.path.dirname(dump))
                   if f.startswith(os.path.basename(dump) + ".") and f.endswith(".json"))
    reports = [json.load(open(os.path.join(os.path.dirname(dump), f))) for f in files]
    return o, [r["paths"][0]["first_divergence"] for r in reports]


def main():
    from transformers import AutoTokenizer
    from nanovllm import LLM, SamplingParams
    import kvdiff_capture as kc
    from kvdiff_capture.adapters.nano_vllm_workers import in_workers

    kvdiff, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    os.makedirs(out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(MODEL)
    llm = LLM(MODEL, enforce_eager=True, tensor_parallel_size=2, max_model_len=512,
              max_num_batched_tokens=2048, max_num_seqs=16, gpu_memory_utilization=0.3)
    runner = llm.model_runner

    def ids_of(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    def sp(n):
        return SamplingParams(temperature=1e-5, top_k=1, max_tokens=n, ignore_eos=True)

    def run(schedule):
        step, pending = 0, sorted(schedule, key=lambda r: r[0])
        while pending or not llm.is_finished():
            while pending and pending[0][0] <= step:
                _, ids, n = pending.pop(0)
                llm.add_request(list(ids), sp(n))
            if not llm.is_finished():
                llm.step()
            step += 1

    short = conversation(1)
    scenarios = {
        "whole": lambda: run([(0, ids_of(short), 8)]),
        "prefix-hit": lambda: run([(0, ids_of(conversation(5)), 12),
                                   (1, ids_of(conversation(5, "Tell me Sam's city.")), 6)]),
        "continuous": lambda: run([(0, ids_of(short), 10), (2, ids_of(conversation(2)), 4)]),
    }

    def set_fault(fault, ranks, on):
        # Rank 1 is reached through nano-vllm's own call channel, as the capture reaches it.
        if 1 in ranks:
            in_workers(runner, functools.partial(plant, fault, on), out, f"plant-{fault}-{on}")
        if 0 in ranks:
            plant(fault, on, runner)

    # (case, scenario, fault, ranks it is planted in, expectation)
    cases = [
        ("clean whole", "whole", None, (), "equivalent"),
        ("clean prefix-cache hit", "prefix-hit", None, (), "equivalent"),
        ("clean continuous batching", "continuous", None, (), "equivalent"),
        ("positions restart per chunk (both ranks)", "prefix-hit", "positions-restart", (0, 1),
         ("L0.q_rope", 0, BLOCK, None)),
        ("q_norm shard wrong in rank 1 only", "whole", "q-norm-shard", (1,), ("L0.q", 0, 0, 1)),
    ]
    rows = []
    for name, scenario, fault, ranks, expect in cases:
        slug = name.split(" (")[0].replace(" ", "-")
        dump = os.path.join(out, slug)
        if fault:
            set_fault(fault, ranks, True)
        try:
            with kc.capture(llm, dump, prompt=short if scenario == "whole" else None,
                            model_name=MODEL):
                scenarios[scenario]()
        finally:
            if fault:
                set_fault(fault, ranks, False)
        files = sorted(os.listdir(dump))
        r1 = sum(1 for f in files if ".rank-1." in f)
        o, firsts = diff(kvdiff, dump)
        if expect == "equivalent":
            ok = o.returncode == 0 and firsts and all(d is None for d in firsts)
            said = f"exit {o.returncode}, {len(firsts)} seq EQUIVALENT" if ok else o.stdout[-400:]
        else:
            tap, step, pos, rank = expect
            hit = [d for d in firsts if d]
            ok = o.returncode == 1 and bool(hit) and all(
                d["tap"] == tap and d["step"] == step and d["position"] == pos for d in hit)
            if rank is not None:
                ok = ok and all((d.get("tp_rank") or {}).get("rank") == rank for d in hit)
            said = "; ".join(f"{d['tap']} step {d['step']} position {d['position']} head {d['head']}"
                             f" rank {(d.get('tp_rank') or {}).get('rank')}" for d in hit) or o.stdout[-300:]
        rows.append((name, ok, f"{len(files)} files ({r1} from rank 1): {said}"))

    # Rank 1's files gone (a process that ran without the capture): refused, naming rank 1.
    clean = os.path.join(out, "clean-whole")
    missing = os.path.join(out, "rank-missing")
    shutil.rmtree(missing, ignore_errors=True)
    shutil.copytree(clean, missing)
    for f in os.listdir(missing):
        if ".rank-1." in f:
            os.remove(os.path.join(missing, f))
    o = subprocess.run([kvdiff, "diff", "--model", MODEL, missing], capture_output=True, text=True)
    err = o.stderr.strip()
    rows.append(("rank 1's files removed", o.returncode == 2 and "tensor-parallel rank 1 of 2" in err,
                 f"exit {o.returncode}: {err[:160]}"))

    print("\n| case (nano-vllm, tensor_parallel_size=2, bf16) | as expected | what kvdiff said |")
    print("| --- | --- | --- |")
    for name, ok, said in rows:
        print(f"| {name} | {'yes' if ok else 'NO'} | {said} |")
    for f in os.listdir(out):
        if f.startswith("q_norm") and f.endswith(".txt"):
            print(f"\nkvdiff diff, q_norm shard wrong in rank 1:\n{open(os.path.join(out, f)).read()}")
    failed = sum(1 for r in rows if not r[1])
    print(f"{len(rows) - failed} of {len(rows)} as expected")
    llm.exit() if hasattr(llm, "exit") else None
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
