"""batch_forge from Python, against outside references: HF transformers' greedy ids (the
fixtures' reference files) and the `forge` binary's own answers (generation, seeded
sampling, log-probabilities, error messages).

Run from the repository root after installing the wheel (`.ci/run` does this):
    pytest python/tests
`BATCH_FORGE_BIN` names the forge binary (default target/release/forge);
`BATCH_FORGE_SMOLLM2` the real model for the chat test (skipped without it, failed
under CI=true).
"""

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import batch_forge

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
FORGE = os.environ.get("BATCH_FORGE_BIN", str(ROOT / "target" / "release" / "forge"))
IN_CI = os.environ.get("CI") == "true"


def forge(*args):
    """`forge ARGS` -> (exit status, stdout, stderr)."""
    p = subprocess.run([FORGE, *map(str, args)], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def forge_json(*args):
    code, out, err = forge("generate", *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def gpt2():
    return batch_forge.Model(str(FIXTURES / "tiny-gpt2"), threads=2)


def test_forge_binary_is_there():
    assert Path(FORGE).is_file(), f"{FORGE} is missing: build it (cargo build --release) or set BATCH_FORGE_BIN"


def test_gpt2_greedy_equals_hf(gpt2):
    ref = json.loads((FIXTURES / "tiny-gpt2" / "reference.json").read_text())
    checked = 0
    for p in ref["prompts"]:
        if not p["text"]:
            continue  # the empty prompt starts from <|endoftext|>, given as ids below
        assert gpt2.tokenize(p["text"]) == p["prompt_ids"], p["text"]
        c = gpt2.complete(p["text"], max_tokens=len(p["generated_ids"]), temperature=0)
        assert c.prompt_token_ids == p["prompt_ids"]
        assert c.token_ids == p["generated_ids"], p["text"]
        assert c.finish_reason == "length"
        checked += 1
    empty = next(p for p in ref["prompts"] if not p["text"])
    c = gpt2.complete(empty["prompt_ids"], max_tokens=len(empty["generated_ids"]), temperature=0)
    assert c.token_ids == empty["generated_ids"]
    assert checked >= 3


@pytest.mark.parametrize("key,file", [("safetensors", ""), ("q8_0", "tiny-llama.q8_0.gguf"), ("q4_0", "tiny-llama.q4_0.gguf")])
def test_llama_greedy_equals_hf(key, file):
    # HF's greedy 16 tokens, EOS ignored, from the folder and from each GGUF, which
    # transformers dequantizes: so do we here (dtype="f32" decodes the blocks at load).
    m = batch_forge.Model(str(FIXTURES / "tiny-llama" / file), threads=2, dtype="f32")
    runs = json.loads((FIXTURES / "tiny-llama" / "greedy.json").read_text())[key]
    for run in runs:
        c = m.complete(run["prompt_ids"], max_tokens=len(run["greedy_ids"]), temperature=0, ignore_eos=True)
        assert c.token_ids == run["greedy_ids"], run["prompt"]
        assert m.tokenize(run["prompt"]) == run["prompt_ids"]


def test_score_equals_forge_generate_logprobs(gpt2):
    # The CLI with the server's kernels (what Model uses by default): its generated tokens'
    # log-probabilities are what scoring the prompt plus those tokens gives.
    prompt = "The quick brown fox"
    out = forge_json("-m", FIXTURES / "tiny-gpt2", "-p", prompt, "-n", 24, "--temp", 0, "--logprobs", 1, "--batch-invariant")
    ids = out["prompt_ids"] + out["generated_ids"]
    scored = gpt2.score(ids)
    assert len(scored) == len(ids) - 1
    tail = scored[len(out["prompt_ids"]) - 1 :]
    want = [t["logprob"] for t in out["logprobs"]]
    assert len(tail) == len(want) == 24
    assert max(abs(a - b) for a, b in zip(tail, want)) <= 1e-6, (tail, want)
    # And the same numbers from generation in Python.
    c = gpt2.complete(prompt, max_tokens=24, temperature=0, logprobs=1)
    assert c.token_ids == out["generated_ids"]
    assert max(abs(a - b) for a, b in zip(c.logprobs, want)) <= 1e-6
    assert [t[0][0] for t in c.top_logprobs] == c.token_ids  # greedy: the top choice each time


def test_loglikelihood_sums_the_continuation(gpt2):
    ctx, cont = "The quick brown fox", " jumps over"
    total, greedy = gpt2.loglikelihood(ctx, cont)
    ctx_ids, cont_ids = gpt2.tokenize(ctx), gpt2.tokenize(cont, add_special=False)
    scored = gpt2.score(ctx_ids + cont_ids)
    assert total == pytest.approx(sum(scored[-len(cont_ids) :]), abs=1e-9)
    assert isinstance(greedy, bool)
    # A continuation that is greedy decoding's own is greedy; one token off is not.
    g = gpt2.complete(ctx, max_tokens=3, temperature=0)
    assert gpt2.loglikelihood(ctx, g.token_ids)[1] is True
    off = g.token_ids[:2] + [(g.token_ids[2] + 1) % gpt2.vocab_size]
    assert gpt2.loglikelihood(ctx, off)[1] is False
    # lm-eval's pair encoding: a trailing space of the context moves to the continuation.
    assert gpt2.loglikelihood(ctx + " ", cont.lstrip()) == (total, greedy)
    with pytest.raises(ValueError, match="context is empty"):
        gpt2.loglikelihood([], [5])


def test_seeded_sampling_equals_forge_generate(gpt2):
    prompt = "Once upon a time"
    out = forge_json("-m", FIXTURES / "tiny-gpt2", "-p", prompt, "-n", 20, "--temp", 0.9, "-s", 7, "--top-k", 40)
    c = gpt2.complete(prompt, max_tokens=20, temperature=0.9, seed=7, top_k=40)
    assert c.token_ids == out["generated_ids"]
    assert c.text == out["text"]


def test_stream_pieces_join_to_the_text_and_stop_strings_cut(gpt2):
    prompt = "Hello"
    full = gpt2.generate(prompt, max_tokens=30, temperature=0)
    pieces = list(gpt2.stream(prompt, max_tokens=30, temperature=0))
    assert len(pieces) > 1
    assert "".join(pieces) == full
    # A stop string inside the text cuts it there, streamed or not.
    stop = full[10:14]
    cut = full[: full.index(stop)]
    assert gpt2.generate(prompt, max_tokens=30, temperature=0, stop=stop) == cut
    assert "".join(gpt2.stream(prompt, max_tokens=30, temperature=0, stop=[stop])) == cut
    # Dropping a stream early stops it; the model goes on answering the same.
    s = gpt2.stream(prompt, max_tokens=100, temperature=0, ignore_eos=True)
    assert full.startswith(next(s))
    del s
    assert gpt2.generate(prompt, max_tokens=30, temperature=0) == full


def test_tokenize_detokenize_round_trip(gpt2):
    text = "Hello world, ünïcödé and 数字 123"
    ids = gpt2.tokenize(text)
    assert gpt2.detokenize(ids) == text
    code, out, err = forge("tokenize", "-m", FIXTURES / "tiny-gpt2", text)
    assert code == 0, err
    assert [int(x) for x in out.replace(",", " ").replace("[", " ").replace("]", " ").split()] == ids


def test_errors_carry_forges_messages(gpt2):
    long = " a" * 200  # 200 tokens; the model's context is 128
    code, _, err = forge("generate", "-m", FIXTURES / "tiny-gpt2", "-n", 4, "--temp", 0, "-p", long)
    assert code != 0
    cli_message = err.strip().splitlines()[-1].removeprefix("error: ")
    with pytest.raises(batch_forge.ForgeError) as e:
        gpt2.generate(long, max_tokens=4)
    assert str(e.value) == cli_message
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gpt2.generate([50257])
    with pytest.raises(ValueError, match="temperature"):
        gpt2.generate("x", temperature=-1)
    with pytest.raises(TypeError, match="temprature"):
        gpt2.generate("x", temprature=1)
    with pytest.raises(ValueError, match="backend"):
        batch_forge.Model(str(FIXTURES / "tiny-gpt2"), backend="tpu")
    with pytest.raises(batch_forge.ForgeError, match="no such file"):
        batch_forge.Model(str(FIXTURES / "missing.gguf"))
    with pytest.raises(batch_forge.ForgeError, match="no chat template"):
        gpt2.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="content"):
        gpt2.chat([{"role": "user"}])


def test_the_gil_is_released_while_computing():
    m = batch_forge.Model(str(FIXTURES / "tiny-gpt2"), backend="reference", threads=1)
    count = 0
    running = True

    def counter():
        nonlocal count
        while running:
            count += 1

    t = threading.Thread(target=counter)
    t.start()
    time.sleep(0.2)  # the counter alone: its rate
    start, before = time.perf_counter(), count
    time.sleep(0.2)
    rate = (count - before) / (time.perf_counter() - start)
    start, before = time.perf_counter(), count
    m.generate([50256], max_tokens=120, temperature=0, ignore_eos=True)
    elapsed = time.perf_counter() - start
    during = count - before
    running = False
    t.join()
    assert elapsed > 0.05, f"the generation took {elapsed:.3f} s: too short to tell"
    # Holding the GIL, the counter would stand still for the call but one switch
    # interval (5 ms); released, it counts at about its own rate.
    share = during / (rate * elapsed)
    assert share > 0.3, f"the counter ran {share:.0%} of its rate during the call ({elapsed:.3f} s)"


def test_threads_share_a_model(gpt2):
    # Two Python threads on one Model at once get what each gets alone.
    want = {p: gpt2.generate(p, max_tokens=20, temperature=0) for p in ["Hello", "The fox"]}
    got = {}

    def run(p):
        got[p] = gpt2.generate(p, max_tokens=20, temperature=0)

    threads = [threading.Thread(target=run, args=(p,)) for p in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_smollm2_chats():
    path = os.environ.get("BATCH_FORGE_SMOLLM2")
    if not path or not Path(path).is_file():
        msg = "BATCH_FORGE_SMOLLM2 is not set (.ci/run fetches SmolLM2-135M-Instruct Q4_1)"
        assert not IN_CI, msg
        pytest.skip(msg)
    m = batch_forge.Model(path, threads=2)
    assert m.architecture == "llama"
    reply = m.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=24, temperature=0)
    assert "Paris" in reply, reply
