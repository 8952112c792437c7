"""The start-up report: what the weights weigh, how big the KV cache is in tokens and in
requests of ``max_model_len``, what the CUDA graphs hold, and how long each part took; logged
on the ``mrv2`` logger, which the ``mrv2`` command (and the engine process it starts)
configures from ``MRV2_LOGGING_LEVEL``."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.logs import LEVEL_ENV_VAR, _Handler, configure_logging, configured_level
from mrv2.runner.startup import StartupReport
from mrv2.testing import make_tiny_checkpoint


@pytest.fixture
def clean_logging() -> Iterator[logging.Logger]:
    """The ``mrv2`` logger as a library leaves it (no handler, no level), before and after."""
    root = logging.getLogger("mrv2")

    def reset() -> None:
        for handler in [h for h in root.handlers if isinstance(h, _Handler)]:
            root.removeHandler(handler)
        root.setLevel(logging.NOTSET)

    reset()
    yield root
    reset()


def test_configure_logging_reads_the_level_from_the_environment(
        clean_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert configured_level() is None  # a library configures nothing
    monkeypatch.setenv(LEVEL_ENV_VAR, "warning")
    assert configure_logging() == logging.WARNING
    assert configure_logging() == logging.WARNING  # again: still one handler
    assert sum(isinstance(h, _Handler) for h in clean_logging.handlers) == 1
    assert configured_level() == logging.WARNING
    logging.getLogger("mrv2.runner").info("not shown")
    logging.getLogger("mrv2.runner").warning("shown %d", 7)
    err = capsys.readouterr().err  # the stderr of the moment, not the handler's first one
    assert "not shown" not in err
    assert "WARNING" in err and "mrv2.runner: shown 7" in err
    monkeypatch.delenv(LEVEL_ENV_VAR)
    assert configure_logging() == logging.INFO  # the default


def test_an_unknown_level_names_the_variable_and_the_levels(
        clean_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LEVEL_ENV_VAR, "LOUD")
    with pytest.raises(ValueError, match=f"{LEVEL_ENV_VAR}='LOUD'.*DEBUG, INFO, WARNING"):
        configure_logging()
    assert configured_level() is None  # nothing installed


def test_the_runner_reports_weights_kv_cache_and_parts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    caplog.set_level(logging.INFO, logger="mrv2")
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=64,
        num_gpu_blocks_override=40))
    runner = engine.runner
    facts, seconds = runner.startup.facts, runner.startup.seconds
    params = {id(t): t for t in [*runner.model.parameters(), *runner.model.buffers()]}
    assert facts["weight_bytes"] == sum(t.numel() * t.element_size() for t in params.values())
    assert facts["kv_tokens"] == runner.num_kv_blocks * 4 == 160
    assert facts["max_concurrency"] == pytest.approx(160 / 64)
    assert set(seconds) == {"config", "load", "kv_cache"}  # no graphs off CUDA
    assert all(s >= 0 for s in seconds.values())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Qwen3ForCausalLM loaded in" in text
    assert "KV cache: 160 tokens (40 blocks of 4" in text and "float32" in text
    assert "2.5 requests of max_model_len 64 fit at once (" in text  # no peak off CUDA
    ready = next(r.getMessage() for r in caplog.records if "engine ready in" in r.getMessage())
    assert re.fullmatch(r"engine ready in [\d.]+ s \(config [\d.]+ s, load [\d.]+ s, "
                        r"kv cache [\d.]+ s, other [\d.]+ s\)", ready), ready
    assert "CUDA graphs" not in text


def test_the_graph_line_counts_each_kind_and_quiet_ranks_say_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mrv2")
    graphs = SimpleNamespace(graphs={(1, 1): 0, (1, 2): 0, (1, 4): 0}, mixed_graphs={64: 0},
                             tail_graphs={}, draft_graphs={})
    report = StartupReport()
    report.seconds["graphs"] = 2.31
    report.graphs(graphs, 3 << 29)
    assert report.facts["graph_counts"] == {"decode": 3, "mixed": 1, "sampling tails": 0,
                                            "drafting": 0}
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graphs captured in 2.3 s: 3 decode, 1 mixed; 1.50 GiB of device memory"]
    caplog.clear()
    quiet = StartupReport(quiet=True)  # a tensor-parallel rank past 0
    quiet.graphs(graphs, 0)
    assert quiet.facts["graph_counts"]["decode"] == 3 and not caplog.records


def test_the_kv_line_names_the_encoders_share(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="mrv2")
    report = StartupReport()
    report.facts.update(encoder_peak_bytes=3 << 28, encoder_kept_bytes=1 << 28)
    report.kv_cache(100, 16, 1 << 20, "bfloat16", 4096, 5 << 29)
    assert ("activation peak 2.50 GiB (the encoder's 0.75 GiB counted, 0.25 GiB reserved "
            "for its cache)") in caplog.text
    caplog.clear()
    text = StartupReport()  # a text model: the encoder's share is not mentioned
    text.facts.update(encoder_peak_bytes=0, encoder_kept_bytes=0)
    text.kv_cache(100, 16, 1 << 20, "bfloat16", 4096, 5 << 29)
    assert "activation peak 2.50 GiB (0.0 s)" in caplog.text


def _cpu_budget_gb(path: Path, blocks: int, block_size: int = 4) -> float:
    """A CPU KV budget (``cpu_kv_cache_gb``) of ``blocks`` float32 blocks of the checkpoint."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = (cfg["num_hidden_layers"] * 2 * block_size * cfg["num_key_value_heads"]
                 * head_dim * 4)
    return (blocks + 0.5) * per_block / (1 << 30)


def test_a_cache_too_small_for_one_max_model_len_request_refuses_to_start(
        tmp_path: Path) -> None:
    """vLLM's start-up check: a KV cache sized from memory that cannot hold one request of
    max_model_len tokens is refused at start-up (naming max_model_len, what is needed and
    held, and the longest length that fits), instead of an engine that then refuses every
    request leaving max_tokens unset; at that length it starts and takes such requests."""
    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    kwargs = {"model": str(ckpt), "device": "cpu", "dtype": "float32", "block_size": 4,
              "cpu_kv_cache_gb": _cpu_budget_gb(ckpt, 20)}
    with pytest.raises(ValueError, match=(
            r"holds 20 blocks of 4 tokens \(80 tokens\), but one request of max_model_len "
            r"256 tokens needs 64 blocks.*largest max_model_len that fits is about 80\. "
            r"Raise cpu_kv_cache_gb, or lower max_model_len")):
        LLMEngine(EngineConfig.from_kwargs(max_model_len=256, **kwargs))
    engine = LLMEngine(EngineConfig.from_kwargs(max_model_len=80, **kwargs))
    assert engine.block_manager.num_blocks == 20
    assert engine.validate([1, 2, 3], SamplingParams(max_tokens=None)) == 77


def test_a_sliding_window_model_is_counted_by_its_windows(tmp_path: Path) -> None:
    """Every layer sliding: a request holds its window's blocks (and a step's), not
    max_model_len's, so a cache far smaller than max_model_len tokens serves it."""
    ckpt = make_tiny_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=5)
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=256,
        max_num_batched_tokens=8, cpu_kv_cache_gb=_cpu_budget_gb(ckpt, 8)))
    assert engine.runner.kv_table_windows == (5,) and engine.block_manager.num_blocks == 8
    assert engine.validate([1, 2, 3], SamplingParams(max_tokens=None)) == 253
