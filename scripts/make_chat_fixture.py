#!/usr/bin/env python3
"""Chat-template cases rendered by HF transformers' `apply_chat_template`, for tests/chat.rs.

  python3 scripts/make_chat_fixture.py SmolLM2-135M-Instruct.Q4_1.gguf [--out tests/fixtures/chat/cases.json]

The tokenizer (and its BOS/EOS tokens) is the one transformers builds from the SmolLM2
GGUF. Templates: SmolLM2's own (`tokenizer.chat_template`, read from the GGUF) and four
written here to exercise what real templates use: `bos_token`/`eos_token`, `trim`,
Python string methods (`.strip()`), `raise_exception`, `loop.index0`/`loop.last`,
`namespace`, loop filters, `tojson`, and trim_blocks/lstrip_blocks whitespace control.

Each case: template name, messages, add_generation_prompt, and either HF's `text` and
`ids` (the rendered text tokenized without adding special tokens, as HF does) or
`error` (HF raised). Needs: transformers, gguf, torch.
"""

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

TEMPLATES = {
    "llama3-style": (
        "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "alternating": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'].strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    "multiline": (
        "{% for message in messages %}\n"
        "{% if message['role'] == 'user' %}\n"
        "{{ '<|user|>\\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'system' %}\n"
        "{{ '<|system|>\\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'assistant' %}\n"
        "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n"
        "{% endif %}\n"
        "{% if loop.last and add_generation_prompt %}\n"
        "{{ '<|assistant|>' }}\n"
        "{% endif %}\n"
        "{% endfor %}"
    ),
    "namespace-tojson": (
        "{%- set ns = namespace(system='') -%}"
        "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endif -%}{%- endfor -%}"
        "{%- if ns.system -%}<<SYS>>{{ ns.system }}<</SYS>>{{ '\\n' }}{%- endif -%}"
        "{%- for m in messages if m.role != 'system' -%}"
        "[{{ loop.index }}] {{ m.role | upper }}: {{ m.content | tojson }}{{ '\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}ASSISTANT:{%- endif -%}"
    ),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [{"role": "user", "content": "Café 東京 🚀 naïve\n\ttabs and \"quotes\" and <tags> & 'apostrophes'"}],
    [{"role": "user", "content": "  padded  \n"}, {"role": "assistant", "content": "\n ok \n"}],
    [{"role": "user", "content": ""}],
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/fixtures/chat/cases.json")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    templates = {"smollm2": tok.chat_template, **TEMPLATES}
    cases = []
    for name, template in templates.items():
        for messages in CONVERSATIONS:
            for gen in (True, False):
                case = {"template": name, "messages": messages, "add_generation_prompt": gen}
                try:
                    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                   add_generation_prompt=gen)
                    case["text"] = text
                    case["ids"] = tok.encode(text, add_special_tokens=False)
                except Exception as e:  # the template raised (raise_exception)
                    case["error"] = str(e)
                cases.append(case)
    out = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "templates": templates, "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(cases)} cases, {sum('error' in c for c in cases)} errors")


if __name__ == "__main__":
    main()
