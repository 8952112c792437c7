"""``mrv2 serve``'s HTTP options (vLLM's flags): CORS, the root path, TLS, the docs pages;
bad values refused before the engine loads, naming the flag."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL

from mrv2 import EngineConfig
from mrv2.engine.engine import LLMEngine
from mrv2.entrypoints.cli import build_parser
from mrv2.entrypoints.http_options import HTTPOptions

DATA = Path(__file__).parent / "data"
KEY, CERT = str(DATA / "tls_test.key"), str(DATA / "tls_test.crt")
TRUST = ssl.create_default_context(cafile=CERT)  # a client that trusts the test certificate
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def _options(*flags: str) -> HTTPOptions:
    return HTTPOptions.from_args(build_parser().parse_args(["serve", "m", *flags]))


@pytest.mark.parametrize(("flags", "message"), [
    (["--allowed-origins", "*"], "--allowed-origins='\\*': expected a JSON list of strings"),
    (["--allowed-methods", '["GET", 3]'], "--allowed-methods=.*JSON list of strings"),
    (["--root-path", "api"], "--root-path='api': expected a path such as /api"),
    (["--ssl-keyfile", KEY], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/no/such.key", "--ssl-certfile", CERT],
     "--ssl-keyfile='/no/such.key': no such file"),
    (["--ssl-keyfile", KEY, "--ssl-certfile", CERT, "--ssl-cert-reqs", "3"],
     "--ssl-cert-reqs=3: allowed values are 0 .*, 1 .*, 2"),
    (["--ssl-keyfile", KEY, "--ssl-certfile", CERT, "--ssl-cert-reqs", "2"],
     "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs"),
    (["--allow-credentials"], "--allow-credentials with --allowed-origins"),
])
def test_bad_options_name_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _options(*flags).check()


def test_the_defaults_are_vllms() -> None:
    options = _options()
    options.check()
    assert options == HTTPOptions()
    assert options.allowed_origins == ("*",) and not options.allow_credentials
    assert options.scheme == "http" and options.uvicorn_kwargs() == {}
    tls = _options("--ssl-keyfile", KEY, "--ssl-certfile", CERT)
    tls.check()
    assert tls.scheme == "https" and tls.uvicorn_kwargs()["ssl_certfile"] == CERT
    assert _options("--root-path", "/llm").uvicorn_kwargs() == {"root_path": "/llm"}


def test_serve_refuses_a_bad_option_before_the_engine_loads(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.engine_process as process_module
    import mrv2.entrypoints.server  # noqa: F401 (imported before the patch: it keeps the names)
    from mrv2.entrypoints.cli import main

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine was built")

    monkeypatch.setattr(engine_module, "LLMEngine", refuse)
    monkeypatch.setattr(process_module, "RemoteEngine", refuse)
    assert main(["serve", "m", "--device", "cpu", "--port", "0",
                 "--ssl-certfile", CERT]) == 2
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-pending", "0"], "--max-pending=0: expected >= 1"),
    (["--max-n", "0"], "--max-n=0: expected >= 1"),
    (["--port", "70000"], "--port=70000: expected 0 to 65535"),
])
def test_serve_refuses_a_bad_server_flag_before_the_engine_loads(
        flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """They were checked once the engine had loaded (``--max-pending 0``, ``--max-n 0``: a
    message naming create_app's parameters), or not at all (``--port 70000``: bind's
    OverflowError, a traceback)."""
    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.engine_process as process_module
    import mrv2.entrypoints.server  # noqa: F401 (imported before the patch: it keeps the names)
    from mrv2.entrypoints.cli import main

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine was built")

    monkeypatch.setattr(engine_module, "LLMEngine", refuse)
    monkeypatch.setattr(process_module, "RemoteEngine", refuse)
    assert main(["serve", "m", "--device", "cpu", "--port", "0", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))


def _serve(engine: LLMEngine, http: HTTPOptions) -> Iterator[str]:
    """The app on a free local port through :func:`make_server` (TLS included); yields its
    URL once ``/health`` answers."""
    import socket

    from mrv2.entrypoints.server import create_app
    from mrv2.entrypoints.server_run import make_server

    app = create_app(engine, MODEL, API_KEY, http=http)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = make_server(app, "127.0.0.1", port, "warning", False, http)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"{http.scheme}://127.0.0.1:{port}"
    verify: Any = TRUST if http.ssl_certfile else True
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1, verify=verify).status_code == 200:
                break
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)


def test_cors_preflight_is_answered_before_the_key_is_asked_for(engine: LLMEngine) -> None:
    for url in _serve(engine, HTTPOptions()):
        origin = {"Origin": "https://app.example"}
        pre = httpx.options(f"{url}/v1/completions", headers={**origin, **PREFLIGHT})
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        denied = httpx.get(f"{url}/v1/models", headers=origin)  # no key: 401, CORS headers on
        assert denied.status_code == 401
        assert denied.headers["access-control-allow-origin"] == "*"
        ok = httpx.get(f"{url}/v1/models", headers={**origin, **AUTH})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"


def test_listed_origins_only(engine: LLMEngine) -> None:
    http = HTTPOptions(allowed_origins=("https://app.example",), allow_credentials=True)
    for url in _serve(engine, http):
        good = httpx.options(f"{url}/v1/completions",
                             headers={"Origin": "https://app.example", **PREFLIGHT})
        assert good.status_code == 200
        assert good.headers["access-control-allow-origin"] == "https://app.example"
        assert good.headers["access-control-allow-credentials"] == "true"
        bad = httpx.options(f"{url}/v1/completions",
                            headers={"Origin": "https://evil.example", **PREFLIGHT})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        plain = httpx.get(f"{url}/v1/models", headers={"Origin": "https://evil.example", **AUTH})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_root_path_and_docs(engine: LLMEngine) -> None:
    for url in _serve(engine, HTTPOptions(root_path="/llm", allowed_origins=())):
        spec = httpx.get(f"{url}/openapi.json", headers=AUTH)
        assert spec.status_code == 200 and spec.json()["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in httpx.get(f"{url}/docs", headers=AUTH).text
        # the proxy strips the prefix (uvicorn's and vLLM's meaning of the root path)
        assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200  # no key for health, still
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert "access-control-allow-origin" not in httpx.get(
            f"{url}/v1/models", headers={"Origin": "https://a.example", **AUTH}).headers
    for url in _serve(engine, HTTPOptions(disable_fastapi_docs=True)):
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{url}{path}", headers=AUTH).status_code == 404, path
        assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200


def test_tls(engine: LLMEngine) -> None:
    http = HTTPOptions(ssl_keyfile=KEY, ssl_certfile=CERT)
    http.check()
    for url in _serve(engine, http):
        assert url.startswith("https://")
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, verify=TRUST, timeout=60, json={
            "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0
        with pytest.raises(httpx.HTTPError):  # a client that does not trust the certificate
            httpx.get(f"{url}/health", verify=True, timeout=5)
        with pytest.raises(httpx.HTTPError):  # plain HTTP to a TLS port
            httpx.get(url.replace("https://", "http://") + "/health", timeout=5)


def _serve_args(flags: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, dict[str, Any]]:
    """``mrv2 serve`` with the engine and the server stubbed: its exit code and what it passed
    to run_server."""
    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.server_run as run_module
    from mrv2.entrypoints.cli import main

    seen: dict[str, Any] = {}

    def run_server(engine: Any, host: str, port: int, names: Any, api_key: str | None,
                   *args: Any, **kwargs: Any) -> int:
        seen.update(kwargs, api_key=api_key)
        return 0

    monkeypatch.setattr(engine_module, "LLMEngine", lambda config: object())
    monkeypatch.setattr(run_module, "run_server", run_server)
    monkeypatch.setattr(run_module, "listen_socket", lambda host, port: None)
    code = main(["serve", "m", "--device", "cpu", "--load-format", "dummy",
                 "--no-engine-process", *flags])
    return code, seen


@pytest.mark.parametrize("flag", ["--disable-log-requests", "--enable-log-requests"])
def test_vllms_log_requests_flags_are_accepted(flag: str, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """vLLM launch scripts pass them; mrv2 never logs request contents: a no-op (they were
    argparse's "unrecognized arguments")."""
    assert _serve_args([flag], monkeypatch)[0] == 0
    with pytest.raises(SystemExit):  # other unknown flags are still refused
        build_parser().parse_args(["serve", "m", "--disable-log-everything"])


def test_vllm_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM reads VLLM_API_KEY when --api-key is absent: a server its user believes keyed came
    up open."""
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert _serve_args([], monkeypatch)[1]["api_key"] == "env-key"
    assert _serve_args(["--api-key", "flag-key"], monkeypatch)[1]["api_key"] == "flag-key"
    monkeypatch.delenv("VLLM_API_KEY")
    assert _serve_args([], monkeypatch)[1]["api_key"] is None


def test_tool_call_parser_without_auto_tool_choice_is_vllms(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM refuses --enable-auto-tool-choice without a parser only; a parser alone serves
    (auto tool choice off: forced tool_choice still works, "auto" requests are refused)."""
    code, seen = _serve_args(["--tool-call-parser", "hermes"], monkeypatch)
    assert code == 0 and seen["tool_call_parser"] is None
    code, seen = _serve_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                             monkeypatch)
    assert code == 0 and seen["tool_call_parser"] == "hermes"
    assert _serve_args(["--enable-auto-tool-choice"], monkeypatch)[0] == 2
    assert "--enable-auto-tool-choice requires --tool-call-parser" in capsys.readouterr().err
