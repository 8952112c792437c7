"""vLLM's frontend flags of ``mrv2 serve`` (:mod:`mrv2.entrypoints.serve_options`): the
parser takes them (they were argparse's "unrecognized arguments"), and each changes the
answers as vLLM's does, against a server without them."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

from conftest import serve
from mrv2.entrypoints.cli import build_parser
from mrv2.entrypoints.serve_options import H11_MAX_INCOMPLETE_EVENT_SIZE, ServeOptions

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FLAGS = ["--response-role", "bot", "--return-tokens-as-token-ids",
         "--enable-force-include-usage", "--default-chat-template-kwargs",
         '{"greeting": "hi", "name": "x"}', "--chat-template-content-format", "openai",
         "--exclude-tools-when-tool-choice-none", "--enable-request-id-headers",
         "--max-log-len", "100", "--enable-tokenizer-info-endpoint", "--log-error-stack",
         "--enable-server-load-tracking", "--h11-max-incomplete-event-size", "65536"]
USER = [{"role": "user", "content": "hello"}]


def _options(*flags: str) -> ServeOptions:
    return ServeOptions.from_args(build_parser().parse_args(["serve", "m", *flags]))


@pytest.fixture(scope="module")
def flagged(model_dir: Path) -> Iterator[Served]:
    yield from serve(model_dir, trust_request_chat_template=True, options=_options(*FLAGS))


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> Iterator[Served]:
    yield from serve(model_dir, trust_request_chat_template=True)


def _post(url: str, route: str, body: dict[str, Any],
          headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={"model": MODEL, **body},
                      headers={**AUTH, **(headers or {})}, timeout=60)


def _events(url: str, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    got = []
    with httpx.stream("POST", f"{url}{route}", headers=AUTH, timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got.append(json.loads(line[6:]))
    return got


def _rendered(url: str, template: str, messages: list[dict[str, Any]],
              **extra: Any) -> str:
    """The chat template's text for ``messages`` (``/tokenize`` then ``/detokenize``)."""
    ids = _post(url, "/tokenize", {"messages": messages, "chat_template": template,
                                   "add_generation_prompt": False, **extra})
    assert ids.status_code == 200, ids.text
    text = _post(url, "/detokenize", {"tokens": ids.json()["tokens"]})
    return str(text.json()["prompt"])


def test_the_parser_takes_vllms_flags() -> None:
    options = _options(*FLAGS)
    assert options == ServeOptions(
        response_role="bot", return_tokens_as_token_ids=True,
        enable_force_include_usage=True,
        default_chat_template_kwargs={"greeting": "hi", "name": "x"},
        chat_template_content_format="openai", exclude_tools_when_tool_choice_none=True,
        enable_request_id_headers=True, max_log_len=100,
        enable_tokenizer_info_endpoint=True, log_error_stack=True,
        enable_server_load_tracking=True, h11_max_incomplete_event_size=65536)
    assert _options() == ServeOptions()  # the defaults are vLLM's
    assert ServeOptions().h11_max_incomplete_event_size == 4 * 1024 * 1024


def test_serve_help_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in FLAGS:
        if flag.startswith("--"):
            assert flag in text


@pytest.mark.parametrize(("flags", "message"), [
    (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs=.*JSON obj"),
    (["--default-chat-template-kwargs", "{x"], "--default-chat-template-kwargs=.*JSON obj"),
    (["--max-log-len", "-1"], "--max-log-len=-1: expected >= 0"),
    (["--h11-max-incomplete-event-size", "0"], "--h11-max-incomplete-event-size=0"),
    (["--response-role", ""], "--response-role: expected a role name"),
])
def test_bad_values_name_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _options(*flags)


def test_serve_passes_them_to_the_server(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from test_serve_plugins import _run

    code, seen = _run(monkeypatch, *FLAGS)
    assert code == 0 and seen["options"] == _options(*FLAGS)
    assert _run(monkeypatch, "--default-chat-template-kwargs", "true")[0] == 2
    assert "--default-chat-template-kwargs='true': expected a JSON object" in (
        capsys.readouterr().err)


def test_response_role(flagged: Served, plain: Served) -> None:
    body = {"messages": USER, "max_tokens": 2, "temperature": 0}
    assert _post(flagged.url, "/v1/chat/completions", body).json()[
        "choices"][0]["message"]["role"] == "bot"
    assert _post(plain.url, "/v1/chat/completions", body).json()[
        "choices"][0]["message"]["role"] == "assistant"
    first = _events(flagged.url, "/v1/chat/completions", body)[0]
    assert first["choices"][0]["delta"]["role"] == "bot"
    beams = _post(flagged.url, "/v1/chat/completions",
                  {**body, "use_beam_search": True, "n": 2}).json()
    assert [c["message"]["role"] for c in beams["choices"]] == ["bot", "bot"]
    # without a generation prompt the answer continues the last message: its role (vLLM's;
    # mrv2 said "assistant")
    for served in (flagged, plain):
        answer = _post(served.url, "/v1/chat/completions",
                       {**body, "add_generation_prompt": False}).json()
        assert answer["choices"][0]["message"]["role"] == "user"
        first = _events(served.url, "/v1/chat/completions",
                        {**body, "add_generation_prompt": False})[0]
        assert first["choices"][0]["delta"]["role"] == "user"


def test_return_tokens_as_token_ids(flagged: Served, plain: Served) -> None:
    body = {"messages": USER, "max_tokens": 2, "temperature": 0, "logprobs": True,
            "top_logprobs": 2}

    def tokens(served: Served, **extra: Any) -> list[str]:
        choice = _post(served.url, "/v1/chat/completions", {**body, **extra}).json()[
            "choices"][0]
        content = choice["logprobs"]["content"]
        return [e["token"] for e in content] + [t["token"] for e in content
                                                for t in e["top_logprobs"]]

    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens(flagged))
    assert not any(t.startswith("token_id:") for t in tokens(plain))
    # the request's own field wins, either way
    assert not any(t.startswith("token_id:")
                   for t in tokens(flagged, return_tokens_as_token_ids=False))
    assert all(t.startswith("token_id:") for t in tokens(plain, return_tokens_as_token_ids=True))
    completion = _post(flagged.url, "/v1/completions", {
        "prompt": "hi", "max_tokens": 2, "temperature": 0, "logprobs": 1}).json()
    assert all(t.startswith("token_id:") for t in completion["choices"][0]["logprobs"]["tokens"])


def test_force_include_usage(flagged: Served, plain: Served) -> None:
    routes: list[tuple[str, dict[str, Any]]] = [("/v1/completions", {"prompt": "hi"}),
                                                ("/v1/chat/completions", {"messages": USER})]
    for route, given in routes:
        body = {**given, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        events = _events(flagged.url, route, body)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
        assert all("usage" not in e for e in events[:-1])  # (no continuous usage unasked)
        assert all("usage" not in e for e in _events(plain.url, route, body))
        asked = _events(flagged.url, route, {**body, "stream_options": {
            "include_usage": False, "continuous_usage_stats": True}})
        assert asked[-1]["usage"]["completion_tokens"] == 3
        assert all("usage" in e for e in asked)


def test_default_chat_template_kwargs(flagged: Served, plain: Served) -> None:
    template = "[{{ greeting }}|{{ name }}]"
    assert _rendered(flagged.url, template, USER) == "[hi|x]"
    assert _rendered(flagged.url, template, USER,
                     chat_template_kwargs={"greeting": "yo"}) == "[yo|x]"  # the request's win
    assert _rendered(plain.url, template, USER) == "[|]"
    # the chat route renders them too: a longer prompt
    body = {"messages": USER, "max_tokens": 1, "chat_template": template}
    with_defaults = _post(flagged.url, "/v1/chat/completions", body).json()
    without = _post(plain.url, "/v1/chat/completions", body).json()
    assert with_defaults["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]


def test_chat_template_content_format(flagged: Served, plain: Served) -> None:
    template = ("{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}"
                "{% else %}L{{ m['content'] | length }}:{% for p in m['content'] %}"
                "{{ p['type'] }}={{ p['text'] }};{% endfor %}{% endif %}/{% endfor %}")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b"}]}]
    assert _rendered(flagged.url, template, messages) == "L1:text=be brief;/L2:text=a;text=b;/"
    # auto (vLLM's): a template that loops over a message's content is given parts
    assert _rendered(plain.url, template, messages) == "L1:text=be brief;/L2:text=a;text=b;/"
    # ... one that reads no parts (the same content as a string test) one string
    plain_template = ("{% for m in messages %}{% if m['content'] is string %}S:"
                      "{{ m['content'] }}{% else %}L{% endif %}/{% endfor %}")
    assert _rendered(plain.url, plain_template, messages) == "S:be brief/S:a\nb/"
    # a template written for parts alone (no string case): the texts, not its characters
    parts_only = ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }};"
                  "{% endfor %}/{% endfor %}")
    assert _rendered(plain.url, parts_only, messages) == "be brief;/a;b;/"


def test_content_format_auto_reads_the_servers_template(plain: Served) -> None:
    """auto detects on the template the server renders (its tokenizer's, or the one of
    --chat-template), the chat route's too; the start-up log names what it found."""
    tokenizer = plain.engine.tokenizer
    assert tokenizer is not None
    own = tokenizer.hf.chat_template
    parts_only = ("{% for m in messages %}<|{{ m['role'] }}|>{% for p in m['content'] %}"
                  "{{ p['text'] }}{% endfor %}</s>{% endfor %}")
    messages = [{"role": "user", "content": "Hello world"}]
    try:
        tokenizer.set_chat_template(parts_only)
        ids = _post(plain.url, "/tokenize", {"messages": messages,
                                             "add_generation_prompt": False})
        assert ids.status_code == 200, ids.text
        assert ids.json()["tokens"] == tokenizer.encode("<|user|>Hello world</s>", False)
        answer = _post(plain.url, "/v1/chat/completions", {"messages": messages,
                                                            "max_tokens": 1})
        assert answer.json()["usage"]["prompt_tokens"] == len(ids.json()["tokens"])
    finally:
        tokenizer.set_chat_template(own)


def test_content_format_auto_is_logged_at_start(plain: Served,
                                                caplog: pytest.LogCaptureFixture) -> None:
    from mrv2.entrypoints.server import create_app

    name = "mrv2.entrypoints.content_format"
    with caplog.at_level(logging.INFO, logger=name):
        create_app(plain.engine, MODEL, API_KEY)
        create_app(plain.engine, MODEL, API_KEY, options=_options(
            "--chat-template-content-format", "openai"))  # (no detection: no line)
    lines = [r.getMessage() for r in caplog.records if r.name == name]
    assert len(lines) == 1 and "content format detected: 'string'" in lines[0]


def test_exclude_tools_when_tool_choice_none(flagged: Served, plain: Served) -> None:
    template = ("{% if tools %}TOOLS:{{ tools | length }}{% endif %}{% for m in messages %}"
                "{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {"messages": USER, "max_tokens": 1, "chat_template": template, "tools": tools,
            "tool_choice": "none"}

    def prompt_tokens(served: Served, **extra: Any) -> int:
        answer = _post(served.url, "/v1/chat/completions", {**body, **extra})
        assert answer.status_code == 200, answer.text
        return int(answer.json()["usage"]["prompt_tokens"])

    for served in (flagged, plain):  # (the flagged server's content is parts: its own bare)
        bare = prompt_tokens(served, tools=None, tool_choice=None)
        if served is flagged:
            assert prompt_tokens(served) == bare
        else:  # vLLM's default: the template still lists them
            assert prompt_tokens(served) > bare


def test_request_id_headers(flagged: Served, plain: Served) -> None:
    given = httpx.get(f"{flagged.url}/v1/models", headers={**AUTH, "X-Request-Id": "abc-1"})
    assert given.headers["x-request-id"] == "abc-1"
    fresh = httpx.get(f"{flagged.url}/v1/models", headers=AUTH).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", fresh)
    refused = httpx.get(f"{flagged.url}/v1/models")  # (no key: the 401 carries it too)
    assert refused.status_code == 401 and "x-request-id" in refused.headers
    answer = _post(flagged.url, "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                   headers={"X-Request-Id": "gen-7"})
    assert answer.headers["x-request-id"] == "gen-7"
    assert "x-request-id" not in httpx.get(f"{plain.url}/v1/models", headers=AUTH).headers


def test_tokenizer_info_endpoint(flagged: Served, plain: Served) -> None:
    info = httpx.get(f"{flagged.url}/tokenizer_info")
    assert info.status_code == 200, info.text
    body = info.json()
    tokenizer = flagged.engine.tokenizer
    assert tokenizer is not None and body["tokenizer_class"] == type(tokenizer.hf).__name__
    assert "<|assistant|>" in body["chat_template"]
    assert not any(key.endswith("_file") for key in body)
    assert httpx.get(f"{plain.url}/tokenizer_info", headers=AUTH).status_code == 404


def test_log_error_stack(flagged: Served, plain: Served,
                         caplog: pytest.LogCaptureFixture) -> None:
    bad = {"messages": USER, "max_tokens": 1, "n": 1000}
    with caplog.at_level(logging.ERROR, logger="mrv2.entrypoints.server"):
        assert _post(plain.url, "/v1/chat/completions", bad).status_code == 400
        assert not [r for r in caplog.records if r.name == "mrv2.entrypoints.server"]
        assert _post(flagged.url, "/v1/chat/completions", bad).status_code == 400
    records = [r for r in caplog.records if r.name == "mrv2.entrypoints.server"]
    assert len(records) == 1 and records[0].exc_info is not None
    assert "POST /v1/chat/completions: 400" in records[0].getMessage()


def _held_request(url: str, release: threading.Event) -> threading.Thread:
    """A completion request whose body waits for ``release``: in flight until then."""
    def body() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL.encode()
        release.wait(30)
        yield b'", "prompt": "hi", "max_tokens": 1}'

    thread = threading.Thread(target=lambda: httpx.post(
        f"{url}/v1/completions", content=body(), timeout=60,
        headers={**AUTH, "Content-Type": "application/json"}))
    thread.start()
    return thread


def test_server_load_tracking(flagged: Served, plain: Served) -> None:
    def load(served: Served) -> int:
        answer = httpx.get(f"{served.url}/load")  # (open, as vLLM's: no key)
        assert answer.status_code == 200
        return int(answer.json()["server_load"])

    for served, expected in ((flagged, 1), (plain, 0)):
        assert load(served) == 0
        release = threading.Event()
        thread = _held_request(served.url, release)
        deadline = time.monotonic() + 10
        while expected and load(served) != expected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert load(served) == expected
        release.set()
        thread.join(60)
        assert load(served) == 0


def _big_header_status(engine: Any, options: ServeOptions | None) -> int:
    """The status (400: refused) of a request with a 1 MB header to a server
    :func:`make_server` built, on uvicorn's h11 protocol (where httptools is installed
    uvicorn takes it by default; the flag is h11's)."""
    from mrv2.entrypoints.server import create_app
    from mrv2.entrypoints.server_run import make_server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    app = create_app(engine, MODEL, API_KEY, options=options)
    server = make_server(app, "127.0.0.1", port, "warning", False, options=options)
    assert server.config.h11_max_incomplete_event_size == (
        options or ServeOptions()).h11_max_incomplete_event_size
    server.config.http = "h11"
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            return httpx.get(f"{url}/health", headers={"X-Big": "a" * 1_000_000},
                             timeout=10).status_code
        except httpx.TransportError:  # (refused: a 400 and the connection closed midway)
            return 400
    finally:
        server.should_exit = True
        thread.join(10)


def test_h11_max_incomplete_event_size(flagged: Served) -> None:
    """vLLM's default (4 MiB) takes a request head h11's own (16 kB, uvicorn's default: mrv2
    refused it) does not."""
    assert _big_header_status(flagged.engine, None) == 200
    assert _big_header_status(flagged.engine, ServeOptions(
        h11_max_incomplete_event_size=16 * 1024)) == 400
    assert H11_MAX_INCOMPLETE_EVENT_SIZE == 4 * 1024 * 1024
