"""A GGUF rewritten at another precision: the bf16 files llama.cpp's converter wrote
(fixtures/gguf/, scripts/make_gguf_fixtures.py) as f32 or f16, metadata and tensor order
unchanged, with gguf-py (llama.cpp's own GGUF library; numpy only, no torch). bf16 to f32 is
exact; to f16 rounds each weight as an f16 checkpoint would.

  python3 scripts/gguf_precision.py SRC.gguf DEST.gguf f32|f16
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter


def widened(t):
    """A tensor's values as f32, in its own shape (numpy order: the GGUF dims reversed)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type == GGMLQuantizationType.BF16:
        raw = np.ascontiguousarray(t.data).view(np.uint16).reshape(-1)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    raise SystemExit(f"{t.name} is {t.tensor_type.name}: only bf16, f16 and f32 GGUFs are rewritten")


def main(src, dest, precision):
    if precision not in ("f32", "f16"):
        raise SystemExit(f"precision {precision!r}: f32 or f16")
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dest, arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if name == "general.file_type":
            w.add_file_type(0 if precision == "f32" else 1)  # LLAMA_FTYPE_ALL_F32 / MOSTLY_F16
            continue
        sub = field.types[1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), kind, sub_type=sub)
    for t in r.tensors:
        v = widened(t)
        # 1-D tensors (norms) stay f32, as the converter keeps them.
        out = v if precision == "f32" or v.ndim == 1 else v.astype(np.float16)
        w.add_tensor(t.name, out)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__.strip())
    main(*sys.argv[1:])
