#!/usr/bin/env python3
"""Print a multilingual UTF-8 corpus of several MB for tokenizer comparisons: the translated
messages of Django's ~100 locales (prose in many scripts: Latin, Cyrillic, Greek, Arabic,
Hebrew, Devanagari, Bengali, Thai, CJK, …), emoji with their names and sequences (ZWJ,
skin tones, flags) from the `emoji` package, and this Python's standard-library sources
(code, whitespace runs, tabs) up to the size asked.

  python3 -m pip download --no-deps django==5.1.4 emoji==2.14.0 -d WHEELS
  python3 scripts/make_multilingual_corpus.py WHEELS [--code-mb 3] > corpus.txt
"""
import argparse
import json
import pathlib
import sysconfig
import zipfile

ap = argparse.ArgumentParser()
ap.add_argument("wheels", type=pathlib.Path)
ap.add_argument("--code-mb", type=float, default=3.0)
args = ap.parse_args()

out = []
django = next(args.wheels.glob("[Dd]jango-*.whl"))
with zipfile.ZipFile(django) as z:
    for name in sorted(n for n in z.namelist() if n.endswith(".po")):
        for line in z.read(name).decode("utf-8", errors="replace").split("\n"):
            if line.startswith("msgstr ") or line.startswith('"'):
                text = line[len("msgstr "):] if line.startswith("msgstr ") else line
                try:
                    text = json.loads(text)
                except ValueError:
                    continue
                if text:
                    out.append(text)
emoji = next(args.wheels.glob("emoji-*.whl"))
with zipfile.ZipFile(emoji) as z:
    data = z.read("emoji/unicode_codes/emoji.json").decode("utf-8")
    for e, meta in json.loads(data).items():
        out.append(f"{e} {meta.get('en', '')} {e}{e}")
size, code = 0, []
for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
    try:
        t = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        continue
    code.append(t)
    size += len(t)
    if size > args.code_mb * 1e6:
        break
print("\n".join(out + code))
