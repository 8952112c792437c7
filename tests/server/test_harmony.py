"""gpt-oss's harmony format: ``--reasoning-parser openai_gptoss`` and ``--tool-call-parser
openai``. Whole outputs and streams cut at every character (markers split across deltas) give
the same reasoning, content and calls, and no marker ever reaches the client; the chat
answer (streamed or not, with either parser or both) and the Responses API's items; a
tokenizer whose markers are special tokens, decoded token by token as the engine does; the
server decodes such requests keeping special tokens; the CLI takes the names."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, join_tool_calls, spy_add_request

from mrv2.contract.params import SamplingParams
from mrv2.engine.detokenizer import IncrementalDetokenizer
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.engine.tokenizer import Tokenizer
from mrv2.entrypoints.harmony import MARKERS, HarmonyStream, read_header
from mrv2.entrypoints.openai_responses import ResponsesRequest, ResponsesStream
from mrv2.entrypoints.reasoning import ReasoningStream, check_reasoning_parser, split_reasoning
from mrv2.entrypoints.responses import Stream, _Answer
from mrv2.entrypoints.tool_calls import (
    ToolCalling,
    check_tool_call_parser,
    get_tool_parser,
    parse_tool_calls,
)
from mrv2.entrypoints.tool_stream import ToolCallStream
from mrv2.testing import make_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OPENAI = ToolCalling(get_tool_parser("openai"))
A = "<|channel|>analysis<|message|>"
PARIS = ('<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json'
         '<|message|>{"city": "Paris"}<|call|>')
LYON = ('<|start|>assistant to=functions.weather<|channel|>commentary <|constrain|>json'
        '<|message|>{"city":"Lyon","days":3}')  # recipient in the role's part; EOS cut <|call|>
Case = tuple[str, str | None, str | None, list[tuple[str, str]]]
#: analysis, a preamble, two calls
TWO_CALLS: Case = (
    A + "Two cities.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking both."
    "<|end|>" + PARIS + LYON, "Two cities.", "Checking both.",
    [("weather", '{"city": "Paris"}'), ("weather", '{"city": "Lyon", "days": 3}')])
CASES: list[Case] = [
    # (text, reasoning, content, [(name, arguments)])
    (A + "User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>The answer is 4."
     "<|return|>", "User asks 2+2.", "The answer is 4.", []),
    (A + "Simple.<|end|><|start|>assistant<|channel|>final<|message|>Four.", "Simple.",
     "Four.", []),  # (<|return|> is an EOS: not in the text)
    (A + "stray <|constrain|>marks<|message|>!", "stray marks!", None, []),
    (A + "Need the weather.<|end|>" + PARIS, "Need the weather.", None,
     [("weather", '{"city": "Paris"}')]),
    (LYON[len("<|start|>assistant"):], None, None,
     [("weather", '{"city": "Lyon", "days": 3}')]),  # the output opens " to=functions..."
    TWO_CALLS,
    ("<|channel|>final<|message|>Hi there.<|return|>", None, "Hi there.", []),
    (A + "The user wants", "The user wants", None, []),  # max_tokens cut mid-analysis
    (A + "one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
     "<|start|>assistant<|channel|>final<|message|>x <| y < z |>", "one\ntwo", "x <| y < z |>",
     []),
    (A + "look it up<|end|><|start|>assistant<|channel|>analysis to=browser.search code"
     '<|message|>{"query": "x"}<|call|>', 'look it up\n{"query": "x"}', None, []),
    (A + "call it<|end|><|start|>assistant<|channel|>commentary to=functions.weather "
     '<|constrain|>json<|message|>{"city": "Pa', "call it", None, []),  # cut: no call
    ("<|channel|>commentary to=functions.now <|constrain|>json<|message|><|call|>", None, None,
     [("now", "{}")]),
    (A + "now<|end|><|start|>assistant<|channel|>commentary to=functions.now<|message|>", "now",
     None, []),  # cut right after the header: no call made up
    ("to=" + "x" * 300, None, "to=" + "x" * 300, []),  # too long for a recipient: text
    ("<|channel|>" + "y" * 300 + "<|message|>z", None, "y" * 300 + "z", []),  # no header
    ("<|channel|>commentary to=functions.run <|constrain|>python<|message|>print(1)<|call|>",
     None, None, [("run", "print(1)")]),  # another content type: as written
    (A + "x<|end|><|start|>assistant<|channel|>fin", "x", None, []),  # a header cut off
    (A + "think<|start|>assistant<|channel|>final<|message|>ok", "think", "ok", []),
    (PARIS + '<|start|>functions.weather to=assistant<|channel|>commentary<|message|>'
     '{"sunny": true}<|end|><|start|>assistant<|channel|>final<|message|>Sunny.', None,
     "Sunny.", [("weather", '{"city": "Paris"}')]),  # a tool's answer it wrote: dropped
    (" Plain answer, no header.", None, " Plain answer, no header.", []),
    ('{"answer": 4}', None, '{"answer": 4}', []),  # held to a grammar from its first token
    ("to be or not", None, "to be or not", []),
    ("", None, None, []),
]


def _calls(calls: list[Any]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def _no_marker(*texts: str | None) -> bool:
    return not any(m in (t or "") for t in texts for m in MARKERS)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_whole_outputs(text: str, reasoning: str | None, content: str | None,
                       calls: list[tuple[str, str]]) -> None:
    assert split_reasoning("openai_gptoss", text) == (reasoning, content)
    got_content, got_calls = parse_tool_calls(text, "openai")
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert all(c.id.startswith("call_") for c in got_calls)


def _cuts(text: str) -> list[list[str]]:
    """The text a character a delta, and cut in two at every place."""
    return [list(text) or [""]] + [[text[:k], text[k:]] for k in range(len(text) + 1)]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CASES)
def test_a_stream_cut_at_every_character_gives_the_whole_split(
        text: str, reasoning: str | None, content: str | None,
        calls: list[tuple[str, str]]) -> None:
    for deltas in _cuts(text):
        last = len(deltas) - 1
        split, tools = ReasoningStream("openai_gptoss"), ToolCallStream("openai")
        thought = said = told = ""
        got: list[Any] = []
        for i, delta in enumerate(deltas):
            r, c = split.feed(delta, final=i == last)
            t, found = tools.feed(delta, final=i == last)
            assert _no_marker(r, c, t), (text, deltas)
            thought, said, told = thought + r, said + c, told + t
            got += [p.as_dict() for p in found]
            # nothing sent is taken back: what went out begins the whole split
            assert (reasoning or "").startswith(thought) and (content or "").startswith(said)
        assert (thought or None, said or None, told or None) == (reasoning, content, content)
        joined = _calls_of(join_tool_calls(got))
        assert tools.called == bool(calls)
        if calls:
            assert joined == calls, deltas
        else:  # (a call cut off: what of it went out stands, nothing more)
            assert len(joined) <= 1 and all(c[1] == "" or c[1][0] == "{" for c in joined)


def test_a_stream_holds_only_what_may_be_a_marker() -> None:
    stream = HarmonyStream()
    assert stream.feed("<|chan") == [] and stream.feed("nel|>analysis<|mess") == []
    assert [p.text for p in stream.feed("age|>Hmm <|e")] == ["Hmm "]
    assert [p.text for p in stream.feed("nd! ")] == ["<|end! "]
    assert [(p.kind, p.text) for p in stream.feed("<|end|>")] == []
    assert [(p.kind, p.text) for p in stream.feed("More", final=True)] == [("content", "More")]


def test_headers() -> None:
    call = read_header("<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert (call.kind, call.name, call.content_type) == ("call", "get_weather", "json")
    bare = read_header("<|start|>assistant to=functions.f<|channel|>commentary json")
    assert (bare.kind, bare.name, bare.content_type) == ("call", "f", "json")
    assert read_header("<|start|>assistant<|channel|>final").kind == "content"
    assert read_header("<|channel|>commentary").kind == "content"  # a preamble
    assert read_header("<|channel|>analysis").kind == "reasoning"
    assert read_header("<|channel|>analysis to=python").kind == "reasoning"
    assert read_header("<|channel|>commentary to=container.exec").kind == "reasoning"
    assert read_header("<|start|>functions.f to=assistant<|channel|>commentary").kind == "drop"


def test_the_parser_names() -> None:
    assert check_reasoning_parser("openai_gptoss") == "openai_gptoss"
    assert check_tool_call_parser("openai") == "openai"
    parser = get_tool_parser("openai")
    assert parser.special_tokens and parser.harmony
    with pytest.raises(ValueError, match="allowed values are qwen3, deepseek_r1, openai_gptoss"):
        check_reasoning_parser("gptoss")
    with pytest.raises(ValueError, match="allowed values are .*, openai$"):
        check_tool_call_parser("harmony")


class _Body:
    include_usage = False
    continuous_usage = False


def _stream(reasoning: str | None, tools: ToolCalling | None) -> Stream:
    return Stream(None, "chatcmpl-x", "m", True, SamplingParams(max_tokens=99),  # type: ignore[arg-type]
                  _Body(), ["r"], [([1], None)], reasoning, tools)


def _output(text: str, finished: bool, reason: str | None = None) -> RequestOutput:
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1],
                         outputs=[CompletionOutput(0, text, [0] * max(len(text), 1), reason)],
                         finished=finished, delta=True)


def _streamed(stream: Stream, deltas: list[str]) -> dict[str, Any]:
    """The chat stream's deltas of ``deltas`` folded: reasoning, content, calls, finish."""
    got: dict[str, Any] = {"reasoning": "", "content": "", "calls": [], "finish": None}
    for i, delta in enumerate(deltas):
        final = i == len(deltas) - 1
        for choice, _ in stream._deltas(_output(delta, final, "stop" if final else None)):
            assert _no_marker(json.dumps(choice))
            got["reasoning"] += choice["delta"].get("reasoning_content", "")
            got["content"] += choice["delta"]["content"]
            got["calls"] += choice["delta"].get("tool_calls", [])
            got["finish"] = choice["finish_reason"]
    got["calls"] = _calls_of(join_tool_calls(got["calls"]))
    return got


@pytest.mark.parametrize(("reasoning", "tools"), [("openai_gptoss", OPENAI),
                                                  ("openai_gptoss", None), (None, OPENAI)])
def test_the_chat_answer(reasoning: str | None, tools: ToolCalling | None) -> None:
    """Both parsers: reasoning, content, calls; the reasoning parser alone drops the calls
    (vLLM's); the tool-call parser alone reads the content and calls from the whole text."""
    text, thought, content, calls = TWO_CALLS
    want_calls = calls if tools is not None else []
    choice: dict[str, Any] = {"finish_reason": "stop"}
    message = _stream(reasoning, tools)._message(text, choice)
    assert message["content"] == content and _no_marker(json.dumps(message))
    assert message.get("reasoning_content") == (thought if reasoning else None)
    assert _calls_of(message.get("tool_calls", [])) == want_calls
    assert choice["finish_reason"] == ("tool_calls" if want_calls else "stop")
    for deltas in (list(text), [text[:40], text[40:90], text[90:]]):
        got = _streamed(_stream(reasoning, tools), deltas)
        assert got == {"reasoning": thought if reasoning else "", "content": content,
                       "calls": want_calls,
                       "finish": "tool_calls" if want_calls else "stop"}, deltas


def _calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_the_responses_api_items() -> None:
    """A Responses API answer: a reasoning item, the message, the function calls; streamed,
    the same items."""
    text, thought, content, calls = TWO_CALLS
    args = (None, "resp", "m", True, SamplingParams(max_tokens=99), _Body(), ["r"],
            [([1], None)], "openai_gptoss", OPENAI)
    whole = ResponsesStream(*args, request=ResponsesRequest(input="hi"))
    whole.answers = {"r": {}}
    for c in text:  # (the answer gathered from its deltas, as the server does)
        whole.answers["r"].setdefault(0, _Answer()).add(_output(c, False).outputs[0])
    items = whole._whole()["output"]
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call",
                                          "function_call"]
    assert items[0]["content"][0]["text"] == thought
    assert items[1]["content"][0]["text"] == content
    assert [(i["name"], i["arguments"]) for i in items[2:]] == calls

    async def events() -> list[dict[str, Any]]:
        stream = ResponsesStream(*args, request=ResponsesRequest(input="hi"))
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for i, c in enumerate(text):
            sink.put_nowait(_output(c, i == len(text) - 1, "stop" if i == len(text) - 1
                                    else None))
        return [json.loads(line[6:]) async for chunk in stream.events(sink)
                for line in chunk.splitlines() if line.startswith("data: ")]

    sent = asyncio.run(events())
    assert _no_marker(json.dumps(sent))
    assert [(i["type"], i.get("name")) for i in sent[-1]["response"]["output"]] == [
        (i["type"], i.get("name")) for i in items]


def test_streamed_items_have_ids_of_their_own() -> None:
    """Analysis after a preamble (harmony's messages in any order): the stream opens a
    reasoning item and a message again, each with an id no other item of the response has,
    and its events name the item they belong to."""
    text = (A + "one<|end|><|start|>assistant<|channel|>commentary<|message|>pre<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>two<|end|><|start|>assistant"
            "<|channel|>final<|message|>done")

    async def events() -> list[dict[str, Any]]:
        stream = ResponsesStream(None, "resp", "m", True, SamplingParams(max_tokens=99),  # type: ignore[arg-type]
                                 _Body(), ["r"], [([1], None)], "openai_gptoss", OPENAI,
                                 request=ResponsesRequest(input="hi"))
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for i, c in enumerate(text):
            last = i == len(text) - 1
            sink.put_nowait(_output(c, last, "stop" if last else None))
        return [json.loads(line[6:]) async for chunk in stream.events(sink)
                for line in chunk.splitlines() if line.startswith("data: ")]

    sent = asyncio.run(events())
    output = sent[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["reasoning", "message", "reasoning", "message"]
    ids = [i["id"] for i in output]
    assert len(set(ids)) == len(ids), ids
    added = [e["item"]["id"] for e in sent if e["type"] == "response.output_item.added"]
    assert added == ids
    for e in sent:
        if "item_id" in e:
            assert e["item_id"] == ids[e["output_index"]], e


def test_special_tokens_decoded_token_by_token(tmp_path: Path) -> None:
    """With the markers special tokens of the tokenizer (as o200k_harmony's are), the engine's
    detokenizer keeps them only with skip_special_tokens=False; its deltas, a token at a
    time, give the chat stream its split."""
    make_tiny_tokenizer(tmp_path, special_tokens=MARKERS)
    tok = Tokenizer.from_pretrained(tmp_path)
    text, thought, content, calls = TWO_CALLS
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert _no_marker(tok.decode(ids))  # the default decode loses the format
    detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=False)
    deltas = [detok.add_tokens([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text and "<|message|>" in deltas
    got = _streamed(_stream("openai_gptoss", OPENAI), deltas)
    assert (got["reasoning"], got["content"], got["calls"]) == (thought, content, calls)


def test_the_server_keeps_special_tokens_for_harmony(model_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--reasoning-parser openai_gptoss``: every chat request is decoded keeping special
    tokens (a request's own skip_special_tokens too), a structured output is marked for the
    engine's reasoning-aware grammar (held after ``<|channel|>final<|message|>``);
    ``--tool-call-parser openai``: requests offering tools.
    Completions are decoded as asked."""
    from conftest import serve

    seen: list[tuple[bool, str | None]] = []


    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    chat = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 3,
            "temperature": 0}
    cases: dict[str | None, list[tuple[str, dict[str, Any], bool]]] = {
        "openai_gptoss": [("chat", {}, False), ("chat", {"skip_special_tokens": True}, False),
                          ("chat", {"stream": True}, False),
                          ("chat", {"guided_choice": ["a", "b"]}, False),
                          ("chat", {"tools": tools}, False), ("completions", {}, True)],
        None: [("chat", {"tools": tools}, False), ("chat", {"stream": True}, True),
               ("chat", {"tools": tools, "tool_choice": "none"}, True)]}
    for reasoning, runs in cases.items():
        for served in serve(model_dir, reasoning_parser=reasoning, tool_call_parser="openai"):
            spy_add_request(monkeypatch, served.engine,
                            lambda p: seen.append((p.skip_special_tokens, p._reasoning)))
            for route, extra, skip in runs:
                body = {**chat, **extra} if route == "chat" else {"prompt": "Hi",
                                                                  "max_tokens": 3}
                path = "chat/completions" if route == "chat" else route
                response = httpx.post(f"{served.url}/v1/{path}", headers=AUTH, timeout=60,
                                      json=body)
                assert response.status_code == 200, response.text
                assert _no_marker(response.text)
                mark = reasoning if "guided_choice" in extra else None  # held after final
                assert seen.pop() == (skip, mark), (reasoning, route, extra)


def test_the_cli_takes_the_names(capsys: pytest.CaptureFixture[str]) -> None:
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "--reasoning-parser", "openai_gptoss",
                                      "--enable-auto-tool-choice", "--tool-call-parser",
                                      "openai"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("openai_gptoss", "openai")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--tool-call-parser", "harmony"])
    assert "argument --tool-call-parser: invalid choice: 'harmony'" in capsys.readouterr().err
    # (a reasoning parser's name is checked once a --reasoning-parser-plugin file is loaded)
    with pytest.raises(ValueError, match="reasoning_parser='harmony': allowed values are"):
        check_reasoning_parser("harmony")


def _both(text: str, size: int) -> tuple[list[Any], list[Any]]:
    """The Responses API's output items of ``text`` (deltas of ``size`` characters), whole
    and as the stream's final response gives them."""
    args = (None, "resp", "m", True, SamplingParams(max_tokens=99), _Body(), ["r"],
            [([1], None)], "openai_gptoss", OPENAI)
    deltas = [text[i:i + size] for i in range(0, len(text), size)]
    outputs = [_output(d, i == len(deltas) - 1, "stop" if i == len(deltas) - 1 else None)
               for i, d in enumerate(deltas)]
    whole = ResponsesStream(*args, request=ResponsesRequest(input="hi"))  # type: ignore[arg-type]
    whole.answers = {"r": {0: _Answer()}}
    for output in outputs:
        whole.answers["r"][0].add(output.outputs[0])

    async def events() -> list[dict[str, Any]]:
        stream = ResponsesStream(*args, request=ResponsesRequest(input="hi"))  # type: ignore[arg-type]
        stream.response_id = whole.response_id  # (the same ids)
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for output in outputs:
            sink.put_nowait(output)
        return [json.loads(line[6:]) async for chunk in stream.events(sink)
                for line in chunk.splitlines() if line.startswith("data: ")]

    return whole._whole()["output"], asyncio.run(events())[-1]["response"]["output"]


def _texts(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(i["type"], i["content"][0]["text"] if i.get("content") else i.get("name"))
            for i in items]


@pytest.mark.parametrize(("text", "want"), [
    ("<|channel|>final<|message|>Four.<|end|><|start|>assistant" + A + "checked<|end|>",
     [("message", "Four."), ("reasoning", "checked")]),
    (A + "one<|end|><|start|>assistant<|channel|>commentary<|message|>pre<|end|>"
     "<|start|>assistant<|channel|>analysis<|message|>two<|end|><|start|>assistant"
     "<|channel|>final<|message|>done", [("reasoning", "one"), ("message", "pre"),
                                         ("reasoning", "two"), ("message", "done")]),
    (A + "one<|end|><|start|>assistant<|channel|>commentary<|message|>pre<|end|>" + PARIS,
     [("reasoning", "one"), ("message", "pre"), ("function_call", "weather")]),
])
def test_the_items_follow_the_generation_order(text: str, want: list[tuple[str, str]]
                                               ) -> None:
    """Harmony's messages in any order (final text before the analysis, analysis after a
    preamble): the whole answer's output items are the stream's, one item per run of a kind
    in the order the model wrote them, as vLLM's (a message again after another kind holds
    its own text, no separator before it), however the text came in deltas (several
    messages in one: a step of several tokens)."""
    for size in (1, 7, len(text)):
        whole, streamed = _both(text, size)
        assert _texts(whole) == want, size
        for item in (*whole, *streamed):
            item.pop("call_id", None)  # (a fresh one each parse)
        assert whole == streamed, size


def test_a_stored_answer_is_one_assistant_turn() -> None:
    """An answer of several message items (a preamble, more analysis, the final text), whole
    or streamed, is kept in the store as the chat route's message: one assistant turn, its
    texts joined by a newline, with its calls."""
    from mrv2.entrypoints.responses_store import ResponseStore

    text = (A + "one<|end|><|start|>assistant<|channel|>commentary<|message|>pre<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>two<|end|><|start|>assistant"
            "<|channel|>final<|message|>done<|end|>" + PARIS)
    args = (None, "resp", "m", True, SamplingParams(max_tokens=99), _Body(), ["r"],
            [([1], None)], "openai_gptoss", OPENAI)
    store = ResponseStore()
    user = [{"role": "user", "content": "hi"}]
    outputs = [_output(c, i == len(text) - 1, "stop" if i == len(text) - 1 else None)
               for i, c in enumerate(text)]
    whole = ResponsesStream(*args, request=ResponsesRequest(input="hi"), store=store,  # type: ignore[arg-type]
                            conversation=user)
    whole.answers = {"r": {0: _Answer()}}
    for output in outputs:
        whole.answers["r"][0].add(output.outputs[0])
    whole._whole()

    async def events() -> None:
        stream = ResponsesStream(*args, request=ResponsesRequest(input="hi"), store=store,  # type: ignore[arg-type]
                                 conversation=user)
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for output in outputs:
            sink.put_nowait(output)
        async for _ in stream.events(sink):
            pass

    asyncio.run(events())
    assert len(store._items) == 2
    for record in store._items.values():
        assert [m["role"] for m in record.messages] == ["user", "assistant"]
        assert record.messages[1]["content"] == "pre\ndone"
        assert [c["function"]["name"] for c in record.messages[1]["tool_calls"]] == ["weather"]


def test_the_usage_counts_the_reasoning_tokens() -> None:
    """``output_tokens_details.reasoning_tokens``: the analysis message's tokens, from its
    ``<|message|>`` to its ``<|end|>`` (a delta a token, as the engine gives them), whole and
    streamed alike; not the headers', the final text's or the call's."""
    deltas = ["<|channel|>", "analysis", "<|message|>", "Two", " cities", ".", "<|end|>",
              "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hi", "."]
    args = (None, "resp", "m", True, SamplingParams(max_tokens=99), _Body(), ["r"],
            [([1], None)], "openai_gptoss", OPENAI)
    last = len(deltas) - 1
    outputs = [RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1],
                             outputs=[CompletionOutput(0, d, [i], "stop" if i == last else None)],
                             finished=i == last, delta=True) for i, d in enumerate(deltas)]
    whole = ResponsesStream(*args, request=ResponsesRequest(input="hi"))  # type: ignore[arg-type]
    whole.answers = {"r": {0: _Answer()}}
    for output in outputs:
        whole.answers["r"][0].add(output.outputs[0])
    usage = whole._whole()["usage"]
    assert usage["output_tokens"] == len(deltas)
    assert usage["output_tokens_details"]["reasoning_tokens"] == 5

    async def events() -> list[dict[str, Any]]:
        stream = ResponsesStream(*args, request=ResponsesRequest(input="hi"))  # type: ignore[arg-type]
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for output in outputs:
            sink.put_nowait(output)
        return [json.loads(line[6:]) async for chunk in stream.events(sink)
                for line in chunk.splitlines() if line.startswith("data: ")]

    assert asyncio.run(events())[-1]["response"]["usage"] == usage
