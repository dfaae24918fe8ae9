"""The random models of scripts/bench_big.py (the multi-GPU benchmark's 32B and 70B shapes),
written at a small size: safetensors files whose headers tile each file exactly, weights whose
bf16 values lie where the generator says, every norm 1, and tensors not copies of each other."""

import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "..", "scripts"))

import bench_big  # noqa: E402


def bf16(bits):
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def test_random_values_are_signed_and_within_their_binade():
    block = bench_big.random_bf16(4096, seed=1)
    values = [bf16(v) for v in struct.unpack("<4096H", block)]
    assert all(2 ** -6 <= abs(v) < 2 ** -5 for v in values)
    negative = sum(v < 0 for v in values)
    assert 1800 < negative < 2300
    assert bench_big.random_bf16(4096, seed=1) == block
    assert bench_big.random_bf16(4096, seed=2) != block


def test_a_small_model_of_the_70b_layout(tmp_path):
    shape = dict(bench_big.SHAPES["70b"], hidden_size=64, num_hidden_layers=5, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=96)
    total, shards, fds = bench_big.write_model(shape, str(tmp_path))
    try:
        index = json.load(open(tmp_path / "model.safetensors.index.json"))
        names = dict(bench_big.tensors(shape))
        assert set(index["weight_map"]) == set(names)
        assert shards == 2 and index["metadata"]["total_size"] == total
        seen, starts = 0, {}
        for f in sorted(set(index["weight_map"].values())):
            raw = open(tmp_path / f, "rb").read()
            (n,) = struct.unpack("<Q", raw[:8])
            header = json.loads(raw[8:8 + n])
            spans = sorted(h["data_offsets"] for h in header.values())
            # The tensors tile the data section exactly, in the header's own order.
            assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert 8 + n + spans[-1][1] == len(raw)
            for name, h in header.items():
                assert h["dtype"] == "BF16" and tuple(h["shape"]) == names[name]
                data = raw[8 + n + h["data_offsets"][0]:8 + n + h["data_offsets"][1]]
                values = struct.unpack(f"<{len(data) // 2}H", data)
                if name.endswith("norm.weight"):
                    assert set(values) == {0x3F80}
                else:
                    assert all(2 ** -6 <= abs(bf16(v)) < 2 ** -5 for v in values[:512])
                    starts[name] = values[:16]
                seen += len(data)
        assert seen == total
        # Each matrix starts at its own place in the random block.
        assert len(set(starts.values())) == len(starts)
        cfg = json.load(open(tmp_path / "config.json"))
        assert cfg["num_hidden_layers"] == 5 and cfg["architectures"] == ["LlamaForCausalLM"]
    finally:
        for fd in fds:
            os.close(fd)
