"""Raw HTTP: bad input gets OpenAI's error JSON with the right status, never a 500."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server: Served, path: str, body: object, headers: dict[str, str] | None = None,
          raw: bytes | None = None) -> httpx.Response:
    kwargs: dict[str, object] = {"content": raw} if raw is not None else {"json": body}
    return httpx.post(f"{server.url}{path}", headers=headers or AUTH, timeout=30,
                      **kwargs)  # type: ignore[arg-type]


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


def test_health_without_key_and_auth(server: Served) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    _error(httpx.get(f"{server.url}/v1/models"), 401)
    _error(httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer no"}), 401)
    _error(_post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"},
                 headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH).status_code == 200


def test_malformed_json(server: Served) -> None:
    _error(_post(server, "/v1/completions", None, raw=b"{not json"), 400)
    _error(_post(server, "/v1/chat/completions", None, raw=b"[1, 2]"), 400)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 2.0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": 3.5}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [1, 100000]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [999]}, "stop_token_ids"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
])
def test_bad_parameters(server: Served, body: dict[str, object], param: str) -> None:
    error = _error(_post(server, "/v1/completions", {"model": MODEL, **body}), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_bad_chat(server: Served) -> None:
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": "hi"}), 400)
    _error(_post(server, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400)
    error = _error(_post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        400)
    assert error["param"] == "top_logprobs"


def test_unknown_model(server: Served) -> None:
    error = _error(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404)
    assert "gpt-9" in str(error["message"])


def test_prompt_too_long(server: Served) -> None:
    error = _error(_post(server, "/v1/completions",
                         {"model": MODEL, "prompt": [5] * 64, "max_tokens": 1}), 400)
    assert "max_model_len is 64" in str(error["message"])
    assert "63" in str(error["message"])


def test_metrics(server: Served) -> None:
    _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    for name in ("mrv2_num_requests_running", "mrv2_num_requests_waiting",
                 "mrv2_kv_cache_usage_perc", "mrv2_prefix_cache_hit_rate",
                 "mrv2_num_preemptions_total", "mrv2_prompt_tokens_total",
                 "mrv2_generation_tokens_total", "mrv2_time_to_first_token_seconds_bucket",
                 "mrv2_time_per_output_token_seconds_count", "mrv2_request_success_total",
                 "mrv2_spec_decode_num_draft_tokens_total",
                 "mrv2_spec_decode_num_accepted_tokens_total"):
        assert name in text


def test_bench_serve_against_server(server: Served, capsys: pytest.CaptureFixture[str]) -> None:
    from mrv2.entrypoints.cli import main

    rc = main(["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--rates", "50",
               "inf", "--num-requests", "6", "--max-tokens", "4", "--prompt-len", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "inf" in out and "TTFT" in out
    assert "   6    0" in out  # every request completed at both rates


def test_unsupported_chat_features_are_refused(server: Served) -> None:
    messages = [{"role": "user", "content": "x"}]
    error = _error(_post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "tools": [{"type": "function"}]}), 400)
    assert error["param"] == "tools"
    error = _error(_post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "response_format": {"type": "json_object"}}), 400)
    assert error["param"] == "response_format"


def test_queue_full_raises_before_queueing(model_dir: Path) -> None:
    """The engine thread refuses a request past ``max_pending``; the server maps it to 503."""
    import asyncio

    from server_util import ENGINE_KWARGS

    from mrv2 import EngineConfig, SamplingParams
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.engine_thread import EngineThread, QueueFullError

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    worker = EngineThread(engine, max_pending=1)
    loop = asyncio.new_event_loop()
    sink: asyncio.Queue[object] = asyncio.Queue()
    params = SamplingParams(max_tokens=2)
    try:
        worker.submit("a", [5, 6], params, None, sink, loop)  # type: ignore[arg-type]
        with pytest.raises(QueueFullError, match="max-pending 1"):
            worker.submit("b", [5, 6], params, None, sink, loop)  # type: ignore[arg-type]
        assert worker.num_pending == 1
    finally:
        loop.close()


def test_queue_full_is_503_over_http_and_the_server_recovers(model_dir: Path) -> None:
    import time

    from conftest import serve

    servers = serve(model_dir, max_pending=1)
    small = next(servers)
    step = small.engine.step

    def slow_step() -> list[object]:
        time.sleep(0.02)  # keep the first request in flight while the second arrives
        return step()  # type: ignore[return-value]

    small.engine.step = slow_step  # type: ignore[method-assign]
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{small.url}/v1/completions", json=body, headers=AUTH,
                          timeout=30) as first:
            lines = first.iter_lines()  # keep it: dropping the iterator closes the stream
            assert next(lines).startswith("data: ")
            error = _error(_post(small, "/v1/completions", {"model": MODEL, "prompt": "hi"}),
                           503)
            assert "max-pending 1" in str(error["message"])
        # closing the stream aborted the first request; the server takes new ones again
        deadline = time.monotonic() + 20
        while small.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _post(small, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                               "max_tokens": 2}).status_code == 200
    finally:
        next(servers, None)  # runs the generator's shutdown


def test_speculation_over_http_same_text_and_counted(server: Served) -> None:
    from conftest import serve

    body = {"model": MODEL, "prompt": "The capital of France is Paris. The capital of",
            "max_tokens": 12, "temperature": 0}
    plain = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    servers = serve(server.model_dir, engine_kwargs=spec)
    other = next(servers)
    try:
        got = _post(other, "/v1/completions", body).json()["choices"][0]["text"]
        text = httpx.get(f"{other.url}/metrics", headers=AUTH).text
    finally:
        next(servers, None)  # runs the generator's shutdown
    assert got == plain
    drafts = [line for line in text.splitlines()
              if line.startswith("mrv2_spec_decode_num_draft_tokens_total{")]
    assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0
