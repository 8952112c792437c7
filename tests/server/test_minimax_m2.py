"""MiniMax-M2 behind the server, text only: ``--reasoning-parser minimax_m2`` (the prompt opens
the ``<think>`` block: reasoning up to ``</think>``, a repeated ``</think>`` dropped from the
content) and ``minimax_m2_append_think`` (no split: ``<think>`` put back before the output, all
of it content), whole outputs and streams split at every place, as vLLM's parsers; what a
structured output is marked with for the engine; the CLI's names; and a chat choice through
both parsers, streamed a character at a time and not (``--tool-call-parser minimax_m2``'s own
cases: test_tool_parsers.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_util import join_tool_calls

from mrv2.contract.params import SamplingParams
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.entrypoints.reasoning import (
    REASONING_PARSERS,
    ReasoningStream,
    check_reasoning_parser,
    grammar_mark,
    split_reasoning,
)
from mrv2.entrypoints.responses import Stream
from mrv2.entrypoints.tool_calls import ToolCalling, get_tool_parser

#: (output, minimax_m2's (reasoning, content)); vLLM's cases for its parser, and more.
MINIMAX = [
    ("This is a reasoning section</think>This is the rest",
     ("This is a reasoning section", "This is the rest")),
    ("This is a reasoning section</think>", ("This is a reasoning section", None)),
    ("This is reasoning in progress", ("This is reasoning in progress", None)),
    ("First line\nSecond line</think>Response first line\nResponse second",
     ("First line\nSecond line", "Response first line\nResponse second")),
    ("</think>This is the response", (None, "This is the response")),
    ("", (None, None)),
    ("```python\nprint('hello')\n```</think>Here is the code.",
     ("```python\nprint('hello')\n```", "Here is the code.")),
    ("reasoning</think>content A</think>content B", ("reasoning", "content Acontent B")),
    ("\nplan\n</think>\n\nx </thin k> and </think", ("\nplan\n", "\n\nx </thin k> and </think")),
    ("<think>\nplan</think>ok", ("\nplan", "ok")),  # a leading <think> is dropped
    ("plan</think>a</think></think>b</thi", ("plan", "ab</thi")),
]


def _split_at_every_place(text: str) -> list[list[str]]:
    """``text`` a character at a time, and in two pieces cut at every place."""
    return [list(text) or [""]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]


def _streamed(kind: str, deltas: list[str]) -> tuple[str | None, str | None]:
    stream = ReasoningStream(kind)
    parts = [stream.feed(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]
    return ("".join(r for r, _ in parts) or None), ("".join(c for _, c in parts) or None)


@pytest.mark.parametrize(("text", "want"), MINIMAX)
def test_minimax_m2_splits_at_the_end_of_thinking(text: str, want: tuple[str | None, ...]
                                                  ) -> None:
    assert split_reasoning("minimax_m2", text) == want
    for deltas in _split_at_every_place(text):
        assert _streamed("minimax_m2", deltas) == want, deltas


@pytest.mark.parametrize(("text", "_"), MINIMAX)
def test_minimax_m2_append_think_keeps_the_block_in_the_content(text: str, _: Any) -> None:
    """vLLM's ``minimax_m2_append_think``: no reasoning; the content is ``<think>`` and the
    output as it came (an empty output too: ``<think>``)."""
    want = (None, "<think>" + text)
    assert split_reasoning("minimax_m2_append_think", text) == want
    for deltas in _split_at_every_place(text):
        assert _streamed("minimax_m2_append_think", deltas) == want, deltas


def test_a_stream_holds_only_what_may_be_a_tag() -> None:
    stream = ReasoningStream("minimax_m2")
    assert stream.feed("plan</th") == ("plan", "")
    assert stream.feed("ink>ok </") == ("", "ok ")
    assert stream.feed("think>x") == ("", "x")
    assert stream.feed("</th", final=True) == ("", "</th")
    append = ReasoningStream("minimax_m2_append_think")
    assert append.feed("") == ("", "<think>")  # the first delta, even an empty one
    assert append.feed("plan</th") == ("", "plan</th")


def test_the_names_and_what_a_structured_output_is_marked_with() -> None:
    """Both MiniMax parsers end the thinking at ``</think>`` with the block opened by the
    prompt, as vLLM's do (DeepSeek-R1's convention for the engine's grammar); the other
    parsers keep their own mark; no parser, no mark."""
    for name in ("minimax_m2", "minimax_m2_append_think"):
        assert name in REASONING_PARSERS and check_reasoning_parser(name) == name
        assert grammar_mark(name) == "deepseek_r1"
    assert [grammar_mark(k) for k in ("qwen3", "deepseek_r1", "openai_gptoss", None)] == [
        "qwen3", "deepseek_r1", "openai_gptoss", None]
    with pytest.raises(ValueError, match="reasoning_parser='minimax': allowed values are "
                                         ".*minimax_m2, minimax_m2_append_think"):
        check_reasoning_parser("minimax")
    with pytest.raises(ValueError, match="tool_call_parser='minimax': allowed values are "
                                         ".*glm47, minimax_m2, deepseek_v3"):
        get_tool_parser("minimax")
    assert not get_tool_parser("minimax_m2").special_tokens  # plain text in its tokenizer


def test_the_cli_takes_the_names(capsys: pytest.CaptureFixture[str]) -> None:
    from mrv2.entrypoints.cli import build_parser

    for reasoning in ("minimax_m2", "minimax_m2_append_think"):
        args = build_parser().parse_args(["serve", "m", "--reasoning-parser", reasoning,
                                          "--enable-auto-tool-choice", "--tool-call-parser",
                                          "minimax_m2"])
        assert (args.reasoning_parser, args.tool_call_parser) == (reasoning, "minimax_m2")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--tool-call-parser", "minimax"])
    assert "argument --tool-call-parser: invalid choice: 'minimax'" in capsys.readouterr().err
    # (a reasoning parser's name is checked once a --reasoning-parser-plugin file is loaded)
    with pytest.raises(ValueError, match="reasoning_parser='minimax': allowed values are"):
        check_reasoning_parser("minimax")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
ANSWER = ("The user wants the weather.\n</think>\n\nChecking.\n<minimax:tool_call>\n"
          '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
          '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_weather">\n'
          '<parameter name="city">Lyon</parameter>\n</invoke>\n</minimax:tool_call>')
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Lyon"})]
#: --reasoning-parser -> the message's (reasoning_content, content)
MESSAGES = {"minimax_m2": ("The user wants the weather.\n", "\n\nChecking.\n"),
            "minimax_m2_append_think": (None, "<think>The user wants the weather.\n</think>"
                                              "\n\nChecking.\n")}


class _Body:
    include_usage = False
    continuous_usage = False


def _stream(reasoning: str) -> Stream:
    return Stream(None, "chatcmpl-x", "m", True, SamplingParams(max_tokens=99),  # type: ignore[arg-type]
                  _Body(), ["r"], [([1], None)], reasoning,
                  ToolCalling(get_tool_parser("minimax_m2"), TOOLS))


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("reasoning", sorted(MESSAGES))
def test_a_chat_choice_through_both_parsers(reasoning: str) -> None:
    """The reasoning parser splits the answer, the tool-call parser reads what it left as
    content: the same message whole and streamed a character (a token) at a time, each call
    sent by pieces (its name, then a parameter at a time, the end with its invoke), finishing
    with ``tool_calls``."""
    choice: dict[str, Any] = {"finish_reason": "stop"}
    message = _stream(reasoning)._parsed_message(ANSWER, choice)
    thought, content = MESSAGES[reasoning]
    assert (message.get("reasoning_content"), message["content"]) == (thought, content)
    assert _calls(message["tool_calls"]) == CALLS and choice["finish_reason"] == "tool_calls"
    stream, got = _stream(reasoning), {"reasoning_content": "", "content": ""}
    entries: list[dict[str, Any]] = []
    for i, char in enumerate(ANSWER):
        final = i == len(ANSWER) - 1
        out = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], finished=final,
                            outputs=[CompletionOutput(0, char, [i], "stop" if final else None)],
                            delta=True)
        for chunk, _ in stream._deltas(out):
            delta = chunk["delta"]
            got["reasoning_content"] += delta.get("reasoning_content", "")
            got["content"] += delta["content"]
            assert "<minimax" not in delta["content"]
            if delta.get("tool_calls"):  # (with a tag's end: the head's, a parameter's...)
                assert ANSWER[:i + 1].endswith(('">', "</parameter>", "</invoke>"))
            entries += delta.get("tool_calls", [])
            assert chunk["finish_reason"] == ("tool_calls" if final else None)
    assert (got["reasoning_content"] or None, got["content"], _calls(join_tool_calls(
        entries))) == (thought, content, CALLS)
    assert len(entries) == 2 * len(CALLS) + sum(len(args) for _, args in CALLS)
