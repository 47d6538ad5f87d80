#!/usr/bin/env python3
"""A GGUF model's tokenizer as a small fixture, with HF transformers' ids for a set of texts.

  python3 scripts/make_gguf_tokenizer_fixture.py MODEL.gguf OUT_DIR [--cases tests/fixtures/gpt2-tokenizer/cases.jsonl]

Writes
  OUT_DIR/tokenizer.gguf  the source's general.architecture/name and every tokenizer.*
                          key (tokens, token types, merges, special ids, pre-tokenizer,
                          chat template), no tensors: a valid GGUF file of about 1.5 MB
  OUT_DIR/cases.jsonl     one {"text", "ids", "ids_gguf_converter"} per line: the texts of
                          --cases plus extra ones for numbers, special tokens, ChatML and
                          bytes missing from the vocabulary.
                          "ids_gguf_converter": AutoTokenizer.from_pretrained(dir,
                          gguf_file=...) on the source GGUF, as transformers builds it
                          from the metadata (default special-token handling).
                          "ids": the same tokenizer with the pre-tokenizer that
                          tokenizer.ggml.pre names, as the model's own tokenizer.json has
                          it and llama.cpp applies it. transformers' GGUF converter always
                          installs a bare ByteLevel pre-tokenizer; for `smollm` (SmolLM2,
                          whose tokenizer.json is Digits(individual_digits) + ByteLevel)
                          that differs on numbers outside ASCII (" ½": converter " ½" as
                          one word, the model and llama.cpp " " then "½"). For `deepseek-llm`,
                          `deepseek-coder` and `deepseek-v3`, the chain of isolated splits.

Needs: pip install gguf transformers (and torch for transformers' GGUF loading).
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tokenizers import Regex, pre_tokenizers
from transformers import AutoTokenizer

from make_split_chain_fixture import rust_split_chains

# DeepSeek's chains of splits, as its tokenizer.json files and llama.cpp have them.
DEEPSEEK_CHAINS = rust_split_chains(Path(__file__).parent.parent / "src/tokenizer/split_chain.rs")

EXTRA = [
    "12345", "3.14159", "2024-11-30", "x = 10**9 + 7", "Ⅻ ² ½ ٣ ๕", "version 1.2.3-rc4",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>", "<repo_name>batch_forge<file_sep>src/main.rs",
    "a\x04b\x06c\x13\x14 \x16\x1d", "tab\there\r\nnew line", "  leading and trailing  ",
    "def f(x):\n    return x * 2  # comment\n", "Ünïcödé — 東京 🚀👍🏽 مرحبا नमस्ते",
    "I'm we'll they've she'd it's", "$100,000.00 (approx.)", "",
]


def hf_tokenizer_for_gguf(path):
    """transformers' tokenizer from a GGUF file, with the pre-tokenizer its
    tokenizer.ggml.pre names (the GGUF converter always installs a bare ByteLevel)."""
    path = Path(path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    pre = GGUFReader(str(path)).fields["tokenizer.ggml.pre"].contents()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in DEEPSEEK_CHAINS:
        hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), "isolated") for p in DEEPSEEK_CHAINS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre not in ("gpt-2", "default"):
        raise SystemExit(f"pre-tokenizer {pre!r}: not handled by this script")
    return hf


def copy_tokenizer(src, out):
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(str(out), arch)
    for key, field in r.fields.items():
        if not (key.startswith("tokenizer.") or key == "general.name"):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", type=Path, default=Path("tests/fixtures/gpt2-tokenizer/cases.jsonl"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fixture = args.out / "tokenizer.gguf"
    copy_tokenizer(args.gguf, fixture)

    texts = [json.loads(l)["text"] for l in args.cases.read_text(encoding="utf-8").split("\n") if l]
    texts += EXTRA
    converted = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    hf = hf_tokenizer_for_gguf(args.gguf)
    # The fixture alone must give transformers the same tokenizer.
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(fixture, Path(d) / "tokenizer.gguf")
        small = AutoTokenizer.from_pretrained(d, gguf_file="tokenizer.gguf")
    differ = 0
    with open(args.out / "cases.jsonl", "w", encoding="utf-8") as f:
        for t in texts:
            ids, conv = hf(t).input_ids, converted(t).input_ids
            assert small(t).input_ids == conv, t
            differ += ids != conv
            f.write(json.dumps({"text": t, "ids": ids, "ids_gguf_converter": conv}, ensure_ascii=True) + "\n")
    print(f"wrote {fixture} ({fixture.stat().st_size / 1e6:.1f} MB) and {len(texts)} cases; "
          f"the bare GGUF converter differs on {differ}")


if __name__ == "__main__":
    main()
