"""Drive `forge serve` with the official `openai` Python package (run by tests/serve.rs).

    python tests/openai_client.py BASE_URL API_KEY

The server must run a model with a chat template. Exits non-zero on the first failed check.
"""

import sys

import openai
from openai import OpenAI

base, key = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
model = client.models.list().data[0].id

# Completions: whole, with logprobs.
c = client.completions.create(model=model, prompt="Hello world", max_tokens=12, temperature=0, logprobs=2,
                              extra_body={"ignore_eos": True})
choice = c.choices[0]
assert choice.finish_reason == "length", choice
assert len(choice.logprobs.tokens) == 12 and len(choice.logprobs.top_logprobs) == 12, choice.logprobs
assert all(lp <= 0 for lp in choice.logprobs.token_logprobs), choice.logprobs
assert c.usage.completion_tokens == 12 and c.usage.prompt_tokens > 0, c.usage
text = choice.text

# Prompt scoring (lm-eval-harness's loglikelihood request): echo + logprobs + max_tokens 0.
sc = client.completions.create(model=model, prompt="Hello world" + text, max_tokens=0, echo=True, logprobs=1)
lp = sc.choices[0].logprobs
assert sc.choices[0].text == "Hello world" + text and sc.usage.completion_tokens == 0, sc
assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:]), lp
assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == sc.usage.prompt_tokens, lp
assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:]), lp

# Streamed: the same text, usage last.
chunks = list(client.completions.create(model=model, prompt="Hello world", max_tokens=12, temperature=0,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True}))
assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

# A stop string split across tokens 2 and 3 (never emitted, finish_reason "stop").
toks = choice.logprobs.tokens
a, b = toks[1], toks[2]
stop = a[-2:] + b[:2]
cut = len(toks[0]) + len(a) - len(a[-2:])
assert len(stop) >= 2 and stop not in text[:cut], ("pick another stop", toks, stop)
for stream in (False, True):
    r = client.completions.create(model=model, prompt="Hello world", max_tokens=12, temperature=0,
                                  stop=["zzzz", stop], stream=stream, extra_body={"ignore_eos": True})
    if stream:
        parts = list(r)
        got = "".join(p.choices[0].text for p in parts if p.choices)
        reason = [p.choices[0].finish_reason for p in parts if p.choices][-1]
    else:
        got, reason = r.choices[0].text, r.choices[0].finish_reason
    assert got == text[:cut], (stream, got, text[:cut], stop)
    assert reason == "stop", reason

# Chat: whole and streamed agree; logprobs in the chat shape.
messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? 東京"}]
r = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                   top_logprobs=2, extra_body={"ignore_eos": True})
msg = r.choices[0].message
assert msg.role == "assistant"
assert len(r.choices[0].logprobs.content) == 10
assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
s = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == msg.content

# Seeded sampling repeats.
kw = dict(model=model, prompt="Once", max_tokens=16, temperature=0.9, seed=1234, extra_body={"ignore_eos": True})
assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text

# Errors arrive as the package's exception types.
for bad in [dict(max_tokens=-1), dict(temperature=-1.0), dict(top_p=2.0), dict(n=3), dict(logprobs=99)]:
    try:
        client.completions.create(model=model, prompt="x", **bad)
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body and e.body.get("message"), e.body
    else:
        raise AssertionError(f"{bad} was accepted")
try:
    OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
except openai.AuthenticationError:
    pass
else:
    raise AssertionError("a wrong key was accepted")
try:
    client.chat.completions.create(model=model, messages=[], max_tokens=2)
except openai.BadRequestError:
    pass
else:
    raise AssertionError("empty messages were accepted")

# Structured output: response_format json_schema (strict) and json_object give JSON that
# parses and validates, whole and streamed; a schema that cannot be enforced is a 400.
import json

schema = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "done": {"type": "boolean"},
    },
    "required": ["color", "count", "done"],
    "additionalProperties": False,
}
fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
for temperature in (0, 1.0):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=temperature,
                                       seed=7, response_format=fmt)
    v = json.loads(r.choices[0].message.content)
    assert set(v) == {"color", "count", "done"} and v["color"] in ("red", "green", "blue"), v
    assert isinstance(v["count"], int) and 1 <= v["count"] <= 9 and isinstance(v["done"], bool), v
    assert r.choices[0].finish_reason == "stop", r.choices[0]
s = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0, stream=True,
                                   response_format=fmt)
streamed = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
assert json.loads(streamed) == json.loads(
    client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                   response_format=fmt).choices[0].message.content), streamed
r = client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                   response_format={"type": "json_object"})
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
else:
    assert r.choices[0].message.content.startswith("{"), r.choices[0].message.content
try:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    client.chat.completions.create(model=model, messages=messages, max_tokens=8, response_format=bad)
except openai.BadRequestError as e:
    assert "uniqueItems" in e.body.get("message", ""), e.body
else:
    raise AssertionError("an unenforceable schema was accepted")
print("openai client: all checks passed")
