#!/usr/bin/env python3
"""HF tokenizers' splits of texts by Llama 3's and Qwen 2's pre-tokenizer patterns, for the tests.

  python3 scripts/make_pretokenizer_fixture.py CORPUS.txt > tests/fixtures/pretokenizers.jsonl

One {"text", "llama3": [pieces], "qwen2": [pieces], "llama3_ids", "qwen2_ids"} per line: `pre_tokenizers.Split(Regex(P),
"isolated")` as those models' tokenizer.json have it (P as written in src/tokenizer/pretokenize.rs),
on tests/fixtures/smollm2-tokenizer/cases.jsonl's texts, edge cases (contractions in both
cases, digit runs, whitespace and newline runs, Unicode spaces and numbers) and 300 lines
drawn with a fixed seed from CORPUS.txt (scripts/make_multilingual_corpus.py). The ids are
tests/fixtures/tiny-llama's byte-level BPE with its pre-tokenizer replaced by each model's
pipeline, Sequence([Split(P, "isolated"), ByteLevel(use_regex=False)]). Needs tokenizers.
"""
import json
import random
import re
import sys

from tokenizers import Regex, Tokenizer, pre_tokenizers

src = open("src/tokenizer/pretokenize.rs", encoding="utf-8").read()
patterns = {name: re.search(rf'pub const {const}: &str = r"(.*)";', src).group(1)
            for name, const in (("llama3", "LLAMA3_PATTERN"), ("qwen2", "QWEN2_PATTERN"))}
texts = [json.loads(l)["text"] for l in open("tests/fixtures/smollm2-tokenizer/cases.jsonl", encoding="utf-8")]
texts += ["I'M YOU'RE we'Ll it'S 'tis", "x12345y 1234567 ½ ²³ ١٢٣٤", "a  b   c\n\n\nd \n e\r\n\tf  ",
          "(ok)\n\n  next", "trailing   ", "\u00a0x\u3000y\u2028z", "'s", "'", "ok!!\n\r\n?", "🚀🚀 🚀\n",
          "naïve café ŝ x\u0301y", "   ", "\n", "a\u200bb"]
lines = [l for l in open(sys.argv[1], encoding="utf-8").read().split("\n") if l.strip()]
texts += random.Random(3).sample(lines, 300)
splitters = {n: pre_tokenizers.Split(Regex(p), "isolated") for n, p in patterns.items()}
bpe = {}
for n, sp in splitters.items():
    tok = Tokenizer.from_file("tests/fixtures/tiny-llama/tokenizer.json")
    tok.pre_tokenizer = pre_tokenizers.Sequence([sp, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe[n] = tok
for t in texts:
    row = {"text": t}
    for n, sp in splitters.items():
        row[n] = [piece for piece, _ in sp.pre_tokenize_str(t)]
        row[n + "_ids"] = bpe[n].encode(t, add_special_tokens=False).ids
    print(json.dumps(row, ensure_ascii=False))
