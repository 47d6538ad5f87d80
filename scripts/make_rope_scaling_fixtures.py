#!/usr/bin/env python3
"""Tiny random checkpoints with RoPE scaling, their GGUF conversions and HF references, for the tests.

  python3 scripts/make_rope_scaling_fixtures.py [--llama-cpp /tmp/llama.cpp-build] [--out tests/fixtures]

Writes, each an HF folder (`save_pretrained`, random weights, the byte-level tokenizer of
scripts/make_llama_fixtures.py) with verify.safetensors (scripts/hf_reference.py on the folder,
float64, 16 greedy ids per prompt of tests/fixtures/verify-prompts.txt):

  tiny-llama3/         LlamaForCausalLM with Llama 3.1's `llama3` scaling (factor 8, low/high
                       frequency factors 1 and 4, original context 32; head size 16, base 10000:
                       of the 8 pairs, 1 keeps its frequency, 1 is blended, 6 are divided by 8),
                       and tiny-llama3.f32.gguf from llama.cpp's convert_hf_to_gguf.py, which stores
                       the scaling as the `rope_freqs.weight` tensor. transformers' GGUF loader
                       ignores that tensor, so the GGUF is held to the folder's reference.
  tiny-gemma3-linear/  Gemma3ForCausalLM with `linear` scaling (factor 8) on its global blocks, as
                       Gemma 3 4B and larger have it; the sliding-window blocks are not scaled.

Prompts and their 16 greedy ids reach position ~30, where the scaled pairs' angles differ from unscaled ones by radians,
so a loader that ignored the scaling fails the first stage after RoPE. Needs what
scripts/make_llama_fixtures.py needs.
"""
import argparse
import subprocess
import sys
from pathlib import Path

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from make_llama_fixtures import PROMPTS, VOCAB, convert, make_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures")
args = ap.parse_args()
torch.set_num_threads(1)


def reference(folder: Path, source: Path):
    subprocess.run([sys.executable, str(ROOT / "scripts/hf_reference.py"), str(source), "--prompts", str(PROMPTS),
                    "--out", str(folder / "verify.safetensors"), "--dtype", "float64", "--greedy", "16"],
                   check=True)


def randomize_norms(model, gemma: bool):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                # Gemma computes x · (1 + w).
                p.copy_(0.3 * torch.randn_like(p) if gemma else 1.0 + 0.2 * torch.randn_like(p))


torch.manual_seed(4008)
llama3 = LlamaConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
    bos_token_id=0, eos_token_id=0, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
    hidden_act="silu",
    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
model = LlamaForCausalLM(llama3).eval()
randomize_norms(model, gemma=False)
out = args.out / "tiny-llama3"
model.save_pretrained(out, safe_serialization=True)
make_tokenizer(out)
convert(args.llama_cpp, out, ["f32"], "tiny-llama3")
reference(out, out)
print(f"wrote {out}")

torch.manual_seed(4009)
gemma = Gemma3TextConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
    max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=0, eos_token_id=0,
    pad_token_id=0, tie_word_embeddings=True)
model = Gemma3ForCausalLM(gemma).eval()
randomize_norms(model, gemma=True)
out = args.out / "tiny-gemma3-linear"
model.save_pretrained(out, safe_serialization=True)
make_tokenizer(out)
reference(out, out)
print(f"wrote {out}")
