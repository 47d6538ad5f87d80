#!/usr/bin/env python3
"""Compare `forge tokenize -m MODEL.gguf` with HF transformers on a text corpus, line by line.

  python3 scripts/gguf_tokenizer_vs_hf.py MODEL.gguf CORPUS.txt [--forge target/release/forge]

Each line of CORPUS.txt (newline kept off) is tokenized by forge (--jsonl) and by
transformers' tokenizer for the GGUF with the pre-tokenizer tokenizer.ggml.pre names
(scripts/make_gguf_tokenizer_fixture.py explains why). Prints the corpus size, the
number of lines and tokens, and every line whose ids differ (exit 1 if any).
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_gguf_tokenizer_fixture import hf_tokenizer_for_gguf  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--forge", default="target/release/forge")
    args = ap.parse_args()
    lines = args.corpus.read_bytes().decode("utf-8", errors="replace").split("\n")  # \r kept
    payload = "".join(json.dumps({"text": l}) + "\n" for l in lines)
    out = subprocess.run([args.forge, "tokenize", "--jsonl", "-m", str(args.gguf)], input=payload.encode(),
                         capture_output=True, check=True).stdout.decode().split("\n")
    ours = [json.loads(l)["ids"] for l in out if l]
    hf = hf_tokenizer_for_gguf(args.gguf)
    theirs = hf(lines).input_ids
    assert len(ours) == len(theirs) == len(lines)
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    size = args.corpus.stat().st_size
    print(f"{args.corpus}: {size / 1e6:.2f} MB, {len(lines)} lines, {sum(map(len, theirs))} tokens; "
          f"{len(lines) - len(bad)} lines equal, {len(bad)} differ")
    for i in bad[:20]:
        print(f"line {i + 1}: {lines[i]!r}\n  forge {ours[i]}\n  hf    {theirs[i]}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
