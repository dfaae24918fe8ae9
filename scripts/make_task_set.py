"""Writes the default model's held-out task set (fixtures/tasks.jsonl) for `kvdiff eval`:
conversations of scripts/chat_task.py with their expected answer, case and fact.

Usage: python3 scripts/make_task_set.py [N] > fixtures/tasks.jsonl
"""

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))
import chat_task  # noqa: E402

rng = random.Random(2026)
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 100):
    messages, answer, case, value = chat_task.make_example(rng)
    print(json.dumps({"messages": messages, "answer": answer, "case": case, "fact": value}))
