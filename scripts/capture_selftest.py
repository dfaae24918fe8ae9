"""Replays a kvdiff dump through kvdiff_capture as an engine would (no torch needed): the prefill
as two forward calls, each decode step as one, rows numbered by the capture itself, every tensor
written through `tap()` as plain Python lists. `kvdiff diff` must find the replay equivalent to
the original, and name the one row `--perturb` changes.

  python3 scripts/capture_selftest.py SOURCE_DUMP OUT_DIR [--perturb TAP STEP ROW] [--batched]

--batched packs two copies of the run into every call as sequences 0 and 1 (continuous
batching); only sequence 1 is perturbed.
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


def main():
    src, out = sys.argv[1], sys.argv[2]
    perturb = sys.argv[4:7] if len(sys.argv) > 3 and sys.argv[3] == "--perturb" else None
    batched = "--batched" in sys.argv
    copies = 2 if batched else 1
    meta = json.load(open(os.path.join(src, "meta.json")))
    steps = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    with kc.capture(None, out, engine="replay", dtype="float32", model_name=meta["model"]) as cap:
        for f in steps:
            step = int(f[5:9])
            t = read(os.path.join(src, f))
            n = t["positions"][1][0]
            calls = [range(0, n // 2), range(n // 2, n)] if step == 0 else [range(n)]
            for call in calls:
                toks = [t["tokens"][2][i] for i in call]
                if batched:
                    cap.begin(toks * 2, positions=[t["positions"][2][i] for i in call] * 2,
                              seq=[0] * len(call) + [1] * len(call))
                else:
                    cap.begin(toks)
                for name, tensor in t.items():
                    if name in ("tokens", "positions") or name.endswith(".positions"):
                        continue
                    out_rows = []
                    for copy in range(copies):
                        r, shape = rows(tensor, call)
                        if perturb and name == perturb[0] and step == int(perturb[1]) and copy == copies - 1:
                            want = int(perturb[2])
                            for k, i in enumerate(call):
                                if i == want:
                                    big = max(abs(x) for x in r[k])
                                    r[k] = list(r[k])
                                    r[k][len(r[k]) // 3] += 0.05 * big
                        out_rows += [nest(x, shape) for x in r]
                    kc.tap(name, out_rows)
                cap.end()


main()
