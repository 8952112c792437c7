"""``--reasoning-parser``: ``<think>...</think>`` as ``reasoning_content``, whole outputs and
streams cut anywhere (tags split across deltas), both conventions; the server's chat
answers, streamed or not."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, Served

from mrv2.entrypoints.reasoning import (
    ReasoningStream,
    check_reasoning_parser,
    prompt_reasoning,
    split_reasoning,
)
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}

CASES = [  # (text, qwen3's (reasoning, content), deepseek_r1's)
    ("<think>\nplan it\n</think>\n\nThe answer.", ("\nplan it\n", "\n\nThe answer."),
     ("\nplan it\n", "\n\nThe answer.")),
    ("  <think>a</think>b", ("a", "b"), ("a", "b")),
    ("The answer, no thinking.", (None, "The answer, no thinking."),
     ("The answer, no thinking.", None)),
    ("still thinking when cut", (None, "still thinking when cut"),
     ("still thinking when cut", None)),
    ("<think>cut while thinking", ("cut while thinking", None), ("cut while thinking", None)),
    ("plan</think>answer", (None, "plan</think>answer"), ("plan", "answer")),
    ("<think></think>x < y and </thin k>", (None, "x < y and </thin k>"),
     (None, "x < y and </thin k>")),
    ("<thinking>not a tag", (None, "<thinking>not a tag"), ("<thinking>not a tag", None)),
    ("", (None, None), (None, None)),
]


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
def test_whole_outputs(kind: str) -> None:
    for text, qwen3, r1 in CASES:
        assert split_reasoning(kind, text) == (qwen3 if kind == "qwen3" else r1), text


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
def test_a_stream_cut_anywhere_gives_the_whole_outputs_split(kind: str) -> None:
    rng = random.Random(0)
    for text, *_ in CASES:
        want = split_reasoning(kind, text)
        for _ in range(40):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
            deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream = ReasoningStream(kind)
            parts = [stream.feed(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]
            reasoning = "".join(r for r, _ in parts)
            content = "".join(c for _, c in parts)
            assert (reasoning or None, content or None) == want, (text, deltas)
            assert all("<think>" not in r + c and "</think>" not in r + c for r, c in parts) \
                or "</think>" in (want[1] or "")


def test_the_parser_name_is_checked() -> None:
    assert check_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="reasoning_parser='r1': allowed values are qwen3, "
                                         "deepseek_r1"):
        check_reasoning_parser("r1")


def test_the_server_splits_chat_answers(model_dir: Path) -> None:
    """The tiny model's greedy answer stands in for the model's text: the server's chat
    answer, streamed and not, is ``split_reasoning`` of it (deepseek_r1: no ``</think>`` in
    a random model's text, so all of it is reasoning); completions are untouched."""
    from conftest import serve

    body = {"messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    for served in serve(model_dir, reasoning_parser="deepseek_r1"):
        plain = _chat(served, body)["choices"][0]["message"]
        assert plain["content"] is None and plain["reasoning_content"]
        streamed = _streamed(served, body)
        assert streamed == (plain["reasoning_content"], "")
        completion = httpx.post(f"{served.url}/v1/completions", headers=AUTH, timeout=60,
                                json={"prompt": "Hello", "max_tokens": 3}).json()
        assert "reasoning_content" not in completion["choices"][0]
    for served in serve(model_dir):  # no parser: the same text is the content
        message = _chat(served, body)["choices"][0]["message"]
        assert message["content"] == plain["reasoning_content"]
        assert "reasoning_content" not in message


def _chat(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                          json=body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _streamed(served: Served, body: dict[str, Any]) -> tuple[str, str]:
    reasoning = content = ""
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    reasoning += choice["delta"].get("reasoning_content") or ""
                    content += choice["delta"].get("content") or ""
    return reasoning, content


def test_qwen3_answers_a_prompt_that_opened_the_block_from_its_reasoning(
        tmp_path: Path) -> None:
    """``qwen3`` with a template that opens ``<think>`` in the prompt (Qwen3's thinking
    models): the answer is reasoning up to ``</think>`` and content after it, whole and
    streamed, as the engine holds a structured output (after ``</think>``, biased to come
    first here); an answer with no ``</think>`` yet is all reasoning."""
    from conftest import serve

    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path, special_tokens=["<think>", "</think>"], chat_template=(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "<|assistant|><think>"))
    for served in serve(path, reasoning_parser="qwen3"):
        tokenizer = served.engine.tokenizer
        assert tokenizer is not None
        start, end = (tokenizer.encode(t, False)[0] for t in ("<think>", "</think>"))
        encode = functools.partial(tokenizer.encode, add_special_tokens=False)
        assert prompt_reasoning("qwen3", [5, start, 6], encode) == "deepseek_r1"
        assert prompt_reasoning("qwen3", [start, 6, end, 7], encode) == "qwen3"
        assert prompt_reasoning("deepseek_r1", [5], encode) == "deepseek_r1"
        body = {"messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 20,
                "temperature": 0, "skip_special_tokens": False,
                "guided_choice": ["Paris", "London"], "logit_bias": {str(end): 100}}
        message = _chat(served, body)["choices"][0]["message"]
        assert message["content"] in ("Paris", "London") and not message["reasoning_content"]
        assert _streamed(served, body) == ("", message["content"])
        body = {**body, "max_tokens": 6, "ignore_eos": True, "logit_bias": {str(end): -100}}
        del body["guided_choice"]
        message = _chat(served, body)["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"]
        assert _streamed(served, body) == (message["reasoning_content"], "")
        # beam search's answers are read alike (their content was the whole reasoning)
        beams = {"messages": body["messages"], "max_tokens": 6, "ignore_eos": True,
                 "use_beam_search": True, "n": 2}
        for choice in _chat(served, beams)["choices"]:
            assert choice["message"]["content"] is None
            assert choice["message"]["reasoning_content"]
