#!/usr/bin/env python3
"""HF tokenizers' splits of texts by DeepSeek's and MiniCPM 5's chains of regex splits, for the tests.

  python3 scripts/make_split_chain_fixture.py [--llama-vocab-cpp PATH] \\
      > tests/fixtures/pretokenizers-split-chain.jsonl

One {"text", "deepseek-llm": [pieces], "deepseek-llm_ids", "deepseek-llm-digits": …,
"deepseek-coder": …, "deepseek-v3": …, "minicpm5": …} per line: `pre_tokenizers.Sequence([Split(Regex(P),
"isolated") for P in chain])`, the chains as written in src/tokenizer/split_chain.rs (with
--llama-vocab-cpp, checked equal to the `regex_exprs` of llama.cpp's src/llama-vocab.cpp for the
same names); as DeepSeek LLM's and Coder's own tokenizer.json files have them, their last step
is `Digits(individual_digits=True)` ("deepseek-llm-digits", "deepseek-coder"; the script checks
that Coder's equals its `Split("\\p{N}")` and LLM's `Digits(individual_digits=False)` its
`Split("\\p{N}+")`, piece for piece), on the texts of
tests/fixtures/pretokenizers.jsonl and tests/fixtures/pretokenizers-case-split.jsonl, texts in
the scripts and spaces these chains single out (CJK, kana, Hangul, U+0800–U+4E00, full-width
forms, U+3000, quotation marks, exotic spaces, trailing spaces) and 400 seeded random mixes of
such characters. The ids (texts of up to 300 characters) are tests/fixtures/tiny-llama's
byte-level BPE with its pre-tokenizer replaced by the chain then ByteLevel(use_regex=False).
Needs tokenizers.
"""
import argparse
import json
import random
import re

from tokenizers import Regex, Tokenizer, pre_tokenizers

NAMES = {"deepseek-llm": "DEEPSEEK_LLM_SPLITS", "deepseek-coder": "DEEPSEEK_CODER_SPLITS",
         "deepseek-v3": "DEEPSEEK_V3_SPLITS", "minicpm5": "MINICPM5_SPLITS"}


def unescape(lit):
    """The value of a Rust or C++ string literal's body (escapes \\\\ \\" \\r \\n \\t \\u{…})."""
    out, i = [], 0
    while i < len(lit):
        c = lit[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = lit[i + 1]
        if e == "u":
            end = lit.index("}", i)
            out.append(chr(int(lit[i + 3:end], 16)))
            i = end + 1
            continue
        out.append({"\\": "\\", '"': '"', "r": "\r", "n": "\n", "t": "\t"}[e])
        i += 2
    return "".join(out)


def literals(block):
    return [unescape(m) for m in re.findall(r'"((?:[^"\\]|\\.)*)"', block)]


def rust_split_chains(path="src/tokenizer/split_chain.rs"):
    """{llama.cpp name: [patterns]} as src/tokenizer/split_chain.rs writes them."""
    src = open(path, encoding="utf-8").read()
    return {name: literals(re.search(rf"pub const {const}: \[&str; \d+\] =(.*?)\];", src, re.S).group(1))
            for name, const in NAMES.items()}


def llama_cpp_chains(path):
    src = open(path, encoding="utf-8").read()
    cases = {"deepseek-llm": "DEEPSEEK_LLM", "deepseek-coder": "DEEPSEEK_CODER", "deepseek-v3": "DEEPSEEK3_LLM",
             "minicpm5": "MINICPM5"}
    # llama.cpp spells HF's case-insensitive contractions out.
    contractions = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])", "(?i:'s|'t|'re|'ve|'m|'ll|'d)")
    out = {}
    for name, c in cases.items():
        block = re.search(rf"case LLAMA_VOCAB_PRE_TYPE_{c}:.*?regex_exprs = \{{(.*?)\}};", src, re.S).group(1)
        code = "\n".join(line for line in block.split("\n") if not line.strip().startswith("//"))
        out[name] = [p.replace(*contractions) for p in literals(code)]
    return out


def splits(chain):
    return [pre_tokenizers.Split(Regex(p), "isolated") for p in chain]


def pipelines(chains):
    """{fixture key: pre-tokenizer steps}, DeepSeek LLM's and Coder's ending as their files do."""
    digits = pre_tokenizers.Digits(individual_digits=True)
    return {"deepseek-llm": splits(chains["deepseek-llm"]),
            "deepseek-llm-digits": splits(chains["deepseek-llm"][:-1]) + [digits],
            "deepseek-coder": splits(chains["deepseek-coder"][:-1]) + [digits],
            "deepseek-v3": splits(chains["deepseek-v3"]),
            "minicpm5": splits(chains["minicpm5"])}


POOL = (list("aZ xy Q") + list("0123456789") + list(" \t\r\n  ") + list(".,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`|")
        + list("你好世界龥一丁") + list("ひらがなカタカナー゠ゟヿ") + list("한국어가힣\ud7a3") + ["\u3000", "、", "。", "「", "」"]
        + list("ＡＺａｚ！？（）０９～") + list("‘’“”„‟") + ["\u00a0", "\u2003", "\u2009", "\u200b", "\u0085", "\u2028",
                                                              "\u000b", "\u000c", "\u180e", "\u202f"]
        + ["\u0301", "\u0308", "\u093f", "\u20dd"] + list("éñßÀöøƻǅʰͰΩωЖжԱႠᎠꙀﬀ") + list("ไทยनमस्तेמرح")
        + list("½²Ⅻ٣๕") + ["😀", "👍", "🏽", "❤", "\ufe0f", "€", "©", "∑", "←", "™"] + ["𐐀", "𞤀", "𝐀", "𑢠"])


def tiny_llama_with(steps):
    """tests/fixtures/tiny-llama's byte-level BPE with its pre-tokenizer replaced by `steps`
    then ByteLevel(use_regex=False)."""
    tok = Tokenizer.from_file("tests/fixtures/tiny-llama/tokenizer.json")
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)])
    return tok


def print_rows(texts, splitters, bpe):
    """One JSON line per text: each splitter's pieces, and its BPE ids for texts of up to 300
    characters."""
    for t in texts:
        row = {"text": t}
        for n, sp in splitters.items():
            row[n] = [piece for piece, _ in sp.pre_tokenize_str(t)]
            if len(t) <= 300:
                row[n + "_ids"] = bpe[n].encode(t, add_special_tokens=False).ids
        print(json.dumps(row, ensure_ascii=False, separators=(",", ":")))


def random_texts(n, seed=31):
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(1, 40))) for _ in range(n)]


EXTRA = [
    "你好，世界！这是一个测试。中文123数字和English混合",
    "日本語のテキスト、カタカナとひらがな。東京タワー",
    "한국어 텍스트입니다. 안녕하세요! 서울 2024년",
    "全角　スペース　テスト　", "ＡＢＣ　ａｂｃ！？（）～ １２３", "‘single’ “double” „low‟ «guillemets»",
    "a\u00a0b\u2003c\u2009d \u200b e\u0085f\u2028g\u000bh\u000ci", "trailing   ", "  \t ", "line  \n  next  \r\n",
    "\n\n\n", "\r\n\r\n  \r\n", "1234567890 12 3.14159 ١٢٣٤٥ ½ Ⅻ 100,000 0.5e-10",
    "e\u0301 \u0301a ñ x\u0308y \u0301\u0301 a\u20dd", "def f(x):\n    return x**2  # comment\n\n\tif a<=b: pass",
    "Ἀθῆναι Ωμέγα Ꭰ ᏸ Ⴀ Ա ａ ǅ ʰ ƻ µ ﬀ 𐐀𐐁 𞤀", "ࠀࠁ ภาษาไทย नमस्ते 한 一 龥 龦 丁",
    "😀👍🏽 🇫🇷 ❤️ $100 + 5% = €20 © ™ ← → ∑∫",
    "a.b.c e.g. ./run --flag=value @user #tag 'quote' \"dq\" [x](y) {z} <a href=\"b\">",
    "HTTPServer's 'S 's DON'T it's we'll", "x=1;y=2\r\nz=3\n", " !!! ... ,,, ?!?", "a\u3000\u3000b", "\u3000",
    "。。、、「」『』", "１２３４", "a1b22c333d4444e55555", " 1 22 333 4444", "end.\n", "   ",
    # Spaces before numbers: MiniCPM 5 splits numbers off first, so a space run ends there.
    "a  1 b   22 c\t\t333 d    4444", "  1", "x  \n  2", "1  2  3  ", "  12345  67", "½  ²   ٣",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-vocab-cpp")
    args = ap.parse_args()
    chains = rust_split_chains()
    if args.llama_vocab_cpp:
        assert chains == llama_cpp_chains(args.llama_vocab_cpp), "chains differ from llama.cpp's"
    texts = []
    for f in ("tests/fixtures/pretokenizers.jsonl", "tests/fixtures/pretokenizers-case-split.jsonl"):
        texts += [json.loads(line)["text"] for line in open(f, encoding="utf-8")]
    texts += EXTRA + random_texts(400)
    texts = list(dict.fromkeys(texts))
    steps = pipelines(chains)
    splitters = {n: pre_tokenizers.Sequence(s) for n, s in steps.items()}
    same = {"deepseek-coder": pre_tokenizers.Sequence(splits(chains["deepseek-coder"])),
            "deepseek-llm": pre_tokenizers.Sequence(
                splits(chains["deepseek-llm"][:-1]) + [pre_tokenizers.Digits(individual_digits=False)])}
    for t in texts:
        for n, sp in same.items():
            assert sp.pre_tokenize_str(t) == splitters[n].pre_tokenize_str(t), (n, t)
    print_rows(texts, splitters, {n: tiny_llama_with(s) for n, s in steps.items()})


if __name__ == "__main__":
    main()
