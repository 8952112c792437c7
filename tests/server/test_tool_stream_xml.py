"""Streamed tool calls of the XML-like formats, parameter by parameter (vLLM's way): a call's
name goes out alone as soon as its head is read, then each parameter's piece of the arguments
(``{"city": "Paris"``, ``, "days": 3``) with the character that closes it, its value typed by
the tool's schema, and ``}`` with the one that closes the block; the pieces joined are the
non-streamed answer's arguments to the byte, for every format, fed a token, a character or a
random piece at a time (tags split across pieces, several calls, text before and between
them). What could read otherwise at the end waits for the block (a value holding a tag, a
dropped ``</parameter>``, a name read otherwise, DSML's wrapper); a key given twice goes out
twice and the call closes where the pieces read as the answer's arguments. A delta's work does
not grow with the call's length."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

import pytest
from server_util import join_tool_calls
from test_tool_stream import _pieces
from test_tool_stream_whole import ANSWERS, _dsml, _glm, _invoke, _qwen, _work

from mrv2.entrypoints.tool_calls import PARSERS, ToolCall, ToolParser, parse_tool_calls
from mrv2.entrypoints.tool_parsers_more import DSML, DSML_CALLS, DSML_CALLS_END
from mrv2.entrypoints.tool_stream import ToolCallStream
from mrv2.entrypoints.tool_stream_whole import BLOCKS
from mrv2.entrypoints.tool_stream_xml import FORMATS

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "when": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
         {"type": "function", "function": {"name": "write", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"},
                                              "content": {"type": "string"}}}}}]

#: One call's parameters as the model writes them, and the pieces that go out for them.
PARAMS = {"city": "Zürich \"old\" town", "days": "3", "temp": "-2.5", "metric": "true",
          "opts": '{"a": [1, 2], "b": null}', "tags": '["x", "y"]', "note": "x < y & z"}
PIECES = ['{"city": "Zürich \\"old\\" town"', ', "days": 3', ', "temp": -2.5',
          ', "metric": true', ', "opts": {"a": [1, 2], "b": null}', ', "tags": ["x", "y"]',
          ', "note": "x < y & z"', "}"]


def _mm(name: str, **kw: str) -> str:
    return f"<minimax:tool_call>\n{_invoke(name, **kw)}</minimax:tool_call>"


def _ds(name: str, **kw: str) -> str:
    typed = {k: ("true" if k in ("city", "note") else "false", v) for k, v in kw.items()}
    return f"{DSML_CALLS}\n{_dsml(name, **typed)}{DSML_CALLS_END}"


#: parser -> (one call's text, the tag that closes a parameter, the one that closes the call)
CALL: dict[str, tuple[Callable[..., str], str, str]] = {
    "qwen3_coder": (_qwen, "</parameter>", "</function>"),
    "qwen3_xml": (_qwen, "</parameter>", "</function>"),
    "glm45": (_glm, "</arg_value>", "</tool_call>"),
    "glm47": (lambda name, **kw: _glm(name, "", **kw), "</arg_value>", "</tool_call>"),
    "minimax_m2": (_mm, "</parameter>", "</invoke>"),
    "deepseek_v32": (_ds, f"</{DSML}parameter>", f"</{DSML}invoke>"),
}

#: parser -> more answers: several calls, content before and between, no parameters
TEXTS: dict[str, list[str]] = {p: [*ANSWERS[p], "Sure, " + make("weather", **PARAMS) + "\n"
                                   + make("write", path="a.py", content="x = 1\n")
                                   + make("weather")]
                               for p, (make, _, _) in CALL.items()}

_TOKEN = re.compile(r"</?[^<>\s]*>?|\w+|\s+|.", re.DOTALL)


def _cuts(text: str) -> list[list[str]]:
    """``text`` fed as token-like pieces (a tag mostly whole), a character at a time, and in
    random pieces (tags split across them)."""
    rng = random.Random(0)
    cuts = [_TOKEN.findall(text), list(text)]
    for n in (rng.randint(2, 30) for _ in range(6)):
        cuts.append([text[i:i + n] for i in range(0, len(text), n)])
    return cuts


def test_every_xml_format_streams_its_parameters() -> None:
    assert set(FORMATS) == set(BLOCKS) == set(CALL)


@pytest.mark.parametrize(("parser", "text"),
                         [(p, t) for p, texts in TEXTS.items() for t in texts])
def test_the_pieces_join_into_the_whole_answers_arguments(parser: str, text: str) -> None:
    content, calls = parse_tool_calls(text, parser, TOOLS)
    assert len(calls) >= 2
    for deltas in _cuts(text):
        assert "".join(deltas) == text
        stream = ToolCallStream(parser, TOOLS)
        said, feeds = _pieces(stream, deltas)
        entries = [p for feed in feeds for p in feed]
        joined = join_tool_calls(entries)  # (checks the shape)
        assert said == (content or "") and stream.called
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in joined] == [
            (c.name, c.arguments) for c in calls], deltas
        # (the answer's end: only the rest of the last call)
        assert all(e["index"] == len(joined) - 1 for e in feeds[-1])
        if len(deltas) == len(text):  # the name alone first, then a piece a parameter, "}"
            for index, call in enumerate(joined):
                pieces = [e["function"] for e in entries if e["index"] == index]
                if parser.startswith("glm") and pieces[0]["arguments"]:  # (GLM's name ends
                    assert pieces == [call["function"]] == [  # at <arg_key>: none, whole)
                        {"name": "weather", "arguments": "{}"}]
                    continue
                assert pieces[0] == {"name": call["function"]["name"], "arguments": ""}
                assert len(pieces) == len(json.loads(call["function"]["arguments"])) + 2


@pytest.mark.parametrize("parser", sorted(CALL))
def test_two_pieces_cut_anywhere_join_alike(parser: str) -> None:
    """(A tag cut anywhere: between the pieces of a call, a parameter, a value.)"""
    text = TEXTS[parser][-1]
    content, calls = parse_tool_calls(text, parser, TOOLS)
    for at in range(len(text) + 1):
        stream = ToolCallStream(parser, TOOLS)
        said, feeds = _pieces(stream, [text[:at], text[at:]])
        joined = join_tool_calls([p for feed in feeds for p in feed])
        assert said == content and [c["function"]["arguments"] for c in joined] == [
            c.arguments for c in calls], at


@pytest.mark.parametrize("parser", sorted(CALL))
def test_each_parameter_goes_out_typed_as_it_closes(parser: str) -> None:
    make, close, end = CALL[parser]
    text = "Let me look.\n" + make("weather", **PARAMS)
    assert parse_tool_calls(text, parser, TOOLS)[1][0].arguments == "".join(PIECES)
    stream, sent = ToolCallStream(parser, TOOLS), []
    for i, char in enumerate(text):
        for piece in stream.feed(char, final=i == len(text) - 1)[1]:
            sent.append((text[:i + 1], piece.as_dict()["function"]))
    assert [f for _, f in sent] == [{"name": "weather", "arguments": ""}] + [
        {"arguments": p} for p in PIECES]
    assert sent[0][0].endswith(("weather>", 'weather">', "<arg_key>"))
    assert all(at.endswith(close) for at, _ in sent[1:-1])  # (with its closing tag)
    assert sent[-1][0].endswith(end)


@pytest.mark.parametrize(("parser", "text", "streamed"), [
    # a value holding <parameter=: read whole where its </parameter> comes (it waits)
    ("qwen3_coder", "<function=write>\n<parameter=path>\na.py\n</parameter>\n"
     "<parameter=content>\nx<parameter=y>z\n</parameter>\n</function>", ['{"path": "a.py"']),
    # a dropped </parameter>: the value ends at </function> (the rest with the block's end)
    ("qwen3_coder", "<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</function>", ['{"city": "Paris"']),
    ("qwen3_xml", "<function=weather>\n<parameter=days>\n3\n<parameter=city>\nParis\n"
     "</function>", []),
    # a name read otherwise early: the call whole at its end
    ("minimax_m2", "<minimax:tool_call><invoke name=\"a>b\">\n<parameter name=\"x\">1"
     "</parameter></invoke></minimax:tool_call>", None),
    # a lone wrapper DeepSeek's parser unwraps; a second parameter after one
    ("deepseek_v32", f"{DSML_CALLS}\n<{DSML}invoke name=\"weather\">\n<{DSML}parameter "
     f"name=\"arguments\" string=\"false\">{{\"city\": \"Rome\"}}</{DSML}parameter>\n"
     f"</{DSML}invoke>\n{DSML_CALLS_END}", []),
    ("deepseek_v32", f"{DSML_CALLS}\n<{DSML}invoke name=\"weather\">\n<{DSML}parameter "
     f"name=\"arguments\" string=\"false\">{{\"city\": \"Rome\"}}</{DSML}parameter>\n<{DSML}"
     f"parameter name=\"days\" string=\"false\">2</{DSML}parameter></{DSML}invoke>\n"
     f"{DSML_CALLS_END}", []),
    # GLM: a key that runs past a </arg_key> not followed by its value reads alike
    ("glm45", "<tool_call>write\n<arg_key>path</arg_key> <arg_key>x</arg_key><arg_value>1"
     "</arg_value>\n<arg_key>content</arg_key><arg_value>c</arg_value></tool_call>",
     ['{"path</arg_key> <arg_key>x": 1', ', "content": "c"']),
])
def test_what_may_read_otherwise_waits_for_the_block(parser: str, text: str,
                                                     streamed: list[str] | None) -> None:
    text += "\nThat is all, nothing more to add here now."  # (the block closes before the end)
    _, calls = parse_tool_calls(text, parser, TOOLS)
    assert len(calls) == 1
    for deltas in _cuts(text):
        stream = ToolCallStream(parser, TOOLS)
        feeds = _pieces(stream, deltas)[1]
        entries = [p["function"] for feed in feeds for p in feed]
        assert "".join(e["arguments"] for e in entries) == calls[0].arguments
        if streamed is None:  # (one piece, name and all)
            assert entries == [{"name": calls[0].name, "arguments": calls[0].arguments}]
        else:
            assert [e["arguments"] for e in entries] == ["", *streamed, calls[0].arguments[
                len("".join(streamed)):]]


def _first_param_tag(parser: str) -> str:
    return {"glm45": "<arg_key>", "glm47": "<arg_key>", "deepseek_v32": f"<{DSML}parameter",
            "minimax_m2": "<parameter"}.get(parser, "<parameter=")


@pytest.mark.parametrize("after", ["", " Done."])
@pytest.mark.parametrize("parser", sorted(CALL))
def test_a_key_given_twice_goes_out_twice(parser: str, after: str) -> None:
    """(The closing brace where the pieces read as the answer's arguments: when the block
    closes, or, at the answer's end, from the whole answer's parse.)"""
    make, close, end = CALL[parser]
    one, two = make("weather", city="Paris", days="2"), make("weather", city="Lyon")
    # the second call's parameter spliced into the first: city, days, city
    param = two[two.index(_first_param_tag(parser)):two.rindex(close) + len(close)]
    text = one.replace(end, param + end, 1) + after
    _, calls = parse_tool_calls(text, parser, TOOLS)
    assert calls[0].arguments == '{"city": "Lyon", "days": 2}'
    stream = ToolCallStream(parser, TOOLS)
    feeds = _pieces(stream, list(text))[1]
    entries = [p["function"]["arguments"] for feed in feeds for p in feed]
    assert entries == ["", '{"city": "Paris"', ', "days": 2', ', "city": "Lyon"', "}"]
    assert json.loads("".join(entries)) == json.loads(calls[0].arguments) and stream.called


def test_a_block_refused_after_pieces_went_out_stops_the_stream() -> None:
    text = _qwen("weather", city="Paris") + "<function=weather>\n<parameter=city>\nx\n" \
        "</parameter>\nstray text\n</function>"
    assert parse_tool_calls(text, "qwen3_coder", TOOLS) == (text, [])
    stream = ToolCallStream("qwen3_coder", TOOLS)
    said, feeds = _pieces(stream, list(text))
    calls = join_tool_calls([p for feed in feeds for p in feed])
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', '{"city": "x"']
    assert not stream.called and said == "" and not feeds[-1]


def test_a_registered_parser_of_a_builtin_name_sends_each_call_whole() -> None:
    """A format this module does not know: its calls whole, as its own parser reads them."""
    parser = ToolParser("qwen3_coder", ("<function=",), lambda text, tools: [
        ToolCall(c.name.upper(), c.arguments) for c in PARSERS["qwen3_coder"].calls_of(
            text, tools)])
    text = _qwen("weather", city="Paris") + _qwen("write", path="a")
    stream = ToolCallStream(parser, TOOLS)
    feeds = _pieces(stream, list(text))[1]
    entries = [p["function"] for feed in feeds for p in feed]
    assert entries == [{"name": "WEATHER", "arguments": '{"city": "Paris"}'},
                       {"name": "WRITE", "arguments": '{"path": "a"}'}]


def _long(parser: str) -> Callable[[int], str]:
    make = CALL[parser][0]
    return lambda n: "Here:\n" + make("write", path="a.py", content="print('x')\n" * (n // 22),
                                      note="y = [1]\n" * (n // 16))


@pytest.mark.parametrize("parser", ["glm45", "minimax_m2", "deepseek_v32", "qwen3_xml"])
def test_a_delta_costs_the_same_however_long_the_call(parser: str) -> None:
    """Four times the text, four times the work (:func:`test_tool_stream_whole._work`)."""
    short, long = _work(parser, _long(parser)(5_000)), _work(parser, _long(parser)(20_000))
    assert long < 6 * short, (short, long)
