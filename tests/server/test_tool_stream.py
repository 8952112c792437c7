"""Streamed tool calls' arguments in pieces (vLLM's way): a call's first piece has its index,
id, type and name, the later ones only arguments; the pieces of a call join into the whole
answer's arguments text to the byte (strings with escaped quotes, non-ASCII and escaped
surrogate pairs, nested objects, numbers json writes otherwise, several calls, content before
them), for every parser that streams JSON arguments, fed a character at a time and in random
pieces; nothing uncertain goes out (an unfinished number or escape, a call's closing brace);
a long call streams in many pieces before the answer ends, through the chat route and the
Responses API's ``function_call_arguments.delta`` events; a call that goes wrong after it went
out stands as sent; the canonical JSON reader against ``json`` on random objects."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from server_util import join_tool_calls

from mrv2.contract.params import SamplingParams
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.entrypoints.json_stream import JsonStream
from mrv2.entrypoints.openai_responses import ResponsesRequest, ResponsesStream
from mrv2.entrypoints.responses import Stream
from mrv2.entrypoints.tool_calls import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    ToolCalling,
    forced_tool_choice,
    get_tool_parser,
    parse_tool_calls,
)
from mrv2.entrypoints.tool_parsers_more import KIMI_ARGUMENTS, KIMI_CALL, KIMI_CALL_END
from mrv2.entrypoints.tool_stream import HEADS, ToolCallStream

#: Arguments that json writes otherwise than the model did (escapes, spacing, numbers).
TRICKY = ('{"text": "say \\"hi\\" \\\\ back\\nnow", "city": "Zürich \\u00e9\\ud83d\\ude00 日本",'
          ' "nested": {"a": [1, 2.50, -0, 1E3, {"b": null}], "c": {}}, "ok" :true,"no":false}')
SIMPLE = '{"city": "Paris"}'


def _hermes(args: str, name: str = "weather") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _ds31(args: str, name: str = "weather") -> str:
    return f"{DS_CALL_BEGIN}{name}{DS_SEP}{args}{DS_CALL_END}"


def _ds3(args: str, name: str = "weather") -> str:
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


def _harmony(args: str, name: str = "weather") -> str:
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
            f"<|message|>{args}<|call|>")


#: parser -> answers: content before the calls, several calls, tricky arguments.
ANSWERS = {
    "hermes": ["Let me see.\n" + _hermes(TRICKY) + "\n" + _hermes(SIMPLE, "now"),
               _hermes(TRICKY.replace('"city"', '"parameters_like"'))],
    "llama3_json": [f'{{"name": "weather", "parameters": {TRICKY}}}; '
                    f'{{"name": "now", "parameters": {SIMPLE}}}',
                    f'<|python_tag|>{{"name": "weather", "arguments": {TRICKY}}}',
                    f'{{"type": "function", "name": "weather", "parameters": {TRICKY}}}'],
    "mistral": [f"Sure[TOOL_CALLS]weather[ARGS]{TRICKY}[TOOL_CALLS]now[ARGS]{SIMPLE}",
                f'[TOOL_CALLS][{{"name": "weather", "arguments": {TRICKY}}}, '
                f'{{"name": "now", "arguments": {SIMPLE}}}]',
                f"[TOOL_CALLS]weather[CALL_ID]a1b2c3d4e[ARGS]{TRICKY}"],
    "deepseek_v31": [f"Hm.{DS_CALLS_BEGIN}{_ds31(TRICKY)}{_ds31(SIMPLE, 'now')}{DS_CALLS_END}"],
    "deepseek_v3": [f"Hm.{DS_CALLS_BEGIN}{_ds3(TRICKY)}\n{_ds3(SIMPLE, 'now')}{DS_CALLS_END}"],
    "openai": ["<|channel|>analysis<|message|>think<|end|>" + _harmony(TRICKY)
               + _harmony(SIMPLE, "now") + "<|start|>assistant<|channel|>final<|message|>ok"],
}
ANSWERS["llama4_json"] = ANSWERS["llama3_json"]
ANSWERS["kimi_k2"] = [
    "Checking.<|tool_calls_section_begin|>" + "".join(
        f"{KIMI_CALL} functions.{name}:{i} {KIMI_ARGUMENTS}{args}{KIMI_CALL_END}"
        for i, (name, args) in enumerate([("weather", TRICKY), ("now", SIMPLE)]))
    + "<|tool_calls_section_end|>"]


def _pieces(stream: ToolCallStream, deltas: list[str]) -> tuple[str, list[list[Any]]]:
    """The content a stream sent, and the call pieces of each feed (as chat entries)."""
    content, feeds = "", []
    for i, delta in enumerate(deltas):
        said, pieces = stream.feed(delta, final=i == len(deltas) - 1)
        content += said
        feeds.append([p.as_dict() for p in pieces])
    return content, feeds


def test_every_json_format_streams() -> None:
    assert set(ANSWERS) == set(HEADS) - {"required"} | {"openai"}


@pytest.mark.parametrize(("parser", "text"),
                         [(p, t) for p, texts in ANSWERS.items() for t in texts])
def test_the_pieces_join_into_the_whole_answers_arguments(parser: str, text: str) -> None:
    content, calls = parse_tool_calls(text, parser)
    assert calls and all(json.loads(c.arguments) for c in calls)
    rng = random.Random(0)
    cuts = [list(text)] + [[text[i:i + n] for i in range(0, len(text), n)]
                           for n in (rng.randint(2, 9) for _ in range(8))]
    for deltas in cuts:
        stream = ToolCallStream(parser)
        said, feeds = _pieces(stream, deltas)
        joined = join_tool_calls([p for feed in feeds for p in feed])  # (checks the shape)
        assert (said or None) == content or (parser == "openai" and said == "ok")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in joined] == [
            (c.name, c.arguments) for c in calls], deltas
        assert stream.called
        if parser == "kimi_k2":  # (the model's ids)
            assert [c["id"] for c in joined] == [c.id for c in calls] == [
                "functions.weather:0", "functions.now:1"]
        if len(deltas) == len(text):  # a character at a time: each call streamed
            for index in range(len(calls)):
                pieces = [p for feed in feeds[:-1] for p in feed if p["index"] == index]
                assert len(pieces) > 3, (index, pieces)
                assert pieces[0]["function"]["name"] == calls[index].name and pieces[0]["id"]
                assert pieces[0]["function"]["arguments"].startswith("{")


def test_nothing_uncertain_goes_out() -> None:
    """A number until it ends, an escape until it is whole, the closing brace until the call
    ends; a high surrogate escape until the low one shows."""
    stream = ToolCallStream("hermes")
    head = '<tool_call>{"name": "f", "arguments": {"n": 1'
    _, pieces = stream.feed(head)
    assert "".join(p.arguments for p in pieces) == '{"n": '
    _, pieces = stream.feed('0, "s": "a\\')
    assert "".join(p.arguments for p in pieces) == '10, "s": "a'
    _, pieces = stream.feed('"\\ud83d')
    assert "".join(p.arguments for p in pieces) == '\\"'
    _, pieces = stream.feed('\\ude00"}')
    assert "".join(p.arguments for p in pieces) == '😀"'  # (the brace held)
    _, pieces = stream.feed("}</tool_call>")
    assert pieces == []
    _, pieces = stream.feed("", final=True)
    assert [(p.index, p.arguments) for p in pieces] == [(0, "}")]
    # a second call: the first's brace goes out with the next's first piece
    stream = ToolCallStream("hermes")
    stream.feed(_hermes(SIMPLE))
    second = _hermes('{"x": 1}', "now")
    _, pieces = stream.feed(second[:second.index("1}")])
    assert [(p.index, p.name, p.arguments) for p in pieces] == [(0, "", "}"),
                                                                (1, "now", '{"x": ')]
    # empty arguments: the call's first piece when they end, its brace when the next begins
    stream = ToolCallStream("hermes")
    text = _hermes("{}", "now") + _hermes(SIMPLE)
    _, feeds = _pieces(stream, list(text))
    assert [(p["index"], p["function"]) for feed in feeds[:text.index("city")] for p in feed
            ] == [(0, {"name": "now", "arguments": "{"}), (0, {"arguments": "}"}),
                  (1, {"name": "weather", "arguments": '{"'})]
    assert [c["function"]["arguments"] for c in join_tool_calls(
        [p for feed in feeds for p in feed])] == ["{}", SIMPLE]


def test_a_long_hermes_call_streams_through_the_chat_route() -> None:
    args = json.dumps({"path": "a.py", "content": "print('x')\n" * 40})
    text = "Writing it.\n" + _hermes(args, "write")
    stream = Stream(None, "chatcmpl-x", "m", True, SamplingParams(max_tokens=999),  # type: ignore[arg-type]
                    _Body(), ["r"], [([1], None)], tools=ToolCalling(get_tool_parser("hermes")))
    entries, finish = [], []
    for i in range(0, len(text), 3):  # (a few characters a token)
        last = i + 3 >= len(text)
        for choice, _ in stream._deltas(_output(text[i:i + 3], last, "stop" if last else None)):
            entries.append(choice["delta"].get("tool_calls", []))
            finish.append(choice["finish_reason"])
    assert sum(bool(e) for e in entries[:-1]) > 100  # (pieces before the answer ended)
    (call,) = join_tool_calls([p for e in entries for p in e])
    assert call["function"] == {"name": "write", "arguments": args}
    assert finish[-1] == "tool_calls" and not any(finish[:-1])


def test_a_call_that_goes_wrong_after_it_went_out_stands() -> None:
    """Cut off (max_tokens) or malformed after a call began: what went out stands, nothing
    more of it comes, the answer is no call (the choice keeps its finish reason); a call
    whose arguments begin malformed sends nothing, and its text is content."""
    for tail in ('"Par', '"Paris"} extra</tool_call>', '"Paris</tool_call>"}</tool_call>'):
        stream = ToolCallStream("hermes")
        said, feeds = _pieces(stream, list('Hi<tool_call>{"name": "w", "arguments": {"city": '
                                           + tail))
        (call,) = join_tool_calls([p for feed in feeds for p in feed])
        assert said == "Hi" and not stream.called and not feeds[-1]
        assert call["function"]["arguments"].startswith('{"city": "Pa'), tail
        assert "</tool_call>" not in call["function"]["arguments"]
    stream = ToolCallStream("hermes")
    text = '<tool_call>{"name": "w", "arguments": {bad}}</tool_call>'
    assert _pieces(stream, list(text)) == (text, [[]] * len(text))


def test_an_xml_call_streams_by_parameter() -> None:
    """(Its name once read, each value typed by the tools' schemas once whole, the closing
    brace with its block: :mod:`test_tool_stream_xml`.)"""
    text = "<tool_call>\n<function=now>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    said, feeds = _pieces(ToolCallStream("qwen3_coder"), list(text))
    sent = {text[:i + 1]: feed for i, feed in enumerate(feeds) if feed}
    assert said == "" and [[p["function"] for p in feed] for feed in sent.values()] == [
        [{"name": "now", "arguments": ""}], [{"arguments": '{"x": "1"'}], [{"arguments": "}"}]]
    assert [at.endswith(e) for at, e in zip(sent, ("=now>", "</parameter>", "</function>"),
                                            strict=True)] == [True] * 3


def test_forced_calls_stream() -> None:
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {}}}]
    named, _ = forced_tool_choice({"type": "function", "function": {"name": "pick"}}, tools)
    required, _ = forced_tool_choice("required", tools)
    for parser, text in ((named, TRICKY), (required, f'[{{"name": "pick", "parameters": '
                                                      f'{TRICKY}}}, {{"name": "pick", '
                                                      f'"parameters": {SIMPLE}}}]')):
        stream = ToolCallStream(parser, tools)
        said, feeds = _pieces(stream, list(text))
        joined = join_tool_calls([p for feed in feeds for p in feed])
        assert said == "" and sum(bool(f) for f in feeds) > 20
        assert [c["function"]["arguments"] for c in joined] == [
            c.arguments for c in parser.parse(text, tools)[1]]


class _Body:
    include_usage = False
    continuous_usage = False


def _output(text: str, finished: bool, reason: str | None = None) -> RequestOutput:
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1],
                         outputs=[CompletionOutput(0, text, [0] * max(len(text), 1), reason)],
                         finished=finished, delta=True)


def test_the_responses_api_streams_the_arguments() -> None:
    """``response.function_call_arguments.delta`` events as the call comes, which join into
    the ``.done`` event's and the final item's arguments, the item opened at its first piece
    after the message (closed first), the next call's after it."""
    text = "Let me see.\n" + _hermes(TRICKY) + "\n" + _hermes(SIMPLE, "now")
    args = (None, "resp", "m", True, SamplingParams(max_tokens=999), _Body(), ["r"],
            [([1], None)], None, ToolCalling(get_tool_parser("hermes")))

    async def events() -> list[dict[str, Any]]:
        stream = ResponsesStream(*args, request=ResponsesRequest(input="hi"))  # type: ignore[arg-type]
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for i, c in enumerate(text):
            last = i == len(text) - 1
            sink.put_nowait(_output(c, last, "stop" if last else None))
        return [json.loads(line[6:]) async for chunk in stream.events(sink)
                for line in chunk.splitlines() if line.startswith("data: ")]

    sent = asyncio.run(events())
    output = sent[-1]["response"]["output"]
    assert [(i["type"], i.get("name")) for i in output] == [
        ("message", None), ("function_call", "weather"), ("function_call", "now")]
    _, calls = parse_tool_calls(text, "hermes")
    for index, (item, call) in enumerate(zip(output[1:], calls, strict=True)):
        deltas = [e["delta"] for e in sent if e["type"] == "response.function_call_arguments"
                  ".delta" and e["item_id"] == item["id"]]
        (done,) = [e for e in sent if e["type"] == "response.function_call_arguments.done"
                   and e["item_id"] == item["id"]]
        assert len(deltas) > 3 and "".join(deltas) == done["arguments"] == item["arguments"]
        assert item["arguments"] == call.arguments and done["output_index"] == index + 1
    kinds = [e["type"] for e in sent]
    first_call = kinds.index("response.function_call_arguments.delta")
    assert kinds.index("response.output_text.done") < first_call  # (the message closed first)
    assert first_call < len(kinds) - 20  # (pieces before the answer ended)


def test_the_canonical_json_reader() -> None:
    """Random objects, written with json's options, fed in random pieces: what comes out is
    always a beginning of ``json.dumps(json.loads(raw), ensure_ascii=False)``, and all of it
    with the held brace; the end is where the object ends; what no object can be fails."""
    rng = random.Random(1)
    leaves: list[Any] = [0, -0.0, 1.5, 10**20, -3, True, False, None, 1e300, "", "\ud800x",
                         'a"b\\c\n\t/é😀\u2028\x01']

    def value(depth: int = 0) -> Any:
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice(leaves)
        if r < 0.6:
            return {rng.choice(["k", "é", 'a"', "x y"]) + str(i): value(depth + 1)
                    for i in range(rng.randint(0, 3))}
        return [value(depth + 1) for _ in range(rng.randint(0, 3))]

    for _ in range(600):
        raw = " " + json.dumps({"v": value()}, ensure_ascii=rng.random() < 0.5,
                               indent=rng.choice([None, 2]),
                               separators=rng.choice([None, (",", ":")])) + " ;rest"
        want = json.dumps(json.loads(raw[:raw.rindex("}") + 1]), ensure_ascii=False)
        reader, got, pos = JsonStream(), "", 0
        while pos < len(raw):
            step = rng.randint(1, 7)
            reader.feed(raw[pos:pos + step])
            pos += step
            got += reader.take()
            assert want.startswith(got), (raw, got)
        assert reader.done and got + reader.closing() == want
        assert raw[reader.end:] == " ;rest"
    for bad in ('{"a": 1, "a": 2}', '{"a": 01}', '{"a": "\x01"}', '{"a": tru}', '["x"]',
                '{"a": "\\x"}', '{"a": 1,}', '{"a": [1,]}', '{"a" 1}', '{"a": 1]'):
        reader = JsonStream()
        reader.feed(bad + " ")
        assert reader.failed, bad
