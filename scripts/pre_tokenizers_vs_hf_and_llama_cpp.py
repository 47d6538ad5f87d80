#!/usr/bin/env python3
"""Run pre-tokenizers over a real vocabulary and a corpus, three ways: forge (from a GGUF and
from a `tokenizer.json`), HF tokenizers and llama.cpp's `llama-tokenize`.

  python3 scripts/pre_tokenizers_vs_hf_and_llama_cpp.py SmolLM2-135M-Instruct.Q4_1.gguf CORPUS.txt... \\
      [--names deepseek-llm,deepseek-coder,deepseek-v3,qwen35] [--llama-lines 1000] \\
      [--llama-tokenize /tmp/llama.cpp-build/build/bin/llama-tokenize] \\
      [--forge target/release/forge] [--work /tmp/pre-tokenizer-check]

For each name (DeepSeek's chains of splits; `llama-bpe`, `qwen2`, `qwen35`, `gpt-4o` and
`tekken`'s patterns): a tokenizer-only copy of the
GGUF with `tokenizer.ggml.pre` rewritten to that name; HF's `tokenizer.json` for it
(scripts/hf_tokenizer_from_gguf.py, then the `Split`s + `ByteLevel(use_regex=False)` as the
models' own files have them, since transformers' GGUF conversion does not know the DeepSeek
names). Every line of the corpora (newline kept off) goes through forge on both files and HF
tokenizers; `--llama-lines` lines sampled evenly through `llama-tokenize` (one process per
line). Prints the counts and the first lines that differ; exit 1 if forge differs from HF.
Needs: tokenizers transformers gguf numpy (pip).
"""
import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter
from tokenizers import Regex, Tokenizer, pre_tokenizers

sys.path.insert(0, str(Path(__file__).parent))
from make_split_chain_fixture import rust_split_chains  # noqa: E402

HERE = Path(__file__).parent
_SRC = (HERE.parent / "src/tokenizer/pretokenize.rs").read_text(encoding="utf-8")
# llama.cpp's name → the one-regex patterns of src/tokenizer/pretokenize.rs.
PATTERNS = {name: [re.search(rf'pub const {const}: &str =\s*r"(.*)";', _SRC).group(1)]
            for name, const in (("llama-bpe", "LLAMA3_PATTERN"), ("qwen2", "QWEN2_PATTERN"),
                                ("qwen35", "QWEN35_PATTERN"), ("gpt-4o", "GPT4O_PATTERN"),
                                ("tekken", "TEKKEN_PATTERN"))}


def copy_tokenizer(src, out, pre):
    r = GGUFReader(str(src))
    w = GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, pre if key == "tokenizer.ggml.pre" else field.contents(), vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def forge_ids(forge, model, lines):
    payload = "".join(json.dumps({"text": l}) + "\n" for l in lines)
    out = subprocess.run([forge, "tokenize", "--jsonl", "-m", str(model)], input=payload.encode(),
                         capture_output=True, check=True).stdout.decode().split("\n")
    return [json.loads(l)["ids"] for l in out if l]


def llama_ids(tool, gguf, text, tmp):
    tmp.write_bytes(text.encode())
    out = subprocess.run([tool, "-m", str(gguf), "-f", str(tmp), "--ids", "--log-disable", "--no-escape"],
                         capture_output=True, check=True).stdout.decode().strip().split("\n")[-1]
    return ast.literal_eval(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("corpora", type=Path, nargs="+")
    ap.add_argument("--llama-tokenize", default="/tmp/llama.cpp-build/build/bin/llama-tokenize")
    ap.add_argument("--llama-lines", type=int, default=1000)
    ap.add_argument("--forge", default="target/release/forge")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pre-tokenizer-check"))
    ap.add_argument("--names", default="deepseek-llm,deepseek-coder,deepseek-v3,qwen35")
    args = ap.parse_args()
    lines = []
    for c in args.corpora:
        lines += c.read_bytes().decode("utf-8", errors="replace").split("\n")  # \r kept
    lines = [l for l in lines if l]
    print(f"{len(lines)} lines, {sum(len(l.encode()) for l in lines) / 1e6:.2f} MB")
    failed = False
    splits = rust_split_chains(HERE.parent / "src/tokenizer/split_chain.rs") | PATTERNS
    for name in args.names.split(","):
        chain = splits[name]
        d = args.work / name
        (d / "hf").mkdir(parents=True, exist_ok=True)
        gguf = d / "tokenizer.gguf"
        copy_tokenizer(args.gguf, gguf, name)
        subprocess.run([sys.executable, str(HERE / "hf_tokenizer_from_gguf.py"), str(gguf), str(d / "hf")],
                       check=True, capture_output=True)
        hf = Tokenizer.from_file(str(d / "hf/tokenizer.json"))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), "isolated") for p in chain]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.save(str(d / "hf/tokenizer.json"))
        theirs = [e.ids for e in hf.encode_batch(lines, add_special_tokens=False)]
        from_gguf = forge_ids(args.forge, gguf, lines)
        from_json = forge_ids(args.forge, d / "hf", lines)
        bad = [i for i in range(len(lines)) if not from_gguf[i] == from_json[i] == theirs[i]]
        print(f"{name}: {sum(map(len, theirs))} HF tokens; forge (GGUF and tokenizer.json) equal to HF on "
              f"{len(lines) - len(bad)} lines, differ on {len(bad)}")
        for i in bad[:10]:
            print(f"  {lines[i]!r}\n    gguf {from_gguf[i]}\n    json {from_json[i]}\n    hf   {theirs[i]}")
        failed |= bool(bad)
        if Path(args.llama_tokenize).exists() and args.llama_lines:
            step = max(1, len(lines) // args.llama_lines)
            sample = range(0, len(lines), step)
            with tempfile.TemporaryDirectory() as t:
                tmp = Path(t) / "line.txt"
                llama_bad = [i for i in sample if llama_ids(args.llama_tokenize, gguf, lines[i], tmp) != theirs[i]]
            print(f"  llama-tokenize: {len(sample) - len(llama_bad)} of {len(sample)} sampled lines equal HF, "
                  f"{len(llama_bad)} differ")
            for i in llama_bad[:10]:
                print(f"  {lines[i]!r}\n    llama {llama_ids(args.llama_tokenize, gguf, lines[i], Path('/tmp/l.txt'))}"
                      f"\n    hf    {theirs[i]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
