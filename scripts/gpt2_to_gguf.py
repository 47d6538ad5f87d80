#!/usr/bin/env python3
"""Convert a GPT-2 model folder (config.json, model.safetensors, vocab.json, merges.txt)
to GGUF for llama.cpp, so both engines can be benchmarked on the same weights.

Needs numpy, safetensors and the `gguf` package (`pip install gguf`, or llama.cpp's own
gguf-py on PYTHONPATH). No torch.

  python3 scripts/gpt2_to_gguf.py MODEL_DIR OUT.gguf --dtype f32|f16

HF GPT-2 linear layers are Conv1D, stored [in, out]; GGUF wants [out, in] rows, so
they are transposed. LayerNorm parameters and biases stay f32, as llama.cpp's own
converter does; with --dtype f16 the 2-D weights (embeddings included) become f16.
"""

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=["f32", "f16"], default="f32")
    args = ap.parse_args()

    cfg = json.loads((args.model_dir / "config.json").read_text())
    n_embd, n_layer = cfg["n_embd"], cfg["n_layer"]
    n_ctx = cfg.get("n_positions", cfg.get("n_ctx"))
    w = gguf.GGUFWriter(str(args.out), "gpt2")
    w.add_name(args.model_dir.name)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(cfg.get("n_inner") or 4 * n_embd)
    w.add_block_count(n_layer)
    w.add_head_count(cfg["n_head"])
    w.add_layer_norm_eps(cfg.get("layer_norm_epsilon", 1e-5))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if args.dtype == "f16" else gguf.LlamaFileType.ALL_F32)

    # Tokenizer: GPT-2 byte-level BPE.
    vocab = json.loads((args.model_dir / "vocab.json").read_text())
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [l for l in (args.model_dir / "merges.txt").read_text().split("\n")[1:] if l]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id", 50256))
    w.add_eos_token_id(cfg.get("eos_token_id", 50256))

    st = load_file(str(args.model_dir / "model.safetensors"))
    st = {k.removeprefix("transformer."): v for k, v in st.items()}
    wdt = np.float16 if args.dtype == "f16" else np.float32

    def put(name, arr, matrix):
        arr = np.ascontiguousarray(arr.astype(wdt if matrix else np.float32))
        w.add_tensor(name, arr)

    put("token_embd.weight", st["wte.weight"], True)
    put("position_embd.weight", st["wpe.weight"], True)
    put("output_norm.weight", st["ln_f.weight"], False)
    put("output_norm.bias", st["ln_f.bias"], False)
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for i in range(n_layer):
        for hf, gg in names.items():
            wt, b = st[f"h.{i}.{hf}.weight"], st[f"h.{i}.{hf}.bias"]
            matrix = wt.ndim == 2
            put(f"blk.{i}.{gg}.weight", wt.T if matrix else wt, matrix)
            put(f"blk.{i}.{gg}.bias", b, False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out} ({args.dtype})")


if __name__ == "__main__":
    main()
