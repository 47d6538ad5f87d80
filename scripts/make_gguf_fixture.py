#!/usr/bin/env python3
"""Write small GGUF files with gguf-py (llama.cpp's own Python writer) and dump what
gguf-py's GGUFReader reads back from them, as the truth for tests/gguf.rs.

    pip install gguf==0.19.0
    python3 scripts/make_gguf_fixture.py tests/fixtures/gguf

Also, for any existing GGUF file, `--dump FILE OUT.json` writes the same kind of dump
(used once to check the reader against SmolLM2-135M-Instruct.Q4_1.gguf).
"""
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T


def dump(path, out):
    r = gguf.GGUFReader(path)
    meta = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            et = field.types[-1]
            if et == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            meta[name] = {"type": "array", "elem": et.name, "value": val}
        elif vt == gguf.GGUFValueType.STRING:
            meta[name] = {"type": "STRING", "value": bytes(field.parts[field.data[0]]).decode("utf-8")}
        else:
            meta[name] = {"type": vt.name, "value": field.parts[field.data[0]].tolist()[0]}
    tensors = [
        {
            "name": t.name,
            "type": t.tensor_type.name,
            "dims": [int(d) for d in t.shape],  # ggml order, innermost first
            "offset": int(t.data_offset),  # absolute, in the file
            "n_bytes": int(t.n_bytes),
            "first_bytes": bytes(np.asarray(t.data).view(np.uint8).reshape(-1)[:16]).hex(),
        }
        for t in r.tensors
    ]
    Path(out).write_text(json.dumps({"metadata": meta, "tensors": tensors}, indent=1, ensure_ascii=False) + "\n")


def write(path, alignment=None):
    w = gguf.GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_name("fixture — ünïcode ✓")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.empty", "")
    w.add_array("t.strings", ["a", "", "Ġthe", "<|im_start|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(11).astype(np.float32))
    # Quantized tensors as raw blocks (the writer takes bytes with a byte shape).
    for name, qt, shape in [("q8", T.Q8_0, (2, 64)), ("q4k", T.Q4_K, (1, 256)), ("q6k", T.Q6_K, (2, 256))]:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(shape[0], shape[1] // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if sys.argv[1] == "--dump":
        dump(sys.argv[2], sys.argv[3])
    else:
        out = Path(sys.argv[1])
        out.mkdir(parents=True, exist_ok=True)
        for name, align in [("types.gguf", None), ("aligned64.gguf", 64)]:
            write(out / name, align)
            dump(out / name, out / (name + ".json"))
        print("gguf", gguf.__version__ if hasattr(gguf, "__version__") else "?", "numpy", np.__version__)
