"""The server's Prometheus metrics, kept by ``prometheus_client`` in a registry per server.

The engine thread (or the engine process's reader) counts prompt and generated tokens as each
request's tokens come out, as vLLM counts them per step (a request's prompt once, with its first
token; every sequence's tokens, an aborted request's included), and the finish reasons and
time per output token as requests finish; the engine's own
gauges and counters (running, waiting, KV blocks, prefix cache, preemptions, speculation) are
read from its last ``stats()`` snapshot when ``/metrics`` is scraped, so a scrape never touches
the engine. Every ``mrv2_*`` series carries a ``model_name`` label (``--served-model-name``,
escaped by the library); ``process_*`` (resident memory, CPU seconds, open fds) come from the
library's process collector; ``mrv2_gc_pause_seconds`` counts the garbage collector's pauses
of the server's process and of the engine's, when it has one of its own.

The series vLLM also serves come a second time under vLLM's names, types, bucket edges and
labels (``model_name`` and ``engine="0"``, as vLLM v1's ``PrometheusStatLogger`` sets them),
from the same measurement: the engine's snapshot rendered twice, the request-side counters and
histograms updated in the same calls (:data:`VLLM_NAMES`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mrv2.engine.gc_pauses import GCPauses

#: Histogram buckets (seconds) of time to first token and time per output token.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

#: vLLM's bucket edges (vllm/v1/metrics/loggers.py) of the histograms under vLLM's names.
VLLM_TTFT_BUCKETS = TTFT_BUCKETS + (160.0, 640.0, 2560.0)
VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: The ``mrv2_*`` series vLLM also serves: mrv2's name -> vLLM's (a counter's without
#: ``_total``; ``vllm:request_time_per_output_token_seconds`` is vLLM's per-request mean time
#: per output token, what mrv2's TPOT measures). ``vllm:e2e_request_latency_seconds`` (arrival
#: to a sequence's end) has no mrv2 twin.
VLLM_NAMES = {
    "mrv2_num_requests_running": "vllm:num_requests_running",
    "mrv2_num_requests_waiting": "vllm:num_requests_waiting",
    "mrv2_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "mrv2_prefix_cache_queries": "vllm:prefix_cache_queries",
    "mrv2_prefix_cache_hits": "vllm:prefix_cache_hits",
    "mrv2_num_preemptions": "vllm:num_preemptions",
    "mrv2_prompt_tokens": "vllm:prompt_tokens",
    "mrv2_generation_tokens": "vllm:generation_tokens",
    "mrv2_request_success": "vllm:request_success",
    "mrv2_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "mrv2_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
}
_VLLM_LABELS = ["model_name", "engine"]
#: The ``engine`` label's value (vLLM's engine index: one engine).
_VLLM_ENGINE = "0"

# (name, help, key in LLMEngine.stats()) of the engine's own series.
_GAUGES = (
    ("mrv2_num_requests_running", "Requests running on the engine.", "num_running"),
    ("mrv2_num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("mrv2_kv_cache_usage_perc", "Fraction of KV blocks in use.", "kv_usage"),
    ("mrv2_kv_cache_free_blocks", "KV blocks free (not held by a request).", "kv_free_blocks"),
    ("mrv2_kv_cache_blocks", "KV blocks in the cache.", "kv_num_blocks"),
    ("mrv2_prefix_cache_hit_rate", "Prefix cache hits / queried tokens.",
     "prefix_cache_hit_rate"),
    ("mrv2_engine_sleeping", "1 while the engine sleeps (sleep mode), else 0.", "is_sleeping"),
    ("mrv2_engine_paused", "1 while generation is paused (pause_generation), else 0.",
     "is_paused"),
)
_COUNTERS = (
    ("mrv2_prefix_cache_queries", "Prompt tokens looked up.", "prefix_cache_queries"),
    ("mrv2_prefix_cache_hits", "Prompt tokens found cached.", "prefix_cache_hits"),
    ("mrv2_num_preemptions", "Preempted requests.", "num_preemptions"),
    ("mrv2_kv_cache_window_freed_blocks", "KV blocks freed while their request ran, out of "
     "a sliding-window layer's window.", "kv_window_freed_blocks"),
    ("mrv2_spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).",
     "spec_num_draft_tokens"),
    ("mrv2_spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding).",
     "spec_num_accepted_tokens"),
    ("mrv2_spec_decode_num_drafts", "Request-steps that verified drafts (mean accepted length: "
     "1 + accepted tokens / this).", "spec_num_steps"),
)
# (name, help, key) of per-draft-position counters, labelled ``position``.
_POSITION_COUNTERS = (
    ("mrv2_spec_decode_num_draft_tokens_per_pos", "Drafts verified at each draft position.",
     "spec_num_drafts_per_pos"),
    ("mrv2_spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at each draft position.",
     "spec_num_accepted_per_pos"),
)


class ServerMetrics:
    """What ``/metrics`` shows: one :class:`CollectorRegistry` per server (two servers in one
    process never share counts). The engine thread calls the ``observe_*`` methods and stores
    ``stats``; the HTTP side calls :meth:`render`."""

    def __init__(self, model_name: str, device: torch.device | str = "cpu") -> None:
        self.registry = CollectorRegistry()
        self.stats: dict[str, Any] = {}
        #: Sequences in flight on the server (set by the engine thread's owner).
        self.num_pending: Callable[[], int] = lambda: 0
        reg, name = self.registry, model_name
        self.prompt_tokens = Counter(
            "mrv2_prompt_tokens", "Prompt tokens of the requests that produced a token.",
            ["model_name"], registry=reg).labels(name)
        self.generation_tokens = Counter(
            "mrv2_generation_tokens", "Tokens generated (counted as they come out).",
            ["model_name"], registry=reg).labels(name)
        self._success = Counter("mrv2_request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        for reason in ("stop", "length"):
            self._success.labels(name, reason)
        self.requests_aborted = Counter("mrv2_request_aborted", "Requests aborted (client gone).",
                                        ["model_name"], registry=reg).labels(name)
        self.requests_failed = Counter(
            "mrv2_request_failed", "Requests failed by an engine error or shutdown.",
            ["model_name"], registry=reg).labels(name)
        self.ttft = Histogram("mrv2_time_to_first_token_seconds", "Time to first token.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=reg).labels(name)
        self.tpot = Histogram("mrv2_time_per_output_token_seconds", "Time per output token.",
                              ["model_name"], buckets=TPOT_BUCKETS, registry=reg).labels(name)
        # The same series under vLLM's names (and its labels, bucket edges), updated in the
        # same calls as the mrv2 ones above.
        vllm, engine = VLLM_NAMES, _VLLM_ENGINE
        self._vllm_prompt_tokens = Counter(
            vllm["mrv2_prompt_tokens"], "Number of prefill tokens processed.", _VLLM_LABELS,
            registry=reg).labels(name, engine)
        self._vllm_generation_tokens = Counter(
            vllm["mrv2_generation_tokens"], "Number of generation tokens processed.",
            _VLLM_LABELS, registry=reg).labels(name, engine)
        self._vllm_success = Counter(vllm["mrv2_request_success"],
                                     "Count of successfully processed requests.",
                                     [*_VLLM_LABELS, "finished_reason"], registry=reg)
        for reason in ("stop", "length", "abort"):  # (vLLM's FinishReason values)
            self._vllm_success.labels(name, engine, reason)
        self._vllm_ttft = Histogram(
            vllm["mrv2_time_to_first_token_seconds"], "Histogram of time to first token in "
            "seconds.", _VLLM_LABELS, buckets=VLLM_TTFT_BUCKETS, registry=reg).labels(name, engine)
        self._vllm_tpot = Histogram(
            vllm["mrv2_time_per_output_token_seconds"], "Histogram of "
            "time_per_output_token_seconds per request.", _VLLM_LABELS, buckets=VLLM_TPOT_BUCKETS,
            registry=reg).labels(name, engine)
        self._vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            _VLLM_LABELS, buckets=VLLM_E2E_BUCKETS, registry=reg).labels(name, engine)
        self._name = name
        #: This process's garbage-collector pauses (an engine process reports its own).
        self.gc_pauses = GCPauses()
        ProcessCollector(registry=reg)
        reg.register(_EngineCollector(self, name, torch.device(device)))

    def close(self) -> None:
        """Stop counting this process's collector pauses (the server stopped)."""
        self.gc_pauses.close()

    def observe_tokens(self, num_prompt: int, num_generated: int) -> None:
        """Tokens came out: ``num_generated`` new ones over a request's sequences, and
        ``num_prompt``, its prompt's length, with its first ones (else 0)."""
        if num_prompt:
            self.prompt_tokens.inc(num_prompt)
            self._vllm_prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self._vllm_generation_tokens.inc(num_generated)

    def observe_first_token(self, seconds: float) -> None:
        """A request's first token came ``seconds`` after it arrived."""
        self.ttft.observe(seconds)
        self._vllm_ttft.observe(seconds)

    def observe_finished(self, sequences: list[tuple[str, int, float | None, float]]) -> None:
        """A request finished: each sequence's finish reason, length, unless None its decode
        seconds (the request's first token to the sequence's end), which give its time per
        output token, and its seconds from the request's arrival to its end."""
        for reason, num, decode_seconds, e2e_seconds in sequences:
            self._success.labels(self._name, reason).inc()
            self._vllm_success.labels(self._name, _VLLM_ENGINE, reason).inc()
            self._vllm_e2e.observe(e2e_seconds)
            if decode_seconds is not None and num > 1:
                self.tpot.observe(decode_seconds / (num - 1))
                self._vllm_tpot.observe(decode_seconds / (num - 1))

    def observe_aborted(self, num_seqs: int) -> None:
        """A request of ``num_seqs`` sequences was aborted (its client left): one request on
        ``mrv2_request_aborted``, and each sequence on vLLM's
        ``vllm:request_success{finished_reason="abort"}``, where vLLM counts aborts."""
        self.requests_aborted.inc()
        self._vllm_success.labels(self._name, _VLLM_ENGINE, "abort").inc(num_seqs)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return bytes(generate_latest(self.registry))


class _EngineCollector(Collector):
    """The engine's stats snapshot and the device's memory, read at scrape time."""

    def __init__(self, metrics: ServerMetrics, model_name: str, device: torch.device) -> None:
        self.metrics, self.model_name, self.device = metrics, model_name, device

    def collect(self) -> Iterator[Metric]:
        stats, label = self.metrics.stats, [self.model_name]
        vllm_label = [self.model_name, _VLLM_ENGINE]
        for name, doc, key in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, float(stats.get(key, 0)))
            yield family
            if name in VLLM_NAMES:
                family = GaugeMetricFamily(VLLM_NAMES[name], doc, labels=_VLLM_LABELS)
                family.add_metric(vllm_label, float(stats.get(key, 0)))
                yield family
        for name, doc, key in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, float(stats.get(key, 0)))
            yield counter
            if name in VLLM_NAMES:
                counter = CounterMetricFamily(VLLM_NAMES[name], doc, labels=_VLLM_LABELS)
                counter.add_metric(vllm_label, float(stats.get(key, 0)))
                yield counter
        for name, doc, key in _POSITION_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=["model_name", "position"])
            for position, value in enumerate(stats.get(key, [])):
                counter.add_metric([self.model_name, str(position)], float(value))
            yield counter
        if "max_lora" in stats:  # vLLM's lora_requests_info: the labels carry the news
            info = GaugeMetricFamily(
                "mrv2_lora_requests_info", "LoRA adapters of running and waiting requests "
                "(comma-separated names; the value: when this was read, Unix seconds).",
                labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(stats["max_lora"]), ",".join(stats["lora_running"]),
                             ",".join(stats["lora_waiting"])], time.time())
            yield info
        pending = GaugeMetricFamily("mrv2_num_requests_pending",
                                    "Sequences in flight on the server (a request counts n).",
                                    labels=["model_name"])
        pending.add_metric(label, float(self.metrics.num_pending()))
        yield pending
        pauses = CounterMetricFamily(
            "mrv2_gc_pause_seconds", "Seconds Python's garbage collector stopped a process "
            "(server: the HTTP server's process, the engine's too when it runs on a thread there; "
            "engine: the engine's own process).",
            labels=["model_name", "process"])
        pauses.add_metric([self.model_name, "server"], self.metrics.gc_pauses.total_seconds)
        if "gc_pause_seconds" in stats:
            pauses.add_metric([self.model_name, "engine"], float(stats["gc_pause_seconds"]))
        yield pauses
        on_gpu = self.device.type == "cuda"
        for name, doc, read, key in (
            ("mrv2_gpu_memory_allocated_bytes", "Device memory held by tensors.",
             torch.cuda.memory_allocated, "gpu_memory_allocated"),
            ("mrv2_gpu_memory_reserved_bytes", "Device memory held by the caching allocator.",
             torch.cuda.memory_reserved, "gpu_memory_reserved"),
        ):
            gauge = GaugeMetricFamily(name, doc + " (0 on CPU)", labels=["model_name"])
            value = stats.get(key)  # an engine in its own process reports its own
            if value is None:
                value = read(self.device) if on_gpu else 0
            gauge.add_metric(label, float(value))
            yield gauge
