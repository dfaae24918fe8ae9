"""The pytest plugin on torch engines (GPU machine: scripts/gpu_tests.sh engine-ci): HF
transformers prefilling in chunks through its KV cache, and a real nano-vllm `LLM`, captured by
the `kvdiff` fixture. Clean runs pass (and any chunking Hypothesis draws); a planted RoPE fault
(positions restarting at 16 in the prefill) fails with its first divergence in the message."""
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from transformers import AutoModelForCausalLM, DynamicCache

import kvdiff_capture as kc
from kvdiff_capture.strategies import chunkings

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "fixtures/default-model"
PROMPT = ROOT / "fixtures/prompts/task.json"
IDS = kc.prompt_ids(PROMPT, model=MODEL)
HF = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager").cuda().eval()


def hf_generate(cuts=(), bug=False, new=3):
    """The engine: HF's model prefilling IDS in chunks starting at `cuts`, then greedy decode.
    `bug`: positions fed RoPE restart at 16 (a late chunk rotated from its own start)."""
    bounds = [0, *sorted(cuts), len(IDS)]
    cache = DynamicCache(config=HF.config)
    with torch.no_grad():
        for lo, hi in zip(bounds, bounds[1:]):
            ids = torch.tensor([IDS[lo:hi]], device="cuda")
            pos = torch.arange(lo, hi, device="cuda")
            if bug:
                pos = torch.where(pos >= 16, pos - 16, pos)
            logits = HF(input_ids=ids, position_ids=pos[None], past_key_values=cache, use_cache=True).logits
        at = len(IDS)
        for _ in range(new - 1):
            nxt = logits[0, -1].argmax().view(1, 1)
            logits = HF(input_ids=nxt, position_ids=torch.tensor([[at]], device="cuda"),
                        past_key_values=cache, use_cache=True).logits
            at += 1


def test_hf_chunked_prefill_is_equivalent(kvdiff):
    with kvdiff.capture(HF, model_name=str(MODEL), prompt=str(PROMPT)):
        hf_generate(cuts=(16, 30))


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(cuts=chunkings(len(IDS), max_chunks=4, min_chunk=2))
def test_hf_any_chunking_is_equivalent(kvdiff, cuts):
    with kvdiff.capture(HF, model_name=str(MODEL), prompt=str(PROMPT)):
        hf_generate(cuts=cuts)


def test_hf_planted_rope_fault_fails_with_its_first_divergence(kvdiff):
    with pytest.raises(kc.Divergence) as e:
        with kvdiff.capture(HF, model_name=str(MODEL), prompt=str(PROMPT)):
            hf_generate(cuts=(16, 30), bug=True)
    msg = str(e.value)
    print(msg)
    assert "first divergence: step 0 (prefill), L0.q_rope, position 16" in msg, msg
    assert "rerun: kvdiff diff" in msg and all(Path(h).is_file() for h in e.value.html_reports)


@pytest.fixture(scope="module")
def nano():
    """A real nano-vllm LLM (the nano-vllm-fork wheel) on the default model in bf16, flash-attn
    replaced by the torch stand-in."""
    sys.path.insert(0, str(ROOT / "scripts/nano_vllm"))  # the flash_attn stand-in, first
    if not os.environ.get("KVDIFF_REQUIRE_NANO"):
        pytest.importorskip("nanovllm", reason="nano-vllm is not installed (scripts/gpu_tests.sh installs it)")
    import nanovllm.engine.model_runner as mr
    from nanovllm import LLM, SamplingParams
    import rope_compat
    rope_compat.install()
    # bf16, the checkpoint's own: nano-vllm's f32 RMSNorm updates its residual in place, which
    # a capture sees as a divergence (scripts/nano_vllm_suite.py measures that case apart).
    llm = LLM(str(MODEL), enforce_eager=True, max_model_len=512, max_num_batched_tokens=2048,
              max_num_seqs=4, gpu_memory_utilization=0.2)
    sp = SamplingParams(temperature=1e-5, top_k=1, max_tokens=4, ignore_eos=True)
    return llm, sp, mr


def test_nano_vllm_is_equivalent(kvdiff, nano):
    llm, sp, _ = nano
    with kvdiff.capture(llm, prompt=str(PROMPT)):
        llm.generate([IDS], sp, use_tqdm=False)


def test_nano_vllm_planted_rope_fault_fails_with_its_first_divergence(kvdiff, nano):
    llm, sp, mr = nano
    original = mr.ModelRunner.prepare_prefill

    def late_positions(self, seqs):
        input_ids, positions = original(self, seqs)
        return input_ids, torch.where(positions >= 16, positions - 16, positions)
    mr.ModelRunner.prepare_prefill = late_positions
    try:
        with pytest.raises(kc.Divergence) as e:
            with kvdiff.capture(llm, prompt=str(PROMPT)):
                llm.generate([IDS], sp, use_tqdm=False)
    finally:
        mr.ModelRunner.prepare_prefill = original
    msg = str(e.value)
    print(msg)
    assert "L0.q_rope, position 16" in msg, msg
