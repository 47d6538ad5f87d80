#!/usr/bin/env python3
"""Greedy continuations of forge's default (quantized) path beside llama.cpp's, with both margins.

  python3 scripts/compare_llama_cpp.py MODEL.gguf [--llama-cpp /tmp/llama.cpp-build] [-n 32] [--chat]
      [--prompts FILE] [--kv-dtype f32|f16]

Starts `llama-server` (one slot, 2 threads) and, for each prompt, asks it for a temperature-0
continuation of forge's prompt ids with `n_probs: 2` (its top-2 log-probabilities of the raw
logits at every step), and runs `forge generate --temp 0 --json --logprobs 2` on the same
prompt; both stop at the model's end-of-generation token (after it the ids mean nothing).

Reports how many tokens agree and, at the first difference, **llama.cpp's own** top-2 logprob
margin there (the issue's test: the ids must agree up to the first step where llama.cpp's
margin is a near tie) beside forge's, and the f32 truth's verdict there (`forge serve --dtype
f32`, equal to HF transformers' f32 logits within 2e-4, scoring the agreed prefix followed by
each engine's token: positive means the truth prefers llama.cpp's token); the smallest
llama.cpp margin over the agreeing prefix (how close a call the agreement survived) and the
largest gap between the two engines' logprobs of the chosen token over it. Then both engines'
logprobs of llama.cpp's tokens against the truth's, teacher-forced along llama.cpp's path
(forge's rows do not depend on the batch, so scoring the path as one prompt gives its decode
steps' numbers). With --chat each prompt is a user message in the model's chat template
(both sides get the same token ids). Needs: scripts/build_llama_cpp.sh's build with
llama-server, and target/release/forge.
"""

import argparse
import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORGE = ROOT / "target/release/forge"

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]


def forge(*args, stdin=None):
    out = subprocess.run([str(FORGE), *args], capture_output=True, text=True, input=stdin)
    if out.returncode != 0:
        raise SystemExit(f"forge {' '.join(args)}: {out.stderr}")
    return out.stdout


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


def start_server(argv, port):
    proc = subprocess.Popen([*map(str, argv), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{argv[0]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"{argv[0]} did not become healthy within 120 s")


def margin(top):
    return top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else float("inf")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp-build"))
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--kv-dtype", default="f32", help="forge's KV cache (f32, its default; llama.cpp's is f16)")
    args = ap.parse_args()
    prompts = args.prompts.read_text().splitlines() if args.prompts else DEFAULT_PROMPTS
    port, truth_port, quant_port = free_port(), free_port(), free_port()
    rows = []
    errors = {"llama.cpp": [], "forge": []}
    servers = []
    try:
        servers.append(start_server([args.llama_cpp / "build/bin/llama-server", "-m", args.model, "-t", "2",
                                     "-np", "1", "-c", "4096"], port))
        # forge's f32 path (dequantized weights, f32 activations) equals HF transformers' f32 run
        # within 2e-4 (tests/model_llama.rs): the truth both quantized engines approximate.
        servers.append(start_server([FORGE, "serve", "-m", args.model, "--dtype", "f32", "-np", "1", "-t", "2"],
                                    truth_port))
        servers.append(start_server([FORGE, "serve", "-m", args.model, "-np", "1", "-t", "2", "--kv-dtype",
                                     args.kv_dtype], quant_port))
        for prompt in prompts:
            flags = ["--chat"] if args.chat else []
            ours = json.loads(forge("generate", "-m", str(args.model), "-p", prompt, "--temp", "0",
                                    "-n", str(args.n), "--json", "--logprobs", "2", "--no-escape", "--kv-dtype",
                                    args.kv_dtype, *flags))
            reply = post(f"http://127.0.0.1:{port}/completion", {
                "prompt": ours["prompt_ids"], "n_predict": args.n, "temperature": 0, "n_probs": 2,
                "cache_prompt": False, "return_tokens": True})
            # `tokens` holds every generated id; llama-server folds the steps of a character split
            # over several byte tokens into one `completion_probabilities` entry, so per-step numbers
            # line up with the ids only when the two lists have the same length.
            steps = reply["completion_probabilities"]
            theirs = reply.get("tokens") or [step["id"] for step in steps]
            if len(steps) != len(theirs):
                steps = None
            # Both engines' logprobs of llama.cpp's tokens against the f32 truth's, teacher-forced along
            # llama.cpp's path (forge's rows do not depend on the batch, so scoring the path as one
            # prompt gives its decode steps' numbers).
            scored = {}
            for name, p in (("truth", truth_port), ("forge", quant_port)):
                lp = post(f"http://127.0.0.1:{p}/v1/completions", {
                    "prompt": ours["prompt_ids"] + theirs, "max_tokens": 0, "echo": True,
                    "logprobs": 1})["choices"][0]["logprobs"]["token_logprobs"]
                scored[name] = lp[len(ours["prompt_ids"]):]
            for i, step in enumerate(steps or []):
                errors["llama.cpp"].append(abs(step["logprob"] - scored["truth"][i]))
                errors["forge"].append(abs(scored["forge"][i] - scored["truth"][i]))
            mine = ours["generated_ids"]
            agree = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            theirs_margin = ours_margin = truth_margin = None
            if agree < len(mine) and agree < len(theirs):
                theirs_margin = margin(steps[agree]["top_logprobs"]) if steps else None
                ours_margin = margin(ours["logprobs"][agree]["top_logprobs"])
                # The truth's logprobs of the two tokens, by id: each scored as the last token
                # of the agreed prefix followed by it.
                def truth_lp(token):
                    return post(f"http://127.0.0.1:{truth_port}/v1/completions", {
                        "prompt": ours["prompt_ids"] + mine[:agree] + [token], "max_tokens": 0, "echo": True,
                        "logprobs": 1})["choices"][0]["logprobs"]["token_logprobs"][-1]
                truth_margin = truth_lp(theirs[agree]) - truth_lp(mine[agree])
            closest = min((margin(step["top_logprobs"]) for step in (steps or [])[:agree]), default=None)
            # How far apart the two engines' numbers are where they agree: the chosen token's logprob.
            gap = max((abs(step["logprob"] - lp["logprob"]) for step, lp in zip((steps or [])[:agree], ours["logprobs"])),
                      default=None)
            n = f"{len(mine)}" if len(mine) == len(theirs) else f"{len(mine)} vs {len(theirs)}"
            rows.append((prompt, agree, n, theirs_margin, ours_margin, truth_margin, closest, gap, ours["text"][:40],
                         reply["content"][:40]))
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print("| prompt | tokens equal | first difference: llama.cpp's top-2 margin | forge's there "
          "| f32 truth there: lp(llama.cpp's) − lp(forge's) | smallest llama.cpp margin before it "
          "| largest logprob gap before it | forge | llama.cpp |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    fmt = lambda m: "-" if m is None else f"{m:.3f}"  # noqa: E731
    for prompt, agree, n, theirs_m, ours_m, truth_m, closest, gap, a, b in rows:
        print(f"| {prompt!r} | {agree}/{n} | {fmt(theirs_m)} | {fmt(ours_m)} | {fmt(truth_m)} | {fmt(closest)} "
              f"| {fmt(gap)} | {a!r} | {b!r} |")
    print()
    print("Logprob of llama.cpp's tokens against the f32 truth, teacher-forced along llama.cpp's path "
          f"({len(errors['forge'])} steps; a prompt whose steps llama-server folds is left out):")
    print()
    print("| engine | mean abs error | median | max |")
    print("| --- | ---: | ---: | ---: |")
    for name, errs in errors.items():
        errs = sorted(errs)
        if not errs:
            print(f"| {name} | - | - | - |")
            continue
        print(f"| {name} | {sum(errs) / len(errs):.4f} | {errs[len(errs) // 2]:.4f} | {errs[-1]:.4f} |")

if __name__ == "__main__":
    main()
