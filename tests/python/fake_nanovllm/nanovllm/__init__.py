"""A stand-in for nano-vllm's tensor-parallel call channel alone (no model): what
test_tp_channel.py drives the capture's worker protocol through, without torch."""
