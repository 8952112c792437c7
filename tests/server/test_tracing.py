"""OpenTelemetry request tracing (``mrv2 serve --otlp-traces-endpoint``, vLLM's flags): one
``llm_request`` span per finished completion or chat request, streamed or not, with the engine
on a thread or in its own process, carrying vLLM's attributes and parented by the caller's
``traceparent``; nothing traced (and no SDK needed) without the flag; the flag refused at
start-up, naming the packages, where they are missing.

The exporter is the SDK's in-memory one, standing in for the OTLP exporter module the flag
loads (:func:`_fake_exporter`), so the flags, the app and the workers run as in production.
"""

from __future__ import annotations

import importlib.machinery
import json
import logging
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from server_util import API_KEY, ENGINE_KWARGS, MODEL

from mrv2 import EngineConfig, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.output_deltas import DeltaEncoder
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.entrypoints import tracing
from mrv2.entrypoints.cli import build_parser, main
from mrv2.entrypoints.engine_process import EngineProcess
from mrv2.entrypoints.engine_process import _Sink as ProcessSink
from mrv2.entrypoints.engine_thread import EngineThread, _Sink
from mrv2.entrypoints.metrics import ServerMetrics
from mrv2.entrypoints.serve_options import ServeOptions
from mrv2.entrypoints.server import create_app
from mrv2.entrypoints.tracing import PROTOCOL_ENV, RequestTracer
from mrv2.entrypoints.tracing import SpanAttributes as A
from mrv2.testing import serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC = "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
HTTP = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
LATENCIES = (A.GEN_AI_LATENCY_TIME_IN_QUEUE, A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
             A.GEN_AI_LATENCY_E2E, A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
             A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE, A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE)


class _Exporter(InMemorySpanExporter):
    """The in-memory exporter, made as the OTLP exporter is (``OTLPSpanExporter(endpoint=)``)."""

    made: list[_Exporter] = []

    def __init__(self, endpoint: str | None = None) -> None:
        super().__init__()
        self.endpoint = endpoint
        _Exporter.made.append(self)


def _fake_exporter(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Module ``name`` (an OTLP exporter's) importable, its ``OTLPSpanExporter``
    :class:`_Exporter`."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.OTLPSpanExporter = _Exporter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)


def _options(*flags: str) -> ServeOptions:
    return ServeOptions.from_args(build_parser().parse_args(["serve", "m", *flags]))


@pytest.fixture(scope="module", params=["thread", "process"])
def traced(request: pytest.FixtureRequest, model_dir: Path
           ) -> Iterator[tuple[str, RequestTracer, _Exporter]]:
    """A server started with ``--otlp-traces-endpoint`` (and ``--collect-detailed-traces``),
    its engine on a thread or in its own process."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(PROTOCOL_ENV, raising=False)
        _fake_exporter(patch, GRPC)
        options = _options("--otlp-traces-endpoint", "http://collector:4317",
                           "--collect-detailed-traces", "model,worker")
        config = EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS)
        if request.param == "thread":
            engine: Any = LLMEngine(config)
        else:
            from mrv2.entrypoints.engine_process import RemoteEngine

            engine = RemoteEngine(config)
        try:
            app = create_app(engine, served_model_name=MODEL, api_key=API_KEY, options=options)
            exporter = _Exporter.made[-1]
            assert exporter.endpoint == "http://collector:4317"
            for url in serve_in_thread(app):
                yield url, app.state.tracer, exporter
        finally:
            if request.param == "process":
                engine.shutdown()


def _post(url: str, route: str, body: dict[str, Any], headers: dict[str, str] | None = None
          ) -> dict[str, Any]:
    """The answer's usage (a stream's from its usage chunk) and the finish reasons."""
    body = {"model": MODEL, **body}
    headers = {**AUTH, **(headers or {})}
    if not body.get("stream"):
        r = httpx.post(f"{url}{route}", headers=headers, timeout=60, json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        return {"usage": answer["usage"],
                "reasons": sorted(c["finish_reason"] for c in answer["choices"])}
    usage, reasons = None, []
    with httpx.stream("POST", f"{url}{route}", headers=headers, timeout=60,
                      json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
    return {"usage": usage, "reasons": sorted(reasons)}


def _spans(tracer: RequestTracer, exporter: _Exporter) -> list[Any]:
    tracer.flush()
    spans = list(exporter.get_finished_spans())
    exporter.clear()
    return spans


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_span_per_finished_request(traced: tuple[str, RequestTracer, _Exporter], route: str,
                                     stream: bool) -> None:
    url, tracer, exporter = traced
    _spans(tracer, exporter)
    chat = route.endswith("chat/completions")
    body: dict[str, Any] = {"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "n": 2,
                            "ignore_eos": True, "stream": stream, "seed": 1}
    body.update({"messages": [{"role": "user", "content": "hello"}]} if chat
                else {"prompt": "hello there"})
    before = time.time_ns()
    answer = _post(url, route, body)
    after = time.time_ns()
    spans = _spans(tracer, exporter)
    assert len(spans) == 1, spans
    span = spans[0]
    assert span.name == "llm_request" and span.kind is SpanKind.SERVER
    assert span.parent is None  # (no traceparent header)
    attrs = dict(span.attributes)
    request_id = attrs.pop(A.GEN_AI_REQUEST_ID)
    assert request_id.startswith("chatcmpl-" if chat else "cmpl-") and request_id.endswith("-0")
    latencies = {name: attrs.pop(name) for name in LATENCIES}
    assert attrs == {
        A.GEN_AI_RESPONSE_MODEL: MODEL, A.GEN_AI_REQUEST_N: 2,
        A.GEN_AI_REQUEST_TEMPERATURE: 0.5, A.GEN_AI_REQUEST_TOP_P: 0.9,
        A.GEN_AI_REQUEST_MAX_TOKENS: 5, A.GEN_AI_USAGE_NUM_SEQUENCES: 2,
        A.GEN_AI_USAGE_PROMPT_TOKENS: answer["usage"]["prompt_tokens"],
        A.GEN_AI_USAGE_COMPLETION_TOKENS: answer["usage"]["completion_tokens"],
        A.GEN_AI_RESPONSE_FINISH_REASONS: ("length", "length")}
    assert answer["usage"]["completion_tokens"] == 10 and answer["reasons"] == ["length"] * 2
    assert all(value >= 0 for value in latencies.values()), latencies
    e2e = latencies[A.GEN_AI_LATENCY_E2E]
    assert latencies[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] <= e2e
    assert latencies[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] <= e2e
    assert latencies[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] <= (
        latencies[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] + 1e-6)
    assert before <= span.start_time < span.end_time <= after
    assert span.end_time - span.start_time == pytest.approx(e2e * 1e9, abs=2e6)


def test_the_callers_traceparent_parents_the_span(traced: tuple[str, RequestTracer, _Exporter]
                                                  ) -> None:
    url, tracer, exporter = traced
    _spans(tracer, exporter)
    _post(url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2},
          {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=1"})
    spans = _spans(tracer, exporter)
    assert len(spans) == 2  # a span per prompt (an engine request each), as vLLM's
    assert sorted(s.attributes[A.GEN_AI_REQUEST_ID][-2:] for s in spans) == ["-0", "-1"]
    for span in spans:
        assert span.context.trace_id == int(TRACE_ID, 16)
        assert span.parent is not None and span.parent.span_id == int(PARENT_ID, 16)
        assert span.parent.is_remote and span.context.span_id != int(PARENT_ID, 16)
        assert span.context.trace_state.get("vendor") == "1"


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_the_workers_times_make_the_spans_latencies(worker: str) -> None:
    """n=2: arrival at t=0, first token at t=0.1, choice 0 ends at 1.1, choice 1 at 4.1; the
    engine reports 0.05 s in queue (through the engine process's deltas too). The span's
    latencies are those times', its length the request's."""
    exporter = InMemorySpanExporter()
    tracer = RequestTracer.start("unused", exporter=exporter)
    trace = tracer.request("r", "m", SamplingParams(n=2, max_tokens=7, temperature=0.25))
    hand_over = type("HandOver", (), {"add": lambda self, loop, item, key=None: None,
                                      "post": lambda self: None})()
    encoder = DeltaEncoder()
    if worker == "thread":
        thread = object.__new__(EngineThread)  # only what _deliver reads
        thread.metrics, thread._lock, thread._pending, thread._hand_over = (
            ServerMetrics("m"), threading.Lock(), 2, hand_over)
        thread._sinks = {"r": _Sink(None, None, 0.0, num_prompt=4, num_seqs=2,  # type: ignore[arg-type]
                                    trace=trace)}

        def deliver(output: RequestOutput, now: float) -> None:
            thread._deliver(output, now)
    else:
        reader = object.__new__(EngineProcess)
        reader.metrics, reader._lock, reader._pending, reader._hand_over = (
            ServerMetrics("m"), threading.Lock(), 2, hand_over)
        reader._sinks = {"r": ProcessSink(None, None, 0.0, num_prompt=4,  # type: ignore[arg-type]
                                          num_seqs=2, trace=trace)}

        def deliver(output: RequestOutput, now: float) -> None:
            reader._deliver([encoder.encode(output)], now)
    state = [CompletionOutput(0, "", []), CompletionOutput(1, "", [])]
    steps = [(0.1, {0: 3, 1: 7}, {}), (1.1, {0: 4, 1: 8}, {0: "stop"}),
             (2.1, {1: 9}, {}), (4.1, {1: 10}, {1: "length"})]
    for now, new, reasons in steps:
        for index, token in new.items():
            state[index].token_ids = state[index].token_ids + [token]
        for index, reason in reasons.items():
            state[index].finish_reason = reason
        finished = now == 4.1
        output = RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(
            c.index, "", list(c.token_ids), c.finish_reason) for c in state],
            finished=finished, new_token_ids=[new[i] for i in sorted(new)],
            time_in_queue=0.05 if finished else None)
        deliver(output, now)
        tracer.flush()
        assert len(exporter.get_finished_spans()) == finished  # (at the finish only)
    span = exporter.get_finished_spans()[0]
    attrs = span.attributes
    assert attrs[A.GEN_AI_REQUEST_ID] == "r" and attrs[A.GEN_AI_RESPONSE_MODEL] == "m"
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == 0.25 and attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 7
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == 4
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 6
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "length")
    expected = {A.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.05, A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.1,
                A.GEN_AI_LATENCY_E2E: 4.1, A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.05,
                A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 4.0,
                A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: 4.05}
    assert {k: attrs[k] for k in expected} == pytest.approx(expected)
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(4.1, abs=1e-3)


def test_the_engine_reports_each_requests_time_in_queue(model_dir: Path) -> None:
    """A finished output (of n=2: the merged one) says how long the request waited for its
    first step; earlier outputs say nothing."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True, n=2),
                       request_id="r", stream=True)
    outputs: list[RequestOutput] = []
    while engine.wants_step():
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs) > 1
    assert all(o.time_in_queue is None for o in outputs[:-1])
    queued = outputs[-1].time_in_queue
    assert queued is not None and 0 <= queued < 60


@pytest.fixture
def untraced(model_dir: Path) -> Iterator[str]:
    """A server without the flag, where the SDK cannot be imported (for this test only)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("opentelemetry.sdk", "opentelemetry.sdk.trace"):
            patch.setitem(sys.modules, name, None)
        engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
        app = create_app(engine, served_model_name=MODEL, api_key=API_KEY)
        assert app.state.tracer is None
        yield from serve_in_thread(app)


def test_nothing_is_traced_without_the_flag(untraced: str, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    made: list[Any] = []
    monkeypatch.setattr(tracing.RequestTrace, "finish", lambda self, *a: made.append(a))
    monkeypatch.setattr(tracing, "_warned_untraced", False)
    with caplog.at_level(logging.WARNING, logger="mrv2.entrypoints.tracing"):
        for stream in (False, True):
            answer = _post(untraced, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                         "stream": stream},
                           {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            assert answer["usage"]["completion_tokens"] == 2
    assert made == []
    warned = [r for r in caplog.records if "tracing is off" in r.getMessage()]
    assert len(warned) == 1  # (vLLM's warning, once)


def test_missing_packages_fail_at_start_up(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str],
                                           model_dir: Path) -> None:
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    _fake_exporter(monkeypatch, GRPC)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    assert main(["serve", str(model_dir), "--otlp-traces-endpoint",
                 "http://collector:4317", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--otlp-traces-endpoint needs opentelemetry-sdk (OTLP over grpc)" in err
    assert "pip install 'mrv2[tracing]'" in err
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")  # its exporter is the HTTP one
    monkeypatch.setitem(sys.modules, HTTP, None)
    with pytest.raises(ValueError, match="needs opentelemetry-sdk, "
                       "opentelemetry-exporter-otlp-proto-http .OTLP over http/protobuf."):
        _options("--otlp-traces-endpoint", "http://collector:4318/v1/traces")


def test_the_protocol_picks_the_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_exporter(monkeypatch, GRPC)
    _fake_exporter(monkeypatch, HTTP)
    http_module = sys.modules[HTTP]

    class _HTTPExporter(_Exporter):
        pass

    http_module.OTLPSpanExporter = _HTTPExporter  # type: ignore[attr-defined]
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    grpc = tracing.span_exporter("http://c:4317")
    assert type(grpc) is _Exporter and grpc.endpoint == "http://c:4317"
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    http = tracing.span_exporter("http://c:4318/v1/traces")
    assert type(http) is _HTTPExporter and http.endpoint == "http://c:4318/v1/traces"
    monkeypatch.setenv(PROTOCOL_ENV, "http/json")
    with pytest.raises(ValueError, match="speaks grpc or http/protobuf"):
        tracing.span_exporter("http://c:4318")


def test_detailed_traces_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    _fake_exporter(monkeypatch, GRPC)
    endpoint = ("--otlp-traces-endpoint", "http://c:4317")
    assert _options(*endpoint, "--collect-detailed-traces", "all").collect_detailed_traces == (
        "all",)
    assert _options(*endpoint, "--collect-detailed-traces", "model", "worker"
                    ).collect_detailed_traces == ("model", "worker")
    assert _options().otlp_traces_endpoint is None and _options().collect_detailed_traces == ()
    with pytest.raises(ValueError, match="requires --otlp-traces-endpoint"):
        _options("--collect-detailed-traces", "model")
    with pytest.raises(ValueError, match="'modle': expected model, worker, all"):
        _options(*endpoint, "--collect-detailed-traces", "modle")
