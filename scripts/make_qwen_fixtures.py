#!/usr/bin/env python3
"""Tiny random Qwen 2 and Qwen 3 checkpoints, their f32 GGUF conversions and HF references, for the tests.

  python3 scripts/make_qwen_fixtures.py [--llama-cpp /tmp/llama.cpp-build] [--out tests/fixtures]

For each of tiny-qwen2 and tiny-qwen3, writes `OUT/NAME/`: an HF folder (`save_pretrained`,
random weights, the byte-level tokenizer of scripts/make_llama_fixtures.py), NAME.f32.gguf
(llama.cpp's convert_hf_to_gguf.py, told the pre-tokenizer is `gpt-2` as that script does),
verify.safetensors (scripts/hf_reference.py on the folder, float64, 16 greedy ids per prompt)
and, for tiny-qwen2, verify.f32.safetensors (the same on the GGUF, which transformers loads;
transformers' GGUF loader ignores qwen3.attention.key_length and builds heads of
hidden_size / heads, so tiny-qwen3's GGUF, converted from the folder, is held to the
folder's reference instead).

Qwen 2 adds biases to q, k and v (the init leaves them zero: they are drawn ~ N(0, 0.5));
Qwen 3 adds an RMSNorm on each query and key head (gains ~ N(1, 0.3)). Every other norm
gain ~ N(1, 0.2). Needs what scripts/make_llama_fixtures.py needs.
"""
import argparse
import subprocess
import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from make_llama_fixtures import PROMPTS, VOCAB, convert, make_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures")
args = ap.parse_args()

common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2,
              bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
CHECKPOINTS = [
    ("tiny-qwen2", Qwen2ForCausalLM, Qwen2Config(rope_theta=1000000.0, **common), 4006),
    # Qwen 3: the head size is its own (24, not 64 / 4), an untied head.
    ("tiny-qwen3", Qwen3ForCausalLM, Qwen3Config(head_dim=24, rope_theta=1000000.0, attention_bias=False,
                                                 **{**common, "tie_word_embeddings": False}), 4007),
]
for name, cls, config, seed in CHECKPOINTS:
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif n.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    out = args.out / name
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer(out)
    ggufs = convert(args.llama_cpp, out, ["f32"], name)
    ref = [sys.executable, str(ROOT / "scripts/hf_reference.py")]
    subprocess.run(ref + [str(out), "--prompts", str(PROMPTS), "--out", str(out / "verify.safetensors"),
                          "--dtype", "float64", "--greedy", "16"], check=True)
    if name == "tiny-qwen3":
        continue
    subprocess.run(ref + [str(ggufs["f32"]), "--prompts", str(PROMPTS), "--out",
                          str(out / "verify.f32.safetensors"), "--dtype", "float64", "--greedy", "16"], check=True)
    print(f"wrote {out}")
