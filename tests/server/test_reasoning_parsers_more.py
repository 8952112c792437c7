"""The reasoning parsers of Kimi-K2 (``kimi_k2``: a tool-call section ends the thinking too),
Olmo 3 (``olmo3``), Step3 / Step-3.5 (``step3``, ``step3p5``: the newlines around
``</think>``), Hunyuan-A13B (``hunyuan_a13b``: ``<think>`` / ``<answer>``) and MiMo
(``mimo``), vLLM's names and rules: whole outputs (reasoning, none, cut off) and the same
outputs streamed cut anywhere; the template switch, what a structured output is marked with,
the CLI's names, and one behind the server's chat route."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from server_util import spy_add_request
from test_reasoning import _chat, _streamed

from mrv2.entrypoints.reasoning import (
    IDENTITY,
    ReasoningStream,
    check_reasoning_parser,
    grammar_mark,
    keeps_special_tokens,
    prompt_reasoning,
    request_parser,
    split_reasoning,
    structured_refusal,
)
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

SECTION = "<|tool_calls_section_begin|>"
NEW = ("kimi_k2", "olmo3", "step3", "step3p5", "hunyuan_a13b", "mimo")

#: parser -> [(output, (reasoning, content))]
CASES: dict[str, list[tuple[str, tuple[str | None, str | None]]]] = {
    "kimi_k2": [
        ("<think>plan</think>answer", ("plan", "answer")),
        ("plan</think>answer", ("plan", "answer")),
        ("cut while thinking", ("cut while thinking", None)),
        (f"plan{SECTION}<|tool_call_begin|>x", ("plan", f"{SECTION}<|tool_call_begin|>x")),
        (f"plan</think>text{SECTION}y", ("plan", f"text{SECTION}y")),
        (f"a{SECTION}b</think>c", ("a", f"{SECTION}b</think>c")),
        (SECTION, (None, SECTION)),
        ("<|tool_calls_section", ("<|tool_calls_section", None)),
        ("", (None, None)),
    ],
    "olmo3": [
        ("<think>plan</think>answer", ("plan", "answer")),
        ("plan</think>answer", ("plan", "answer")),
        ("cut while thinking", ("cut while thinking", None)),
        ("a</think>b</think>c", ("a", "b</think>c")),
        ("", (None, None)),
    ],
    "step3": [
        ("plan</think>answer", ("plan", "answer")),
        ("<think>plan</think>answer", ("<think>plan", "answer")),
        ("cut while thinking", ("cut while thinking", None)),
        ("</think>only the answer", (None, "only the answer")),
        ("", (None, None)),
    ],
    "step3p5": [
        ("<think>\nplan\n</think>\nanswer", ("\nplan", "answer")),
        ("plan\n\n</think>\n\nanswer", ("plan\n", "\nanswer")),
        ("plan</think>answer", ("plan", "answer")),
        ("cut while thinking\n", ("cut while thinking", None)),
        ("a\nb", ("a\nb", None)),
        ("a\n</think>\n", ("a", None)),
        ("\n</think>\n", (None, None)),
        ("", (None, None)),
    ],
    "hunyuan_a13b": [
        ("<think>\nplan\n</think>\n<answer>\nanswer\n</answer>", ("plan", "answer")),
        ("<think>\n\n</think>\n<answer>\nanswer\n</answer>", (None, "answer")),
        ("<think>\nplan\n</think>\n<answer>\ncut in the answer", ("plan", "cut in the answer")),
        ("<think>\ncut while thinking", ("cut while thinking", None)),
        ("<think>\nplan</think>\n<answer>\nx\n</answer>", ("plan", "x")),
        ("  <think>\na\n</think>\n<answer>\nb\n</answer>\nafter", ("a", "b")),
        ("no thinking\n</answer>dropped", (None, "no thinking")),
        ("plain answer", (None, "plain answer")),
        ("<think>plan</think>x", (None, "<think>plan</think>x")),
        ("<think>\na\n</think>\nb", ("a\n</think>\nb", None)),
        ("x\n</answ", (None, "x\n</answ")),
        ("", (None, None)),
    ],
    "mimo": [
        ("<think>plan</think>answer", ("plan", "answer")),
        ("just the answer", (None, "just the answer")),
        ("", (None, None)),
    ],
}
PAIRS = [(kind, text, want) for kind, cases in CASES.items() for text, want in cases]


@pytest.mark.parametrize(("kind", "text", "want"), PAIRS)
def test_whole_outputs(kind: str, text: str, want: tuple[str | None, str | None]) -> None:
    assert split_reasoning(kind, text) == want


@pytest.mark.parametrize(("kind", "text", "want"), PAIRS)
def test_a_stream_cut_anywhere_gives_the_whole_outputs_split(
        kind: str, text: str, want: tuple[str | None, str | None]) -> None:
    """A character at a time, in two pieces cut at every place, and in random cuts (empty
    deltas included): the same split, and no tag reaches the client where the whole
    output's parts hold none."""
    rng = random.Random(hash((kind, text)) % 1000)
    splits = [list(text) or [""]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(30):
        cuts = sorted(rng.choices(range(len(text) + 1), k=5))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    tags = ["<think>", "</think>", "<answer>", "</answer>", SECTION]
    hidden = [t for t in tags if t not in "".join(p or "" for p in want)]
    for deltas in splits:
        stream = ReasoningStream(kind)
        parts = [stream.feed(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]
        got = ("".join(r for r, _ in parts) or None), ("".join(c for _, c in parts) or None)
        assert got == want, deltas
        assert not any(t in r + c for t in hidden for r, c in parts), (deltas, parts)


def test_a_stream_sends_what_cannot_be_a_tag_at_once() -> None:
    """Only what may begin a marker waits: Step-3.5's newline before ``</think>``,
    Hunyuan's before ``</answer>``."""
    step = ReasoningStream("step3p5")
    assert step.feed("<think>pla") == ("pla", "")
    assert step.feed("n\n") == ("n", "")
    assert step.feed("more\n</think>") == ("\nmore", "")
    assert step.feed("\nok") == ("", "ok")
    hunyuan = ReasoningStream("hunyuan_a13b")
    assert hunyuan.feed("<think>") == ("", "")
    assert hunyuan.feed("\nhm\n</think>\n<answer>\nHi\n") == ("hm", "Hi")
    assert hunyuan.feed("</answer>\nmore", final=True) == ("", "")
    kimi = ReasoningStream("kimi_k2")
    assert kimi.feed("plan<|tool_calls") == ("plan", "")
    assert kimi.feed("_section_begin|>x") == ("", f"{SECTION}x")


@pytest.mark.parametrize(("kwargs", "want"), [
    (None, "kimi_k2"),
    ({"thinking": True}, "kimi_k2"),
    ({"thinking": False}, IDENTITY),
    ({"thinking": None}, IDENTITY),  # (vLLM's bool(get("thinking", True)))
    ({"enable_thinking": False}, "kimi_k2"),
])
def test_kimi_k2s_thinking_switch(kwargs: dict[str, Any] | None, want: str) -> None:
    assert request_parser("kimi_k2", kwargs) == want


def test_marks_and_prompts() -> None:
    """Structured outputs: the ``<think>`` parsers as DeepSeek-R1's (MiMo as Qwen3's;
    Step-3.5 its own, a newline free after ``</think>``); Hunyuan's its own (its plain-text
    answer tag); none keeps special tokens or is refused. MiMo's answer to a prompt
    that opened the block opens in its reasoning, as Qwen3's."""
    marks = {"kimi_k2": "deepseek_r1", "olmo3": "deepseek_r1", "step3": "deepseek_r1",
             "step3p5": "step3p5", "mimo": "qwen3", "hunyuan_a13b": "hunyuan_a13b"}
    for kind, mark in marks.items():
        assert grammar_mark(kind) == mark, kind
        assert not keeps_special_tokens(kind)
        assert structured_refusal(kind, {"thinking": True}) is None
    assert grammar_mark(request_parser("kimi_k2", {"thinking": False})) is None
    ids = {"<think>": [7], "</think>": [8]}

    def encode(text: str) -> list[int]:
        return ids[text]

    assert prompt_reasoning("mimo", [1, 7], encode) == "deepseek_r1"
    assert prompt_reasoning("mimo", [1, 7, 8], encode) == "mimo"
    assert split_reasoning("hunyuan_a13b", '{"a": 1}') == (None, '{"a": 1}')


def test_the_names() -> None:
    from mrv2.entrypoints.cli import build_parser

    for name in NEW:
        assert check_reasoning_parser(name) == name
        args = build_parser().parse_args(["serve", "m", "--reasoning-parser", name])
        assert args.reasoning_parser == name


@pytest.mark.parametrize(("kind", "deltas"), [
    ("kimi_k2", ["<think>", "hm", "</think>", "Hi"]),
    ("step3p5", ["hm", "\n</think>", "\n", "Hi"]),
    ("hunyuan_a13b", ["<think>\n", "hm", "\n</think>\n<answer>\n", "Hi", "\n</answer>"]),
])
def test_the_responses_api_counts_the_reasoning_tokens(kind: str, deltas: list[str]) -> None:
    """The Responses API's split reads each parser's stream: the block's tokens, its markers
    included, are reasoning; the answer's are not."""
    from mrv2.entrypoints.responses_output import AnswerSplit

    split = AnswerSplit(kind, None, True, None)
    runs = []
    for i, text in enumerate(deltas):
        runs += split.feed(text, [i], None, i == len(deltas) - 1)[0]
    assert runs == [("reasoning", "hm"), ("content", "Hi")]
    assert split.reasoning_tokens == deltas.index("hm") + 2


def test_the_server_reads_kimi_k2s_switch(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind the server's chat route: ``kimi_k2`` reads an answer as reasoning (a random
    model writes no ``</think>``), streamed and not, its structured output marked as R1's;
    with ``chat_template_kwargs`` ``thinking: false`` the answer is content, unmarked."""
    from conftest import serve

    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path, special_tokens=["<think>", "</think>"])
    seen: list[str | None] = []


    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hello world!"}],
                            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    off = {"chat_template_kwargs": {"thinking": False}}
    choice = {"guided_choice": ["Paris", "London"]}
    for served in serve(path, reasoning_parser="kimi_k2"):
        spy_add_request(monkeypatch, served.engine, lambda p: seen.append(p._reasoning))
        thought = _chat(served, body)["choices"][0]["message"]
        assert thought["reasoning_content"] and thought["content"] is None
        plain = _chat(served, {**body, **off})["choices"][0]["message"]
        assert plain["reasoning_content"] is None
        assert plain["content"] == thought["reasoning_content"]
        assert _streamed(served, body) == (plain["content"], "")
        assert _streamed(served, {**body, **off}) == ("", plain["content"])
        seen.clear()
        for extra, mark in (({}, "deepseek_r1"), (off, None)):
            _chat(served, {**body, **choice, **extra})
            assert seen.pop() == mark
