"""``/metrics`` serves vLLM's names beside mrv2's: each series vLLM also has comes a second
time under vLLM's name, type, labels (``model_name``, ``engine="0"``) and bucket edges, with
the mrv2 series' value; ``vllm:e2e_request_latency_seconds`` times arrival to finish."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import API_KEY, MODEL, Served

from mrv2.entrypoints.engine_thread import _Sink
from mrv2.entrypoints.metrics import (
    VLLM_E2E_BUCKETS,
    VLLM_NAMES,
    VLLM_TPOT_BUCKETS,
    VLLM_TTFT_BUCKETS,
    ServerMetrics,
)

AUTH = {"Authorization": f"Bearer {API_KEY}"}

# vLLM's name -> (its Prometheus type, its bucket edges for a histogram)
_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


def _families(text: str) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """name -> {(sample name, its labels but ``engine``): value}, and name -> type."""
    out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for family in text_string_to_metric_families(text):
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine"))
            samples[(s.name.split(family.name, 1)[1], labels)] = s.value
        samples[("type", ())] = {"gauge": 0, "counter": 1, "histogram": 2}[family.type]
    return out


def test_vllm_names_equal_the_mrv2_series(server: Served) -> None:
    for prompt, n in (("hi", 1), ("hello there", 2), ("a b c", 1)):
        response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "n": n, "ignore_eos": True})
        assert response.status_code == 200, response.text
    text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=60).text
    families = _families(text)
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name, kind in _TYPES.items():
        assert types.get(name) == kind, (name, types.get(name))
        for sample in text.splitlines():
            if sample.startswith(name) and not sample.startswith("#"):
                assert f'model_name="{MODEL}"' in sample and 'engine="0"' in sample, sample
    for mrv2_name, vllm_name in VLLM_NAMES.items():
        mrv2, vllm = families[mrv2_name], families[vllm_name]
        if types[vllm_name] == "histogram":
            for key in ("_count", "_sum"):
                assert vllm[(key, (("model_name", MODEL),))] == pytest.approx(
                    mrv2[(key, (("model_name", MODEL),))]), (vllm_name, key)
            # the edges both have count the same observations
            for (sample, labels), value in mrv2.items():
                if sample == "_bucket" and (sample, labels) in vllm:
                    assert vllm[(sample, labels)] == value, (vllm_name, labels)
        else:
            shared = {k: v for k, v in vllm.items() if k in mrv2}
            assert shared == {k: v for k, v in mrv2.items() if k in vllm}
            assert len(shared) > 1, vllm_name  # (the type and at least one value)
    ok = families["vllm:request_success"]
    assert ok[("_total", (("finished_reason", "length"), ("model_name", MODEL)))] >= 4
    assert ok[("_total", (("finished_reason", "abort"), ("model_name", MODEL)))] == 0
    e2e, ttft = families["vllm:e2e_request_latency_seconds"], families[
        "vllm:time_to_first_token_seconds"]
    key = (("model_name", MODEL),)
    assert e2e[("_count", key)] == sum(v for (s, labels), v in ok.items() if s == "_total")
    assert e2e[("_sum", key)] > 0
    assert e2e[("_count", key)] >= ttft[("_count", key)] >= 3
    assert families["vllm:generation_tokens"][("_total", key)] >= 16


def test_vllm_buckets_and_e2e_from_arrival() -> None:
    metrics = ServerMetrics("m")
    sink = _Sink(None, None, 10.0, num_prompt=3, num_seqs=2)  # type: ignore[arg-type]
    sink.first = 10.5
    sink.count(0, 3, "stop", now=11.5)
    sink.count(1, 5, "length", now=12.0)
    metrics.observe_first_token(0.5)
    metrics.observe_finished(sink.finished_lengths(13.0))
    text = metrics.render().decode()
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    lab = (("engine", "0"), ("model_name", "m"))

    def value(name: str, *extra: tuple[str, str]) -> float:
        return values[(name, tuple(sorted(lab + extra)))]

    assert value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(3.5)  # 1.5 + 2.0
    assert value("vllm:e2e_request_latency_seconds_bucket", ("le", "1.5")) == 1
    assert value("vllm:e2e_request_latency_seconds_bucket", ("le", "2.0")) == 2
    # (0.5 + 0.375; 1.5 / 2 and 1.5 / 4, the mrv2 histogram's the same)
    assert value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.875)
    assert values[("mrv2_time_per_output_token_seconds_sum", (("model_name", "m"),))] == (
        pytest.approx(0.875))
    assert value("vllm:time_to_first_token_seconds_bucket", ("le", "2560.0")) == 1
    assert value("vllm:request_success_total", ("finished_reason", "stop")) == 1
    assert value("vllm:request_success_total", ("finished_reason", "abort")) == 0
    for name, edges in (("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
                        ("vllm:request_time_per_output_token_seconds", VLLM_TPOT_BUCKETS),
                        ("vllm:e2e_request_latency_seconds", VLLM_E2E_BUCKETS)):
        served = [float(dict(labels)["le"]) for (sample, labels) in values
                  if sample == name + "_bucket"]
        assert served == [*edges, float("inf")], name
