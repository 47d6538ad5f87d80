#!/usr/bin/env python3
"""HF tokenizers' ids for SentencePiece-style and NFC `tokenizer.json` pipelines, for the tests.

  python3 scripts/make_spm_json_fixture.py   # writes tests/fixtures/spm-json/

tokenizer.json: a character-level BPE with byte fallback (HF tokenizers' BpeTrainer on the texts
of tests/fixtures/pretokenizers.jsonl, words split at spaces, ~150 characters; then the 256
`<0xXX>` byte tokens below 0xF0 put into the vocabulary as SentencePiece conversions have them), with
`<unk>`, `<s>`, `</s>` special and `<|sep|>` an added token that is not special, in Llama 2's
pipeline, and `▁▁` merged last. pipelines.json: the normalizer / pre_tokenizer / decoder of each variant, as HF
tokenizers serializes them:
  llama2           Prepend("▁") + Replace(" ", "▁"); no pre-tokenizer; Strip one space in decode
  metaspace_first  Metaspace(prepend_scheme="first", split=False) (Llama / Mistral, legacy=False)
  metaspace_always Metaspace(prepend_scheme="always", split=True) with the Metaspace decoder
  gemma            Replace(" ", "▁"), Split(" ", "merged_with_previous") (Gemma)
  nfc_split_*      NFC + Replace(" ", "▁"), then Split("▁", behaviour) for each of the five
  qwen2_nfc        tests/fixtures/tiny-llama's byte-level BPE with Qwen 2's pipeline and its
                   NFC normalizer (base "tiny-llama")
cases.jsonl: one {"text", VARIANT: ids (the split variants and qwen2_nfc on texts of up to 200
characters only), "decoded": {VARIANT: text}} per line, ids without BOS
(add_special_tokens=False), special tokens parsed; `decoded` is HF's decode of those ids where it is not the text. decode.jsonl: id
sequences text does not produce (invalid byte runs, `▁▁` or an added token first) with each
pipeline's HF decode.
Texts: those of tests/fixtures/pretokenizers.jsonl (its 394 cases and edge cases, every eighth of
its corpus lines) and edge cases (leading, trailing and
repeated spaces, added tokens mid-text and first, decomposed characters NFC composes).
Needs tokenizers.
"""
import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

OUT = "tests/fixtures/spm-json"
rows = [json.loads(l) for l in open("tests/fixtures/pretokenizers.jsonl", encoding="utf-8")]
texts = [r["text"] for r in rows]
# All the case and edge-case texts, and every eighth multilingual corpus line (the vocabulary
# is trained on all of them).
train = list(texts)
texts = texts[:394] + texts[394::8]
texts += ["  two leading", "trailing  ", "a  b   c", " ", "▁x ▁", "<s>Hello", "Hi <s> there</s>", "<|sep|>x y",
          "x<|sep|> y", "<unk>", "e\u0301t\u00e9 A\u030a \u1100\u1161\u11a8 \ufb01", "Cafe\u0301 \u212b", "\u00a0x", "🚀 rocket",
          "🚀中🚀 a🚀b🚀🚀x 中🚀中"]

trainer = trainers.BpeTrainer(vocab_size=600, limit_alphabet=150, show_progress=False)
t = Tokenizer(BPE())
t.normalizer = normalizers.Replace(" ", "▁")
t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
t.train_from_iterator(train, trainer)
trained = json.loads(t.to_str())["model"]
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
# No byte tokens for 0xF0..0xFF: characters of four UTF-8 bytes (emoji) fall back to `<unk>`,
# consecutive ones fused into one.
vocab.update({f"<0x{b:02X}>": 3 + b for b in range(0xF0)})
for tok, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
    vocab.setdefault(tok, len(vocab))
vocab["<|sep|>"] = len(vocab)
merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
# Two spaces as one token, merged last: space runs then split differently by pipeline.
vocab["▁▁"] = len(vocab)
merges.append(("▁", "▁"))

pipelines = {
    "llama2": dict(normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                   pre_tokenizer=None,
                   decoder=decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                              decoders.Strip(" ", 1, 0)])),
    "metaspace_first": dict(normalizer=None,
                            pre_tokenizer=pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False),
                            decoder=decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                       decoders.Fuse(), decoders.Strip(" ", 1, 0)])),
    "metaspace_always": dict(normalizer=None,
                             pre_tokenizer=pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
                             decoder=decoders.Sequence([decoders.ByteFallback(),
                                                        decoders.Metaspace(replacement="▁", prepend_scheme="always")])),
    "gemma": dict(normalizer=normalizers.Replace(" ", "▁"),
                  pre_tokenizer=pre_tokenizers.Split(" ", "merged_with_previous"),
                  decoder=decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])),
}
for behaviour in ("removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"):
    pipelines[f"nfc_split_{behaviour}"] = dict(
        normalizer=normalizers.Sequence([normalizers.NFC(), normalizers.Replace(" ", "▁")]),
        pre_tokenizer=pre_tokenizers.Split("▁", behaviour),
        decoder=decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]))


def spm_tokenizer(p):
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if p["normalizer"] is not None:
        tok.normalizer = p["normalizer"]
    if p["pre_tokenizer"] is not None:
        tok.pre_tokenizer = p["pre_tokenizer"]
    tok.decoder = p["decoder"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    tok.add_tokens([AddedToken("<|sep|>", special=False, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


tokenizers_ = {name: spm_tokenizer(p) for name, p in pipelines.items()}
tokenizers_["llama2"].save(f"{OUT}/tokenizer.json")
serialized = {}
for name, tok in tokenizers_.items():
    j = json.loads(tok.to_str())
    serialized[name] = {k: j[k] for k in ("normalizer", "pre_tokenizer", "decoder")}

src = open("src/tokenizer/pretokenize.rs", encoding="utf-8").read()
import re
qwen2 = re.search(r'pub const QWEN2_PATTERN: &str =\s*r"(.*)";', src).group(1)
qwen = Tokenizer.from_file("tests/fixtures/tiny-llama/tokenizer.json")
qwen.normalizer = normalizers.NFC()
qwen.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(qwen2), "isolated"),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
tokenizers_["qwen2_nfc"] = qwen
j = json.loads(qwen.to_str())
serialized["qwen2_nfc"] = {k: j[k] for k in ("normalizer", "pre_tokenizer", "decoder")} | {"base": "tiny-llama"}
json.dump(serialized, open(f"{OUT}/pipelines.json", "w", encoding="utf-8"), ensure_ascii=False, indent=1)

with open(f"{OUT}/cases.jsonl", "w", encoding="utf-8") as f:
    for text in texts:
        row = {"text": text, "decoded": {}}
        for name, tok in tokenizers_.items():
            if len(text) > 200 and name.startswith(("nfc_split", "qwen2")):
                continue  # long texts: the four main pipelines only
            ids = tok.encode(text, add_special_tokens=False).ids
            row[name] = ids
            if name != "qwen2_nfc":
                decoded = tok.decode(ids, skip_special_tokens=False)
                if decoded != text:
                    row["decoded"][name] = decoded
        f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
# Id sequences text does not produce, decoded by each pipeline: invalid byte runs, a valid
# one between text, `▁▁` first, added tokens first.
byte = lambda b: vocab[f"<0x{b:02X}>"]
sequences = [[byte(0xE2), byte(0x82)], [byte(0x41), byte(0xC3)], [byte(0xE2), byte(0x82), byte(0xAC), vocab["▁▁"]],
             [vocab["▁▁"], vocab["▁"]], [vocab["▁"]], [1, vocab["▁▁"]], [vocab["<|sep|>"], vocab["▁"]], [byte(0x20), vocab["▁"]],
             [0, 0, byte(0x41)]]
with open(f"{OUT}/decode.jsonl", "w", encoding="utf-8") as f:
    for ids in sequences:
        row = {"ids": ids} | {name: tok.decode(ids, skip_special_tokens=False)
                              for name, tok in tokenizers_.items() if name != "qwen2_nfc"}
        f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
print(f"{len(vocab)} tokens, {len(merges)} merges, {len(texts)} texts")
