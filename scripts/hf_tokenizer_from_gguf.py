#!/usr/bin/env python3
"""Write HF's own tokenizer for a GGUF file (`tokenizer.json` + `tokenizer_config.json`), the
files `AutoTokenizer.from_pretrained(dir, gguf_file=...)` then `save_pretrained` give,
without PyTorch:

  python3 scripts/hf_tokenizer_from_gguf.py model.gguf OUT_DIR

transformers' GGUF reader imports torch; this reads the metadata with llama.cpp's `gguf`
package instead and hands it to transformers' own conversion
(`integrations/gguf/gguf_tokenizer_mapping.py`) and tokenizer class. For Gemma 3 270M the
result is byte-identical to the torch path's (transformers 5.25.0, tokenizers 0.23.3).
Needs: transformers tokenizers gguf numpy (pip).
"""
import os
import sys

from gguf import GGUFReader, GGUFValueType
import transformers.integrations.gguf as hf_gguf
from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

gguf_path, out_dir = sys.argv[1], sys.argv[2]


def value(field):
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


reader = GGUFReader(gguf_path)
meta = {k: value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.") or k == "general.architecture"}


def get_gguf_tokenizer(_path):
    """transformers' `get_gguf_tokenizer`, over the metadata read above."""
    architecture = meta["general.architecture"]
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return architecture, tokenizer, config


hf_gguf.get_gguf_tokenizer = get_gguf_tokenizer
name = TOKENIZER_MAPPING_NAMES.get(meta["general.architecture"]) or "PreTrainedTokenizerFast"
cls = tokenizer_class_from_name(name)
tok = cls.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path))
tok.save_pretrained(out_dir)
print(f"{out_dir}: {type(tok).__name__}, {len(tok)} tokens")
