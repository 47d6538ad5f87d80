#!/usr/bin/env python3
"""HF tokenizers' splits of texts by GPT-4o's, Tekken's and Qwen 3.5's pre-tokenizer patterns
(letter cases, marks), for the tests.

  python3 scripts/make_case_split_fixture.py > tests/fixtures/pretokenizers-case-split.jsonl

One {"text", "gpt4o": [pieces], "tekken": …, "qwen35": …, "gpt4o_ids", "tekken_ids", "qwen35_ids"}
per line: `pre_tokenizers.Split(Regex(P), "isolated")` (P as written in
src/tokenizer/pretokenize.rs, and checked equal to the pattern transformers' GGUF tokenizer
conversion installs for llama.cpp's `gpt-4o`, `tekken` and `qwen35`), on the texts of
tests/fixtures/pretokenizers.jsonl plus texts that mix letter cases, titlecase and modifier
letters, marks and contractions, then 400 seeded random mixes of such characters
(scripts/make_split_chain_fixture.py's). The ids (texts of up to 300 characters) are
tests/fixtures/tiny-llama's byte-level BPE with its pre-tokenizer replaced by
Sequence([Split(P, "isolated"), ByteLevel(use_regex=False)]). Needs tokenizers and transformers.
"""
import json
import re
import sys
from pathlib import Path

from tokenizers import Regex, pre_tokenizers
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

sys.path.insert(0, str(Path(__file__).parent))
from make_split_chain_fixture import print_rows, random_texts, tiny_llama_with  # noqa: E402

src = open("src/tokenizer/pretokenize.rs", encoding="utf-8").read()
patterns = {name: re.search(rf'pub const {const}: &str =\s*r"(.*)";', src).group(1)
            for name, const in (("gpt4o", "GPT4O_PATTERN"), ("tekken", "TEKKEN_PATTERN"),
                                ("qwen35", "QWEN35_PATTERN"))}
assert patterns["gpt4o"] == GGUF_PRE_TOKENIZER_SPLITS["gpt-4o"] == GGUF_PRE_TOKENIZER_SPLITS["llama4"]
assert patterns["tekken"] == GGUF_PRE_TOKENIZER_SPLITS["tekken"]
assert patterns["qwen35"] == GGUF_PRE_TOKENIZER_SPLITS["qwen35"]
texts = [json.loads(l)["text"] for l in open("tests/fixtures/pretokenizers.jsonl", encoding="utf-8")]
texts += ["HTTPServer helloWorld iPhone XMLHttpRequest getHTTPResponseCode ABCdef abcDEF",
          "ÉCOLEé éÉ ÀÉÎõü Straße STRASSE ǅungla ǈ ǋa ʰʲa aʰB",
          "DON'T don't HELLO'S Hello'S it'LL x'Ve 'S",
          "a/b\n/c ///\n\n// path/to/file.py\r\n/",
          "नमस्ते दुनिया क्षत्रिय ไทยภาษา ٱللَّٰه e\u0301A\u030aB \u0301abc x\u0301\u0302Y",
          "東京Tokyo 東京tokyo Москва МОСКВАмосква ΑθήναΑΘΉΝΑ 123abc ABC123 ½¼",
          "camelCaseWithNumbers2And3 snake_case_ID __init__ CONSTANT_VALUE",
          "\tTabbed\n\n  Indented Text\r\n", "ｆｕｌｌｗｉｄｔｈ ＦＵＬＬ", "ǅ", "ʰ", "\u0301", " \u0301"]
texts += ["!\u0301a .\u0301\u0302 ,\u20dd x \u093f\u093f 1\u0301 \u0301\u0301!! (\u0301) '\u0301s",
          "\u0301\n\u0301\r\n \u0301 a\u0301'S e\u0301'll \u20dd\u20dd", "क्षि ि ि 👍🏽\u0301 ٱللَّٰه ـَـ"]
texts += random_texts(400)
splitters = {n: pre_tokenizers.Split(Regex(p), "isolated") for n, p in patterns.items()}
print_rows(texts, splitters, {n: tiny_llama_with([sp]) for n, sp in splitters.items()})
