"""OpenTelemetry request tracing, vLLM's: ``mrv2 serve --otlp-traces-endpoint URL`` sends one
``llm_request`` span (kind SERVER) per finished generation request to an OTLP collector.

The span starts when the request reached the server's engine worker and ends when its last
sequence finished; it carries vLLM's attribute names (:class:`SpanAttributes`): the request's
id, the served model, its temperature, top_p, max_tokens and n, its prompt and completion
token counts, its sequences' finish reasons, and the latencies: time in queue (the engine's
arrival to its first step), time to first token, end to end, and the model's prefill
(first step to first token), decode (first token to last) and inference (first step to last
token) times. A ``traceparent`` (and ``tracestate``) header of the HTTP request makes the
span a child of the caller's span, in the caller's trace (W3C trace context).

The timestamps are those ``/metrics`` already takes (each request's arrival, first token
and finish at the server, and the scheduler's first step of it): tracing adds no work a
token or a step, only the span of a request that finished, made where the metrics count it.

Exporter: OTLP over gRPC, or over HTTP with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
http/protobuf`` (vLLM's choice, the default ``grpc``); the OpenTelemetry SDK reads its other
settings (``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_TRACES_INSECURE``, headers...) from
the environment. The SDK and the exporters are an extra (``pip install 'mrv2[tracing]'``):
nothing here imports them unless the flag is given, and without them the flag fails at
start-up naming the packages to install (:func:`check_tracing_available`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mrv2.contract.params import SamplingParams

__all__ = ["DETAILED_TRACE_MODULES", "PROTOCOL_ENV", "TRACE_HEADERS", "RequestTrace",
           "RequestTracer", "SpanAttributes", "check_tracing_available", "otlp_protocol",
           "span_exporter", "warn_untraced"]

logger = logging.getLogger(__name__)

#: The W3C trace-context headers a request's span is parented by.
TRACE_HEADERS = ("traceparent", "tracestate")
#: ``--collect-detailed-traces``' values (vLLM's).
DETAILED_TRACE_MODULES = ("model", "worker", "all")
#: The environment variable that picks the exporter's protocol (the OpenTelemetry SDK's).
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
#: protocol -> (the exporter's module, its package).
_EXPORTERS = {
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
             "opentelemetry-exporter-otlp-proto-grpc"),
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                      "opentelemetry-exporter-otlp-proto-http"),
}
#: The span's name (vLLM's).
SPAN_NAME = "llm_request"


class SpanAttributes:
    """The span's attribute names: OpenTelemetry's generative-AI conventions where they
    have one, vLLM's own names otherwise (the same strings as vLLM's ``SpanAttributes``)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def otlp_protocol() -> str:
    """The exporter's protocol (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, default ``grpc``);
    ValueError for one vLLM does not export by."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc").strip() or "grpc"
    if protocol not in _EXPORTERS:
        raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: the OTLP trace exporter speaks "
                         f"{' or '.join(_EXPORTERS)}")
    return protocol


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # (a parent package missing, or stubbed out)
        return False


def check_tracing_available() -> None:
    """ValueError, naming the packages to install, unless the OpenTelemetry API, SDK and the
    exporter of :func:`otlp_protocol` can be imported."""
    protocol = otlp_protocol()
    exporter_module, exporter_package = _EXPORTERS[protocol]
    missing = [package for module, package in (
        ("opentelemetry.trace", "opentelemetry-api"), ("opentelemetry.sdk.trace",
                                                       "opentelemetry-sdk"),
        (exporter_module, exporter_package)) if not _installed(module)]
    if missing:
        raise ValueError(
            f"--otlp-traces-endpoint needs {', '.join(missing)} (OTLP over {protocol}), which "
            f"this Python lacks: pip install 'mrv2[tracing]' (or pip install "
            f"{' '.join(missing)})")


def span_exporter(endpoint: str) -> Any:
    """The OTLP span exporter to ``endpoint``, of :func:`otlp_protocol`'s protocol."""
    module = importlib.import_module(_EXPORTERS[otlp_protocol()][0])
    return module.OTLPSpanExporter(endpoint=endpoint)


_warned_untraced = False


def warn_untraced(headers: Mapping[str, str]) -> None:
    """A warning, once, for a request with a trace context while tracing is off (vLLM's)."""
    global _warned_untraced
    if not _warned_untraced and any(h in headers for h in TRACE_HEADERS):
        _warned_untraced = True
        logger.warning("received a request with a trace context (traceparent), but tracing "
                       "is off: start mrv2 serve with --otlp-traces-endpoint URL to export "
                       "spans")


class RequestTracer:
    """The server's tracer (``--otlp-traces-endpoint``): :meth:`request` gives a finished
    request's span maker. ``collect_detailed_traces``: vLLM's modules, accepted; mrv2's
    spans carry the same attributes with or without them (module doc of
    :mod:`~mrv2.entrypoints.serve_options`)."""

    def __init__(self, tracer: Any, provider: Any = None,
                 collect_detailed_traces: Sequence[str] = ()) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer, self.provider = tracer, provider
        self.collect_detailed_traces = tuple(collect_detailed_traces)
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def start(cls, endpoint: str, collect_detailed_traces: Sequence[str] = (),
              exporter: Any = None) -> RequestTracer:
        """A tracer whose spans go, in batches, to ``exporter`` (default: OTLP to
        ``endpoint``, :func:`span_exporter`)."""
        if exporter is None:
            check_tracing_available()
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(
            span_exporter(endpoint) if exporter is None else exporter))
        return cls(provider.get_tracer("mrv2.serve"), provider, collect_detailed_traces)

    def context_of(self, headers: Mapping[str, str]) -> Any:
        """The caller's trace context of an HTTP request's headers (None without one)."""
        carrier = {h: headers[h] for h in TRACE_HEADERS if h in headers}
        return self._propagator.extract(carrier) if carrier else None

    def request(self, req_id: str, model: str, params: SamplingParams,
                context: Any = None) -> RequestTrace:
        """What makes request ``req_id``'s span when it finishes (``context``: the caller's,
        :meth:`context_of`)."""
        return RequestTrace(self.tracer, context, req_id, model, params)

    def flush(self, timeout_ms: int = 30_000) -> None:
        """Export the spans made so far."""
        if self.provider is not None:
            self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Export what is left and stop (the server stops)."""
        if self.provider is not None:
            self.provider.shutdown()


@dataclass
class RequestTrace:
    """One engine request's span, made by :meth:`finish` when the request finished."""

    tracer: Any
    context: Any
    req_id: str
    model: str
    params: SamplingParams

    def finish(self, arrival: float, first: float | None, now: float, num_prompt: int,
               sequences: Sequence[tuple[str, int, float | None, float]],
               time_in_queue: float | None) -> None:
        """The span of a request that arrived at ``arrival``, had its first token at
        ``first`` (None: none) and finished at ``now`` (``time.monotonic()`` all three), of
        ``num_prompt`` prompt tokens, whose sequences ended as ``sequences`` says (finish
        reason, tokens, decode seconds, seconds from arrival to its end: the metrics'
        ``finished_lengths``), that waited ``time_in_queue`` seconds for its first step
        (None: unknown). Never raises: a failure is logged."""
        try:
            self._finish(arrival, first, now, num_prompt, sequences, time_in_queue)
        except Exception:  # (an exporter's or the SDK's trouble must not fail serving)
            logger.exception("could not record the span of request %s", self.req_id)

    def _finish(self, arrival: float, first: float | None, now: float, num_prompt: int,
                sequences: Sequence[tuple[str, int, float | None, float]],
                time_in_queue: float | None) -> None:
        from opentelemetry.trace import SpanKind

        wall_ns, mono = time.time_ns(), time.monotonic()
        params, a = self.params, SpanAttributes
        attributes: dict[str, Any] = {
            a.GEN_AI_RESPONSE_MODEL: self.model,
            a.GEN_AI_REQUEST_ID: self.req_id,
            a.GEN_AI_REQUEST_N: params.n,
            a.GEN_AI_REQUEST_TEMPERATURE: float(params.temperature),
            a.GEN_AI_REQUEST_TOP_P: float(params.top_p),
            a.GEN_AI_USAGE_NUM_SEQUENCES: len(sequences),
            a.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt,
            a.GEN_AI_USAGE_COMPLETION_TOKENS: sum(n for _, n, _, _ in sequences),
            a.GEN_AI_RESPONSE_FINISH_REASONS: [reason for reason, _, _, _ in sequences],
            a.GEN_AI_LATENCY_E2E: now - arrival,
        }
        if params.max_tokens is not None:
            attributes[a.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        last = arrival + max((end for _, _, _, end in sequences), default=now - arrival)
        if first is not None:
            attributes[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first - arrival
            attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last - first
        if time_in_queue is not None:
            attributes[a.GEN_AI_LATENCY_TIME_IN_QUEUE] = time_in_queue
            scheduled = min(arrival + time_in_queue, last)
            attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last - scheduled
            if first is not None:
                attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = max(first - scheduled,
                                                                         0.0)
        span = self.tracer.start_span(SPAN_NAME, context=self.context, kind=SpanKind.SERVER,
                                      attributes=attributes,
                                      start_time=wall_ns - int((mono - arrival) * 1e9))
        span.end(end_time=wall_ns - int((mono - now) * 1e9))
