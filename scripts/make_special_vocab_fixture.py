#!/usr/bin/env python3
"""What gguf-py's SpecialVocab writes for variants of one folder's tokenizer files.

  python3 scripts/make_special_vocab_fixture.py [--llama-cpp /tmp/llama.cpp-build] [--out tests/fixtures/special-vocab.json]

Each case replaces top-level keys of tests/fixtures/tiny-llama's tokenizer.json,
tokenizer_config.json and config.json (and may add chat template files), runs llama.cpp's
`gguf.SpecialVocab(folder, load_merges=True)` on the result, as convert_hf_to_gguf.py's
`_set_vocab_gpt2` does, and records the `tokenizer.*` keys its `add_to_gguf` writes (but
the merges, which tests/quantize.rs checks elsewhere): special ids, add_* flags, chat
templates (the list of names sorted: gguf-py writes a set), normalizer flags.
`forge quantize` must write the same keys for each case.
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/special-vocab.json")
args = ap.parse_args()
sys.path.insert(0, str(args.llama_cpp / "src/vendor/llama.cpp/gguf-py"))
import gguf  # noqa: E402

S = lambda t: {"SpecialToken": {"id": t, "type_id": 0}}  # noqa: E731
A, B = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}

CASES = [
    # Llama 3's: a ByteLevel then a TemplateProcessing that puts BOS first.
    {"name": "llama3-bos-template",
     "tokenizer": {"post_processor": {"type": "Sequence", "processors": [
         BYTE_LEVEL, {"type": "TemplateProcessing", "single": [S("<|im_start|>"), A],
                      "pair": [S("<|im_start|>"), A, S("<|im_start|>"), B], "special_tokens": {}}]}},
     "config": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}},
    # A leading token tokenizer_config does not name (becomes BOS), and EOS between the
    # pair with no sep_token (SEP added, and SEP becomes EOS).
    {"name": "cls-sep-pair",
     "tokenizer": {"post_processor": {"type": "TemplateProcessing", "single": [S("<|im_start|>"), A],
                                      "pair": [S("<|im_start|>"), A, S("<|endoftext|>"), B],
                                      "special_tokens": {}}},
     "config": {"bos_token": None, "eos_token": "<|endoftext|>"}},
    # A trailing EOS and a pair with EOS twice in the middle.
    {"name": "trailing-eos-pair",
     "tokenizer": {"post_processor": {"type": "TemplateProcessing", "single": [S("<|im_start|>"), A, S("<|im_end|>")],
                                      "pair": [S("<|im_start|>"), A, S("<|im_end|>"), S("<|im_end|>"), B,
                                               S("<|im_end|>")], "special_tokens": {}}},
     "config": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "sep_token": "<|endoftext|>"}},
    # A trailing token other than EOS: EOS moves to EOT, the trailing one becomes EOS.
    {"name": "trailing-not-eos",
     "tokenizer": {"post_processor": {"type": "TemplateProcessing", "single": [S("<|im_start|>"), A, S("<|im_end|>")],
                                      "pair": [], "special_tokens": {}}},
     "config": {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>", "add_eos_token": False}},
    # No eos_token: the trailing token is EOS.
    {"name": "trailing-no-eos",
     "tokenizer": {"post_processor": {"type": "TemplateProcessing", "single": [A, S("<|im_end|>")],
                                      "pair": [], "special_tokens": {}}},
     "config": {"bos_token": {"content": "<|im_start|>", "lstrip": False}, "eos_token": None}},
    # An AddedToken dict as EOS, equal in content to the trailing token: gguf-py compares
    # the dict with the string, so it moves EOS to EOT all the same.
    {"name": "dict-eos-trailing",
     "tokenizer": {"post_processor": {"type": "TemplateProcessing", "single": [A, S("<|im_end|>")],
                                      "pair": [], "special_tokens": {}}},
     "config": {"eos_token": {"content": "<|im_end|>", "special": True}}},
    # An empty tokenizer_config.json counts as none; an empty chat template is not written.
    {"name": "empty-config",
     "tokenizer": {"post_processor": {"type": "TemplateProcessing", "single": [S("<|im_start|>"), A],
                                      "pair": [], "special_tokens": {}}},
     "replace_config": {},
     "files": {"chat_template.jinja": ""}},
    # Nested normalizer Sequences; named chat templates; config.json ids (an EOS list is
    # not an id; text_config's pad; an id past the vocabulary is skipped only with n_vocab).
    {"name": "normalizers-templates-config-ids",
     "tokenizer": {"normalizer": {"type": "Sequence", "normalizers": [
         {"type": "NFC"}, {"type": "Sequence", "normalizers": [{"type": "Lowercase"}]},
         {"type": "BertNormalizer", "strip_accents": False}]}},
     "config": {"bos_token": None, "eos_token": None, "unk_token": None,
                "chat_template": [{"name": "default", "template": "{{ messages }}"},
                                  {"name": "tool use", "template": "{{ tools }}"},
                                  {"name": "rag", "template": "{{ documents }}"}]},
     "model_config": {"bos_token_id": 1, "eos_token_id": [0, 2], "mask_token_id": 3,
                      "text_config": {"pad_token_id": 2}}},
    # chat_template.jinja with additional_chat_templates/, no tokenizer_config template.
    {"name": "jinja-files",
     "config": {"add_bos_token": True, "sep_token": "<|im_end|>"},
     "files": {"chat_template.jinja": "{{ bos_token }}{{ messages }}",
               "additional_chat_templates/tool_use.jinja": "{{ tools }}"}},
]


def keys_of(folder: Path) -> dict:
    sv = gguf.SpecialVocab(folder, load_merges=True)
    w = gguf.GGUFWriter(path=None, arch="llama")
    sv.add_to_gguf(w, quiet=True)
    out = {}
    for k, v in w.kv_data[0].items():
        if not k.startswith("tokenizer.") or k == "tokenizer.ggml.merges":
            continue
        value = v.value
        if k == "tokenizer.chat_templates":
            value = sorted(value)
        out[k] = value
    return out


cases = []
with tempfile.TemporaryDirectory() as tmp:
    for case in CASES:
        folder = Path(tmp) / case["name"]
        shutil.copytree(ROOT / "tests/fixtures/tiny-llama", folder,
                        ignore=shutil.ignore_patterns("*.gguf", "*.safetensors", "greedy.json"))
        for name, key in [("tokenizer.json", "tokenizer"), ("tokenizer_config.json", "config"),
                          ("config.json", "model_config")]:
            data = json.loads((folder / name).read_text())
            data.update(case.get(key, {}))
            if key == "config" and "replace_config" in case:
                data = case["replace_config"]
            (folder / name).write_text(json.dumps(data))
        for rel, text in case.get("files", {}).items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(text)
        cases.append({**case, "expected": keys_of(folder)})
args.out.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
for c in cases:
    print(c["name"], c["expected"])
