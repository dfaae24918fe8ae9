"""The capture package without torch: what it writes (files, steps, rows, meta.json), how the
nano-vllm adapter places rows from the engine's bookkeeping, and its public API. Runs against
the installed package (`pip install .`), or the source tree when it is not installed."""

import inspect
import json
import os
import re
import struct
import sys
from array import array
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
try:
    import kvdiff_capture as kc
except ImportError:  # not installed: the source tree
    sys.path.insert(0, str(ROOT / "scripts"))
    import kvdiff_capture as kc

from kvdiff_capture.adapters.nano_vllm import rows_from_context, rows_from_sequences  # noqa: E402


def read(path):
    """A safetensors file as ({name: (dtype, shape, values)}, metadata), read by hand."""
    b = Path(path).read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        code = {"F32": "f", "I64": "q"}[h["dtype"]]
        out[name] = (h["dtype"], h["shape"], array(code, b[8 + n + lo:8 + n + hi]).tolist())
    return out, meta


def files(d):
    """{file name: (tensors, metadata)} of a dump folder."""
    return {f: read(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith(".safetensors")}


def rows_by_step(d, seq=None):
    """{step: [(position, token)]} over a dump's files (of one sequence when given)."""
    out = {}
    for f, (t, meta) in files(d).items():
        if seq is not None and f".seq-{seq}." not in f:
            continue
        step = int(meta["step"])
        out.setdefault(step, []).extend(zip(t["positions"][2], t["tokens"][2]))
    return {k: sorted(v) for k, v in out.items()}


def test_the_package_version_follows_the_dump_format_kvdiff_reads():
    major = int(kc.__version__.split(".")[0])
    assert major == kc.VERSION
    reader = (ROOT / "src/tap/read.rs").read_text()
    assert re.search(rf"pub const VERSION: u64 = {kc.VERSION};", reader), "the Rust reader's version moved"
    project = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{kc.__version__}"' in project
    crate = (ROOT / "Cargo.toml").read_text()
    assert re.search(rf'^version = "{re.escape(kc.__version__)}"$', crate, re.M), "the binary's version is the package's"


def test_the_installed_package_brings_its_own_binary():
    """`pip install` of the repository puts the kvdiff binary beside the interpreter; CI
    installs the wheel and sets KVDIFF_REQUIRE_INSTALLED, elsewhere a cargo build may serve."""
    import subprocess
    import sysconfig
    exe = kc.check.kvdiff_binary()
    if not os.environ.get("KVDIFF_REQUIRE_INSTALLED"):
        pytest.skip("not an installed wheel (CI checks it with KVDIFF_REQUIRE_INSTALLED=1)")
    assert Path(exe).resolve().parent == Path(sysconfig.get_path("scripts")).resolve(), exe
    out = subprocess.run([exe, "--version"], stdout=subprocess.PIPE, text=True, check=True).stdout
    assert out.strip() == f"kvdiff {kc.__version__}"


def test_a_plain_list_capture_writes_steps_rows_and_meta(tmp_path):
    out = tmp_path / "dump"
    with kc.capture(None, out, engine="my-engine", dtype="bfloat16", model_name="/models/m") as cap:
        cap.begin([5, 6, 7])                       # prompt, first piece
        kc.tap("embed", [[1.0, 2.0]] * 3)
        cap.end()
        cap.begin([8, 9])                          # prompt, second piece
        kc.tap("embed", [[3.0, 4.0]] * 2)
        cap.end()
        for tok in (10, 11):                       # two decode steps
            cap.begin([tok])
            kc.tap("embed", [[float(tok), 0.0]])
            kc.tap("not.selected", [[0.0]])
            cap.end()
    meta = json.loads((out / "meta.json").read_text())
    assert meta == {"format": "kvdiff-dump", "version": 1, "engine": "my-engine",
                    "dtype": "bfloat16", "model": "/models/m"}
    assert rows_by_step(out) == {0: [(0, 5), (1, 6), (2, 7), (3, 8), (4, 9)], 1: [(5, 10)], 2: [(6, 11)]}
    f = files(out)
    last = f["step-0002.call-00003.seq-0.safetensors"][0]
    assert last["embed"] == ("F32", [1, 2], [11.0, 0.0])
    assert not (tmp_path / "dump.partial").exists()


def test_a_failing_engine_leaves_nothing_half_written(tmp_path):
    with pytest.raises(RuntimeError):
        with kc.capture(None, tmp_path / "dump") as cap:
            cap.begin([1, 2])
            cap.end()
            raise RuntimeError("engine crashed")
    assert not (tmp_path / "dump").exists()
    assert not (tmp_path / "dump.partial").exists()


def test_the_prompt_goes_to_meta_json_in_the_shape_kvdiff_reads(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ["a", "b"]}]
    with kc.capture(None, tmp_path / "a", prompt=messages) as cap:
        cap.begin([1])
        cap.end()
    assert json.loads((tmp_path / "a/meta.json").read_text())["prompt"] == {"messages": messages}
    prompt_file = tmp_path / "p.json"
    prompt_file.write_text(json.dumps({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}))
    with kc.capture(None, tmp_path / "b", prompt=str(prompt_file)) as cap:
        pass
    stored = json.loads((tmp_path / "b/meta.json").read_text())["prompt"]
    assert stored["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(ValueError, match="role"):
        kc.Capture(tmp_path / "c", prompt=[{"content": "no role"}])


def test_rope_positions_are_kept_only_where_the_engine_fed_other_ids(tmp_path):
    out = tmp_path / "dump"
    with kc.capture(None, out) as cap:
        cap.begin([1, 2, 3], positions=[0, 1, 2], rope_positions=[0, 1, 2])
        cap.end()
        cap.begin([4, 5], positions=[3, 4], rope_positions=[0, 1], prompt_len=5)  # a chunk restarted at 0
        cap.end()
    f = files(out)
    assert "rope_positions" not in f["step-0000.call-00000.seq-0.safetensors"][0]
    second = f["step-0000.call-00001.seq-0.safetensors"][0]
    assert second["positions"][2] == [3, 4] and second["rope_positions"][2] == [0, 1]


def test_a_batch_is_split_per_sequence_and_tap_rows_follow_their_positions(tmp_path):
    out = tmp_path / "dump"
    with kc.capture(None, out) as cap:
        cap.begin([1, 2, 3, 7, 8], positions=[0, 1, 2, 0, 1], seq=[4, 4, 4, 9, 9], prompt_len={4: 3, 9: 2})
        kc.tap("embed", [[float(i)] for i in range(5)])
        kc.tap("logits", [[0.5], [0.25]], positions=[2, 1], seq=[4, 9])
        cap.end()
        cap.begin([30, 31], positions=[3, 2], seq=[4, 9])
        kc.tap("embed", [[10.0], [11.0]])
        cap.end()
    f = files(out)
    s4 = f["step-0000.call-00000.seq-4.safetensors"][0]
    assert s4["embed"][2] == [0.0, 1.0, 2.0] and s4["seq"][2] == [4, 4, 4]
    assert s4["logits.positions"][2] == [2] and s4["logits"][2] == [0.5]
    s9 = f["step-0001.call-00001.seq-9.safetensors"][0]
    assert s9["positions"][2] == [2] and s9["embed"][2] == [11.0]


def test_a_sequence_prefilled_again_after_preemption_writes_only_its_new_row(tmp_path):
    out = tmp_path / "dump"
    with kc.capture(None, out) as cap:
        cap.begin([1, 2, 3], positions=[0, 1, 2], seq=[5] * 3, prompt_len={5: 3})
        cap.end()
        cap.begin([40], positions=[3], seq=[5])   # decode step 1
        cap.end()
        # Preempted, then prefilled anew: prompt and the decoded token again, plus the new one.
        cap.begin([1, 2, 3, 40, 41], positions=[0, 1, 2, 3, 4], seq=[5] * 5, prompt_len={5: 3}, recompute=[5])
        cap.end()
    assert rows_by_step(out, seq=5) == {0: [(0, 1), (1, 2), (2, 3)], 1: [(3, 40)], 2: [(4, 41)]}


def test_nano_vllm_rows_come_from_the_scheduler_not_from_the_fed_position_ids():
    # Sequence 7 prefills its second chunk (16 cached, 8 new) beside sequence 3's decode step:
    # the rows sit at 16..23 whatever ids the engine fed RoPE.
    seqs = [(7, 16, 24, 24)]
    pos, ids, plens, again = rows_from_sequences(seqs, True, [0, 8])
    assert pos == list(range(16, 24)) and ids == [7] * 8 and plens == {7: 24} and again == []
    # Decode: each row is its sequence's last token; ids stay with their sequence when the
    # batch's order changes (sequence 2 finished, 9 joined).
    pos, ids, _, _ = rows_from_sequences([(9, 0, 12, 11), (3, 0, 30, 20)], False, None)
    assert pos == [11, 29] and ids == [9, 3]
    # A preempted sequence prefilled anew recomputes what it already decoded.
    _, _, _, again = rows_from_sequences([(3, 0, 31, 20)], True, None)
    assert again == [3]


class _Ctx:
    def __init__(self, is_prefill, cu_q=None, cu_k=None, lens=None):
        self.is_prefill, self.cu_seqlens_q, self.cu_seqlens_k, self.context_lens = is_prefill, cu_q, cu_k, lens


def test_nano_vllm_rows_from_the_attention_context_alone():
    # Two packed prefill pieces: the first has 4 cached tokens (a prefix-cache hit), the second none.
    pos, ids = rows_from_context(5, _Ctx(True, [0, 2, 5], [0, 6, 9]))
    assert pos == [4, 5, 0, 1, 2] and ids == [0, 0, 1, 1, 1]
    pos, ids = rows_from_context(2, _Ctx(False, lens=[7, 3, 99]))
    assert pos == [6, 2] and ids == [0, 1]
    assert rows_from_context(3, _Ctx(True, [0, 2], [0, 2])) == (None, None)
    # A context without the keys' lengths tells the sequences only.
    assert rows_from_context(3, _Ctx(True, [0, 1, 3], None)) == (None, [0, 1, 1])
    assert rows_from_context(2, _Ctx(False)) == (None, [0, 1])


def test_adapters_are_registered_by_name_and_unknown_ones_refused(tmp_path):
    class Handle:
        removed = False

        def remove(self):
            Handle.removed = True

    kc.register_adapter("toy", lambda cap, model: Handle())
    try:
        with kc.capture(object(), tmp_path / "d", adapter="toy") as cap:
            cap.begin([1])
            cap.end()
        assert Handle.removed
        assert json.loads((tmp_path / "d/meta.json").read_text())["engine"] == "toy"
        with pytest.raises(ValueError, match="no adapter"):
            with kc.capture(object(), tmp_path / "e", adapter="missing"):
                pass
        with pytest.raises(TypeError):
            kc.register_adapter("bad", 3)
    finally:
        kc.ADAPTERS.pop("toy", None)


def test_the_public_api_is_typed():
    assert (Path(kc.__file__).parent / "py.typed").exists()
    for fn in (kc.capture, kc.tap, kc.Capture.begin, kc.Capture.tap, kc.register_adapter):
        sig = inspect.signature(fn)
        untyped = [p for p in sig.parameters.values() if p.name not in ("self",) and p.annotation is inspect.Parameter.empty]
        assert not untyped, f"{fn.__qualname__}: {untyped}"


def test_padding_rows_are_no_rows_and_take_no_position(tmp_path):
    # A left-padded batch as HF generate() feeds it: sequence 0 behind two pads, then a decode
    # step; right padding in sequence 1 (a pad inside its row) is skipped the same way.
    out = tmp_path / "dump"
    with kc.capture(None, out) as cap:
        cap.begin([0, 0, 5, 6, 7, 8, 9, 0], seq=[0] * 4 + [1] * 4, mask=[0, 0, 1, 1, 1, 1, 1, 0],
                  rope_positions=[1, 1, 0, 1, 0, 1, 2, 1], prompt_len={0: 2, 1: 3})
        kc.tap("embed", [[9.0]] * 2 + [[1.0], [2.0], [3.0], [4.0], [5.0], [9.0]])
        cap.end()
        cap.begin([10, 11], seq=[0, 1], mask=[1, 1])
        kc.tap("embed", [[6.0], [7.0]])
        cap.end()
    assert rows_by_step(out, seq=0) == {0: [(0, 5), (1, 6)], 1: [(2, 10)]}
    assert rows_by_step(out, seq=1) == {0: [(0, 7), (1, 8), (2, 9)], 1: [(3, 11)]}
    f = files(out)
    first = f["step-0000.call-00000.seq-0.safetensors"][0]
    assert first["embed"][2] == [1.0, 2.0]
    # The RoPE ids of real rows follow the mask: nothing to report, the pads' ids ignored.
    assert "rope_positions" not in first


def test_attention_columns_are_placed_at_their_key_positions(tmp_path):
    # One row of sequence 0 behind two pad slots, over a static cache of 6 slots: columns 0-1
    # are padding, 2-3 its keys 0-1, 4-5 unused. Junk in the dropped columns never survives.
    out = tmp_path / "dump"
    with kc.capture(None, out) as cap:
        cap.begin([5, 6], positions=[0, 1])
        row = lambda a, b: [[0.5, 0.5, a, b, 0.25, 0.25]]  # noqa: E731  one head
        kc.tap("L0.attn_probs", [row(1.0, 0.0), row(0.4, 0.6)],
               key_positions=[[-1, -1, 0, 1, -1, -1]] * 2)
        cap.end()
    t = files(out)["step-0000.call-00000.seq-0.safetensors"][0]
    assert t["L0.attn_probs"][1] == [2, 1, 2]
    assert t["L0.attn_probs"][2] == pytest.approx([1.0, 0.0, 0.4, 0.6])


def test_a_forward_pass_the_hooks_never_entered_is_refused(tmp_path):
    # A hooked model whose decode steps ran as a CUDA graph: its top-level hooks begin and end
    # the call, but no layer hook fires. Nothing is written; the message says how to fix it.
    with pytest.raises(RuntimeError, match="enforce_eager=True"):
        with kc.capture(None, tmp_path / "d") as cap:
            cap.hooked, cap.expected = True, ["embed", "L0.resid_in"]
            cap.begin([1, 2])
            kc.tap("embed", [[1.0], [2.0]])
            cap.end()
            cap.begin([3])
            kc.tap("logits", [[0.5]])
            cap.end()
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.partial").exists()
    # A call that ended without the hook that begins it: the same refusal.
    with pytest.raises(RuntimeError, match="no hook saw begin"):
        with kc.capture(None, tmp_path / "e") as cap:
            cap.hooked = True
            cap.end()
    # Taps the capture does not want are not expected.
    with kc.capture(None, tmp_path / "f", taps="logits") as cap:
        cap.hooked, cap.expected = True, ["embed"]
        cap.begin([1])
        kc.tap("logits", [[0.5]])
        cap.end()
    assert (tmp_path / "f/meta.json").exists()


def test_a_nano_vllm_llm_names_its_model_folder_through_its_runner():
    """nano-vllm's model carries no config; its runner's config names the folder that
    `kvdiff diff` loads (a dump without it needs --model)."""
    from types import SimpleNamespace
    from kvdiff_capture.adapters.nano_vllm import runner_and_model
    runner = SimpleNamespace(model=SimpleNamespace(), config=SimpleNamespace(model="/models/qwen3"))
    got_runner, inner = runner_and_model(SimpleNamespace(model_runner=runner))
    assert got_runner is runner
    assert kc._model_name(inner) is None
    assert kc._model_name(got_runner) == "/models/qwen3"
    hf = SimpleNamespace(config=SimpleNamespace(_name_or_path="", model=None))
    assert kc._model_name(hf) is None
