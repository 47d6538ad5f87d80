#!/usr/bin/env python3
"""Load generator for OpenAI-compatible completion servers (`forge serve`, llama-server, vLLM).

The semantics of vLLM's serving benchmark: requests arrive as a Poisson process at
--request-rate per second (inf: all at once), at most --max-concurrency in flight;
each has a random prompt of --input-len token ids and asks for exactly --output-len
tokens (ignore_eos), streamed. Reported: time to first token (TTFT), time per output
token after the first (TPOT), inter-token latency (ITL, every gap between streamed
chunks), end-to-end latency, each as mean / median / p99, plus request and token
throughput. Standard library only.

    scripts/bench_serve.py --base-url http://127.0.0.1:8080 --num-prompts 32 \
        --input-len 128 --output-len 64 --max-concurrency 8 --vocab 49152

To measure structured output, --json-schema FILE sends that schema with every request
(OpenAI's response_format); to measure speculative decoding on a task it helps,
--prompt-file FILE sends that text as every request's prompt (e.g. a passage and the
instruction to repeat it) instead of random ids.
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse


def percentile(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def one_request(url, body, api_key, timeout):
    """Send one streamed completion; returns a dict of timings or an error string."""
    u = urllib.parse.urlparse(url)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    start = time.perf_counter()
    try:
        conn.request("POST", u.path or "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": "HTTP %d: %s" % (resp.status, resp.read()[:200].decode("utf-8", "replace"))}
        arrivals = []
        usage = None
        text = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            choices = obj.get("choices") or []
            if choices and choices[0].get("text"):
                arrivals.append(time.perf_counter())
                text.append(choices[0]["text"])
        end = time.perf_counter()
    except Exception as e:  # a refused or cut connection is a failed request, not a crash
        return {"error": repr(e)}
    finally:
        conn.close()
    if not arrivals:
        return {"error": "no tokens streamed"}
    n_out = usage["completion_tokens"] if usage else len(arrivals)
    return {
        "ttft": arrivals[0] - start,
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "e2e": end - start,
        "output_tokens": n_out,
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="the model field of each request (servers that need one)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    ap.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--vocab", type=int, default=49152, help="random prompt ids are drawn from [100, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--label", default="", help="a name for this run in the report")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--json-schema", default=None, help="a JSON schema file every answer must follow")
    ap.add_argument("--prompt-file", default=None, help="every request's prompt: this file's text")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or args.vocab <= 100:
        sys.exit("--num-prompts, --input-len and --output-len must be >= 1, --vocab > 100")

    rng = random.Random(args.seed)
    url = args.base_url.rstrip("/") + args.endpoint
    bodies = []
    schema = json.load(open(args.json_schema)) if args.json_schema else None
    prompt_text = open(args.prompt_file).read() if args.prompt_file else None
    for i in range(args.num_prompts):
        body = {
            "prompt": prompt_text or [rng.randrange(100, args.vocab) for _ in range(args.input_len)],
            "max_tokens": args.output_len,
            "temperature": args.temperature,
            "seed": args.seed + i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.model:
            body["model"] = args.model
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
        bodies.append(body)

    limit = threading.Semaphore(args.max_concurrency or args.num_prompts)
    results = [None] * len(bodies)
    threads = []

    def run(i):
        try:
            results[i] = one_request(url, bodies[i], args.api_key, args.timeout)
        finally:
            limit.release()

    t0 = time.perf_counter()
    for i in range(len(bodies)):
        if i > 0 and args.request_rate != float("inf"):
            time.sleep(rng.expovariate(args.request_rate))
        limit.acquire()
        t = threading.Thread(target=run, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    duration = time.perf_counter() - t0

    ok = [r for r in results if r and "error" not in r]
    errors = [r["error"] for r in results if r and "error" in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] or args.input_len for r in ok)
    ttft = [r["ttft"] * 1e3 for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) * 1e3 for r in ok if r["output_tokens"] > 1]
    itl = [x * 1e3 for r in ok for x in r["itl"]]
    e2e = [r["e2e"] * 1e3 for r in ok]

    def stats(v):
        return {"mean": statistics.fmean(v) if v else float("nan"), "median": percentile(v, 50), "p99": percentile(v, 99)}

    report = {
        "label": args.label,
        "url": url,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "successful_requests": len(ok),
        "failed_requests": len(errors),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot),
        "itl_ms": stats(itl),
        "e2e_ms": stats(e2e),
    }
    w = 48
    print(("{:=^%d}" % w).format(" Serving Benchmark Result " + (f"({args.label}) " if args.label else "")))
    rows = [
        ("Successful requests:", len(ok)),
        ("Failed requests:", len(errors)),
        ("Benchmark duration (s):", f"{duration:.2f}"),
        ("Total input tokens:", in_tokens),
        ("Total generated tokens:", out_tokens),
        ("Request throughput (req/s):", f"{report['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{report['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{report['total_token_throughput']:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<36}{v:>12}")
    for title, key in [("Time to First Token", "ttft_ms"), ("Time per Output Token (excl. 1st token)", "tpot_ms"),
                       ("Inter-token Latency", "itl_ms"), ("End-to-end Latency", "e2e_ms")]:
        print(("{:-^%d}" % w).format(title))
        name = key.split("_")[0].upper()
        for stat, label in [("mean", "Mean"), ("median", "Median"), ("p99", "P99")]:
            print(f"{label + ' ' + name + ' (ms):':<36}{report[key][stat]:>12.2f}")
    print("=" * w)
    if errors:
        print("first error:", errors[0], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    sys.exit(1 if not ok else 0)


if __name__ == "__main__":
    main()
