"""An engine team's test file, as docs/engine-ci.md shows it: the engine's chunked prefill held
to kvdiff's reference for any chunking Hypothesis draws, and for conversations of a prompt set
with the prompt check. `TINY_ENGINE_BUG` plants one of tiny_engine.BUGS, as a bad commit would.
"""
import os
from pathlib import Path

from hypothesis import given, settings, strategies as st

import kvdiff_capture as kc
from kvdiff_capture.strategies import chunkings, prompts
from tiny_engine import TinyEngine

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "fixtures/default-model"
PROMPT = ROOT / "fixtures/prompts/task.json"
ENGINE = TinyEngine(MODEL, bug=os.environ.get("TINY_ENGINE_BUG") or None)
IDS = kc.prompt_ids(PROMPT, model=MODEL)
EXAMPLES = int(os.environ.get("TINY_ENGINE_EXAMPLES", "12"))


def test_whole_prompt_is_equivalent(kvdiff):
    with kvdiff.capture(None, engine="tiny", model_name=str(MODEL), prompt=str(PROMPT)):
        ENGINE.generate(IDS, max_new_tokens=2)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
@given(cuts=chunkings(len(IDS), max_chunks=4))
def test_any_chunking_is_equivalent(kvdiff, cuts):
    with kvdiff.capture(None, engine="tiny", model_name=str(MODEL), prompt=str(PROMPT)):
        ENGINE.generate(IDS, cuts=cuts, max_new_tokens=2)


@settings(max_examples=max(EXAMPLES // 3, 1), deadline=None, derandomize=True, database=None)
@given(p=prompts(ROOT / "fixtures/prompt-set.jsonl", model=MODEL), data=st.data())
def test_prompt_set_in_chunks_is_equivalent(kvdiff, p, data):
    cuts = data.draw(chunkings(len(p.ids), max_chunks=3), label="cuts")
    with kvdiff.capture(None, engine="tiny", model_name=str(MODEL), prompt=p.messages):
        ENGINE.generate(p.ids, cuts=cuts, max_new_tokens=2)
