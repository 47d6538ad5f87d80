#!/usr/bin/env python3
"""llama-quantize's outputs on the tiny Llama fixtures, as sha256 sums, for tests/quantize.rs.

  python3 scripts/make_quantize_fixture.py [--llama-cpp /tmp/llama.cpp-build] [--out tests/fixtures/quantize]

Writes `OUT/tiny-llama-k.f16.gguf` (convert_hf_to_gguf.py on tests/fixtures/tiny-llama-k, whose
256-wide rows take K-quant blocks: the other fixtures' rows fall back to 32-blocks) and
`OUT/expected.json`: for each (input GGUF, llama-quantize type, flags) the sha256 and size of
the file `llama-quantize` writes, from the llama.cpp that scripts/build_llama_cpp.sh builds.
`forge quantize` must write the same bytes.

Needs: that llama.cpp build (llama-quantize, and its source for convert_hf_to_gguf.py), gguf,
numpy, torch, transformers, sentencepiece.
"""

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests/fixtures"
ALL_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
             "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K"]
# (input relative to tests/fixtures, types, extra llama-quantize flags)
CASES = [
    ("quantize/tiny-llama-k.f16.gguf", ALL_TYPES, []),
    ("quantize/tiny-llama-k.f16.gguf", ["Q4_0", "Q4_K_M", "Q6_K"], ["--pure"]),
    ("tiny-llama/tiny-llama.f32.gguf", ALL_TYPES, []),
    ("tiny-llama-untied/tiny-llama-untied.f32.gguf", ["Q8_0", "Q4_0", "Q4_K_M", "Q6_K"], []),
    ("tiny-llama-odd/tiny-llama-odd.f32.gguf", ["Q8_0", "Q4_0", "Q4_K_M", "BF16"], []),
    ("tiny-llama/tiny-llama.q8_0.gguf", ["Q4_0", "Q4_K_M"], ["--allow-requantize"]),
    ("tiny-gpt2/tiny-gpt2.q8_0.gguf", ["Q4_0", "Q5_K_M"], ["--allow-requantize"]),
]


def convert_f16(llama_cpp: Path, out: Path):
    src = llama_cpp / "src/vendor/llama.cpp"
    with tempfile.TemporaryDirectory() as tmp:
        # The folder's name becomes general.name: keep it.
        folder = Path(tmp) / "tiny-llama-k"
        shutil.copytree(FIX / "tiny-llama-k", folder, ignore=shutil.ignore_patterns("*.gguf", "verify*", "greedy*"))
        code = (
            "import sys; sys.path[:0] = [{src!r}, {gguf!r}];"
            "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2';"
            "sys.argv = ['convert_hf_to_gguf.py', {folder!r}, '--outtype', 'f16', '--outfile', {path!r}];"
            "import convert_hf_to_gguf as c; c.main()"
        ).format(src=str(src), gguf=str(src / "gguf-py"), folder=str(folder), path=str(out))
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
    ap.add_argument("--out", type=Path, default=FIX / "quantize")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    convert_f16(args.llama_cpp, args.out / "tiny-llama-k.f16.gguf")
    quantize = args.llama_cpp / "build/bin/llama-quantize"
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for rel, types, flags in CASES:
            for t in types:
                out = Path(tmp) / "out.gguf"
                subprocess.run([str(quantize), *flags, str(FIX / rel), str(out), t], check=True, capture_output=True)
                data = out.read_bytes()
                cases.append({"input": rel, "type": t, "flags": flags,
                              "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    (args.out / "expected.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(f"{len(cases)} cases in {args.out / 'expected.json'}")


if __name__ == "__main__":
    main()
