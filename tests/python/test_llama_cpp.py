"""llama.cpp (llama-cpp-python built from its sdist, on the CPU) held to kvdiff's reference:
GGUFs converted by llama.cpp's own converter from the same Hugging Face folders kvdiff loads
(fixtures/gguf/, bf16; f32 and f16 rewritten here with gguf-py), captured through the eval
callback, diffed by `kvdiff diff`. Equivalent: whole prompts, micro-batches, two sequences in one
batch, a saved and restored state, an f16 KV cache held to its own rounding. Named where it
acts: chunk reuse copied without its position shift, a chunk fed to another sequence's id,
template tokens missing. Measured: chunk reuse with the shift (an approximate path). CI builds
llama-cpp-python and sets KVDIFF_REQUIRE_LLAMA_CPP; elsewhere these tests skip without it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if os.environ.get("KVDIFF_REQUIRE_LLAMA_CPP"):
    import gguf  # noqa: F401
    import llama_cpp  # noqa: F401
else:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (CI builds it)")
    pytest.importorskip("gguf", reason="gguf-py is not installed (pip install gguf)")

import kvdiff_capture as kc  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import llama_cases as lc  # noqa: E402

MODELS = {"qwen3": ("default-model", ROOT / "fixtures/default-model"),
          "llama3": ("llama3", ROOT / "fixtures/arch/llama3")}
PROMPT = ROOT / "fixtures/prompts/task.json"


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    """Each fixture GGUF at f32 and f16, rewritten from the committed bf16 files."""
    out = tmp_path_factory.mktemp("gguf")
    for name, _ in MODELS.values():
        src = ROOT / f"fixtures/gguf/{name}.bf16.gguf"
        for p in ("f32", "f16"):
            subprocess.run([sys.executable, str(ROOT / "scripts/gguf_precision.py"), str(src),
                            str(out / f"{name}.{p}.gguf"), p], check=True)
    return out


_loaded = {}


def llama(gguf_dir, family="qwen3", precision="f32"):
    name, hf = MODELS[family]
    key = (family, precision)
    if key not in _loaded:
        path = ROOT / f"fixtures/gguf/{name}.bf16.gguf" if precision == "bf16" else gguf_dir / f"{name}.{precision}.gguf"
        dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[precision]
        _loaded[key] = lc.Llama(path, hf, dtype)
    return _loaded[key]


def ids_of(family, prompt=PROMPT):
    return kc.prompt_ids(prompt, model=MODELS[family][1])


def diff(dump, *args):
    """`kvdiff diff`'s exit code and JSON report (the first one, for one sequence)."""
    out = Path(str(dump) + ".json")
    p = subprocess.run([kc.check.kvdiff_binary(), "diff", "--json", str(out), *args, str(dump)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.returncode in (0, 1), p.stderr
    reports = [out] if out.exists() else sorted(out.parent.glob(out.stem + ".seq-*.json"),
                                                key=lambda f: int(f.name.rsplit("seq-", 1)[1].split(".")[0]))
    return p.returncode, [json.loads(r.read_text()) for r in reports], p.stdout


def first(report):
    d = report["paths"][0]["first_divergence"]
    return None if d is None else (d["step"], d["tap"], d["position"])


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
@pytest.mark.parametrize("n_ubatch", [512, 16, 7, 1])
def test_whole_prompts_and_micro_batches_are_equivalent(gguf_dir, tmp_path, family, n_ubatch):
    out = tmp_path / "dump"
    lc.whole(llama(gguf_dir, family), ids_of(family), out, n_ubatch=n_ubatch)
    code, [r], text = diff(out)
    assert (code, first(r)) == (0, None), text
    # Every tap llama.cpp names, less attn_probs (its columns are KV cells).
    compared = set(r["engine"]["compared"])
    assert {"L0.q_rope", "L0.k_rope", "L0.v", "L0.attn_out", "L0.o_proj", "L1.resid_out", "logits"} <= compared


def rows(dump):
    """{(step file, tap): f32 values} of a dump, read by hand."""
    import numpy as np
    import struct
    out = {}
    for f in sorted(Path(dump).glob("*.safetensors")):
        b = f.read_bytes()
        n = struct.unpack("<Q", b[:8])[0]
        for k, v in json.loads(b[8:8 + n]).items():
            if k != "__metadata__" and v["dtype"] == "F32":
                lo, hi = v["data_offsets"]
                out[(f.name.split(".")[0], k)] = np.frombuffer(b[8 + n + lo:8 + n + hi], np.float32)
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_micro_batch_sizes_agree_bitwise_but_one_token_ubatches_round_otherwise(gguf_dir, tmp_path, family):
    m, ids = llama(gguf_dir, family), ids_of(family)
    got = {}
    for u in (512, 16, 7, 1):
        lc.whole(m, ids, tmp_path / f"u{u}", n_ubatch=u)
        got[u] = rows(tmp_path / f"u{u}")
    for u in (16, 7):
        assert all((got[u][k] == v).all() for k, v in got[512].items()), f"n_ubatch {u}"
    # One-token micro-batches take llama.cpp's matrix-vector kernels: other rounding, within
    # the noise model, whether held to kvdiff's reference or to the 512-token run.
    assert any((got[1][k] != v).any() for k, v in got[512].items())
    code, [r], text = diff(tmp_path / "u1", str(tmp_path / "u512"))
    assert (code, first(r)) == (0, None), text


def test_two_sequences_in_one_batch_and_a_restored_state_are_equivalent(gguf_dir, tmp_path):
    m = llama(gguf_dir)
    a = ids_of("qwen3")
    b = ids_of("qwen3", ROOT / "fixtures/prompts/no-system.json")
    lc.two_sequences(m, a, b, tmp_path / "two")
    code, reports, text = diff(tmp_path / "two")
    assert code == 0 and len(reports) == 2 and all(first(r) is None for r in reports), text
    lc.saved_and_restored(m, a, tmp_path / "restored")
    code, [r], text = diff(tmp_path / "restored")
    assert (code, first(r)) == (0, None), text


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_16_bit_ggufs_are_held_to_16_bit_rounding(gguf_dir, tmp_path, precision):
    lc.whole(llama(gguf_dir, precision=precision), ids_of("qwen3"), tmp_path / precision)
    code, [r], text = diff(tmp_path / precision)
    assert (code, first(r)) == (0, None), text
    assert "16-bit floats" in r["tolerance"]["source"]


def test_an_f16_kv_cache_is_held_to_its_own_rounding_not_to_f32(gguf_dir, tmp_path):
    m = llama(gguf_dir)
    out = tmp_path / "kv16"
    lc.whole(m, ids_of("qwen3"), out, kv="float16")
    code, [r], text = diff(out)
    assert (code, first(r)) == (0, None), text
    assert "f16 KV cache" in r["tolerance"]["source"]
    # Declared an f32 cache (meta.json without kv_cache), the same run is held to f32's
    # bounds and parts where the f16 cache first rounds what attention reads.
    meta = json.loads((out / "meta.json").read_text())
    del meta["kv_cache"]
    (out / "meta.json").write_text(json.dumps(meta))
    code, [r], text = diff(out, "--no-replay")
    assert code == 1, text
    assert first(r)[1].endswith("attn_out"), text


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_chunk_reuse_without_the_position_shift_is_named_where_it_acts(gguf_dir, tmp_path, family):
    m = llama(gguf_dir, family)
    ids = ids_of(family)
    cut, end = 12, 30
    lc.chunk_reuse(m, ids, cut, end, tmp_path / "noshift", shift=False)
    code, reports, text = diff(tmp_path / "noshift")
    by_seq = {r["paths"][0]["path"].rsplit(" ", 1)[-1]: r for r in reports}
    assert code == 1, text
    # The chunk's own prefill (sequence 1, alone at 0..n) is exact for what it is; sequence 0
    # continues at the positions llama.cpp gives it, and parts at its first row, the row after
    # the chunk, where RoPE was fed another position.
    assert first(by_seq["1"]) is None, text
    assert first(by_seq["0"]) == (0, "L0.q_rope", end), text
    assert "fed RoPE other position ids" in text


def test_chunk_reuse_with_the_shift_is_measured_as_an_approximate_path(gguf_dir, tmp_path):
    m = llama(gguf_dir)
    ids = ids_of("qwen3")
    cut, end = 12, 30
    lc.chunk_reuse(m, ids, cut, end, tmp_path / "shift", shift=True)
    code, reports, text = diff(tmp_path / "shift")
    by_seq = {r["paths"][0]["path"].rsplit(" ", 1)[-1]: r for r in reports}
    assert first(by_seq["1"]) is None, text
    # The shift re-rotates layer 0's keys exactly; the chunk never saw the head, so from
    # layer 1 on its keys and values are another computation's: an approximate path.
    step, tap, pos = first(by_seq["0"])
    assert (step, pos) == (0, end) and not tap.startswith("L0."), text


def test_seq_cp_across_kv_streams_replaces_what_the_destination_held(gguf_dir, tmp_path):
    """llama.cpp's default context keeps a KV stream per sequence; there llama_memory_seq_cp
    copies the source's whole stream over the destination's, so chunk reuse built on it loses
    the head the destination had prefilled: named at the first row whose attention misses it."""
    m = llama(gguf_dir)
    ids = ids_of("qwen3")
    cut, end = 12, 30
    lc.chunk_reuse(m, ids, cut, end, tmp_path / "streams", shift=True, unified=False)
    code, reports, text = diff(tmp_path / "streams")
    by_seq = {r["paths"][0]["path"].rsplit(" ", 1)[-1]: r for r in reports}
    assert code == 1 and first(by_seq["1"]) is None, text
    assert first(by_seq["0"]) == (0, "L0.attn_out", end), text


def test_a_chunk_fed_to_another_sequences_id_is_named_where_it_acts(gguf_dir, tmp_path):
    m = llama(gguf_dir)
    a = ids_of("qwen3")
    lower = tmp_path / "lower.json"     # the same conversation, asking for lowercase answers
    lower.write_text(PROMPT.read_text().replace("uppercase", "lowercase"))
    b = ids_of("qwen3", lower)
    assert len(a) == len(b) and a != b
    cut = 30
    lc.wrong_sequence(m, a, b, cut, tmp_path / "wrong")
    code, reports, text = diff(tmp_path / "wrong")
    by_seq = {r["paths"][0]["path"].rsplit(" ", 1)[-1]: r for r in reports}
    assert code == 1
    assert first(by_seq["0"]) is None, text
    step, tap, pos = first(by_seq["1"])
    assert (step, pos, tap.split(".")[0]) == (0, cut, "L0") and "attn" in tap, text


def test_template_tokens_missing_are_named_by_the_prompt_check(gguf_dir, tmp_path):
    m = llama(gguf_dir)
    ids = ids_of("qwen3")
    gone = ids[:2] + ids[3:]     # the newline after the system turn's role, dropped
    messages = json.loads(PROMPT.read_text())["messages"]
    lc.whole(m, gone, tmp_path / "template", prompt=messages)
    p = subprocess.run([kc.check.kvdiff_binary(), "diff", str(tmp_path / "template")],
                       stdout=subprocess.PIPE, text=True)
    assert p.returncode == 1
    assert "prompt: PARTS from the chat template" in p.stdout and "at position 2" in p.stdout, p.stdout
