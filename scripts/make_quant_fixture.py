#!/usr/bin/env python3
"""Blocks of every supported GGUF weight format and gguf-py's dequantization of them,
the truth for tests/quant.rs: `python3 scripts/make_quant_fixture.py tests/fixtures/quant`
(needs `pip install gguf==0.19.0`).

For each format, `<TYPE>.bin` holds raw blocks and `<TYPE>.f32` the little-endian f32
values `gguf.quants.dequantize` gives for them. The blocks are: values quantized by
gguf-py where it can (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16), including all-zero and
large-magnitude rows; random bytes with sane f16 scales for every format (every bit
pattern of the packed integers appears, plus an infinite and a negative-zero scale); and
for F32/F16/BF16 every special value (signed zeros, subnormals, infinities, quiet and
signalling NaNs).
"""
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, GGML_QUANT_SIZES, quants

rng = np.random.default_rng(1234)
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
# Where each format keeps its f16 scales (byte offsets in a block).
SCALES = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
          T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
for t in TYPES:
    block, size = GGML_QUANT_SIZES[t]
    parts = []
    n_values = 4 * 256
    if t in (T.F32, T.F16, T.BF16):
        # Every special value as raw bits: ±0, subnormals, ±inf, quiet and signalling NaNs.
        specials = {
            T.F32: [0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFBFFFFF],
            T.F16: [0x0000, 0x8000, 0x0001, 0x83FF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFDFF],
            T.BF16: [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFBF],
        }[t]
        dtype = {T.F32: np.uint32, T.F16: np.uint16, T.BF16: np.uint16}[t]
        parts.append(np.array(specials, dtype=dtype).view(np.uint8))
    if t in (T.F32, T.F16):
        vals = rng.standard_normal(n_values).astype(np.float32) * 10
        parts.append(vals.astype(np.float32 if t == T.F32 else np.float16).view(np.uint8))
    else:
        try:
            vals = np.concatenate([rng.standard_normal(n_values - 64), np.zeros(32), rng.standard_normal(32) * 3e4])
            parts.append(quants.quantize(vals.astype(np.float32).reshape(1, -1), t).reshape(-1))
        except NotImplementedError:
            pass
        if t != T.BF16:
            raw = rng.integers(0, 256, size=(n_values // block, size), dtype=np.uint8)
            for off in SCALES[t]:
                scale = (rng.standard_normal(raw.shape[0]) * 0.05).astype(np.float16)
                scale[0] = np.inf  # non-finite scales in the first blocks
                scale[1] = np.float16(-0.0)
                raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
            parts.append(raw.reshape(-1))
    blocks = np.concatenate(parts).astype(np.uint8)
    values = quants.dequantize(blocks, t).astype(np.float32)
    (out / f"{t.name}.bin").write_bytes(blocks.tobytes())
    (out / f"{t.name}.f32").write_bytes(values.astype("<f4").tobytes())
    print(t.name, len(blocks), "bytes ->", values.size, "values")
