#!/usr/bin/env python3
"""Time HF `tokenizers` (PyPI) encoding a corpus, single thread, for a side-by-side with
`cargo bench --bench tokenizer` on the same file.

  pip install tokenizers
  python3 scripts/make_corpus.py > /tmp/corpus.txt     # or any UTF-8 text
  python3 scripts/tokenizer_speed.py /tmp/corpus.txt
  BF_TOKENIZER_CORPUS=/tmp/corpus.txt cargo bench --bench tokenizer
"""
import os
import statistics
import sys
import time

os.environ["RAYON_RS_NUM_CPUS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402

path = sys.argv[1]
tok_path = sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/gpt2-tokenizer/tokenizer.json"
text = open(path, encoding="utf-8", newline="").read()  # no newline translation
tok = Tokenizer.from_file(tok_path)
mb = len(text.encode()) / 1e6
# One call on the whole corpus is pathologically slow in HF (its regex pre-tokenizer on a
# 20 MB string); tokenizers are used on documents, so time both and report both.
docs = text.split("\n\n")
tok.encode(text[:100000])  # warm up


def timed(f):
    times = []
    for _ in range(3):
        t = time.perf_counter()
        n = f()
        times.append(time.perf_counter() - t)
    return n, statistics.median(times)


n, med = timed(lambda: sum(len(e.ids) for e in tok.encode_batch(docs)))
print(f"HF tokenizers, {len(docs)} documents (encode_batch, 1 thread): {mb:.1f} MB, {n} tokens, median {med:.3f}s = {mb / med:.1f} MB/s")
n, med = timed(lambda: len(tok.encode(text).ids))
print(f"HF tokenizers, whole corpus in one call: {n} tokens, median {med:.3f}s = {mb / med:.1f} MB/s")
