#!/usr/bin/env python3
"""Tiny random checkpoints with a SentencePiece `tokenizer.model`, and llama.cpp's conversions.

  python3 scripts/make_spm_fixtures.py [--llama-cpp /tmp/llama.cpp-build] [--out tests/fixtures]

Writes two HF folders that share one SentencePiece BPE model (byte fallback, Gemma's
special ids: pad 0, eos 1, bos 2, unk 3) trained here on the texts of
tests/fixtures/gemma3/tokenizer.jsonl:

  tiny-gemma3-spm/   Gemma 3 (six blocks, bf16), tokenizer.model, tokenizer.json (transformers'
                     conversion of the model, as Gemma's Hub folders carry both),
                     tokenizer_config.json with added tokens, added_tokens.json; vocab_size
                     above the model's pieces, so the converter pads.
  tiny-llama-spm/    Llama (f32), tokenizer.model and tokenizer_config.json only (as older
                     Llama 2 folders), `add_prefix_space` false.

In each, NAME.f32.gguf is llama.cpp's convert_hf_to_gguf.py of the folder (it reads
tokenizer.model over tokenizer.json), and spm.jsonl holds sentencepiece's own ids for texts
of several scripts (`encode`, without BOS) and transformers' (`hf`, from the same model): the
outside truth for the converted vocabulary. They differ only where a text spells a control
piece (`<mask>`): sentencepiece reads it as text, transformers and llama.cpp as the token.

The model's pieces cover every type: normal, byte (<0x..>), control (<mask>), user-defined
(<start_of_turn>, <end_of_turn>, listed as special tokens in tokenizer_config.json as chat
models list them; <img>, not listed, which the converter writes as a normal piece) and one
unused (<unused0>, retagged in the protobuf).
Needs torch, transformers >= 5, sentencepiece, protobuf and llama.cpp's sources.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import sentencepiece as spm
import torch
from sentencepiece import sentencepiece_model_pb2 as pb
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from make_llama_fixtures import convert  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
ap.add_argument("--out", type=Path, default=ROOT / "tests/fixtures")
args = ap.parse_args()

PIECES = 1024
TEXTS = [json.loads(line)["text"] for line in open(ROOT / "tests/fixtures/gemma3/tokenizer.jsonl", encoding="utf-8")]
CHECK = [
    "Hello world", " leading space", "two  spaces\tand a tab\nnew line", "<start_of_turn>user\nHi<end_of_turn>",
    "Déjà vu, naïve café", "日本語のテキスト", "Привет, мир", "emoji 🦀🚀 and ①②", "x = 12345 + 0.5",
    "   ", "", "<mask> is control, <unused0> unused",
]


def train(tmp: Path) -> Path:
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(t for t in TEXTS if t.strip()), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp / "spm"), vocab_size=PIECES, model_type="bpe",
        byte_fallback=True, character_coverage=0.98, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>", "<unused0>", "<img>"], control_symbols=["<mask>"],
        add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity",
        split_digits=True, allow_whitespace_only_pieces=True, max_sentence_length=100000,
        train_extremely_large_corpus=False, minloglevel=2)
    m = pb.ModelProto()
    m.ParseFromString((tmp / "spm.model").read_bytes())
    for p in m.pieces:
        if p.piece == "<unused0>":
            p.type = pb.ModelProto.SentencePiece.UNUSED
    path = tmp / "tokenizer.model"
    path.write_bytes(m.SerializeToString())
    return path


def write_ids(model: Path, out: Path):
    sp = spm.SentencePieceProcessor(model_file=str(model))
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "tokenizer.model").write_bytes(model.read_bytes())
        (Path(d) / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer"}))
        hf = AutoTokenizer.from_pretrained(d)
    with open(out / "spm.jsonl", "w", encoding="utf-8") as f:
        for t in CHECK + TEXTS[:40]:
            ids = {"spm": sp.encode(t), "hf": hf.encode(t, add_special_tokens=False)}
            f.write(json.dumps({"text": t, **ids}, ensure_ascii=False) + "\n")


def gemma(model_file: Path, out: Path):
    torch.manual_seed(4011)
    config = Gemma3TextConfig(
        vocab_size=PIECES + 4, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=2, eos_token_id=1,
        pad_token_id=0, tie_word_embeddings=True)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.model").write_bytes(model_file.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "mask_token": "<mask>"}))
    AutoTokenizer.from_pretrained(out).save_pretrained(out)
    # The converter's other sources: added tokens past the model's pieces (one with a
    # SentencePiece space, which it writes as a space), and a decoder entry that looks special.
    (out / "added_tokens.json").write_text(json.dumps({"<extra_a>": PIECES + 1}))
    tc = json.loads((out / "tokenizer_config.json").read_text())
    for k in ["vocab_file", "is_local", "local_files_only"]:
        tc.pop(k, None)
    tc["add_bos_token"], tc["add_eos_token"] = True, False
    # As Gemma's Hub folders: the model's special pieces marked special in tokenizer.json
    # and listed in added_tokens_decoder.
    tj = json.loads((out / "tokenizer.json").read_text())
    # (<img>, id 8, stays a user-defined piece the converter writes as normal.)
    for t in tj["added_tokens"]:
        t["special"] = t["id"] < 7
    (out / "tokenizer.json").write_text(json.dumps(tj, indent=2, ensure_ascii=False))
    tc["added_tokens_decoder"] = {str(t["id"]): {"content": t["content"], "special": True}
                                  for t in tj["added_tokens"] if t["id"] < 7}
    tc["added_tokens_decoder"].update({
        str(PIECES): {"content": "\u2581\u2581tab", "special": False},
        str(PIECES + 2): {"content": "<|tool|>", "special": False},
    })
    tc["chat_template"] = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    for f in ["special_tokens_map.json", "chat_template.jinja"]:
        (out / f).unlink(missing_ok=True)


def llama(model_file: Path, out: Path):
    torch.manual_seed(4012)
    config = LlamaConfig(vocab_size=PIECES, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0, tie_word_embeddings=False,
                         max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=2, eos_token_id=1,
                         initializer_range=0.2)
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.model").write_bytes(model_file.read_bytes())
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    specials = [i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)] + [5, 6]
    tc = {"add_bos_token": True, "add_eos_token": False, "add_prefix_space": False, "bos_token": "<bos>",
          "eos_token": "<eos>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer",
          "added_tokens_decoder": {str(i): {"content": sp.id_to_piece(i), "special": True} for i in specials}}
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))


with tempfile.TemporaryDirectory() as tmp:
    model_file = train(Path(tmp))
    for name, make in [("tiny-gemma3-spm", gemma), ("tiny-llama-spm", llama)]:
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        make(model_file, out)
        (out / "generation_config.json").unlink(missing_ok=True)
        write_ids(out / "tokenizer.model", out)
        convert(args.llama_cpp, out, ["f32"], name)
