#!/usr/bin/env python3
"""Regenerate HF transformers reference data for batch_forge's tests.

Writes a random-weight GPT-2 checkpoint in the Hub's file layout plus the references
the Rust tests compare against:

  OUT/config.json, model.safetensors, tokenizer files   (copied from --tokenizer-dir)
  OUT/reference.json        per prompt: prompt_ids, greedy generated_ids (HF generate,
                            KV cache), greedy margins, top-10 logits at every position
  OUT/reference.safetensors prompt<i>.input_ids / prompt<i>.logits for the first prompts

Usage (needs: pip install torch transformers safetensors numpy):

  python3 scripts/make_reference.py --out /tmp/tiny --n-layer 2 --n-embd 64 --n-head 4 \
      --n-positions 128 --seed 1006 --tokenizer-dir tests/fixtures/gpt2-tokenizer

Weights: GPT2LMHeadModel's seeded init with initializer_range 0.2, then every bias and
LayerNorm gain/shift is randomised too (the library's init leaves them 0/1, which a
loader that silently drops them would still pass).
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

PROMPTS = [
    "",
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "In 1848, the first women's rights convention was held in Seneca Falls, New York.",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Café naïve — 東京 🚀👍🏽 مرحبا नमस्ते",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokenizer-dir", required=True, type=Path)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-positions", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1006)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                    help="how model.safetensors stores the weights (references are always float32)")
    ap.add_argument("--full-logits", type=int, default=3, help="prompts whose full logits are saved")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    config = GPT2Config(
        vocab_size=50257, n_positions=args.n_positions, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=args.n_head, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        initializer_range=0.2, bos_token_id=50256, eos_token_id=50256,
    )
    model = GPT2LMHeadModel(config).eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)

    args.out.mkdir(parents=True, exist_ok=True)
    # The Hub's layout: no "transformer." prefix, no lm_head (tied to wte).
    stored_dtype = getattr(torch, args.dtype)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        tensors[name.removeprefix("transformer.")] = t.detach().to(stored_dtype).contiguous().clone()
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    # References come from the stored values, upcast exactly to float32.
    with torch.no_grad():
        for name, t in model.state_dict().items():
            key = name.removeprefix("transformer.")
            if key in tensors:
                t.copy_(tensors[key].to(torch.float32))
    config.save_pretrained(args.out)
    for f in ["tokenizer.json", "vocab.json", "merges.txt"]:
        if (args.tokenizer_dir / f).exists():
            shutil.copy(args.tokenizer_dir / f, args.out / f)
    tok = GPT2TokenizerFast.from_pretrained(str(args.tokenizer_dir))

    prompts, full = [], {}
    for i, text in enumerate(PROMPTS):
        ids = tok.encode(text) if text else [50256]
        if len(ids) >= args.n_positions:
            continue
        input_ids = torch.tensor([ids])
        max_new = min(args.max_new_tokens, args.n_positions - len(ids))
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 num_beams=1, max_new_tokens=max_new,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=50256)
        generated = out.sequences[0, len(ids):].tolist()
        margins = []
        for s in out.scores:
            top2 = torch.topk(s[0], 2).values
            margins.append(float(top2[0] - top2[1]))
        with torch.no_grad():
            logits = model(out.sequences).logits[0]
        top = torch.topk(logits, 10, dim=-1)
        top10 = [{"position": p, "ids": top.indices[p].tolist(), "logits": top.values[p].tolist()}
                 for p in range(logits.shape[0])]
        prompts.append({
            "index": i, "text": text, "prompt_ids": ids, "max_new_tokens": max_new,
            "generated_ids": generated, "generated_text": tok.decode(generated),
            "greedy_margins": margins, "min_margin": min(margins) if margins else None, "top10": top10,
        })
        if i < args.full_logits:
            with torch.no_grad():
                full[f"prompt{i}.input_ids"] = input_ids[0].to(torch.int64).contiguous()
                full[f"prompt{i}.logits"] = model(input_ids).logits[0].to(torch.float32).contiguous()
    save_file(full, str(args.out / "reference.safetensors"))

    # How far float32 is from float64 here: the floor for any tolerance.
    model64 = GPT2LMHeadModel(config).eval().to(torch.float64)
    model64.load_state_dict({k: v.to(torch.float64) for k, v in model.state_dict().items()})
    with torch.no_grad():
        seq = torch.tensor([prompts[-1]["prompt_ids"] + prompts[-1]["generated_ids"]])
        diff = (model(seq).logits.double() - model64(seq).logits).abs().max().item()
    import transformers
    ref = {
        "model": args.out.name,
        "config": {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
                   "n_positions": args.n_positions, "vocab_size": 50257, "seed": args.seed,
                   "stored_dtype": args.dtype},
        "generated_with": {"transformers": transformers.__version__, "torch": torch.__version__,
                           "numpy": np.__version__},
        "min_greedy_argmax_margin": min(p["min_margin"] for p in prompts if p["min_margin"] is not None),
        "max_abs_logit_diff": {"hf_float32_vs_hf_float64": diff},
        "prompts": prompts,
    }
    (args.out / "reference.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1))
    print(f"wrote {args.out}: {len(prompts)} prompts, f32 vs f64 max |diff| {diff:.2e}, "
          f"min greedy margin {ref['min_greedy_argmax_margin']:.2e}")


if __name__ == "__main__":
    main()
