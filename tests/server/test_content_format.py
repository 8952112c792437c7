"""``--chat-template-content-format auto`` (:mod:`mrv2.entrypoints.content_format`): the
chat template's parsed form picks ``openai`` content where it loops over a message's
content, as vLLM's detection does, else ``string``. The templates are small ones in the
style of real models' (their content handling kept, the rest cut)."""

from __future__ import annotations

import logging

import pytest

from mrv2.entrypoints.content_format import (
    detect_content_format,
    log_content_format,
    resolve_content_format,
    template_in_use,
)
from mrv2.entrypoints.serve_options import ServeOptions

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
          " + message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}")
QWEN2_VL = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\\n"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
            "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\\n{% endfor %}")
GEMMA3 = ("{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
          "{%- set first = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
          "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first = '' -%}"
          "{%- set loop_messages = messages -%}{%- endif -%}"
          "{%- for message in loop_messages -%}<start_of_turn>{{ message['role'] }}\\n"
          "{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}"
          "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}<end_of_turn>\\n"
          "{%- endfor -%}")
MISTRAL3 = ("{%- set ns = namespace(system='') %}{%- for message in messages | "
            "rejectattr('role', 'equalto', 'system') %}[INST]{%- for block in "
            "message.content | selectattr('type', 'equalto', 'text') %}{{ block.text }}"
            "{%- endfor %}[/INST]{%- endfor %}")
TOOL_CALLS_ONLY = ("{% for m in messages %}{{ m['content'] }}{% for call in m['tool_calls'] %}"
                   "{{ call['function']['name'] }}{% endfor %}{% endfor %}")


@pytest.mark.parametrize(("template", "expected"), [
    (CHATML, "string"),
    (LLAMA3, "string"),
    (TOOL_CALLS_ONLY, "string"),
    (QWEN2_VL, "openai"),
    (GEMMA3, "openai"),  # (its messages through a slice, set from messages)
    (MISTRAL3, "openai"),  # (filters and attribute access)
    # a chain of variables set from messages, the loop over a reversed one
    ("{% set a = messages %}{% set b = a[1:] %}{% for m in b | reverse %}"
     "{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    # transformers' {% generation %} block (assistant masks) parses, its body read
    ("{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p['text'] }}"
     "{% endfor %}{% endgeneration %}{% endfor %}", "openai"),
    # an item of the content, no loop over it: vLLM's detection reads loops only
    ("{% for m in messages %}{{ m['content'][0]['text'] }}{% endfor %}", "string"),
    # a loop over the content of what is not a message (documents)
    ("{% for d in documents %}{% for c in d['content'] %}{{ c }}{% endfor %}{% endfor %}"
     "{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    # the loop over a message's content outside a loop over messages
    ("{% for p in message['content'] %}{{ p }}{% endfor %}", "string"),
    ("{% for m in messages %}{{ m['content'] }", "string"),  # (does not parse: vLLM's default)
])
def test_detect_content_format(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected


def test_detection_is_cached_per_template() -> None:
    detect_content_format.cache_clear()
    for _ in range(3):
        assert detect_content_format(QWEN2_VL) == "openai"
        assert detect_content_format(CHATML) == "string"
    info = detect_content_format.cache_info()
    assert (info.misses, info.hits) == (2, 4)


def test_resolve_content_format() -> None:
    assert resolve_content_format("auto", QWEN2_VL) == "openai"
    assert resolve_content_format("auto", CHATML) == "string"
    assert resolve_content_format("auto", None) == "string"
    assert resolve_content_format("string", QWEN2_VL) == "string"  # (the flag wins)
    assert resolve_content_format("openai", CHATML) == "openai"


def test_template_in_use() -> None:
    named = {"default": CHATML, "tool_use": QWEN2_VL}
    assert template_in_use(named, tools=False) == CHATML
    assert template_in_use(named, tools=True) == QWEN2_VL
    assert template_in_use({"default": CHATML}, tools=True) == CHATML
    assert template_in_use(CHATML, tools=True) == CHATML
    assert template_in_use("", tools=False) is None


def test_content_parts_under_auto() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    contents = ["be brief", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]]
    auto = ServeOptions()
    assert auto.content_parts(messages, contents, QWEN2_VL) == [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]}]
    assert auto.content_parts(messages, contents, CHATML) == messages
    assert auto.content_parts(messages, contents, None) == messages
    assert ServeOptions(chat_template_content_format="string").content_parts(
        messages, contents, QWEN2_VL) == messages


def test_log_content_format(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="mrv2.entrypoints.content_format"):
        log_content_format(QWEN2_VL)
        log_content_format({"default": CHATML, "tool_use": QWEN2_VL})
        log_content_format(None)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "detected: 'openai'" in lines[0]
    assert "'string' for 'default', 'openai' for 'tool_use'" in lines[1]
