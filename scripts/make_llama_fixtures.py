#!/usr/bin/env python3
"""Tiny random Llama checkpoints, their GGUF conversions and HF references, for the tests.

  python3 scripts/make_llama_fixtures.py [--llama-cpp /tmp/llama.cpp-build] [--out tests/fixtures]

For each checkpoint below, writes `OUT/NAME/`:

  config.json, model.safetensors, tokenizer.json, tokenizer_config.json
                         an HF `LlamaForCausalLM` folder (`save_pretrained`), random weights
  NAME.TYPE.gguf         llama.cpp's `convert_hf_to_gguf.py` (f32, f16) and `llama-quantize`
                         (every other TYPE), from the llama.cpp that scripts/build_llama_cpp.sh builds
  verify.safetensors     scripts/hf_reference.py on the folder, float64 (every stage, logits)
  verify.TYPE.safetensors  the same on NAME.TYPE.gguf: transformers dequantizes the GGUF to
                         float and runs it (the f32 truth for a quantized file)
  greedy.json            HF's greedy continuations (float64) of the verify prompts, from
                         the folder and from each GGUF

The tokenizer is a byte-level BPE of 384 ids trained here (`tokenizers`) on a fixed text, so
the embedding tables stay small; its pre-tokenizer is GPT-2's. convert_hf_to_gguf.py only
knows the pre-tokenizers of published models (it hashes the tokenizer's output on a check
string), so this script tells it the name, `gpt-2`, instead.

Weights: the library's init with a large `initializer_range` (peaked distributions), then
every RMSNorm gain ~ N(1, 0.2) (the init leaves gains at 1, which a loader that dropped them
would pass). Needs: torch, transformers >= 4.56, safetensors, tokenizers, gguf, accelerate,
numpy, sentencepiece (convert_hf_to_gguf.py imports it).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "tests/fixtures/verify-prompts.txt"
VOCAB = 384
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# name, config, GGUF types, stored dtype, seed
CHECKPOINTS = [
    # GQA (4 query heads over 2 KV heads), tied head, RoPE base 10000.
    ("tiny-llama", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
                        max_position_embeddings=128, rms_norm_eps=1e-5),
     ["f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"], torch.float32, 4001),
    # Multi-head (no grouping), untied head, SmolLM2's RoPE base, three layers.
    ("tiny-llama-untied", dict(hidden_size=96, intermediate_size=224, num_hidden_layers=3, num_attention_heads=3,
                               num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=False,
                               max_position_embeddings=96, rms_norm_eps=1e-6),
     ["f32", "q8_0", "q4_1"], torch.float32, 4002),
    # Multi-query (one KV head), odd sizes (48 wide, head_dim 16), RoPE base 500000, stored f16.
    ("tiny-llama-odd", dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
                            num_key_value_heads=1, rope_theta=500000.0, tie_word_embeddings=True,
                            max_position_embeddings=64, rms_norm_eps=1e-5),
     ["f32", "f16"], torch.float16, 4003),
    # Rows of 256 for the k-quants (super-blocks of 256 values).
    ("tiny-llama-k", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False,
                          max_position_embeddings=64, rms_norm_eps=1e-5),
     ["q4_k", "q5_k", "q6_k"], torch.float16, 4004),
]

TRAINING_TEXT = """The quick brown fox jumps over the lazy dog. Hello, world! Café 東京 🚀 naïve.
Once upon a time there was a little model that learned to count: 1 2 3 4 5 6 7 8 9 10.
    Indented lines, tabs\tand newlines\n matter to a tokenizer. "Quotes", 'apostrophes' and (brackets).
def main():\n    return 42\n"""


def make_tokenizer(out: Path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token=None)
    fast.save_pretrained(out)


def make_checkpoint(name, cfg, dtype, seed, out: Path):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, initializer_range=0.2,
                         attention_bias=False, mlp_bias=False, hidden_act="silu", **cfg)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model = model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer(out)


def convert(llama_cpp: Path, folder: Path, gguf_types, name):
    src = llama_cpp / "src/vendor/llama.cpp"
    quantize = llama_cpp / "build/bin/llama-quantize"
    base = {}
    for t in ("f32", "f16"):
        if t in gguf_types or any(q not in ("f32", "f16") for q in gguf_types):
            path = folder / f"{name}.{t}.gguf"
            code = (
                "import sys; sys.path[:0] = [{src!r}, {gguf!r}];"
                "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2';"
                "sys.argv = ['convert_hf_to_gguf.py', {folder!r}, '--outtype', {t!r}, '--outfile', {path!r}];"
                "import convert_hf_to_gguf as c; c.main()"
            ).format(src=str(src), gguf=str(src / "gguf-py"), folder=str(folder), t=t, path=str(path))
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
            base[t] = path
    for t in gguf_types:
        if t in ("f32", "f16"):
            continue
        path = folder / f"{name}.{t}.gguf"
        # From the f32 conversion (the lossless source), as a user quantizes a release.
        subprocess.run([str(quantize), str(base["f32"]), str(path), t.upper()], check=True, capture_output=True)
    for t, path in base.items():
        if t not in gguf_types:
            path.unlink()
    return {t: folder / f"{name}.{t}.gguf" for t in gguf_types}


def greedy(src, load, n_new=16):
    tokenizer = AutoTokenizer.from_pretrained(src, **load)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64, **load).eval()
    prompts = [l for l in PROMPTS.read_text(encoding="utf-8").split("\n")]
    prompts = [p.replace("\\n", "\n") for p in prompts[:-1]]
    out = []
    for text in prompts:
        ids = tokenizer(text).input_ids if text else []
        ids = ids or [model.config.bos_token_id]
        with torch.no_grad():
            x = torch.tensor([ids])
            gen = model.generate(x, max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, attention_mask=torch.ones_like(x))
            logits = model(gen[:, :-1]).logits[0, len(ids) - 1:]
        top2 = torch.topk(logits, 2, dim=-1).values
        out.append({"prompt": text, "prompt_ids": ids, "greedy_ids": gen[0, len(ids):].tolist(),
                    "min_margin": float((top2[:, 0] - top2[:, 1]).min())})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures")
    ap.add_argument("--only", help="make only this checkpoint")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name, cfg, gguf_types, dtype, seed in CHECKPOINTS:
        if args.only and name != args.only:
            continue
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        make_checkpoint(name, cfg, dtype, seed, folder)
        ggufs = convert(args.llama_cpp, folder, gguf_types, name)
        ref = [sys.executable, str(ROOT / "scripts/hf_reference.py")]
        subprocess.run(ref + [str(folder), "--prompts", str(PROMPTS), "--out", str(folder / "verify.safetensors"),
                              "--dtype", "float64", "--top", "5"], check=True)
        runs = {"safetensors": greedy(str(folder), {})}
        for t, path in ggufs.items():
            subprocess.run(ref + [str(path), "--prompts", str(PROMPTS),
                                  "--out", str(folder / f"verify.{t}.safetensors"), "--dtype", "float64",
                                  "--top", "5"], check=True)
            runs[t] = greedy(str(folder), {"gguf_file": path.name})
        (folder / "greedy.json").write_text(json.dumps(runs, indent=1, ensure_ascii=False) + "\n")
        print(f"{name}: {sorted(p.name for p in folder.iterdir())}")


if __name__ == "__main__":
    main()
