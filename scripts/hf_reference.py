#!/usr/bin/env python3
"""Stage-by-stage Hugging Face transformers reference for `forge verify`.

  python3 scripts/hf_reference.py MODEL --prompts PROMPTS.txt --out REF.safetensors [--dtype float64]

MODEL is a model folder, a Hub id, or a .gguf file (through transformers' GGUF loading,
which dequantizes to float; needs the `gguf` and `accelerate` packages). PROMPTS.txt
holds one prompt per line; `\\n`, `\\t` and `\\\\` escapes are expanded, and an empty line
is the empty prompt (the model's BOS token).

For prompt i the file holds, in float32 whatever --dtype computed them in:

  p{i}.input_ids   (T,)      int64, as the HF tokenizer makes them (BOS added where the
                             tokenizer adds it; an empty prompt is [bos])
  p{i}.embeddings  (T, C)    the input to block 0 (token + position embeddings for GPT-2)
  p{i}.block.{j}   (T, C)    the residual stream after block j, for every block
  p{i}.final_norm  (T, C)    the final norm's output
  p{i}.logits      (T, V)    the logits at every position
  p{i}.top_ids     (T, K)    int64: the K most likely next tokens at every position
  p{i}.top_logprobs (T, K)   their log_softmax (torch's, over the full logits)
  p{i}.greedy_ids  (N,)      int64, with --greedy N: HF's greedy continuation (no EOS stop)
  p{i}.greedy_margins (N,)   the top-2 logit margin at each of those steps

and the metadata: model, architecture, n_layer, prompts (JSON), dtype, the transformers
and torch versions, and the date. Needs: pip install torch transformers safetensors.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def unescape(line):
    out, i = [], 0
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):
            nxt = line[i + 1]
            out.append({"n": "\n", "t": "\t", "\\": "\\"}.get(nxt, "\\" + nxt))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def blocks_and_norm(model):
    """The list of transformer blocks and the final norm, for the architectures we run."""
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # GPT-2
        return model.transformer.h, model.transformer.ln_f
    if hasattr(model, "model") and hasattr(model.model, "layers"):  # Llama family
        return model.model.layers, model.model.norm
    sys.exit(f"unsupported architecture {type(model).__name__}: no blocks found")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model folder, Hub id, or .gguf file")
    ap.add_argument("--prompts", required=True, type=Path, help="one prompt per line (\\n escapes allowed)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--top", type=int, default=20, help="top-K logprobs stored per position (default 20)")
    ap.add_argument("--greedy", type=int, default=0, help="also store N greedy tokens after each prompt")
    args = ap.parse_args()

    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    torch.set_num_threads(1)
    load = {}
    path = Path(args.model)
    if path.suffix == ".gguf":
        load = {"gguf_file": path.name}
        src = str(path.parent)
    else:
        src = args.model
    tokenizer = AutoTokenizer.from_pretrained(src, **load)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **load).eval()
    got = next(model.parameters()).dtype
    if got != dtype:  # transformers < 4.56 ignores `dtype=`
        sys.exit(f"the model loaded as {got}, not {dtype}: use transformers >= 4.56")
    blocks, final_norm = blocks_and_norm(model)

    prompts = [unescape(l.removesuffix("\r")) for l in args.prompts.read_text(encoding="utf-8").split("\n")]
    if prompts and prompts[-1] == "":
        prompts.pop()  # the file's final newline
    if not prompts:
        sys.exit(f"{args.prompts}: no prompts")

    captured = {}

    def keep(name):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            captured[name] = out.detach()[0]
        return hook

    hooks = [b.register_forward_hook(keep(f"block.{j}")) for j, b in enumerate(blocks)]
    hooks.append(final_norm.register_forward_hook(keep("final_norm")))

    tensors = {}
    for i, text in enumerate(prompts):
        ids = tokenizer(text, return_tensors="pt").input_ids[0] if text else torch.tensor([])
        if len(ids) == 0:
            # The empty prompt is the model's BOS token (config first, as forge does).
            bos = model.config.bos_token_id if model.config.bos_token_id is not None else tokenizer.bos_token_id
            if bos is None:
                sys.exit("the empty prompt needs a BOS token, and this model has none")
            ids = torch.tensor([bos])
        ids = ids.to(torch.int64)
        captured.clear()
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True, use_cache=False)
        logits = out.logits[0]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        top = torch.topk(logprobs, min(args.top, logprobs.shape[-1]), dim=-1)
        tensors[f"p{i}.input_ids"] = ids.contiguous()
        tensors[f"p{i}.embeddings"] = out.hidden_states[0][0]
        for name, t in captured.items():
            tensors[f"p{i}.{name}"] = t
        tensors[f"p{i}.logits"] = logits
        tensors[f"p{i}.top_ids"] = top.indices.to(torch.int64)
        tensors[f"p{i}.top_logprobs"] = top.values
        if args.greedy:
            seq, margins = ids.tolist(), []
            with torch.no_grad():
                for _ in range(args.greedy):
                    step = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
                    top2 = torch.topk(step, 2).values
                    margins.append(float(top2[0] - top2[1]))
                    seq.append(int(torch.argmax(step)))
            tensors[f"p{i}.greedy_ids"] = torch.tensor(seq[len(ids):], dtype=torch.int64)
            tensors[f"p{i}.greedy_margins"] = torch.tensor(margins, dtype=torch.float32)
    for h in hooks:
        h.remove()
    tensors = {k: (v.to(torch.float32) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    metadata = {
        "format": "batch_forge verify reference v1",
        "model": args.model,
        "architecture": type(model).__name__,
        "n_layer": str(len(blocks)),
        "n_prompts": str(len(prompts)),
        "prompts": json.dumps(prompts, ensure_ascii=False),
        "dtype": args.dtype,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out), metadata=metadata)
    size = args.out.stat().st_size
    print(f"wrote {args.out}: {len(prompts)} prompts, {len(blocks)} blocks, {args.dtype}, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
