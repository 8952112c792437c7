"""Streamed tool calls, the block formats (the XML-like ones, whose arguments stream by
parameter: :mod:`test_tool_stream_xml`) and ``pythonic``, whose calls go out whole: each call
as soon as its element of the list closes (before the answer ends when several are written),
one piece with its index, id, name and whole arguments, byte-identical to the non-streamed
answer's, fed a character at a time and in random pieces; a malformed block stops the stream
(what went out stands); the text of strings and comments does not end a ``pythonic`` call.
And the cost of a delta: the memory a feed allocates does not grow with the call's length (the
stream neither rebuilds nor re-scans the text it holds), for every kind of format."""

from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Callable

import pytest
from server_util import join_tool_calls
from test_tool_stream import _pieces

from mrv2.entrypoints.tool_calls import parse_tool_calls
from mrv2.entrypoints.tool_parsers_more import DSML, DSML_CALLS, DSML_CALLS_END
from mrv2.entrypoints.tool_stream import ToolCallStream
from mrv2.entrypoints.tool_stream_whole import BLOCKS

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "write", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"},
                                              "content": {"type": "string"}}}}}]


def _qwen(name: str, **kw: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in kw.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _glm(name: str, newline: str = "\n", **kw: str) -> str:
    args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in kw.items())
    return f"<tool_call>{name}{newline}{args}</tool_call>"


def _invoke(name: str, close: bool = True, **kw: str) -> str:
    params = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in kw.items())
    return f'<invoke name="{name}">\n{params}' + ("</invoke>\n" if close else "")


def _dsml(name: str, **kw: tuple[str, str]) -> str:
    params = "".join(f'<{DSML}parameter name="{k}" string="{s}">{v}</{DSML}parameter>\n'
                     for k, (s, v) in kw.items())
    return f'<{DSML}invoke name="{name}">\n{params}</{DSML}invoke>\n'


CODE = 'def f(x):\n    return "</parameter> [a, b]" + \'\\n\'\n'
#: parser -> answers with several calls (content before, between and after them)
ANSWERS: dict[str, list[str]] = {
    "qwen3_coder": ["Let me.\n" + _qwen("weather", city="Paris", days="3") + "\n"
                    + _qwen("write", path="a.py", content="x = [1, 2]") + _qwen("weather")],
    "qwen3_xml": ["Hm " + _qwen("weather", city="Paris", opts="{'a': True}") + "\nand\n"
                  + _qwen("weather", days="2") + "\nDone."],
    "glm45": ["Ok." + _glm("weather", city=" Paris ", days="3") + _glm("write", path="a")],
    "glm47": [_glm("weather", "", city="Lyon") + "\n" + _glm("weather", "", days="4")],
    "minimax_m2": ["Sure. <minimax:tool_call>\n" + _invoke("weather", city="Paris", days="3")
                   + _invoke("write", path="b") + "</minimax:tool_call> then "
                   "<minimax:tool_call>" + _invoke("weather", False, city="Rome")
                   + "</minimax:tool_call> end"],
    "deepseek_v32": ["Checking.\n" + DSML_CALLS + "\n" + _dsml(
        "weather", city=("true", "Paris"), days=("false", "3")) + _dsml(
        "write", path=("true", "a.py"), content=("true", CODE)) + DSML_CALLS_END],
    "pythonic": ["[weather(city='Paris', days=3), write(path=\"a.py\", content='''x = \"]\"\n"
                 "y = f(1, 2)'''),  # a comment, ] ( \"\n weather(city=\"\\\"Lyon\\\",\", "
                 "opts={'a': [1, (2, 3)], 'b': None}), ]",
                 "  <|python_start|>[weather(city='Nice'), weather(days=-1)]<|python_end|>"],
}
ANSWERS["llama4_pythonic"] = ANSWERS["pythonic"]


def test_every_whole_format_streams() -> None:
    assert set(ANSWERS) == set(BLOCKS) | {"pythonic", "llama4_pythonic"}


@pytest.mark.parametrize(("parser", "text"), [
    (p, t) for p, texts in ANSWERS.items() for t in texts if p not in BLOCKS])
def test_each_call_goes_out_whole_when_it_closes(parser: str, text: str) -> None:
    content, calls = parse_tool_calls(text, parser, TOOLS)
    assert len(calls) >= 2
    rng = random.Random(0)
    cuts = [list(text)] + [[text[i:i + n] for i in range(0, len(text), n)]
                           for n in (rng.randint(2, 30) for _ in range(8))]
    for deltas in cuts:
        stream = ToolCallStream(parser, TOOLS)
        said, feeds = _pieces(stream, deltas)
        entries = [p for feed in feeds for p in feed]
        joined = join_tool_calls(entries)  # (checks the shape)
        assert said == (content or "") and stream.called
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in joined] == [
            (c.name, c.arguments) for c in calls], deltas
        assert len(entries) == len(calls) and all("id" in e for e in entries)  # (each whole)
        assert not feeds[-1] or len(feeds[-1]) == 1  # (all but the last one before the end)
    # a character at a time: a call goes out with the character that closes its block
    stream = ToolCallStream(parser, TOOLS)
    sent = [i for i, c in enumerate(text) if stream.feed(c)[1]]
    assert len(sent) >= len(calls) - 1
    for at in sent:
        assert text[:at + 1].endswith((",", "]"))


@pytest.mark.parametrize(("parser", "text", "sent"), [
    # a later block malformed (no name): what went out stands, the answer is no call
    ("qwen3_coder", _qwen("weather", city="Paris") + "<function=>\n</function>", 1),
    ("glm45", _glm("weather", city="Paris") + _glm("", days="1"), 1),
    # the first block malformed: nothing goes out, the text is content
    ("minimax_m2", "<minimax:tool_call><invoke name=>\n</invoke></minimax:tool_call>", 0),
    # not a call, after one; a call that goes on after its ")"; no list
    ("pythonic", "[weather(city='Paris'), 3, weather()]", 1),
    ("pythonic", "[weather(city='Paris')(days=1)]", 0),
    ("pythonic", "[weather(city='Paris'), weather(**{'days': 1})]", 1),
    ("pythonic", "[weather(city='Paris')] and more", 1),
])
def test_a_malformed_answer_stops_the_stream(parser: str, text: str, sent: int) -> None:
    assert parse_tool_calls(text, parser, TOOLS) == (text, [])
    stream = ToolCallStream(parser, TOOLS)
    said, feeds = _pieces(stream, list(text))
    assert len(join_tool_calls([p for feed in feeds for p in feed])) == sent
    assert not feeds[-1] and not stream.called and said == ("" if sent else text)


def _hermes(n: int) -> str:
    args = json.dumps({"path": "a.py", "content": "print('x', \"y\")\n" * (n // 18)})
    return f'Sure.\n<tool_call>\n{{"name": "write", "arguments": {args}}}\n</tool_call>'


def _harmony(n: int) -> str:
    args = json.dumps({"content": "x = [1]\n" * (n // 9)})
    return ("<|channel|>analysis<|message|>write it<|end|><|start|>assistant<|channel|>"
            f"commentary to=functions.write <|constrain|>json<|message|>{args}<|call|>")


def _qwen_long(n: int) -> str:
    return "Here:\n" + _qwen("write", path="a.py", content="print('x')\n" * (n // 11))


def _pythonic_long(n: int) -> str:
    return f"[write(path='a.py', content={'print(1)  # [x]' * (n // 17)!r}), weather()]"


def _trailing(n: int) -> str:  # (a long text after a call, that the next head waits in)
    return _hermes(50) + "\nThat is all. " * (n // 14)


def _work(parser: str, text: str) -> int:
    """The bytes that feeding ``text`` in 4-character deltas allocated at its peaks, summed
    over the feeds (the last, the whole answer's parse, left out): what a feed builds."""
    stream, total = ToolCallStream(parser, TOOLS), 0
    deltas = [text[i:i + 4] for i in range(0, len(text), 4)]
    tracemalloc.start()
    try:
        for delta in deltas[:-1]:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            stream.feed(delta)
            total += tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    stream.feed(deltas[-1], final=True)
    assert stream.called
    return total


@pytest.mark.parametrize(("parser", "make"), [
    ("hermes", _hermes), ("openai", _harmony), ("qwen3_coder", _qwen_long),
    ("pythonic", _pythonic_long), ("hermes", _trailing)])
def test_a_delta_costs_the_same_however_long_the_call(parser: str,
                                                       make: Callable[[int], str]) -> None:
    """Four times the text, four times the work (not sixteen: a feed that copied or scanned
    all the text so far, as it grows, would allocate a string as long at each delta)."""
    short, long = _work(parser, make(5_000)), _work(parser, make(20_000))
    assert long < 6 * short, (short, long)
