"""nano-vllm under tensor parallelism: the ranks the engine spawned are captured too.

nano-vllm runs rank 0 in the caller's process and ranks 1..N-1 in worker processes it spawned
when the `LLM` was built; each worker loops on rank 0's calls, which reach it pickled through
shared memory (`ModelRunner.call`). The capture rides that same channel, so it works on an
engine whose workers started long before the capture block opened:

- opening: rank 0 sends one call (`setattr(runner, ATTR, action)`) whose argument, unpickled
  in each worker, hooks that worker's model into a capture writing its own
  `*.rank-R.safetensors` files into rank 0's dump folder;
- every `run` call then carries rank 0's view of the batch (sequence ids, cached tokens,
  lengths), which a worker's copies of the sequences do not have;
- closing: a second call unhooks each worker and has it say it is done; rank 0 waits for every
  rank before writing meta.json, so a dump is whole or not written.

Each step leaves a marker file (`.rank-R.open`, `.rank-R.close`, or `.failed` with the reason) in
the dump's folder; rank 0 waits for them, and a rank that fails or never answers fails the
capture with its reason. `in_workers` is the same channel for any other action in the workers.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

WAIT_SECONDS = float(os.environ.get("KVDIFF_TP_WAIT", "120"))


class RunInfo:
    """Rank 0's view of one `run` call's batch, handed to every worker with the call."""

    def __init__(self, seqs: List[Tuple[int, int, int, int]], is_prefill: bool,
                 cached: Dict[int, List[int]]) -> None:
        self.seqs, self.is_prefill, self.cached = seqs, is_prefill, cached


ATTR = "_kvdiff_worker"


def _install_setter(runner_class: Any) -> None:
    """Makes setting `ATTR` on a worker's runner run what rank 0 sent. nano-vllm's worker
    unpickles a call before it clears the event that announced it, and only then runs it: work
    done (and acknowledged) while unpickling could let rank 0's next call be missed, so the work
    runs here, as the call itself (`setattr(runner, ATTR, ...)`), with the runner at hand."""
    if isinstance(getattr(runner_class, ATTR, None), property):
        return

    def fset(runner: Any, value: Any) -> None:
        if isinstance(value, _Arrived):
            value.run(runner)

    setattr(runner_class, ATTR, property(lambda runner: None, fset))


class _Arrived:
    """An action from rank 0, unpickled in a worker and run when the worker makes the call."""

    def __init__(self, action: Callable[[Any], Any], where: str, token: str) -> None:
        self.action, self.where, self.token = action, where, token

    def run(self, runner: Any) -> None:
        """Never raises: an exception would end the worker's loop and hang rank 0 at its next
        collective, so the reason is written for rank 0 to report instead."""
        rank = getattr(runner, "rank", "?")
        try:
            self.action(runner)
            open(os.path.join(self.where, f".rank-{rank}.{self.token}"), "w").close()
        except Exception:
            # Written whole, then renamed: rank 0 reads the reason as soon as the name appears.
            failed = os.path.join(self.where, f".rank-{rank}.{self.token}.failed")
            try:
                with open(failed + ".tmp", "w") as f:
                    f.write(traceback.format_exc())
                os.replace(failed + ".tmp", failed)
            except OSError:
                pass


def _arrive(action: Callable[[Any], Any], where: str, token: str) -> _Arrived:
    from nanovllm.engine.model_runner import ModelRunner
    _install_setter(ModelRunner)
    return _Arrived(action, where, token)


class _Deliver:
    """What rank 0 pickles into its call: unpickled in a worker, it becomes an `_Arrived`."""

    def __init__(self, action: Callable[[Any], Any], where: str, token: str) -> None:
        self.action, self.where, self.token = action, where, token

    def __reduce__(self) -> Any:
        return (_arrive, (self.action, self.where, self.token))


def _wait(where: str, ranks: range, token: str) -> None:
    """Waits until every rank in `ranks` has run the action `token` or failed; raises naming the
    ranks that failed (with the first one's reason) or never answered."""
    deadline = time.monotonic() + WAIT_SECONDS
    waiting, failed = list(ranks), {}
    while waiting:
        for r in list(waiting):
            path = os.path.join(where, f".rank-{r}.{token}.failed")
            if os.path.exists(path):
                lines = open(path).read().strip().splitlines()
                failed[r] = lines[-1] if lines else "no reason given"
                waiting.remove(r)
            elif os.path.exists(os.path.join(where, f".rank-{r}.{token}")):
                waiting.remove(r)
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel ranks {waiting} did not answer within {WAIT_SECONDS:.0f} s "
                "(their worker processes are busy or gone): fix: check that the LLM's workers are "
                "alive, or raise KVDIFF_TP_WAIT")
        if waiting:
            time.sleep(0.01)
    if failed:
        first = min(failed)
        also = f" (ranks {sorted(failed)} failed)" if len(failed) > 1 else ""
        raise RuntimeError(f"tensor-parallel rank {first} could not {token.replace('-', ' ')}: "
                           f"{failed[first]}{also}")


def in_workers(runner: Any, action: Callable[[Any], Any], where: str, token: str,
               call: Optional[Callable[..., Any]] = None) -> None:
    """Runs `action(worker_runner)` in every worker of rank 0's `runner` through nano-vllm's own
    call channel, and waits until each has (markers `.rank-R.TOKEN` in the folder `where`).
    `action` must be picklable (a module-level function, or a functools.partial of one)."""
    world = int(getattr(runner, "world_size", 1))
    if world <= 1:
        return
    (call or runner.call)("__setattr__", ATTR, _Deliver(action, where, token))
    # Rank 0 ran the same call: a plain attribute set, undone here.
    runner.__dict__.pop(ATTR, None)
    _wait(where, range(1, world), token)


def _open_capture(spec: Dict[str, Any], runner: Any) -> None:
    from ..writer import Capture
    from .nano_vllm import nano_vllm_adapter
    cap = Capture(spec["out_dir"], engine=spec["engine"], dtype=spec["dtype"], model=spec["model"],
                  prompt_len=spec["prompt_len"], taps=spec["taps"], tp_rank=int(runner.rank),
                  tp_size=spec["tp_size"], joined=True)
    hooks = nano_vllm_adapter(cap, runner, worker=True)
    runner.__dict__["_kvdiff_capture"] = WorkerCapture(cap, hooks)


def _close_capture(runner: Any) -> None:
    state = runner.__dict__.pop("_kvdiff_capture", None)
    if isinstance(state, WorkerCapture):
        state.hooks.remove()
        state.cap.close(True)


class WorkerCapture:
    """A worker's capture and hooks, kept on its runner between the open and close calls."""

    def __init__(self, cap: Any, hooks: Any) -> None:
        self.cap, self.hooks = cap, hooks


def start_workers(cap: Any, runner: Any, undo: List[Any]) -> None:
    """Opens a capture in every worker of `runner` (rank 0's, with `world_size` > 1), makes each
    `run` call carry rank 0's batch, and registers in `undo` what closes them again."""
    world = int(runner.world_size)
    spec = {"out_dir": cap.out_dir, "engine": cap.engine, "dtype": cap.dtype, "model": cap.model,
            "prompt_len": cap.fixed_prompt_len, "taps": cap.patterns, "tp_size": world}
    original_call = runner.call
    try:
        in_workers(runner, functools.partial(_open_capture, spec), cap.partial, "open")
    except Exception:
        # Ranks that did open are unhooked again before the capture fails.
        in_workers(runner, _close_capture, cap.partial, "close")
        raise

    def call(method_name: str, *args: Any) -> Any:
        if method_name == "run" and len(args) >= 2:
            from .nano_vllm import batch_of
            is_prefill = bool(args[1])
            rows, cached = batch_of(args[0], is_prefill)
            return original_call(method_name, *args, RunInfo(rows, is_prefill, cached))
        return original_call(method_name, *args)

    def close() -> None:
        runner.call = original_call
        if os.path.isdir(cap.partial):
            in_workers(runner, _close_capture, cap.partial, "close")

    runner.call = call
    undo.append(close)
