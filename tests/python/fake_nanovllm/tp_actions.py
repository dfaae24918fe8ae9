"""Actions test_tp_channel.py sends to the workers (module-level, so they pickle by name)."""

import os


def mark(where, runner):
    open(os.path.join(where, f"ran-in-rank-{runner.rank}"), "w").close()


def fail(runner):
    raise ValueError(f"no such shard in rank {runner.rank}")
