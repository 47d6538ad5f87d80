#!/usr/bin/env python3
"""Print a large, realistic UTF-8 corpus: this Python's standard-library sources (code,
docstrings, comments) up to ~20 MB, followed by the tokenizer fixture cases."""
import json
import pathlib
import sysconfig

out, size = [], 0
for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
    try:
        t = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        continue
    out.append(t)
    size += len(t)
    if size > 20_000_000:
        break
for line in open("tests/fixtures/gpt2-tokenizer/cases.jsonl", encoding="utf-8"):
    out.append(json.loads(line)["text"])
print("\n".join(out))
