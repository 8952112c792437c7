"""Numbers JSON has not in a tool call's arguments: ``NaN``, ``Infinity`` and ``-Infinity``
(Python's json reads them) and numbers no float holds (``1e999``), which json writes back as
``NaN`` / ``Infinity``, text a client's ``JSON.parse`` refuses. Every format that reads its
arguments as JSON takes such a call as malformed (the whole answer is content; ``openai``'s
call is dropped), forced calls too; a stream never sends such a number (what of the call went
out before it stands, and the choice does not finish with ``tool_calls``); big and tiny finite
numbers still make calls, streamed as the whole answer writes them."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from server_util import join_tool_calls

from mrv2.entrypoints.json_stream import JsonStream
from mrv2.entrypoints.tool_calls import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_SEP,
    ToolParser,
    forced_tool_choice,
    get_tool_parser,
)
from mrv2.entrypoints.tool_parsers_more import KIMI_ARGUMENTS, KIMI_CALL, KIMI_CALL_END
from mrv2.entrypoints.tool_stream import ToolCallStream

TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
NAMED, _ = forced_tool_choice({"type": "function", "function": {"name": "now"}}, TOOLS)
REQUIRED, _ = forced_tool_choice("required", TOOLS)

#: parser -> an answer that calls ``now`` with the given arguments text.
FORMATS: dict[str, tuple[str | ToolParser, Callable[[str], str]]] = {
    "hermes": ("hermes", lambda a: f'Hm.<tool_call>\n{{"name": "now", "arguments": {a}}}\n'
                                   "</tool_call>"),
    "llama3_json": ("llama3_json", lambda a: f'{{"name": "now", "parameters": {a}}}'),
    "mistral": ("mistral", lambda a: f"Hm.[TOOL_CALLS]now[ARGS]{a}"),
    "mistral list": ("mistral", lambda a: f'[TOOL_CALLS][{{"name": "now", "arguments": {a}}}]'),
    "deepseek_v3": ("deepseek_v3", lambda a: f"Hm.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function"
                                             f"{DS_SEP}now\n```json\n{a}\n```{DS_CALL_END}"),
    "deepseek_v31": ("deepseek_v31", lambda a: f"Hm.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}now{DS_SEP}"
                                               f"{a}{DS_CALL_END}"),
    "kimi_k2": ("kimi_k2", lambda a: f"Hm.<|tool_calls_section_begin|>{KIMI_CALL}functions.now:0"
                                     f"{KIMI_ARGUMENTS}{a}{KIMI_CALL_END}"),
    "openai": ("openai", lambda a: "<|start|>assistant<|channel|>commentary to=functions.now "
                                   f"<|constrain|>json<|message|>{a}<|call|>"),
    "named": (NAMED, lambda a: a),
    "required": (REQUIRED, lambda a: f'[{{"name": "now", "parameters": {a}}}]'),
}
#: Arguments with a number JSON has not (somewhere: nested, after good members).
BAD = ['{"x": NaN}', '{"x": Infinity}', '{"x": -Infinity}', '{"x": 1e999}', '{"x": -1E400}',
       '{"a": 1, "x": [1, {"y": 2.5e309}]}', '{"a": "NaN", "x": NaN}']
#: Arguments whose numbers are finite (the biggest float, one that underflows to 0.0).
GOOD = '{"big": 1.7976931348623157e308, "tiny": 1e-400, "n": -0.0, "s": "Infinity"}'


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _strict(text: str) -> Any:
    """``text`` as JSON as a client reads it (ValueError: NaN, Infinity)."""
    return json.loads(text, parse_constant=_no_constant)


def _stream(parser: str | ToolParser, deltas: list[str]
            ) -> tuple[str, list[dict[str, Any]], ToolCallStream]:
    """What a stream sent (content, the pieces' chat entries) of ``deltas``, and the stream."""
    stream, said, entries = ToolCallStream(parser, TOOLS), "", []
    for i, delta in enumerate(deltas):
        content, pieces = stream.feed(delta, final=i == len(deltas) - 1)
        said += content
        entries += [p.as_dict() for p in pieces]
    return said, entries, stream


def _cuts(text: str) -> list[list[str]]:
    rng = random.Random(0)
    return [list(text)] + [[text[i:i + n] for i in range(0, len(text), n)]
                           for n in (rng.randint(2, 9) for _ in range(4))]


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("arguments", BAD)
def test_a_number_json_has_not_is_malformed(name: str, arguments: str) -> None:
    parser, answer = FORMATS[name]
    text = answer(arguments)
    content, calls = get_tool_parser(parser).parse(text, TOOLS)
    assert calls == []
    assert content == (None if name == "openai" else text)  # (harmony's call: dropped)
    for deltas in _cuts(text):
        _, entries, stream = _stream(parser, deltas)
        assert not stream.called
        joined = join_tool_calls(entries)
        assert len(joined) <= 1  # (at most the call's beginning, up to the number)
        for call in joined:
            sent = call["function"]["arguments"]
            assert "NaN" not in sent.replace('"NaN"', "") and "Infinity" not in sent, sent
            assert arguments.replace(" ", "").startswith(sent.replace(" ", "")), sent


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_finite_numbers_stay_calls(name: str) -> None:
    parser, answer = FORMATS[name]
    text = answer(GOOD)
    _, (call,) = get_tool_parser(parser).parse(text, TOOLS)
    assert _strict(call.arguments) == {"big": 1.7976931348623157e308, "tiny": 0.0, "n": -0.0,
                                       "s": "Infinity"}
    for deltas in _cuts(text):
        _, entries, stream = _stream(parser, deltas)
        (joined,) = join_tool_calls(entries)
        assert stream.called and joined["function"]["arguments"] == call.arguments


def test_arguments_given_as_a_string() -> None:
    """A string that holds JSON is that JSON; one whose number JSON has not stays the string
    (its JSON text), as a string that holds no JSON does."""
    for inner, want in (('{\\"x\\": 1}', {"x": 1}), ('{\\"x\\": 1e999}', '{"x": 1e999}'),
                        ('{\\"x\\": NaN}', '{"x": NaN}')):
        text = f'[TOOL_CALLS][{{"name": "now", "arguments": "{inner}"}}]'
        _, (call,) = get_tool_parser("mistral").parse(text)
        assert _strict(call.arguments) == want, call


def test_the_stream_reader_refuses_them() -> None:
    for bad in BAD:
        reader = JsonStream()
        reader.feed(bad + " ")
        assert reader.failed and "NaN" not in reader.take().replace('"NaN"', ""), bad
    reader = JsonStream()
    reader.feed(GOOD + " ")
    assert reader.done and reader.take() + reader.closing() == json.dumps(json.loads(GOOD))
