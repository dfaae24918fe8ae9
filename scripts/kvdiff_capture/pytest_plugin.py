"""kvdiff in an engine's pytest suite (registered through the `pytest11` entry point, so a
`pip install` of kvdiff is all it takes). The `kvdiff` fixture captures a block into a fresh
folder and holds it to kvdiff's reference as the block ends:

    def test_chunked_prefill(kvdiff):
        with kvdiff.capture(None, engine="my-engine", model_name=MODEL, prompt=messages):
            my_engine.generate(ids, chunk_size=16)

A divergence fails the test with the first divergence in its message; the failing test's
report gets a "kvdiff" section with the HTML report, the JSON report and the rerun command.
`--kvdiff-arg=--backend=cuda` (repeatable) adds flags to every diff of the run.

The fixture is session-scoped, so Hypothesis tests may use it: every capture gets its own
folder.
"""

from __future__ import annotations

import itertools
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from . import capture as _capture
from .check import Divergence, Result, assert_equivalent
from .writer import Capture


class Kvdiff:
    """The `kvdiff` fixture: captures into numbered folders, and asserts them."""

    def __init__(self, root: Path, extra_args: List[str]) -> None:
        self.root = root
        self.extra_args = extra_args
        self._numbers = itertools.count()

    def dump_dir(self, name: str = "dump") -> Path:
        """A fresh folder for one capture."""
        return self.root / f"{name}-{next(self._numbers):04d}"

    @contextmanager
    def capture(self, model: Any = None, *, diff: Optional[Dict[str, Any]] = None,
                **capture_options: Any) -> Iterator[Capture]:
        """`kvdiff_capture.capture(model, <fresh folder>, **capture_options)`, then, when the
        block ends without an error, `assert_equivalent` on what it wrote with `diff`'s
        options (model=, backend=, no_replay=, ...). An equivalent dump is deleted (a
        Hypothesis run writes one per example); a diverged one is kept for its rerun command."""
        out = self.dump_dir()
        with _capture(model, out, **capture_options) as cap:
            yield cap
        self.assert_equivalent(out, **(diff or {}))
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(str(out) + ".kvdiff", ignore_errors=True)

    def assert_equivalent(self, dump: Any, **options: Any) -> Result:
        """`kvdiff_capture.assert_equivalent`, with the run's --kvdiff-arg flags."""
        extra = list(options.pop("extra_args", ())) + self.extra_args
        return assert_equivalent(dump, extra_args=extra, **options)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvdiff")
    group.addoption("--kvdiff-arg", action="append", default=[], metavar="FLAG",
                    help="a flag for every kvdiff diff of the run, e.g. --kvdiff-arg=--backend=cuda")


@pytest.fixture(scope="session")
def kvdiff(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Kvdiff:
    """Captures a block into a fresh folder and asserts it equivalent to kvdiff's reference."""
    flags = pytestconfig.getoption("kvdiff_arg", default=None) or []
    extra = [a for arg in flags for a in arg.split("=", 1)]
    return Kvdiff(tmp_path_factory.mktemp("kvdiff"), extra)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    err = call.excinfo.value if call.excinfo is not None else None
    if isinstance(err, Divergence):
        lines = [f"HTML report: {h}" for h in err.html_reports]
        lines += [f"JSON report: {j}" for j in err.json_reports]
        lines.append("rerun: " + " ".join(["kvdiff"] + err.command[1:]))
        report.sections.append(("kvdiff", "\n".join(lines)))
        for h in err.html_reports:
            report.user_properties.append(("kvdiff_html_report", h))
