#!/usr/bin/env python3
"""HF transformers (torch, f32, CPU) on the same model folder, in llama-bench's shape:
pp512 = one forward pass over 512 tokens, tg128 = 128 greedy one-token steps with the
KV cache; 5 repetitions after a warm-up, mean ± sd tokens/s, at each thread count.

  pip install torch transformers
  python3 scripts/hf_bench.py /tmp/bf-bench/gpt2 --threads 1,2
  python3 scripts/hf_bench.py /tmp/gpt2-xl --device cuda      # GPU side by side
On CUDA each timed run ends with torch.cuda.synchronize(); --threads is ignored there.
"""
import argparse
import statistics
import time

import torch
from transformers import GPT2LMHeadModel


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
    args = ap.parse_args()
    model = GPT2LMHeadModel.from_pretrained(args.model_dir, dtype=torch.float32).eval().to(args.device)
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
            one = prompt[:, :1]
            m, sd = bench(lambda: model.generate(one, attention_mask=torch.ones_like(one), do_sample=False,
                                                 max_new_tokens=args.n, min_new_tokens=args.n, pad_token_id=0), args.n, args.r, sync)
            print(f"| {args.model_dir} | HF transformers {torch.__version__} {args.device} | {t or '-'} | tg{args.n} | {m:.2f} ± {sd:.2f} |")


if __name__ == "__main__":
    main()
