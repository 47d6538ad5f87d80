#!/usr/bin/env python3
"""HF transformers (torch, f32, CPU) on the same model folder, in llama-bench's shape:
pp512 = one forward pass over 512 tokens, tg128 = 128 greedy one-token steps with the
KV cache; 5 repetitions after a warm-up, mean ± sd tokens/s, at each thread count.

  pip install torch transformers
  python3 scripts/hf_bench.py /tmp/bf-bench/gpt2 --threads 1,2
  python3 scripts/hf_bench.py /tmp/gpt2-xl --device cuda      # GPU side by side
  python3 scripts/hf_bench.py SmolLM2.Q4_1.gguf --device cuda --npl 1,16,64   # pip install gguf accelerate
On CUDA each timed run ends with torch.cuda.synchronize(); --threads is ignored there.
A GGUF file is loaded through transformers' `gguf_file=` (dequantized to --dtype).
`--npl B` also times B sequences generated together (tgN xB: t/s counts all B).
"""
import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def bench(fn, n_tokens, reps, sync=lambda: None):
    fn()
    sync()
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        rates.append(n_tokens / (time.perf_counter() - t))
    return statistics.mean(rates), statistics.stdev(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    ap.add_argument("--npl", default="1", help="sequences generated together in tg, e.g. 1,16,64")
    args = ap.parse_args()
    dtype = torch.float32 if args.dtype == "f32" else torch.float16
    if args.model_dir.endswith(".gguf"):
        import os
        folder, name = os.path.split(os.path.abspath(args.model_dir))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    model = model.eval().to(args.device)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.p), generator=gen).to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    if args.device != "cpu":
        args.threads = "0"
    print(f"| model | backend | threads | test | t/s |")
    print(f"| --- | --- | ---: | --- | ---: |")
    for t in [int(x) for x in args.threads.split(",")]:
        if t > 0:
            torch.set_num_threads(t)
        with torch.inference_mode():
            for label, kw in [("pp%d (all logits)" % args.p, {}), ("pp%d (last logits)" % args.p, {"logits_to_keep": 1})]:
                m, sd = bench(lambda: model(prompt, use_cache=False, **kw), args.p, args.r, sync)
                print(f"| {args.model_dir} | HF transformers {torch.__version__} {args.device} | {t or '-'} | {label} | {m:.2f} ± {sd:.2f} |")
            for b in [int(x) for x in args.npl.split(",")]:
                first = torch.randint(0, model.config.vocab_size, (b, 1), generator=gen).to(args.device)
                m, sd = bench(lambda: model.generate(first, attention_mask=torch.ones_like(first), do_sample=False,
                                                     max_new_tokens=args.n, min_new_tokens=args.n, pad_token_id=0),
                              args.n * b, args.r, sync)
                test = f"tg{args.n}" + (f" x{b}" if b > 1 else "")
                print(f"| {args.model_dir} | HF transformers {torch.__version__} {args.device} {args.dtype} | {t or '-'} | {test} | {m:.2f} ± {sd:.2f} |")


if __name__ == "__main__":
    main()
