"""Replays a kvdiff dump through kvdiff_capture as an engine would (no torch needed): the prefill
as two forward calls, each decode step as one, rows numbered by the capture itself, every tensor
written through `tap()` as plain Python lists. `kvdiff diff` must find the replay equivalent to
the original, and name the one row `--perturb` changes.

  python3 scripts/capture_selftest.py SOURCE_DUMP OUT_DIR [--perturb TAP STEP ROW]
      [--batched [N] | --staggered | --cached] [--prompt PROMPT_FILE]

--batched packs two copies of the run (N with a count) into every call as sequences 0, 1, ...;
--padded does the
same as HF generate() does for a left-padded batch over a static cache: sequence 0 behind pad
rows (mask 0, junk values, RoPE ids of 1), attention columns at cache slots with junk in its pad
columns and in every unused slot past the sequences; --staggered runs
them as sequences 3 and 9 of a continuous-batching engine (9 joins a call later and finishes
later). Only the second copy is perturbed. --cached leaves the prompt's first half uncomputed,
as a prefix-cache hit does (tokens only). --prompt stores the conversation in meta.json.
"""
import json
import os
import struct
import sys
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdiff_capture as kc  # noqa: E402


def read(path):
    """A safetensors file as {name: (dtype, shape, flat values)}, read by hand."""
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        code = {"F32": "f", "I64": "q"}[h["dtype"]]
        out[name] = (h["dtype"], h["shape"], array(code, b[8 + n + lo:8 + n + hi]).tolist())
    return out


def rows(t, keep):
    _, shape, flat = t
    w = len(flat) // max(shape[0], 1)
    return [flat[r * w:(r + 1) * w] for r in keep], shape[1:]


def nest(flat, shape):
    if len(shape) <= 1:
        return list(flat)
    step = len(flat) // shape[0]
    return [nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def calls_of(src, steps, perturb, copy_perturbed):
    """The replayed run as forward calls: (tokens, positions, {tap: rows}) each, the prefill in
    two calls; the perturbation, if any, applied to this copy only when `copy_perturbed`."""
    out = []
    for f in steps:
        step = int(f[5:9])
        t = read(os.path.join(src, f))
        n = t["positions"][1][0]
        for call in ([range(0, n // 2), range(n // 2, n)] if step == 0 else [range(n)]):
            taps = {}
            for name, tensor in t.items():
                if name in ("tokens", "positions") or name.endswith(".positions"):
                    continue
                r, shape = rows(tensor, call)
                if copy_perturbed and perturb and name == perturb[0] and step == int(perturb[1]):
                    want = int(perturb[2])
                    for k, i in enumerate(call):
                        if i == want:
                            big = max(abs(x) for x in r[k])
                            r[k] = list(r[k])
                            r[k][len(r[k]) // 3] += 0.05 * big
                taps[name] = [nest(x, shape) for x in r]
            out.append(([t["tokens"][2][i] for i in call], [t["positions"][2][i] for i in call], taps, n if step == 0 else None))
    return out


PAD = 3
"""Sequence 0's left padding in the --padded replay."""


def padded(cap, a, b):
    """Copies `a` (sequence 0, left-padded by PAD) and `b` (sequence 1) in one batch, every
    attention row laid out over a static cache: slot = position + the sequence's padding."""
    width = PAD + max(pos[-1] for _, pos, _, _ in a) + 4
    for k, ((ta, pa, xa, _), (tb, pb, xb, _)) in enumerate(zip(a, b)):
        pads = PAD if k == 0 else 0
        toks = [0] * pads + ta + tb
        pos = [0] * pads + pa + pb
        seq = [0] * (pads + len(ta)) + [1] * len(tb)
        mask = [0] * pads + [1] * (len(ta) + len(tb))
        rope = [1] * pads + pa + pb
        cap.begin(toks, positions=pos, rope_positions=rope, seq=seq, mask=mask)
        for name in xa:
            ra, rb = xa[name], xb[name]
            if not name.endswith("attn_probs"):
                junk = nest([7.0] * len(flat(ra[0])), shape_of(ra[0]))
                kc.tap(name, [junk] * pads + ra + rb)
                continue
            rows, keys = [], []
            for r, offset in [(x, PAD) for x in ra] + [(x, 0) for x in rb]:
                n = len(r[0])
                slots = [[0.5 if j < offset else 0.25 for j in range(width)] for _ in r]
                for h, head in enumerate(r):
                    slots[h][offset:offset + n] = head
                rows.append(slots)
                keys.append([j - offset if offset <= j < offset + n else -1 for j in range(width)])
            junk = [[9.0] * width for _ in ra[0]]
            kc.tap(name, [junk] * pads + rows, key_positions=[[-1] * width] * pads + keys)
        cap.end()


def flat(x):
    return [v for item in x for v in flat(item)] if isinstance(x, list) else [x]


def shape_of(x):
    return [len(x)] + shape_of(x[0]) if isinstance(x, list) else []


def main():
    args = sys.argv[1:]
    src, out = args[0], args[1]
    perturb = args[args.index("--perturb") + 1:args.index("--perturb") + 4] if "--perturb" in args else None
    prompt = args[args.index("--prompt") + 1] if "--prompt" in args else None
    batched = "--batched" in args
    count = 2
    if batched and args.index("--batched") + 1 < len(args) and args[args.index("--batched") + 1].isdigit():
        count = int(args[args.index("--batched") + 1])
    staggered = "--staggered" in args
    meta = json.load(open(os.path.join(src, "meta.json")))
    steps = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    with kc.capture(None, out, engine="replay", dtype="float32", model_name=meta["model"], prompt=prompt) as cap:
        if staggered:
            # Sequences 3 and 9 as a continuous-batching engine runs them: 9 joins a call later
            # (its prefill beside 3's decode steps) and outlives 3, ending alone in its slot.
            a = calls_of(src, steps, perturb, False)
            b = calls_of(src, steps, perturb, True)
            plen = a[0][3] or 0
            for k in range(len(a) + 1):
                parts = [(3, a[k])] if k < len(a) else []
                if k >= 1:
                    parts.append((9, b[k - 1]))
                toks, pos, seq, taps = [], [], [], {}
                for s, (tk, ps, tp, _) in parts:
                    toks += tk
                    pos += ps
                    seq += [s] * len(tk)
                    for name, r in tp.items():
                        taps.setdefault(name, []).extend(r)
                cap.begin(toks, positions=pos, seq=seq, prompt_len={3: plen, 9: plen})
                for name, r in taps.items():
                    kc.tap(name, r)
                cap.end()
            return
        if "--cached" in args:
            # A prefix-cache hit: the prompt's first call was never computed, only its tokens
            # are known; the rest of the run as usual.
            calls = calls_of(src, steps, perturb, True)
            cap.cached_prefix(0, calls[0][0])
            for toks, pos, taps, _ in calls[1:]:
                cap.begin(toks, positions=pos, prompt_len=calls[0][3])
                for name, r in taps.items():
                    kc.tap(name, r)
                cap.end()
            return
        if "--padded" in args:
            padded(cap, calls_of(src, steps, perturb, False), calls_of(src, steps, perturb, True))
            return
        copies = [calls_of(src, steps, perturb, c == 1 or not batched) for c in range(count if batched else 1)]
        for k, (toks, pos, taps, _) in enumerate(copies[0]):
            if batched:
                seq = [c for c in range(count) for _ in toks]
                cap.begin(toks * count, positions=pos * count, seq=seq)
                for name in taps:
                    kc.tap(name, [r for c in range(count) for r in copies[c][k][2][name]])
            else:
                cap.begin(toks)
                for name, r in taps.items():
                    kc.tap(name, r)
            cap.end()


main()
