"""The capture's way into nano-vllm's tensor-parallel workers (kvdiff_capture.adapters.
nano_vllm_workers), through a stand-in of nano-vllm's own shared-memory call channel with real
spawned worker processes: an action reaches every worker and is acknowledged, the call after it
is not lost, a worker that fails is named with its reason, and one that never answers is named
when the wait runs out. The same channel under a real nano-vllm at tensor_parallel_size=2 is
scripts/nano_vllm_tp_suite.py (GPU machine)."""

import functools
import multiprocessing as mp
import os
import sys
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fake_nanovllm"))

from nanovllm.engine.model_runner import ModelRunner  # noqa: E402
import tp_actions  # noqa: E402
from kvdiff_capture.adapters import nano_vllm_workers as workers  # noqa: E402


@pytest.fixture
def engine(tmp_path):
    """Rank 0 here and two spawned workers, as nano-vllm's LLM builds them."""
    ctx = mp.get_context("spawn")
    name = "kvdiff-test-" + uuid.uuid4().hex[:8]
    events = [ctx.Event() for _ in range(2)]
    procs = []
    runner = ModelRunner(0, 3, events, name, str(tmp_path))
    for rank, event in zip((1, 2), events):
        p = ctx.Process(target=ModelRunner, args=(rank, 3, event, name, str(tmp_path)))
        p.start()
        procs.append(p)
    yield runner, procs, tmp_path
    if all(p.is_alive() for p in procs):
        runner.call("exit")
    elif getattr(runner, "shm", None) is not None:
        runner.exit()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def runs(tmp_path, rank, want):
    """The calls of `run` worker `rank` logged, once it logged `want` of them (or 20 s passed).
    nano-vllm's own channel holds one call at a time: a real `run` is a collective, so rank 0
    cannot send the next before every worker took it; here the test waits instead."""
    import time
    path = tmp_path / f"run-rank-{rank}.log"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= want:
            return lines
        time.sleep(0.01)
    return lines


def test_an_action_reaches_every_worker_and_the_next_call_is_not_lost(engine):
    runner, _procs, tmp = engine
    workers.in_workers(runner, functools.partial(tp_actions.mark, str(tmp)), str(tmp), "mark")
    assert sorted(p.name for p in tmp.glob("ran-in-rank-*")) == ["ran-in-rank-1", "ran-in-rank-2"]
    # Rank 0 ran the same call as a plain attribute set, which is undone.
    assert workers.ATTR not in runner.__dict__
    # A call sent right after the acknowledgement reaches both workers.
    runner.call("run", [7, 8], True)
    assert runs(tmp, 1, 1) == ["[7, 8] True []"] and runs(tmp, 2, 1) == ["[7, 8] True []"]


def test_a_worker_that_fails_is_named_with_its_reason_and_the_channel_still_works(engine):
    runner, _procs, tmp = engine
    with pytest.raises(RuntimeError) as e:
        workers.in_workers(runner, tp_actions.fail, str(tmp), "open")
    assert "tensor-parallel rank 1 could not open" in str(e.value)
    assert "ValueError: no such shard in rank 1 (ranks [1, 2] failed)" in str(e.value)
    runner.call("run", [1], False)
    assert runs(tmp, 1, 1) == ["[1] False []"] and runs(tmp, 2, 1) == ["[1] False []"]


def test_a_worker_that_never_answers_is_named(engine, monkeypatch):
    runner, procs, tmp = engine
    procs[1].kill()
    procs[1].join()
    monkeypatch.setattr(workers, "WAIT_SECONDS", 1.0)
    with pytest.raises(RuntimeError) as e:
        workers.in_workers(runner, functools.partial(tp_actions.mark, str(tmp)), str(tmp), "open")
    assert "tensor-parallel ranks [2] did not answer within 1 s" in str(e.value)
    assert "KVDIFF_TP_WAIT" in str(e.value)


def test_a_joined_rank_writes_into_rank_0s_folder_and_rank_0_finishes_it(tmp_path):
    from kvdiff_capture import Capture
    out = tmp_path / "dump"
    with pytest.raises(FileNotFoundError, match="rank 0's capture must open it first"):
        Capture(out, tp_rank=1, tp_size=2, joined=True)
    owner = Capture(out, tp_rank=0, tp_size=2)
    joined = Capture(out, tp_rank=1, tp_size=2, joined=True)
    for rank, cap in enumerate((owner, joined)):
        cap.begin([5, 6], positions=[0, 1])
        cap.tap("L0.q", [[[float(rank)]], [[float(rank)]]])
        cap.end()
    joined.close(True)
    assert not out.exists(), "only rank 0 renames the folder"
    assert (tmp_path / "dump.partial" / ".rank-1.closed").exists()
    owner.close(True)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["meta.json", "step-0000.call-00000.seq-0.rank-0.safetensors",
                     "step-0000.call-00000.seq-0.rank-1.safetensors"], names
