#!/usr/bin/env python3
"""A tiny random Gemma 3 checkpoint in bf16 and llama.cpp's f32 GGUF conversion of it, for the tests.

  python3 scripts/make_gemma3_gguf_fixture.py [--llama-cpp /tmp/llama.cpp-build] [--out tests/fixtures/tiny-gemma3-6]

Writes config.json, model.safetensors (bf16, as Google ships Gemma 3), the byte-level tokenizer of
scripts/make_llama_fixtures.py and tiny-gemma3-6.f32.gguf: llama.cpp's convert_hf_to_gguf.py,
told the pre-tokenizer is `gpt-2` as that script does. The test holds `forge quantize` to it.

Six blocks, because a GGUF cannot say which blocks are local: llama.cpp's loader takes five of
six (its converter writes no layer types), and 1/sqrt(head_dim) as the query scale (so
`query_pre_attn_scalar` is the head size here). Gemma's norms compute `x · (1 + w)`: the
converter stores 1 + w in f32 (w widened from bf16 first), every w ~ N(0, 0.3).
Needs torch, transformers >= 5, and llama.cpp's sources (scripts/build_llama_cpp.sh).
"""
import argparse
import sys
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, str(Path(__file__).parent))
from make_llama_fixtures import VOCAB, convert, make_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/tiny-gemma3-6")
args = ap.parse_args()

torch.manual_seed(4008)
config = Gemma3TextConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=3,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=0, eos_token_id=0,
    pad_token_id=0, tie_word_embeddings=True)
model = Gemma3ForCausalLM(config).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if n.endswith("norm.weight"):
            p.copy_(0.3 * torch.randn_like(p))
model = model.to(torch.bfloat16)
args.out.mkdir(parents=True, exist_ok=True)
model.save_pretrained(args.out, safe_serialization=True)
make_tokenizer(args.out)
convert(args.llama_cpp, args.out, ["f32"], args.out.name)
