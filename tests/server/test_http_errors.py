"""Raw HTTP: bad input gets OpenAI's error JSON with the right status, never a 500."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

from conftest import serve
from mrv2.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest

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
    """The key guards every route but the informational ones: a Prometheus scrape,
    ``/tokenize`` and ``/version`` need none; ``/v1/*`` and the serving routes outside it
    (``/pooling``) do."""
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/version").status_code == 200
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).status_code == 200
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [5]}).status_code == 200
    _error(httpx.get(f"{server.url}/v1/models"), 401)
    _error(httpx.post(f"{server.url}/pooling", json={"model": MODEL, "input": "hi"}), 401)
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
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),  # (vLLM's [0, 2])
    ({"prompt": "hi", "temperature": 0, "n": 2}, "n"),  # (vLLM's: greedy takes n 1 only)
    ({"prompt": "hi", "top_p": 2.0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": 3.5}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [1, 100000]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [999]}, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {"999": 1.0}}, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "prompt_logprobs": -1}, "prompt_logprobs"),
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
                 "mrv2_num_preemptions_total", "mrv2_kv_cache_window_freed_blocks_total",
                 "mrv2_prompt_tokens_total",
                 "mrv2_generation_tokens_total", "mrv2_time_to_first_token_seconds_bucket",
                 "mrv2_time_per_output_token_seconds_count", "mrv2_request_success_total",
                 "mrv2_spec_decode_num_draft_tokens_total",
                 "mrv2_spec_decode_num_accepted_tokens_total"):
        assert name in text
    # one process (the engine on a thread): the server's collector pauses only
    assert 'mrv2_gc_pause_seconds_total{model_name="tiny",process="server"}' in text
    assert 'process="engine"' not in text


def test_bench_serve_against_server(server: Served, capsys: pytest.CaptureFixture[str],
                                    tmp_path: Path) -> None:
    import json

    from mrv2.entrypoints.cli import main

    rc = main(["bench", "serve", "--url", server.url, "--api-key", API_KEY, "--rates", "50",
               "inf", "--num-requests", "6", "--max-tokens", "4", "--prompt-len", "3",
               "--json", str(tmp_path / "rows.json"), "--json-samples"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "inf" in out and "TTFT" in out
    assert "   6    0" in out  # every request completed at both rates
    rows = json.loads((tmp_path / "rows.json").read_text())
    # the client's own thread's CPU over the run (the server's threads are not counted)
    assert all(0 < row["client_cpu_fraction"] < 1.2 for row in rows)
    from mrv2.bench.serve import percentile  # --json-samples: the percentiles' own samples
    for row in rows:
        # (an ITL a chunk gap: a loaded server may send two tokens in one chunk)
        assert len(row["samples_ms"]["tpot"]) == 6 and 0 < len(row["samples_ms"]["itl"]) <= 18
        assert row["tpot_p90_ms"] == pytest.approx(percentile(row["samples_ms"]["tpot"], 90))


def test_unsupported_chat_features_are_refused(server: Served) -> None:
    messages = [{"role": "user", "content": "x"}]
    error = _error(_post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "tools": [{"type": "function"}]}), 400)
    assert error["param"] == "tools"
    error = _error(_post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "response_format": {"type": "xml"}}), 400)
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
    per_pos = [line for line in text.splitlines()
               if line.startswith("mrv2_spec_decode_num_draft_tokens_per_pos_total{")]
    assert [line.split('position="')[1][0] for line in per_pos] == ["0", "1", "2"]
    assert float(per_pos[0].rsplit(" ", 1)[1]) > 0
    assert "mrv2_spec_decode_num_drafts_total{" in text
    assert "mrv2_spec_decode_num_accepted_tokens_per_pos_total{" in text


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000,
                                 b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
                                 b"\xff\xfe{}", b""])
def test_unparseable_bodies_are_400(server: Served, raw: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = _error(_post(server, path, None, raw=raw), 400)
        assert "JSON" in str(error["message"])


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"stream": 1}, "stream"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": "true"}}, "stream_options"),
    ("/v1/chat/completions", {"logprobs": "true"}, "logprobs"),
    ("/v1/completions", {"n": "2"}, "n"),
    ("/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"ignore_eos": "no"}, "ignore_eos"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
])
def test_strict_types(server: Served, path: str, body: dict[str, object], param: str) -> None:
    base: dict[str, object] = ({"messages": [{"role": "user", "content": "hi"}]}
                               if "chat" in path else {"prompt": "hi"})
    error = _error(_post(server, path, {"model": MODEL, **base, **body}), 400)
    assert error["param"] == param, error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_needs_stream(server: Served, path: str) -> None:
    """``stream_options`` without ``stream: true`` is refused by name (as OpenAI and vLLM)."""
    base: dict[str, object] = ({"messages": [{"role": "user", "content": "hi"}]}
                               if "chat" in path else {"prompt": "hi"})
    for stream in ({}, {"stream": False}):
        error = _error(_post(server, path, {"model": MODEL, **base, **stream, "max_tokens": 2,
                                            "stream_options": {"include_usage": True}}), 400)
        assert error["param"] == "stream_options"
    ok = _post(server, path, {"model": MODEL, **base, "max_tokens": 2, "stream_options": None})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("k", [30, -1, -2])
def test_chat_top_logprobs_is_named(server: Served, k: int) -> None:
    """Too many chat ``top_logprobs`` is a 400 naming ``top_logprobs`` (the field sent), not
    ``logprobs`` (a bool in chat); so is vLLM's -1 (the whole vocabulary: past the 20 it
    allows by default, as vLLM refuses it), with or without ``logprobs``."""
    for logprobs in (True, False):
        error = _error(_post(server, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "logprobs": logprobs, "top_logprobs": k}), 400)
        assert error["param"] == "top_logprobs" and "top_logprobs" in str(error["message"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_nullable_fields_take_null_as_their_default(server: Served, path: str) -> None:
    """OpenAI types n, the penalties, stream, logprobs (chat), echo (completions) and
    parallel_tool_calls "... or null": null is the default (it was a 400), as OpenAI and
    vLLM take it."""
    base: dict[str, object] = ({"messages": [{"role": "user", "content": "hi"}],
                                "logprobs": None, "parallel_tool_calls": None}
                               if "chat" in path else {"prompt": "hi", "echo": None})
    nulls = dict.fromkeys(("n", "presence_penalty", "frequency_penalty", "stream"))
    got = _post(server, path, {"model": MODEL, **base, **nulls, "max_tokens": 2,
                               "temperature": 0})
    want = _post(server, path, {"model": MODEL, "max_tokens": 2, "temperature": 0,
                                **{k: v for k, v in base.items() if v is not None}})
    assert got.status_code == want.status_code == 200, got.text
    answer, expected = got.json(), want.json()
    assert len(answer["choices"]) == 1 and answer["usage"] == expected["usage"]
    assert answer["choices"][0].get("logprobs") is None


def test_ints_are_valid_floats(server: Served) -> None:
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 1,
                                          "top_p": 1, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_beyond_context_is_400(server: Served, path: str, field: str) -> None:
    if field == "max_completion_tokens" and "chat" not in path:
        return  # a chat-only field
    base: dict[str, object] = ({"messages": [{"role": "user", "content": "hi"}]}
                               if "chat" in path else {"prompt": [5, 6, 7]})
    error = _error(_post(server, path, {"model": MODEL, **base, field: 10**12}), 400)
    message = str(error["message"])
    assert error["param"] == field and message.startswith(f"{field}=")  # the field sent
    assert str(10**12) in message and "64" in message  # asked, context length
    if "chat" not in path:
        assert "prompt has 3 tokens" in message and "at most 61" in message
    ok = _post(server, path, {"model": MODEL, **base, field: 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_n_is_bounded(server: Served) -> None:
    error = _error(_post(server, "/v1/completions",
                         {"model": MODEL, "prompt": "hi", "n": 1000}), 400)
    assert error["param"] == "n" and "--max-n" in str(error["message"])
    ok = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 64,
                                           "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64


def test_a_batch_past_max_pending_is_400(server: Served) -> None:
    """Prompts x ``n`` beyond ``--max-pending`` (1024) could never run: a 400 naming the
    prompt, not a 503 to retry."""
    for prompts, n in ((["a"] * 1025, 1), (["a"] * 17, 64)):
        error = _error(_post(server, "/v1/completions", {"model": MODEL, "prompt": prompts,
                                                         "n": n, "max_tokens": 1}), 400)
        assert error["param"] == "prompt" and "--max-pending" in str(error["message"])
    assert not server.engine.has_unfinished()  # nothing was submitted


def test_n_counts_against_max_pending(model_dir: Path) -> None:
    import asyncio

    from server_util import ENGINE_KWARGS

    from mrv2 import EngineConfig, SamplingParams
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.engine_thread import EngineThread, QueueFullError

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    worker = EngineThread(engine, max_pending=4)
    loop = asyncio.new_event_loop()
    sink: asyncio.Queue[object] = asyncio.Queue()
    try:
        worker.submit("a", [5, 6], SamplingParams(n=3, max_tokens=2), None,
                      sink, loop)  # type: ignore[arg-type]
        with pytest.raises(QueueFullError, match="3 sequences in flight and this request "
                                                 "adds 2"):
            worker.submit("b", [5, 6], SamplingParams(n=2, max_tokens=2), None,
                          sink, loop)  # type: ignore[arg-type]
        worker.submit("c", [5, 6], SamplingParams(n=1, max_tokens=2), None,
                      sink, loop)  # type: ignore[arg-type]
        assert worker.num_pending == 4
    finally:
        loop.close()


def test_metrics_parse_with_any_model_name(model_dir: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from conftest import serve

    name = 'we"ird\\name\nx'
    servers = serve(model_dir, served_model_name=name)
    srv = next(servers)
    try:
        r = _post(srv, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 3,
                                           "ignore_eos": True, "n": 2})
        assert r.status_code == 200, r.text
        response = httpx.get(f"{srv.url}/metrics", headers=AUTH)
    finally:
        next(servers, None)
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    label = (("model_name", name),)
    assert samples[("mrv2_generation_tokens_total", label)] == 6
    assert samples[("mrv2_prompt_tokens_total", label)] > 0
    assert samples[("mrv2_request_success_total",
                    (("finished_reason", "length"), ("model_name", name)))] == 2
    assert samples[("mrv2_time_to_first_token_seconds_count", label)] == 1
    assert samples[("mrv2_time_per_output_token_seconds_count", label)] == 2
    assert families["mrv2_time_to_first_token_seconds"].type == "histogram"
    assert samples[("mrv2_kv_cache_free_blocks", label)] == samples[
        ("mrv2_kv_cache_blocks", label)] == 512
    assert samples[("mrv2_num_requests_pending", label)] == 0
    assert samples[("process_resident_memory_bytes", ())] > 0
    assert samples[("mrv2_gpu_memory_allocated_bytes", label)] == 0  # a CPU server


def test_serve_without_server_packages_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    from mrv2.entrypoints.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else find_spec(name, *a))
    assert main(["serve"]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert "needs uvicorn" in err and "pip install 'mrv2[serve]'" in err


def test_the_models_sampling_defaults_fill_unset_fields(model_dir: Path) -> None:
    """``override_generation_config`` (as a model's generation_config.json would) sets what a
    request leaves unset; what it sends wins, but for max_tokens: an override's
    max_new_tokens is vLLM's server-wide limit (it had no effect on a request's own)."""
    defaults = {"max_new_tokens": 3, "temperature": 0.0}
    for served in serve(model_dir, {"override_generation_config": defaults}):
        assert served.engine.sampling_defaults == {"max_tokens": 3, "temperature": 0.0}
        # a completion's max_tokens left out is OpenAI's (and vLLM's) 16, sent as null the
        # model's default; either, and one sent, at most the limit
        for body, tokens in (({"max_tokens": None}, 3), ({"max_tokens": 5}, 3), ({}, 3),
                             ({"max_tokens": 2}, 2)):
            response = _post(served, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                                          "ignore_eos": True, **body})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == tokens
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "ignore_eos": True}
        replies = [_post(served, "/v1/chat/completions", chat).json() for _ in range(2)]
        assert [r["usage"]["completion_tokens"] for r in replies] == [3, 3]
        assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]


def test_a_models_max_new_tokens_is_capped_at_the_context_left(model_dir: Path) -> None:
    """A default longer than the room is capped (as vLLM does), not refused; a request's own
    max_tokens that long is still a 400."""
    for served in serve(model_dir, {"override_generation_config": {"max_new_tokens": 1000}}):
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "ignore_eos": True}
        response = _post(served, "/v1/completions", {**body, "max_tokens": None})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 64 - 4  # max_model_len 64
        error = _error(_post(served, "/v1/completions", {**body, "max_tokens": 1000}), 400)
        assert error["param"] == "max_tokens"


def test_several_served_model_names(model_dir: Path) -> None:
    """vLLM's aliases: /v1/models lists each, a request may give any, the answer carries the
    first; another name is a 404 listing them."""
    from conftest import serve

    servers = serve(model_dir, served_model_name=["main", "alias"])
    srv = next(servers)
    try:
        listed = httpx.get(f"{srv.url}/v1/models", headers=AUTH).json()["data"]
        assert [m["id"] for m in listed] == ["main", "alias"]
        assert {m["root"] for m in listed} == {"main"}
        r = _post(srv, "/v1/completions", {"model": "alias", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "main"
        error = _error(_post(srv, "/v1/completions", {"model": "other", "prompt": "hi"}), 404)
        assert error["param"] == "model" and "'main', 'alias'" in str(error["message"])
    finally:
        next(servers, None)


def test_served_model_names_on_the_command_line() -> None:
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "/m", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"] and args.model_dir == "/m"


def test_logit_bias_is_clamped_to_the_openai_range() -> None:
    """vLLM's server (``SamplingParams.from_optional``) clamps each bias to [-100, 100]
    rather than refusing it."""
    bias = {"5": 1000.0, "6": -1e9, "7": 3.5}
    want = {5: 100.0, 6: -100.0, 7: 3.5}
    completion = CompletionRequest.model_validate({"prompt": "hi", "logit_bias": bias})
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": bias})
    assert completion.sampling_params().logit_bias == want
    assert chat.sampling_params().logit_bias == want


def test_logit_bias_past_100_and_bad_words_of_no_tokens(server: Served) -> None:
    """A bias past 100 is clamped (vLLM's), so it is served; a bad word that is no tokens
    (vLLM refuses it) is a 400 naming ``bad_words``."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
    ok = _post(server, "/v1/completions", {**body, "logit_bias": {"5": 500}})
    assert ok.status_code == 200, ok.text
    error = _error(_post(server, "/v1/completions", {**body, "bad_words": [" "]}), 400)
    assert error["param"] == "bad_words"
