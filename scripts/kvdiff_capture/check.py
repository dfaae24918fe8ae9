"""An engine's dump held to kvdiff's reference from Python: `assert_equivalent` runs `kvdiff
diff` and raises an AssertionError that names the first divergence, for test suites.

    import kvdiff_capture as kc
    with kc.capture(None, "dump/", engine="my-engine", model_name="/models/qwen3") as cap:
        my_engine.generate(...)
    kc.assert_equivalent(cap)              # or the dump folder; options are diff's flags

The kvdiff binary is `$KVDIFF_BIN`, else `kvdiff` on PATH (a `pip install` of the repository puts
it there, beside this package), else the one beside this interpreter.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

PathLike = Union[str, "os.PathLike[str]"]

# Lines of a path's text report that belong to its first divergence (the rest, the answer and
# the per-layer table, are in the report files).
_BLOCK_END = ("  answer:", "  next token:", "  layer ", "  logits rel", "  tokens:", "  no tap")


class KvdiffError(RuntimeError):
    """kvdiff could not test the dump (exit 2 or 3): a missing or malformed dump, a model it
    cannot find, a bad option. Not a divergence."""


class Divergence(AssertionError):
    """The engine's dump parted from the reference. The message names the first divergence;
    the attributes hold where the reports were written and the command that reruns the diff."""

    def __init__(self, message: str, dump: str, json_reports: List[str], html_reports: List[str],
                 command: List[str]) -> None:
        super().__init__(message)
        self.dump = dump
        self.json_reports = json_reports
        self.html_reports = html_reports
        self.command = command


class Result:
    """An equivalent diff: its reports (parsed JSON), and where they were written."""

    def __init__(self, reports: List[Dict[str, Any]], json_reports: List[str],
                 html_reports: List[str], text: str) -> None:
        self.reports = reports
        self.json_reports = json_reports
        self.html_reports = html_reports
        self.text = text


def kvdiff_binary() -> str:
    """The kvdiff executable: $KVDIFF_BIN, `kvdiff` on PATH, or the one beside this Python."""
    env = os.environ.get("KVDIFF_BIN")
    if env:
        if not os.access(env, os.X_OK):
            raise KvdiffError(f"KVDIFF_BIN={env} is not an executable: fix: point it at the kvdiff binary")
        return env
    found = shutil.which("kvdiff")
    if found:
        return found
    beside = Path(sysconfig.get_path("scripts")) / ("kvdiff.exe" if os.name == "nt" else "kvdiff")
    if beside.is_file():
        return str(beside)
    raise KvdiffError("no kvdiff executable: fix: `pip install .` in the kvdiff repository (it "
                      "installs the binary with this package), `cargo install --path .`, or set "
                      "KVDIFF_BIN")


def _flags(options: Dict[str, Any]) -> List[str]:
    """Keyword options as diff's flags: no_replay=True -> --no-replay, backend="cuda" ->
    --backend cuda, taps=["L0.*", "logits"] -> --taps L0.*,logits; False and None leave a flag
    out."""
    out: List[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return out


def diff_command(dump: PathLike, model: Optional[PathLike] = None, **options: Any) -> List[str]:
    """The `kvdiff diff` command line for `dump` with these options."""
    cmd = [kvdiff_binary(), "diff", os.fspath(dump)]
    if model is not None:
        cmd += ["--model", os.fspath(model)]
    return cmd + _flags(options)


def _dump_of(dump_or_capture: Any) -> str:
    out = getattr(dump_or_capture, "out_dir", dump_or_capture)
    if out is None:
        raise TypeError("assert_equivalent takes a dump folder or the Capture a capture() block gave")
    return os.fspath(out)


def _reports(report_dir: Path, ext: str) -> List[str]:
    """report.json, or a batched capture's report.seq-N.json in sequence order."""
    one = report_dir / f"report.{ext}"
    if one.is_file():
        return [str(one)]
    found = list(report_dir.glob(f"report.seq-*.{ext}"))
    return [str(p) for p in sorted(found, key=lambda p: int(p.name.split(".")[1][4:]))]


def first_divergence_text(text: str) -> str:
    """What kvdiff's text report says about each diverged path: the prompt check where it parts,
    the verdict line, the first divergence with its numbers, tolerance and replay line, and the
    first token divergence."""
    keep: List[str] = []
    block: Optional[List[str]] = None
    seq_header: Optional[str] = None
    for line in text.splitlines():
        if line.startswith("## sequence"):
            seq_header = line
        elif line.startswith("prompt: PARTS"):
            keep.append(line)
        elif line.startswith("== "):
            block = None
            if "EQUIVALENT" not in line:
                block = [line]
                if seq_header:
                    keep.append(seq_header)
                keep.extend(block)
        elif block is not None:
            if line.startswith(_BLOCK_END) or not line.strip():
                block = None
            else:
                keep.append(line)
    return "\n".join(keep)


def _chunks(report: Dict[str, Any]) -> str:
    spans = [f"[{c['start']}, {c['end']})" for c in report.get("chunks", [])]
    return " ".join(spans) if spans else "(none)"


def assert_equivalent(dump_or_capture: Any, model: Optional[PathLike] = None, *,
                      report_dir: Optional[PathLike] = None, extra_args: Sequence[str] = (),
                      **options: Any) -> Result:
    """Holds an engine's dump to kvdiff's reference (`kvdiff diff`); raises `Divergence` (an
    AssertionError) naming the first divergence when they part.

    dump_or_capture: a dump folder, or the Capture a `capture()` block gave.
    model: the Hugging Face folder of the engine's model (default: the dump's meta.json).
    report_dir: where report.json and report.html go (default: beside the dump, `DUMP.kvdiff`).
    options: diff's flags as keywords (backend="cuda", no_replay=True, taps="L0.*", seq=3,
        prompt="chat.json", tolerance="exact", ...); extra_args: more, as written.
    Raises KvdiffError where kvdiff cannot test the dump (exit 2 or 3).
    """
    dump = _dump_of(dump_or_capture)
    if not os.path.isdir(dump):
        raise KvdiffError(f"no dump at {dump}: fix: check the capture block ran and ended without an error")
    out = Path(report_dir) if report_dir is not None else Path(dump.rstrip("/\\") + ".kvdiff")
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("report*.json")) + list(out.glob("report*.html")):
        old.unlink()
    cmd = diff_command(dump, model, **options) + list(extra_args)
    run = cmd + ["--json", str(out / "report.json"), "--html", str(out / "report.html")]
    p = subprocess.run(run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode not in (0, 1):
        err = p.stderr.strip().splitlines()
        raise KvdiffError(f"kvdiff diff could not test {dump} (exit {p.returncode}): "
                          + " / ".join(err[-3:] or ["no message"]))
    json_reports, html_reports = _reports(out, "json"), _reports(out, "html")
    reports = [json.loads(Path(f).read_text()) for f in json_reports]
    if p.returncode == 0:
        return Result(reports, json_reports, html_reports, p.stdout)
    rerun = shlex.join(["kvdiff"] + cmd[1:])
    lines = [f"kvdiff: {dump} diverged from its reference ({reports[0]['reference'] if reports else 'kvdiff'})"
             if reports else f"kvdiff: {dump} diverged from its reference"]
    lines.append(first_divergence_text(p.stdout) or p.stdout.strip())
    if reports:
        lines.append(f"prefill chunks: {_chunks(reports[0])} of {reports[0]['prompt_tokens']} prompt tokens")
    lines.append(f"rerun: {rerun}")
    lines.append("reports: " + ", ".join(json_reports + html_reports))
    raise Divergence("\n".join(lines), dump, json_reports, html_reports, cmd)


def prompt_ids(prompt: Any, model: Optional[PathLike] = None) -> List[int]:
    """The token ids kvdiff's reference feeds for a conversation (its chat template, with the
    generation prompt): what an engine's prompt must be. `prompt`: a prompt file, a message
    list or {"messages": [...]}."""
    return _tokens(prompt, model)["ids"]


def _tokens(prompt: Any, model: Optional[PathLike]) -> Dict[str, Any]:
    import tempfile
    if isinstance(prompt, (str, os.PathLike)):
        if not os.path.isfile(prompt):
            raise KvdiffError(f"no prompt file {os.fspath(prompt)}: fix: give a .json or .txt prompt "
                              "file, or the messages themselves")
        path, tmp = os.fspath(prompt), None
    else:
        messages = prompt if isinstance(prompt, list) else prompt["messages"]
        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump({"messages": messages}, tmp)
        tmp.close()
        path = tmp.name
    try:
        cmd = [kvdiff_binary(), "tokens", "--json", path]
        if model is not None:
            cmd += ["--model", os.fspath(model)]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            raise KvdiffError(f"kvdiff tokens failed on {path}: {p.stderr.strip()}")
        return json.loads(p.stdout)
    finally:
        if tmp is not None:
            os.unlink(tmp.name)
