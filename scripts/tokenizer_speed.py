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
text = open(path, encoding="utf-8").read()
tok = Tokenizer.from_file(tok_path)
mb = len(text.encode()) / 1e6
tok.encode(text[:100000])  # warm the cache
times = []
for _ in range(5):
    t = time.perf_counter()
    n = len(tok.encode(text).ids)
    times.append(time.perf_counter() - t)
med = statistics.median(times)
print(f"HF tokenizers: {mb:.1f} MB, {n} tokens, median {med:.3f}s = {mb / med:.1f} MB/s")
