"""Parser plugins of ``mrv2 serve``: ``--reasoning-parser-plugin`` (a file registering a
``--reasoning-parser`` name, tags or a splitter: :func:`register_reasoning_parser`), and a
``--tool-parser-plugin`` parser that streams its calls (``ToolParser.stream``). Before them,
argparse refused ``--reasoning-parser-plugin`` (and any ``--reasoning-parser`` name not
built in), and a plugin's tool calls went out only when the answer ended."""

from __future__ import annotations

import json
import random
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, join_tool_calls
from server_util import run_serve_cli as _run

from mrv2.entrypoints.reasoning import (
    PLUGINS,
    Block,
    ReasoningParser,
    ReasoningStream,
    check_reasoning_parser,
    grammar_mark,
    keeps_special_tokens,
    register_reasoning_parser,
    split_reasoning,
    structured_refusal,
)
from mrv2.entrypoints.tool_calls import PARSERS, ToolCall, ToolParser
from mrv2.entrypoints.tool_stream import CallDelta, ToolCallStream

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# A splitter (the built-ins' contract): the answer's first 5 characters are reasoning, so
# the tiny model's random answer splits, whatever it is; and tags, END given by the test.
REASONING_PLUGIN = textwrap.dedent('''
    from mrv2.entrypoints.reasoning import Block, ReasoningParser, register_reasoning_parser

    class FirstFive:
        def __init__(self):
            self.seen = 0

        def feed(self, delta, final=False):
            cut = max(0, min(len(delta), 5 - self.seen))
            self.seen += len(delta)
            return delta[:cut], delta[cut:]

    register_reasoning_parser(ReasoningParser("first_five", splitter=FirstFive))
    register_reasoning_parser(ReasoningParser("my_tags", Block(("<plan>",), (END,), "prompt")))
''')
# The tool plugin's format: the whole answer is one call of echo, its text the argument; its
# reader streams that text as it comes.
TOOL_PLUGIN = textwrap.dedent('''
    import json

    from mrv2.entrypoints.tool_calls import ToolCall, ToolParser, register_tool_parser
    from mrv2.entrypoints.tool_stream import CallDelta

    def calls(text, tools):
        return [ToolCall(tools[0]["function"]["name"], json.dumps({"text": text}))]

    class Reader:
        def __init__(self, tools):
            self.name, self.started = tools[0]["function"]["name"], False

        def feed(self, text):
            piece = json.dumps(text)[1:-1]  # (escaped alone as within the whole string)
            if self.started:
                return [CallDelta(0, piece)]
            self.started = True
            return [CallDelta(0, '{"text": "' + piece, self.name)]

    register_tool_parser(ToolParser("echo_stream", ("",), calls, stream=Reader))
''')
TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}]


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registered parsers put back after the test (a plugin adds to them)."""
    import mrv2.entrypoints.serve_plugins as serve_plugins

    monkeypatch.setattr(serve_plugins, "_LOADED", {})
    before, tools = dict(PLUGINS), dict(PARSERS)
    yield
    PLUGINS.clear()
    PLUGINS.update(before)
    PARSERS.clear()
    PARSERS.update(tools)
    for name in ("my_reasoning_plugin", "my_tool_plugin", "bad_plugin"):
        sys.modules.pop(name, None)


def _plugin_file(tmp_path: Path, end: str = "</plan>") -> Path:
    path = tmp_path / "my_reasoning_plugin.py"
    path.write_text(f"END = {end!r}\n{REASONING_PLUGIN}")
    return path


def _chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=60, json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed chat answer's chunks' first choices."""
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += json.loads(line[6:])["choices"]
    return chunks


def _split(chunks: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    reasoning = "".join(c["delta"].get("reasoning_content") or "" for c in chunks)
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    return reasoning or None, content or None


# -- --reasoning-parser-plugin --------------------------------------------------------------

def test_a_tags_plugin_splits_whole_and_streamed_cut_anywhere(plugins: None) -> None:
    """A plugin's tags are split as the built-in parsers' (a tag cut across deltas is held
    back, never sent), the stream's parts joined being the whole answer's."""
    register_reasoning_parser(ReasoningParser("plan", Block(("<plan>",), ("</plan>",),
                                                            "output")))
    cases = {"<plan>think</plan>answer": ("think", "answer"), "no plan": (None, "no plan"),
             " <plan>cut off": ("cut off", None), "<plan></plan>x</pl": (None, "x</pl")}
    rng = random.Random(0)
    for text, want in cases.items():
        assert split_reasoning("plan", text) == want
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), 3))
            deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream = ReasoningStream("plan")
            parts = [stream.feed(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]
            joined = tuple("".join(p[k] for p in parts) or None for k in (0, 1))
            assert joined == want, deltas
            assert not any("<plan>" in r or "</plan>" in r + c for r, c in parts)


def test_a_plugin_parser_answers_through_the_chat_route(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        plugins: None) -> None:
    """The file is imported before ``--reasoning-parser`` is checked, which then takes its
    names; the server's chat answers, whole and streamed, carry each parser's split of the
    model's text (the tiny model's greedy answer, read first with no parser): a splitter's,
    and tags' (an end tag taken from that answer, so it splits it)."""
    from conftest import serve

    body = {"messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "model": MODEL}
    for served in serve(model_dir):
        text = _chat(served.url, body)["message"]["content"]
    middle = len(text) // 2
    end = text[middle:middle + 2]
    at = text.find(end)
    plugin = _plugin_file(tmp_path, end)
    for name, want in (("first_five", (text[:5], text[5:])),
                       ("my_tags", (text[:at] or None, text[at + len(end):] or None))):
        code, seen = _run(monkeypatch, "--reasoning-parser-plugin", str(plugin),
                          "--reasoning-parser", name)
        assert code == 0 and seen["reasoning_parser"] == name
        assert split_reasoning(name, text) == want
        for served in serve(model_dir, reasoning_parser=name):
            message = _chat(served.url, body)["message"]
            assert (message["reasoning_content"], message["content"]) == want, name
            assert _split(_stream(served.url, body)) == want, name
            # the engine cannot tell where a plugin's reasoning ends: a grammar is refused
            response = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH,
                                  timeout=60, json={**body, "guided_choice": ["a", "b"]})
            assert response.status_code == 400
            assert f"--reasoning-parser {name}" in response.json()["error"]["message"]


def test_structured_outputs_config_names_the_plugin_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        plugins: None) -> None:
    """vLLM's ``structured_outputs_config.reasoning_parser_plugin`` (which used to be
    refused) loads the file as the flag does; the two may not differ."""
    plugin = str(_plugin_file(tmp_path))
    config = json.dumps({"reasoning_parser_plugin": plugin, "reasoning_parser": "my_tags"})
    code, seen = _run(monkeypatch, "--structured-outputs-config", config)
    assert code == 0 and seen["reasoning_parser"] == "my_tags"
    code, _ = _run(monkeypatch, "--structured-outputs-config", config,
                   "--reasoning-parser-plugin", str(tmp_path / "other.py"))
    assert code == 2 and "disagree: give one of them" in capsys.readouterr().err


def test_one_file_for_both_plugin_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        plugins: None) -> None:
    """A file given to ``--tool-parser-plugin`` too is imported once, its reasoning parsers
    still counted for ``--reasoning-parser-plugin``."""
    plugin = str(_plugin_file(tmp_path))
    code, seen = _run(monkeypatch, "--tool-parser-plugin", plugin,
                      "--reasoning-parser-plugin", plugin, "--reasoning-parser", "first_five")
    assert code == 0 and seen["reasoning_parser"] == "first_five"


@pytest.mark.parametrize(("source", "name", "message"), [
    (None, "my_tags", r"--reasoning-parser-plugin=\S+: no such file"),
    ("raise RuntimeError('boom')", "x", r"--reasoning-parser-plugin=\S+: failed to import: "
                                        "RuntimeError: boom"),
    ("X = 1", "x", r"--reasoning-parser-plugin=\S+: the file registered no reasoning parser"),
    ("from mrv2.entrypoints.reasoning import Block, ReasoningParser, "
     "register_reasoning_parser\nregister_reasoning_parser(ReasoningParser('qwen3', "
     "Block(('<a>',), ('</a>',), 'output')))", "qwen3",
     r"failed to import: ValueError: reasoning parser 'qwen3' is registered already"),
    ("END = '</plan>'\n" + REASONING_PLUGIN, "nope",
     r"reasoning_parser='nope': allowed values are qwen3, deepseek_r1, .*, mimo, "
     r"first_five, my_tags \(or a name a --reasoning-parser-plugin file registers\)"),
])
def test_a_bad_plugin_or_name_is_refused_clearly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        plugins: None, source: str | None, name: str, message: str) -> None:
    plugin = tmp_path / "bad_plugin.py"
    if source is not None:
        plugin.write_text(source)
    code, _ = _run(monkeypatch, "--reasoning-parser-plugin", str(plugin),
                   "--reasoning-parser", name)
    assert code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_plugin_name_without_its_file_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        plugins: None) -> None:
    code, _ = _run(monkeypatch, "--reasoning-parser", "my_tags")
    assert code == 2
    assert "reasoning_parser='my_tags': allowed values are qwen3" in capsys.readouterr().err


class Content:
    """A splitter whose every delta is content."""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        return "", delta


def test_register_reasoning_parser_checks_its_argument(plugins: None) -> None:
    tags = Block(("<a>",), ("</a>",), "output")
    wrong: Any = ("<a>", "</a>", "output")  # (strings, not tuples of them)
    bad: list[tuple[Any, str]] = [
        ("qwen3", "expected a ReasoningParser"),
        (ReasoningParser("", tags), "needs a name"),
        (ReasoningParser("identity", tags), "'identity' is registered already"),
        (ReasoningParser("p"), "give its block .* or its splitter"),
        (ReasoningParser("p", tags, splitter=Content), "give its block .* or its splitter"),
        (ReasoningParser("p", Block(("<a>",), ("</a>",), "later")), "opens is 'output'"),
        (ReasoningParser("p", Block(*wrong)), "needs tuples of end tags"),
        (ReasoningParser("p", Block((), ("</a>",), "output")), "needs tuples of end tags"),
        (ReasoningParser("p", Block(("<a>",), ("",), "prompt")), "none empty"),
        (ReasoningParser("p", splitter=wrong[0]), "splitter must be a class"),
        (ReasoningParser("p", tags, grammar="granite"), "grammar='granite': expected one of"),
    ]
    for parser, message in bad:
        with pytest.raises(ValueError, match=message):
            register_reasoning_parser(parser)
    parser = register_reasoning_parser(ReasoningParser(
        "p", Block((), ("</a>",), "prompt"), special_tokens=True, grammar="deepseek_r1"))
    assert PLUGINS["p"] is parser and check_reasoning_parser("p") == "p"
    assert keeps_special_tokens("p") and grammar_mark("p") == "deepseek_r1"
    assert structured_refusal("p", None) is None
    assert split_reasoning("p", "x</a>y") == ("x", "y")
    with pytest.raises(ValueError, match="'p' is registered already"):
        register_reasoning_parser(parser)


def test_a_splitter_that_returns_no_parts_is_named(plugins: None) -> None:
    class Bad:
        def feed(self, delta: str, final: bool = False) -> Any:
            return delta

    register_reasoning_parser(ReasoningParser("bad", splitter=Bad))
    with pytest.raises(TypeError, match="reasoning parser 'bad': feed returned 'x', "
                                        "expected \\(reasoning, content\\) strings"):
        split_reasoning("bad", "x")
    assert not keeps_special_tokens("bad") and grammar_mark("bad") is None


# -- a streaming --tool-parser-plugin parser ---------------------------------------------------

def _reader(items: list[list[Any]]) -> Any:
    """A plugin reader returning ``items``, one list a feed (an Exception: raised)."""
    class Reader:
        def __init__(self, tools: Any) -> None:
            self.items = iter(items)

        def feed(self, text: str) -> list[Any]:
            found = next(self.items, [])
            if isinstance(found, Exception):
                raise found
            return found
    return Reader


def _calls(text: str, tools: Any) -> list[ToolCall]:
    """``NAME ARGS;`` calls."""
    return [ToolCall(*call.strip().split(" ", 1)) for call in text.split(";") if call.strip()]


@pytest.mark.parametrize(("items", "sent"), [
    # pieces, then a whole call: each goes out as it comes, the rest at the end
    ([[CallDelta(0, '{"a"', "f")], [CallDelta(0, ": 1")], [ToolCall("g", "{}")]],
     [(0, '{"a"', "f"), (0, ": 1", ""), (1, "{}", "g")]),
    # an item out of order (a piece of a call not begun) ends the reader's stream
    ([[CallDelta(0, '{"a"', "f")], [CallDelta(1, "x")], [ToolCall("g", "{}")]],
     [(0, '{"a"', "f")]),
    ([[CallDelta(0, "{", "f"), "junk"]], [(0, "{", "f")]),
    ([[CallDelta(0, "{", "f")], None], [(0, "{", "f")]),  # (not a list)
    # (a piece of a call before the last: calls do not interleave, as vLLM streams them)
    ([[CallDelta(0, "{", "f"), ToolCall("g", "{}"), CallDelta(0, '"a"')]],
     [(0, "{", "f"), (1, "{}", "g")]),
    ([ValueError("bad"), [ToolCall("g", "{}")]], []),  # (its ValueError, likewise)
])
def test_a_plugin_reader_streams_its_calls(items: list[Any],
                                           sent: list[tuple[int, str, str]]) -> None:
    parser = ToolParser("semi", ("",), _calls, stream=_reader(items))
    stream = ToolCallStream(parser, TOOLS)
    deltas = ['f {"a"', ": 1}", ";g {}"]
    pieces = [p for d in deltas for p in stream.feed(d)[1]]
    assert [(p.index, p.arguments, p.name) for p in pieces] == sent
    assert all(p.id for p in pieces if p.name) and len({p.id for p in pieces if p.name}) == (
        len([p for p in pieces if p.name]))
    said, rest = stream.feed("", final=True)
    calls: dict[int, list[str]] = {}
    for piece in pieces + rest:
        calls.setdefault(piece.index, []).append(piece.arguments)
    assert said == "" and stream.called
    assert {i: "".join(a) for i, a in calls.items()} == {0: '{"a": 1}', 1: "{}"}


def test_a_whole_only_plugin_still_answers_at_the_end() -> None:
    stream = ToolCallStream(ToolParser("semi", ("",), _calls), TOOLS)
    assert stream.feed("f {}")[1] == []
    assert [(p.index, p.arguments, p.name) for p in stream.feed(";", final=True)[1]] == [
        (0, "{}", "f")]


def test_a_streaming_plugin_parser_streams_through_the_chat_route(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        plugins: None) -> None:
    """A ``--tool-parser-plugin`` parser with a reader: the streamed answer's call comes in
    pieces as the model writes (its first before the answer ends), joined the whole
    answer's call."""
    from conftest import serve

    plugin = tmp_path / "my_tool_plugin.py"
    plugin.write_text(TOOL_PLUGIN)
    code, seen = _run(monkeypatch, "--tool-parser-plugin", str(plugin),
                      "--enable-auto-tool-choice", "--tool-call-parser", "echo_stream")
    assert code == 0 and seen["tool_call_parser"] == "echo_stream"
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "model": MODEL}
    for served in serve(model_dir, engine_kwargs={"chat_template": TEMPLATE},
                        tool_call_parser="echo_stream"):
        choice = _chat(served.url, body)
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        chunks = _stream(served.url, body)
        with_calls = [i for i, c in enumerate(chunks) if c["delta"].get("tool_calls")]
        assert len(with_calls) > 2 and with_calls[0] < len(chunks) - 2, chunks
        entries = [e for c in chunks for e in c["delta"].get("tool_calls") or []]
        [streamed] = join_tool_calls(entries)
        assert streamed["function"] == call["function"]
        assert [c["finish_reason"] for c in chunks if c.get("finish_reason")] == ["tool_calls"]
