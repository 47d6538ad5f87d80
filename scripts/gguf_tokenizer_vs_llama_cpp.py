#!/usr/bin/env python3
"""Compare `forge tokenize -m MODEL.gguf` with llama.cpp's `llama-tokenize` on the texts of
a cases file (one JSON object with "text" per line) and, optionally, on a whole corpus file.

  python3 scripts/gguf_tokenizer_vs_llama_cpp.py MODEL.gguf CASES.jsonl [--corpus FILE]
      [--llama-tokenize /tmp/llama.cpp-build/build/bin/llama-tokenize] [--forge target/release/forge]

llama-tokenize comes from scripts/build_llama_cpp.sh. Each text goes through a file
(`-f`, `--no-escape`), so both sides see exactly the same bytes; special tokens are parsed (both
defaults). Prints the counts and every text whose ids differ (exit 1 if any).
"""

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def llama_ids(tool, gguf, path):
    out = subprocess.run([tool, "-m", str(gguf), "-f", str(path), "--ids", "--log-disable", "--no-escape"],
                         capture_output=True, check=True).stdout.decode().strip().split("\n")[-1]
    return ast.literal_eval(out)


def forge_ids(forge, gguf, text):
    out = subprocess.run([forge, "tokenize", "-m", str(gguf)], input=text.encode(), capture_output=True, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("cases", type=Path)
    ap.add_argument("--corpus", type=Path)
    ap.add_argument("--llama-tokenize", default="/tmp/llama.cpp-build/build/bin/llama-tokenize")
    ap.add_argument("--forge", default="target/release/forge")
    args = ap.parse_args()
    texts = [json.loads(l)["text"] for l in args.cases.read_text(encoding="utf-8").split("\n") if l]
    bad = []
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "text.txt"
        for t in texts:
            if not t:
                continue  # llama-tokenize refuses an empty file
            f.write_bytes(t.encode())
            a, b = forge_ids(args.forge, args.gguf, t), llama_ids(args.llama_tokenize, args.gguf, f)
            if a != b:
                bad.append((t, a, b))
    print(f"{args.cases}: {len(texts)} texts, {len(bad)} differ")
    for t, a, b in bad[:20]:
        print(f"{t!r}\n  forge {a}\n  llama {b}")
    if args.corpus:
        a = forge_ids(args.forge, args.gguf, args.corpus.read_bytes().decode("utf-8"))  # no newline translation
        b = llama_ids(args.llama_tokenize, args.gguf, args.corpus)
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        size = args.corpus.stat().st_size
        print(f"{args.corpus}: {size / 1e6:.2f} MB, forge {len(a)} tokens, llama.cpp {len(b)} tokens, "
              f"{'equal' if a == b else f'first difference at token {first}'}")
        bad += [] if a == b else [("corpus", [], [])]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
