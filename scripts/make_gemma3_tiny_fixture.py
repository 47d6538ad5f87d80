#!/usr/bin/env python3
"""A tiny random Gemma 3 checkpoint (HF `Gemma3ForCausalLM` folder) and its HF reference, for the tests.

  python3 scripts/make_gemma3_tiny_fixture.py [--out tests/fixtures/tiny-gemma3]

Writes config.json, model.safetensors, the byte-level tokenizer of scripts/make_llama_fixtures.py
(384 ids), and verify.safetensors: scripts/hf_reference.py on the folder in float64 with 16
greedy ids per prompt (tests/fixtures/verify-prompts.txt).

The config exercises what Gemma 3 adds to Llama: a sliding window of 3 keys (shorter than
most prompts) on the local blocks, a global block between them with its own RoPE base,
grouped-query heads with q/k norms, `query_pre_attn_scalar` different from the head size,
GeGLU. Gemma's norms compute `x · (1 + w)`: every norm weight `w` ~ N(0, 0.3) (the init's
zeros would pass a loader that dropped them or forgot the 1). Needs torch, transformers >= 5.
"""
import argparse
import subprocess
import sys
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, str(Path(__file__).parent))
from make_llama_fixtures import PROMPTS, VOCAB, make_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/tiny-gemma3")
args = ap.parse_args()

torch.manual_seed(4005)
config = Gemma3TextConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=0, eos_token_id=0,
    pad_token_id=0, tie_word_embeddings=True)
model = Gemma3ForCausalLM(config).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if n.endswith("norm.weight"):
            p.copy_(0.3 * torch.randn_like(p))
args.out.mkdir(parents=True, exist_ok=True)
model.save_pretrained(args.out, safe_serialization=True)
make_tokenizer(args.out)
subprocess.run([sys.executable, str(ROOT / "scripts/hf_reference.py"), str(args.out), "--prompts", str(PROMPTS),
                "--out", str(args.out / "verify.safetensors"), "--dtype", "float64", "--greedy", "16"], check=True)
