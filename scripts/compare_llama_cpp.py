#!/usr/bin/env python3
"""Greedy continuations of forge's default (quantized) path beside llama.cpp's.

  python3 scripts/compare_llama_cpp.py MODEL.gguf [--llama-cpp /tmp/llama.cpp-build] [-n 32] [--chat]
      [--prompts FILE]

For each prompt, runs `llama-completion` (temperature 0, EOS ignored, 2 threads) and
`forge generate --temp 0 --ignore-eos --json --logprobs 2`, tokenizes llama.cpp's text with
forge's tokenizer (equal to llama.cpp's, tests/tokenizer_gguf.rs), and reports how many
tokens agree and, at the first difference, forge's own top-2 logprob margin there (a near
tie is where the two arithmetics may part: llama.cpp's margins are not exposed by its CLI).
With --chat each prompt is a user message in the model's chat template (both sides get the
same rendered text). Needs: scripts/build_llama_cpp.sh's build with llama-completion.
"""

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORGE = ROOT / "target/release/forge"

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]


def forge(*args, stdin=None):
    out = subprocess.run([str(FORGE), *args], capture_output=True, text=True, input=stdin)
    if out.returncode != 0:
        raise SystemExit(f"forge {' '.join(args)}: {out.stderr}")
    return out.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--kv-dtype", default="f32", help="forge's KV cache (f32, its default; llama.cpp's is f16)")
    args = ap.parse_args()
    prompts = args.prompts.read_text().splitlines() if args.prompts else DEFAULT_PROMPTS
    completion = args.llama_cpp / "build/bin/llama-completion"
    rows = []
    for prompt in prompts:
        flags = ["--chat"] if args.chat else []
        ours = json.loads(forge("generate", "-m", str(args.model), "-p", prompt, "--temp", "0", "--ignore-eos",
                                "-n", str(args.n), "--json", "--logprobs", "2", "--no-escape", "--kv-dtype", args.kv_dtype,
                                *flags))
        text_in = forge("detokenize", "-m", str(args.model), *map(str, ours["prompt_ids"]))
        out = subprocess.run([str(completion), "-m", str(args.model), "-p", text_in, "-n", str(args.n), "--temp", "0",
                              "--ignore-eos", "-t", "2", "-no-cnv", "--no-display-prompt", "--simple-io",
                              "--no-warmup"], capture_output=True, text=True)
        theirs = forge("tokenize", "-m", str(args.model), "-", stdin=out.stdout)
        theirs = json.loads(theirs)[: args.n]
        mine = ours["generated_ids"]
        agree = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        margin = None
        if agree < len(mine) and agree < len(theirs):
            top = ours["logprobs"][agree]["top_logprobs"]
            margin = top[0]["logprob"] - top[1]["logprob"]
        rows.append((prompt, agree, len(mine), margin, ours["text"][:60], out.stdout[:60]))
    print("| prompt | tokens equal | first difference: forge's top-2 logprob margin | forge | llama.cpp |")
    print("| --- | ---: | ---: | --- | --- |")
    for prompt, agree, n, margin, a, b in rows:
        m = "-" if margin is None else f"{margin:.3f}"
        print(f"| {prompt!r} | {agree}/{n} | {m} | {a!r} | {b!r} |")


if __name__ == "__main__":
    main()
