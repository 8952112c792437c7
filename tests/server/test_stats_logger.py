"""``mrv2 serve``'s periodic stats line: the interval's throughput from the engine's token
counters, the requests and caches, speculation; silent while idle; the interval variable
checked; the server logs it while it serves."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL

from conftest import serve
from mrv2 import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.entrypoints.stats_logger import (
    DEFAULT_LOG_STATS_INTERVAL_S,
    LOG_STATS_INTERVAL_ENV_VAR,
    StatsLogger,
    log_stats_interval,
)


class _Feed:
    """Stats snapshots and clock readings, as the test sets them."""

    def __init__(self) -> None:
        self.now = 100.0
        self.stats: dict[str, Any] = {}

    def set(self, **changes: Any) -> None:
        self.stats = {**self.stats, **changes}


def test_a_line_per_interval_and_none_while_idle() -> None:
    feed = _Feed()
    feed.set(num_prompt_tokens=50, num_generation_tokens=7, prefix_cache_queries=10,
             prefix_cache_hits=10)
    lines = StatsLogger(lambda: feed.stats, clock=lambda: feed.now)
    feed.now += 2.0
    feed.set(num_prompt_tokens=1050, num_generation_tokens=507, num_running=3, num_waiting=1,
             kv_usage=0.125, prefix_cache_queries=410, prefix_cache_hits=110)
    assert lines.line() == ("engine: prompt 500.0 tok/s, generation 250.0 tok/s; running 3 "
                            "reqs, waiting 1 reqs; KV cache 12.5% used; prefix cache hit rate "
                            "25.0%")
    feed.now += 4.0  # everything finished: one line of zeros, then silence
    feed.set(num_generation_tokens=527, num_running=0, num_waiting=0, kv_usage=0.0)
    assert lines.line() == ("engine: prompt 0.0 tok/s, generation 5.0 tok/s; running 0 reqs, "
                            "waiting 0 reqs; KV cache 0.0% used; prefix cache hit rate 0.0%")
    feed.now += 10.0
    first_idle = lines.line()
    assert first_idle is not None and "generation 0.0 tok/s" in first_idle
    feed.now += 10.0
    assert lines.line() is None
    feed.now += 10.0
    assert lines.line() is None
    feed.now += 5.0  # work again
    feed.set(num_prompt_tokens=1100, num_generation_tokens=627, num_running=1, num_preemptions=2,
             spec_num_steps=40, spec_num_draft_tokens=80, spec_num_accepted_tokens=60)
    line = lines.line()
    assert line is not None
    assert "prompt 10.0 tok/s, generation 20.0 tok/s; running 1 reqs" in line
    assert line.endswith("; 2 preempted; speculation: mean accepted length 2.50, 60 of 80 "
                         "drafts accepted (75.0%)")


def test_the_interval_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_STATS_INTERVAL_ENV_VAR, raising=False)
    assert log_stats_interval() == DEFAULT_LOG_STATS_INTERVAL_S == 10.0
    monkeypatch.setenv(LOG_STATS_INTERVAL_ENV_VAR, "2.5")
    assert log_stats_interval() == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(LOG_STATS_INTERVAL_ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{LOG_STATS_INTERVAL_ENV_VAR}='{bad}': expected a "
                                             "positive number of seconds"):
            log_stats_interval()


def test_serve_refuses_a_bad_interval_before_the_engine_starts(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import mrv2.entrypoints.engine_process as process_module
    import mrv2.entrypoints.server  # noqa: F401  (imported before the patch: it keeps the name)
    from mrv2.entrypoints.cli import main

    built: list[bool] = []
    monkeypatch.setattr(process_module, "RemoteEngine", lambda *a, **k: built.append(True))
    monkeypatch.setenv(LOG_STATS_INTERVAL_ENV_VAR, "0")
    assert main(["serve", str(model_dir), "--device", "cpu"]) == 2
    assert f"{LOG_STATS_INTERVAL_ENV_VAR}='0'" in capsys.readouterr().err and not built


def test_the_engine_counts_prompt_and_generated_tokens(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), device="cpu",
                                                dtype="float32", block_size=4, max_num_seqs=2))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [1, 2]]
    lengths = [4, 6, 3]
    for prompt, n in zip(prompts, lengths, strict=True):  # 3 requests, 2 rows: one waits
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    stats = engine.stats()
    assert stats["num_prompt_tokens"] == stats["num_generation_tokens"] == 0
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["num_prompt_tokens"] == sum(map(len, prompts))
    assert stats["num_generation_tokens"] == sum(lengths)


def test_the_server_logs_the_line_while_it_serves(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mrv2.entrypoints.stats_logger")
    for served in serve(model_dir, log_stats_interval=0.05):
        response = httpx.post(f"{served.url}/v1/completions", timeout=60,
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 40,
                                    "ignore_eos": True})
        assert response.status_code == 200
        deadline = time.monotonic() + 10
        while "generation" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: ")]
    assert lines, caplog.text
    assert any(" tok/s, generation " in line and "KV cache" in line for line in lines)
    with pytest.raises(ValueError, match="log_stats_interval=0"):
        next(serve(model_dir, log_stats_interval=0))


def test_the_serve_logging_flags_reach_the_server(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.server_run as server_module
    from mrv2 import LoRARequest
    from mrv2.entrypoints.cli import main
    from mrv2.entrypoints.http_options import HTTPOptions
    from mrv2.entrypoints.serve_options import ServeOptions

    calls: list[dict[str, Any]] = []

    def run_server(*args: Any, **kwargs: Any) -> int:
        kwargs.pop("sock").close()  # (bound before the engine: test_serve_binds_its_port...)
        calls.append(kwargs)
        return 0

    monkeypatch.setattr(engine_module, "LLMEngine", lambda *a, **k: None)
    monkeypatch.setattr(server_module, "run_server", run_server)
    assert main(["serve", str(model_dir), "--device", "cpu", "--no-engine-process",
                 "--port", "0"]) == 0
    assert main(["serve", str(model_dir), "--device", "cpu", "--no-engine-process",
                 "--port", "0", "--disable-log-stats", "--uvicorn-log-level", "warning",
                 "--disable-uvicorn-access-log", "--reasoning-parser", "qwen3",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--allowed-origins", '["https://a.example"]', "--root-path", "/llm",
                 "--enable-prompt-tokens-details", "--enable-lora", "--lora-modules",
                 "sql=/adapters/sql", "--trust-request-chat-template"]) == 0
    assert calls == [
        {"log_stats": True, "uvicorn_log_level": "info", "access_log": True,
         "reasoning_parser": None, "tool_call_parser": None, "http": HTTPOptions(),
         "enable_prompt_tokens_details": False, "lora_modules": [],
         "trust_request_chat_template": False, "options": ServeOptions(), "middleware": []},
        {"log_stats": False, "uvicorn_log_level": "warning", "access_log": False,
         "reasoning_parser": "qwen3", "tool_call_parser": "hermes",
         "http": HTTPOptions(allowed_origins=("https://a.example",), root_path="/llm"),
         "enable_prompt_tokens_details": True,
         "lora_modules": [LoRARequest("sql", 1, "/adapters/sql")],
         "trust_request_chat_template": True, "options": ServeOptions(), "middleware": []}]
    # (--tool-call-parser alone serves, as vLLM's: test_http_options)
    for half in (["--enable-auto-tool-choice"],
                 ["--lora-modules", "sql=/adapters/sql"], ["--enable-lora", "--lora-modules",
                                                           "no-path"]):
        assert main(["serve", str(model_dir), "--device", "cpu", "--port", "0", *half]) == 2


def test_serve_binds_its_port_before_the_engine_loads(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A port in use fails at once, naming it, with nothing loaded (a large model's load
    takes minutes); a free one reaches the server bound."""
    import socket

    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.server_run as server_module
    from mrv2.entrypoints.cli import main

    built: list[bool] = []
    socks: list[socket.socket] = []
    monkeypatch.setattr(engine_module, "LLMEngine", lambda *a, **k: built.append(True))
    monkeypatch.setattr(server_module, "run_server",
                        lambda *a, **k: socks.append(k["sock"]) or 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(model_dir), "--device", "cpu", "--no-engine-process",
                     "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}: " in capsys.readouterr().err
        assert not built and not socks
    assert main(["serve", str(model_dir), "--device", "cpu", "--no-engine-process",
                 "--port", str(port)]) == 0
    assert built == [True] and socks[0].getsockname() == ("127.0.0.1", port)
    socks[0].close()
    from mrv2.entrypoints.server_run import listen_socket

    with listen_socket("localhost", 0) as named:  # a name: its IPv4 address
        assert named.family == socket.AF_INET and named.getsockname()[0] == "127.0.0.1"
    with pytest.raises(OSError):
        listen_socket("no-such-host.invalid", 0)
