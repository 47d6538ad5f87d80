#!/usr/bin/env python3
"""The Gemma 3 270M test fixture: HF transformers' truth for the real model, small enough to commit.

  python3 scripts/hf_reference.py gemma-3-270m-q4_k_m.gguf --prompts tests/fixtures/gemma3/prompts.txt \
      --out REF.safetensors --greedy 20
  python3 scripts/make_gemma3_fixture.py gemma-3-270m-q4_k_m.gguf REF.safetensors CORPUS.txt \
      [--llama-tokenize /tmp/llama.cpp-build/build/bin/llama-tokenize]

REF.safetensors is ~700 MB (logits over 262,144 tokens at every position); this keeps, per
prompt, HF's input ids, its top-5 next tokens and their log-probabilities at every
position, and its 20 greedy ids with their top-2 logit margins (tests/fixtures/gemma3/hf.json).

tokenizer.jsonl: texts (tests/fixtures/smollm2-tokenizer/cases.jsonl's 380, whitespace runs,
Gemma's user-defined and control tokens, and 400 lines drawn with a fixed seed from CORPUS.txt,
scripts/make_multilingual_corpus.py's output), each with "hf" (AutoTokenizer from the GGUF,
special tokens parsed) and "llama_cpp" (llama-tokenize, special tokens parsed) ids.
"""
import argparse
import ast
import json
import random
import subprocess
import tempfile
from pathlib import Path

from safetensors import safe_open
from transformers import AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("gguf", type=Path)
ap.add_argument("ref", type=Path)
ap.add_argument("corpus", type=Path)
ap.add_argument("--llama-tokenize", default="/tmp/llama.cpp-build/build/bin/llama-tokenize")
ap.add_argument("--out", type=Path, default=Path("tests/fixtures/gemma3"))
args = ap.parse_args()

with safe_open(str(args.ref), "pt") as f:
    meta = f.metadata()
    prompts = json.loads(meta["prompts"])
    out = {"source": {k: meta[k] for k in ("model", "architecture", "dtype", "transformers", "torch", "date")},
           "prompts": []}
    for i, text in enumerate(prompts):
        top_ids = f.get_tensor(f"p{i}.top_ids")[:, :5]
        top_lp = f.get_tensor(f"p{i}.top_logprobs")[:, :5]
        out["prompts"].append({
            "text": text,
            "ids": f.get_tensor(f"p{i}.input_ids").tolist(),
            "top_ids": top_ids.tolist(),
            "top_logprobs": [[round(float(x), 6) for x in row] for row in top_lp],
            "greedy_ids": f.get_tensor(f"p{i}.greedy_ids").tolist(),
            "greedy_margins": [round(float(x), 5) for x in f.get_tensor(f"p{i}.greedy_margins")],
        })
(args.out / "hf.json").write_text(json.dumps(out, ensure_ascii=False) + "\n")

texts = [json.loads(l)["text"] for l in open("tests/fixtures/smollm2-tokenizer/cases.jsonl", encoding="utf-8")]
texts += [" " * n + "x" + " " * n for n in (1, 2, 15, 16, 17, 30, 31, 32, 33, 40, 64)]
texts += ["\n" * n + "a" for n in (1, 2, 3, 31, 32, 40)] + ["\t\t\tb", "<h1>Title</h1>\n<table><tr><td>1</td></tr></table>",
          "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos><eos><pad>x<unk>", "[multimodal] <unused5>"]
lines = [l for l in args.corpus.read_text(encoding="utf-8").split("\n") if l.strip()]
texts += random.Random(31).sample(lines, 400)
hf = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
with tempfile.TemporaryDirectory() as d, open(args.out / "tokenizer.jsonl", "w", encoding="utf-8") as w:
    p = Path(d) / "t.txt"
    for t in texts:
        p.write_bytes(t.encode())
        llama = subprocess.run([args.llama_tokenize, "-m", str(args.gguf), "-f", str(p), "--ids", "--log-disable",
                                "--no-escape"], capture_output=True, check=True).stdout.decode().strip().split("\n")[-1]
        w.write(json.dumps({"text": t, "hf": hf(t).input_ids, "llama_cpp": ast.literal_eval(llama)},
                           ensure_ascii=False) + "\n")
print(f"wrote {args.out}/hf.json ({len(prompts)} prompts) and tokenizer.jsonl ({len(texts)} texts)")
