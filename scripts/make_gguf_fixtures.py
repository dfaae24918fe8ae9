"""Converts kvdiff's small models to GGUF with llama.cpp's own converter (convert_hf_to_gguf.py,
as vendored by the llama-cpp-python sdist), for the llama.cpp cases (docs/llama-cpp.md). The
converter imports torch, so this runs on the GPU machine; its bf16 output is committed, and the
f32 and f16 files are derived from it with gguf-py where the tests run
(scripts/gguf_precision.py).

  python3 scripts/make_gguf_fixtures.py LLAMA_CPP_DIR OUT_DIR

LLAMA_CPP_DIR holds convert_hf_to_gguf.py, conversion/ and gguf-py/ (the sdist's
vendor/llama.cpp). The fixtures' own byte-level BPE vocabularies are no pretrained model's, so
the converter cannot recognise their pre-tokenizer by its hash: they are declared `gpt-2`, the
regex their tokenizer.json holds (kvdiff feeds llama.cpp token ids, never text).
"""
import os
import sys

src, out = sys.argv[1], sys.argv[2]
sys.path[:0] = [src, os.path.join(src, "gguf-py")]
import convert_hf_to_gguf  # noqa: E402
from conversion import base  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.makedirs(out, exist_ok=True)
for name, folder in [("default-model", "fixtures/default-model"), ("llama3", "fixtures/arch/llama3")]:
    dest = os.path.join(out, f"{name}.bf16.gguf")
    sys.argv = ["convert_hf_to_gguf.py", os.path.join(root, folder), "--outtype", "bf16", "--outfile", dest]
    convert_hf_to_gguf.main()
    print(f"{dest}: {os.path.getsize(dest)} bytes")
