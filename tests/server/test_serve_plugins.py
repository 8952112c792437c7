"""vLLM's ``mrv2 serve`` flags for user extensions and API-server processes
(:mod:`mrv2.entrypoints.serve_plugins`): ``--tool-parser-plugin`` (a file registering a
``--tool-call-parser`` name), ``--middleware``, ``--disable-frontend-multiprocessing``,
``--api-server-count``, ``--headless``. Before them, argparse refused each as unrecognized."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_util import API_KEY, MODEL, join_tool_calls
from server_util import run_serve_cli as _run

from mrv2.entrypoints.cli import main
from mrv2.entrypoints.tool_calls import PARSERS, ToolCall, ToolParser, register_tool_parser

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}]
# The plugin's format: the whole answer is one call of echo, its text the argument (so the
# tiny model's random answer is a call, whatever it is).
PLUGIN = textwrap.dedent('''
    import json

    from mrv2.entrypoints.tool_calls import ToolCall, ToolParser, register_tool_parser

    def calls(text, tools):
        return [ToolCall(tools[0]["function"]["name"], json.dumps({"text": text}))]

    register_tool_parser(ToolParser("echo_all", ("",), calls))
''')
MIDDLEWARE = textwrap.dedent('''
    class Stamp:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            async def stamped(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-stamp", b"class")]}
                await send(message)
            await self.app(scope, receive, stamped)

    async def stamp(request, call_next):
        response = await call_next(request)
        response.headers["x-stamp-fn"] = "function"
        return response

    NOT_MIDDLEWARE = 3
''')


@pytest.fixture
def parsers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registered parsers put back after the test (a plugin adds to them)."""
    import mrv2.entrypoints.serve_plugins as serve_plugins

    monkeypatch.setattr(serve_plugins, "_LOADED", {})
    before = dict(PARSERS)
    yield
    PARSERS.clear()
    PARSERS.update(before)
    sys.modules.pop("my_tool_plugin", None)


@pytest.fixture
def middleware_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_middleware.py").write_text(MIDDLEWARE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_middleware", raising=False)
    return "my_middleware"


def test_a_plugin_parser_answers_whole_and_streamed(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        parsers: None) -> None:
    """The plugin file is imported before the flags are checked: --tool-call-parser takes its
    name, and the server's answers carry the calls it parses, whole and streamed."""
    from conftest import serve

    plugin = tmp_path / "my_tool_plugin.py"
    plugin.write_text(PLUGIN)
    code, seen = _run(monkeypatch, "--tool-parser-plugin", str(plugin),
                      "--enable-auto-tool-choice", "--tool-call-parser", "echo_all")
    assert code == 0 and seen["tool_call_parser"] == "echo_all"
    again = _run(monkeypatch, "--tool-parser-plugin", str(plugin),  # (imported once)
                 "--enable-auto-tool-choice", "--tool-call-parser", "echo_all")
    assert again == (0, seen)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "max_tokens": 3, "temperature": 0, "model": MODEL}
    for served in serve(model_dir, engine_kwargs={"chat_template": TEMPLATE},
                        tool_call_parser="echo_all"):
        answer = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                            json=body).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", answer
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "echo"
        text = json.loads(call["function"]["arguments"])["text"]
        deltas = []
        with httpx.stream("POST", f"{served.url}/v1/chat/completions", headers=AUTH,
                          timeout=60, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    deltas.append(json.loads(line[6:]))
        entries = [e for d in deltas for c in d["choices"]
                   for e in c["delta"].get("tool_calls") or []]
        [streamed] = join_tool_calls(entries)
        assert streamed["function"]["name"] == "echo"
        assert json.loads(streamed["function"]["arguments"]) == {"text": text}
        assert [c["finish_reason"] for d in deltas for c in d["choices"]
                if c.get("finish_reason")] == ["tool_calls"]


def test_without_the_plugin_the_name_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _run(monkeypatch, "--enable-auto-tool-choice", "--tool-call-parser", "echo_all")
    assert "--tool-call-parser: invalid choice: 'echo_all'" in capsys.readouterr().err


@pytest.mark.parametrize(("source", "message"), [
    (None, "--tool-parser-plugin=.*: no such file"),
    ("raise RuntimeError('boom')", "--tool-parser-plugin=.*: failed to import: "
                                   "RuntimeError: boom"),
    ("from mrv2.entrypoints.tool_calls import ToolParser, register_tool_parser\n"
     "register_tool_parser(ToolParser('hermes', ('<x>',), lambda text, tools: []))",
     "--tool-parser-plugin=.*: failed to import: ValueError: tool parser 'hermes' is "
     "registered already"),
])
def test_a_bad_plugin_names_the_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str], parsers: None,
                                     source: str | None, message: str) -> None:
    import re

    plugin = tmp_path / "my_tool_plugin.py"
    if source is not None:
        plugin.write_text(source)
    code, _ = _run(monkeypatch, "--tool-parser-plugin", str(plugin))
    assert code == 2
    assert re.search(message, capsys.readouterr().err)


def test_register_tool_parser_checks_its_argument(parsers: None) -> None:
    with pytest.raises(ValueError, match="expected a ToolParser"):
        register_tool_parser(lambda text, tools: [])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs its markers"):
        register_tool_parser(ToolParser("nomarks", (), lambda text, tools: []))
    parser = register_tool_parser(ToolParser(
        "plus", ("+",), lambda text, tools: [ToolCall(text[1:], "{}")]))
    assert PARSERS["plus"] is parser
    content, calls = parser.parse("see +now")
    assert content == "see " and [(c.name, c.arguments) for c in calls] == [("now", "{}")]
    with pytest.raises(ValueError, match="'plus' is registered already"):
        register_tool_parser(parser)


def test_middleware_adds_headers(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                 middleware_module: str) -> None:
    """A class and a function, each by its import path, as vLLM's --middleware."""
    from conftest import serve

    code, seen = _run(monkeypatch, "--middleware", f"{middleware_module}.Stamp",
                      "--middleware", f"{middleware_module}.stamp")
    assert code == 0 and len(seen["middleware"]) == 2
    for served in serve(model_dir, middleware=seen["middleware"]):
        response = httpx.get(f"{served.url}/v1/models", headers=AUTH, timeout=60)
        assert response.status_code == 200
        assert response.headers["x-stamp"] == "class"
        assert response.headers["x-stamp-fn"] == "function"
    for served in serve(model_dir):
        assert "x-stamp" not in httpx.get(f"{served.url}/v1/models", headers=AUTH,
                                          timeout=60).headers


@pytest.mark.parametrize(("path", "message"), [
    ("nodots", "--middleware=nodots: expected an import path module.attr"),
    ("no_such_module_xyz.M", "--middleware=no_such_module_xyz.M: cannot import"),
    ("{m}.Missing", "--middleware={m}.Missing: {m} has no Missing"),
    ("{m}.NOT_MIDDLEWARE", "--middleware={m}.NOT_MIDDLEWARE: expected an ASGI middleware"),
])
def test_bad_middleware_names_the_flag(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str],
                                       middleware_module: str, path: str,
                                       message: str) -> None:
    code, _ = _run(monkeypatch, "--middleware", path.format(m=middleware_module))
    assert code == 2
    assert message.format(m=middleware_module) in capsys.readouterr().err


def test_disable_frontend_multiprocessing_runs_the_engine_in_process(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import mrv2.entrypoints.engine_process as process_module

    built: list[str] = []
    monkeypatch.setattr(process_module, "RemoteEngine",
                        lambda config, pending: built.append("process"))
    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.server_run as run_module

    monkeypatch.setattr(engine_module, "LLMEngine", lambda config: built.append("thread"))
    monkeypatch.setattr(run_module, "run_server", lambda *a, **k: 0)
    monkeypatch.setattr(run_module, "listen_socket", lambda host, port: None)
    base = ["serve", "m", "--device", "cpu", "--load-format", "dummy"]
    assert main([*base, "--disable-frontend-multiprocessing"]) == 0
    assert main(base) == 0
    assert built == ["thread", "process"]
    assert main([*base, "--disable-frontend-multiprocessing", "--engine-process"]) == 2
    assert "leave --engine-process out" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--api-server-count", "2"], "--api-server-count=2: mrv2 runs one API server process"),
    (["--api-server-count", "0"], "--api-server-count=0"),
    (["--headless"], "--headless: mrv2 has no multi-node engine"),
])
def test_refused_process_flags_name_the_flag(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str],
                                             flags: list[str], message: str) -> None:
    code, _ = _run(monkeypatch, *flags)
    assert code == 2 and message in capsys.readouterr().err
    assert _run(monkeypatch, "--api-server-count", "1")[0] == 0
