"""kvdiff in an engine's own CI, end to end and without torch: the example engine's test file
under the pytest plugin and Hypothesis (clean, it passes; with a planted bug it fails, shrunk to
the known minimal chunking, with the first divergence and the rerun command); the assertion's
message; many dumps diffed to one JSONL and summarized; and `git bisect run` finding the commit
that planted a bug. Needs numpy and hypothesis (CI installs them beside the wheel)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "tests/python/engine_example"
MODEL = ROOT / "fixtures/default-model"
PROMPT = ROOT / "fixtures/prompts/task.json"

if os.environ.get("KVDIFF_REQUIRE_ENGINE_CI"):
    import hypothesis  # noqa: F401
    import numpy  # noqa: F401
else:
    pytest.importorskip("numpy", reason="the example engine needs numpy (pip install numpy)")
    pytest.importorskip("hypothesis", reason="the strategies need hypothesis (pip install hypothesis)")

try:
    import kvdiff_capture as kc
except ImportError:  # not installed: the source tree
    sys.path.insert(0, str(ROOT / "scripts"))
    import kvdiff_capture as kc
sys.path.insert(0, str(EXAMPLE))
from tiny_engine import TinyEngine  # noqa: E402


def env(**extra):
    """The environment of a child Python: this one's, with the source tree's package where it is
    not installed."""
    e = dict(os.environ, **extra)
    pkg = Path(kc.__file__).resolve().parents[1]
    e["PYTHONPATH"] = os.pathsep.join([str(pkg)] + [p for p in [e.get("PYTHONPATH")] if p])
    return e


def capture(out, bug=None, cuts=(20,), ids=None):
    ids = ids or kc.prompt_ids(PROMPT, model=MODEL)
    with kc.capture(None, out, engine="tiny", model_name=str(MODEL), prompt=str(PROMPT)):
        TinyEngine(MODEL, bug=bug).generate(ids, cuts=cuts, max_new_tokens=3)
    return out


def example_suite(tmp_path, bug=None):
    tmp_path.mkdir()
    extra = {"KVDIFF_ENGINE_EXAMPLE": "1", "TINY_ENGINE_BUG": bug or ""}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
         str(tmp_path / "base"), str(EXAMPLE)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(**extra), cwd=ROOT)


def test_the_example_engine_passes_clean_and_a_planted_bug_fails_shrunk_to_its_minimal_chunking(tmp_path):
    clean = example_suite(tmp_path / "clean")
    assert clean.returncode == 0, clean.stdout[-3000:]
    assert "3 passed" in clean.stdout
    bad = example_suite(tmp_path / "bad", bug="late-chunk-positions")
    out = bad.stdout
    assert bad.returncode == 1, out[-3000:]
    # A chunk starting at position 16 or later restarts its positions: the smallest chunking
    # that shows it is one boundary, at 16; the whole prompt stays equivalent.
    assert "2 failed, 1 passed" in out, out[-3000:]
    assert "cuts=[16]," in out, out[-3000:]
    assert "first divergence: step 0 (prefill), L0.q_rope, position 16" in out
    assert "prefill chunks: [0, 16) [16, 51) of 51 prompt tokens" in out
    assert "replay: RoPE adds" in out
    assert "rerun: kvdiff diff " in out
    html = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("HTML report: ")]
    assert html and all(Path(h).is_file() for h in html), out[-2000:]


def test_assert_equivalent_names_each_planted_bug_where_it_acts(tmp_path):
    ids = kc.prompt_ids(PROMPT, model=MODEL)
    ok = kc.assert_equivalent(capture(tmp_path / "clean", ids=ids))
    assert [r["paths"][0]["diverged"] for r in ok.reports] == [False]
    assert all(Path(p).is_file() for p in ok.json_reports + ok.html_reports)
    cases = {"positions-restart": "L0.q_rope, position 20", "isolated-chunks": "L0.attn_probs, position 20"}
    for bug, where in cases.items():
        dump = capture(tmp_path / bug, bug=bug, ids=ids)
        with pytest.raises(kc.Divergence) as e:
            kc.assert_equivalent(dump, report_dir=tmp_path / f"{bug}-reports", no_replay=True)
        msg = str(e.value)
        assert f"first divergence: step 0 (prefill), {where}" in msg, msg
        assert "reference " in msg and "max|diff|" in msg and "tolerance:" in msg
        assert "replay:" not in msg  # no_replay=True became --no-replay
        assert f"rerun: kvdiff diff {dump} --no-replay" in msg
        assert e.value.html_reports == [str(tmp_path / f"{bug}-reports/report.html")]
        assert isinstance(e.value, AssertionError)
    with pytest.raises(kc.KvdiffError, match="no dump at"):
        kc.assert_equivalent(tmp_path / "never-written")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken/meta.json").write_text("{}")
    with pytest.raises(kc.KvdiffError, match="exit 2"):
        kc.assert_equivalent(tmp_path / "broken")


def test_many_dumps_go_to_one_jsonl_in_partitions_that_sweep_summarize_reads(tmp_path):
    ids = kc.prompt_ids(PROMPT, model=MODEL)
    root = tmp_path / "nightly"
    for name, bug, cuts in [("a-whole", None, ()), ("b-cuts", None, (7, 30)),
                            ("c-late", "late-chunk-positions", (10, 40)), ("d-early", "late-chunk-positions", (10,))]:
        capture(root / name, bug=bug, cuts=cuts, ids=ids)
    kvdiff = kc.check.kvdiff_binary()
    runs = [subprocess.run([kvdiff, "diff", "-q", "--out", str(tmp_path / f"part-{k}.jsonl"),
                            "--partition", f"{k}/2", str(root)], stdout=subprocess.PIPE, text=True)
            for k in (1, 2)]
    # Sorted dumps a, b, c, d: partition 1 takes a and c (c diverges), partition 2 b and d.
    assert [r.returncode for r in runs] == [1, 0]
    lines = [json.loads(line) for k in (1, 2) for line in (tmp_path / f"part-{k}.jsonl").read_text().splitlines()]
    by_case = {Path(line["case"]).name: line for line in lines}
    assert sorted(by_case) == ["a-whole", "b-cuts", "c-late", "d-early"]
    assert by_case["b-cuts"]["cuts"] == [7, 30] and by_case["a-whole"]["chunking"] == "whole prompt"
    assert [n for n, line in sorted(by_case.items()) if line["failed"]] == ["c-late"]
    site = by_case["c-late"]["first_divergence"]
    assert (site["step"], site["tap"], site["position"]) == (0, "L0.q_rope", 40)
    summary = subprocess.run([kvdiff, "sweep", "summarize", str(tmp_path / "part-1.jsonl"),
                              str(tmp_path / "part-2.jsonl")], stdout=subprocess.PIPE, text=True)
    assert summary.returncode == 1
    assert "4 cases, 4 lines" in summary.stdout
    assert f"kvdiff diff {root / 'c-late'}" in summary.stdout
    again = subprocess.run([kvdiff, "diff", "--out", str(tmp_path / "part-1.jsonl"), "--partition", "1/2",
                            str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "0 lines written, 2 already there" in again.stderr, again.stderr


ENGINE_TEST = """import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdiff_capture as kc
from tiny_engine import TinyEngine
MODEL, PROMPT = {model!r}, {prompt!r}
ids = kc.prompt_ids(PROMPT, model=MODEL)
with kc.capture(None, os.environ["KVDIFF_DUMP"], engine="tiny", model_name=MODEL, prompt=PROMPT):
    TinyEngine(MODEL).generate(ids, cuts=[16, 32], max_new_tokens=2)
"""


def test_git_bisect_run_finds_the_commit_that_broke_chunked_prefill(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "engine"
    repo.mkdir()
    git_env = env(GIT_AUTHOR_NAME="dev", GIT_AUTHOR_EMAIL="dev@example.com", GIT_COMMITTER_NAME="dev",
                  GIT_COMMITTER_EMAIL="dev@example.com")

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, env=git_env, check=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout

    def commit(message, edit):
        edit()
        git("add", "-A")
        git("commit", "-q", "-m", message)
        return git("rev-parse", "HEAD").strip()

    engine = repo / "tiny_engine.py"
    script = repo / "capture_chunked.py"

    def replace(path, old, new):
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new))

    git("init", "-q")
    good = commit("engine with chunked prefill", lambda: (
        shutil.copy(EXAMPLE / "tiny_engine.py", engine),
        script.write_text(ENGINE_TEST.format(model=str(MODEL), prompt=str(PROMPT)))))
    commit("docs", lambda: (repo / "README").write_text("a tiny engine\n"))
    planted = commit("prefill: rotate each chunk from its own start", lambda: replace(
        engine, "            rope = positions\n", "            rope = list(range(hi - lo))\n"))
    commit("capture script: a typo that breaks it", lambda: replace(script, "import kvdiff_capture", "import kvdiff_captur"))
    commit("capture script: fixed", lambda: replace(script, "import kvdiff_captur as", "import kvdiff_capture as"))
    commit("tidy", lambda: (repo / "README").write_text("a tiny engine, faster\n"))
    git("bisect", "start", "HEAD", good)
    run = subprocess.run(["git", "bisect", "run", sys.executable, "-m", "kvdiff_capture.bisect", "--no-replay",
                          "--", sys.executable, str(script)],
                         cwd=repo, env=git_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"{planted} is the first bad commit" in run.stdout, run.stdout[-3000:]


def test_bisect_and_the_assertion_refuse_what_cannot_be_tested_with_their_codes(tmp_path):
    from kvdiff_capture import bisect
    # No capture command: a usage error stops the bisect (above 127), not a verdict.
    assert bisect.main(["--no-replay"]) == bisect.STOP
    # A command that cannot start, or writes no dump: this commit is skipped (125).
    assert bisect.main(["--", str(tmp_path / "no-such-program")]) == bisect.CANNOT_TEST
    assert bisect.main(["--", sys.executable, "-c", "pass"]) == bisect.CANNOT_TEST
    with pytest.raises(kc.KvdiffError, match="no prompt file"):
        kc.prompt_ids(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="kv_cache"):
        kc.Capture(tmp_path / "d", kv_cache="q8_0")
    assert not (tmp_path / "d.partial").exists()
    (tmp_path / "set.jsonl").write_text('{"messages": []}\nnot json\n')
    from kvdiff_capture.strategies import load_prompt_set
    with pytest.raises(ValueError, match=r"set.jsonl:2: not JSON"):
        load_prompt_set(tmp_path / "set.jsonl")
