"""vLLM's scheduler and parallelism engine flags: ``--long-prefill-token-threshold`` (caps one
request's tokens a step, as vLLM's V1 scheduler), ``--max-num-partial-prefills`` /
``--max-long-partial-prefills`` (1 only, as vLLM's V1 engine), ``-pp`` / ``-dp`` (1 only:
mrv2 does tensor parallelism), ``--model-impl`` and the short names ``-ep`` / ``-sc``."""

from __future__ import annotations

import argparse
import json

import pytest
from pydantic import ValidationError

from mrv2 import SamplingParams
from mrv2.config import EngineConfig, SchedulerConfig
from mrv2.config_cli import add_cli_args, config_from_cli
from mrv2.contract.requests import MultiModalItem, SchedulerOutput
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.request import Request
from mrv2.engine.scheduler import Scheduler


def _parse(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return config_from_cli(parser.parse_args(list(flags)), None)


def _scheduler(num_speculative_tokens: int = 0, **kwargs: object) -> Scheduler:
    config = SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(256, 4), num_speculative_tokens)


def _request(req_id: str, prompt_len: int, mm_items: list[MultiModalItem] | None = None
             ) -> Request:
    return Request(req_id=req_id, prompt_token_ids=[1 + i % 9 for i in range(prompt_len)],
                   sampling_params=SamplingParams(temperature=0.0), seed=0,
                   eos_token_ids=frozenset(), max_tokens=8, mm_items=mm_items or [])


def _step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, then deliver every sampled token at once (a synchronous engine)."""
    out = scheduler.schedule()
    for request in scheduler.running:
        while request.num_pending:
            request.num_pending -= 1
            request.output_token_ids.append(7)
    return out


def test_long_prefill_token_threshold_reaches_the_config() -> None:
    config = _parse("--long-prefill-token-threshold", "512", "--max-num-partial-prefills", "1",
                    "--max-long-partial-prefills", "1")
    assert config.scheduler.long_prefill_token_threshold == 512
    assert config.scheduler.max_num_partial_prefills == 1
    assert config.scheduler.max_long_partial_prefills == 1
    assert EngineConfig.from_kwargs(long_prefill_token_threshold=64) \
        .scheduler.long_prefill_token_threshold == 64
    with pytest.raises(ValidationError, match="long_prefill_token_threshold"):
        EngineConfig.from_kwargs(long_prefill_token_threshold=-1)


@pytest.mark.parametrize("chunked", [True, False])
def test_the_threshold_caps_each_prompts_chunk_a_step(chunked: bool) -> None:
    """As vLLM's V1 scheduler: a new prompt and a running one take at most the threshold's
    tokens a step (also with chunked prefill off), the budget's rest goes to the others."""
    scheduler = _scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=8,
                           enable_chunked_prefill=chunked)
    scheduler.add(_request("long", 20))
    scheduler.add(_request("short", 5))
    assert _step(scheduler).num_scheduled_tokens == {"long": 8, "short": 5}
    assert _step(scheduler).num_scheduled_tokens == {"short": 1, "long": 8}
    assert _step(scheduler).num_scheduled_tokens == {"short": 1, "long": 4}
    assert _step(scheduler).num_scheduled_tokens == {"short": 1, "long": 1}


def test_without_a_threshold_the_budget_alone_bounds_a_chunk() -> None:
    scheduler = _scheduler(max_num_batched_tokens=100)
    scheduler.add(_request("long", 20))
    assert _step(scheduler).num_scheduled_tokens == {"long": 20}


def test_the_threshold_caps_a_decode_and_its_drafts() -> None:
    """vLLM caps a running request's tokens, drafts included, at the threshold."""
    scheduler = _scheduler(num_speculative_tokens=4, max_num_batched_tokens=100,
                           long_prefill_token_threshold=3)
    scheduler.add(_request("a", 3))
    _step(scheduler)
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"a": 3} and out.num_draft_tokens == {"a": 2}


def test_a_bidirectional_item_longer_than_the_threshold_runs_whole() -> None:
    """An item whose tokens attend to each other is never split: one longer than the
    threshold (within the budget) takes a step of its own instead of never running."""
    item = MultiModalItem("image", None, "h", offset=2, length=6, bidirectional=True)
    scheduler = _scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=4)
    scheduler.add(_request("a", 12, [item]))
    chunks = [_step(scheduler).num_scheduled_tokens.get("a") for _ in range(3)]
    assert chunks == [2, 6, 4]


@pytest.mark.parametrize("field", ["max_num_partial_prefills", "max_long_partial_prefills"])
def test_concurrent_partial_prefills_are_refused_naming_the_field(field: str) -> None:
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValidationError, match=f"{field}=2 is not supported.*allowed: 1"):
        _parse(flag, "2")


def test_pipeline_and_data_parallel_sizes() -> None:
    """``-pp`` / ``-dp`` (vLLM's short names) parse; 1 is accepted, more is refused naming
    the field and the tensor parallelism mrv2 does."""
    config = _parse("-pp", "1", "-dp", "1", "--pipeline-parallel-size", "1")
    assert config.parallel.pipeline_parallel_size == config.parallel.data_parallel_size == 1
    for flag, field in [("-pp", "pipeline_parallel_size"), ("--data-parallel-size",
                                                            "data_parallel_size")]:
        with pytest.raises(ValidationError,
                           match=f"{field}=2 is not supported.*tensor_parallel_size"):
            _parse(flag, "2")
    with pytest.raises(ValidationError, match="data_parallel_size"):
        EngineConfig.from_kwargs(data_parallel_size=4)


def test_model_impl() -> None:
    assert _parse("--model-impl", "vllm").model.model_impl == "vllm"
    assert EngineConfig.from_kwargs(model_impl="auto").model.model_impl == "auto"
    with pytest.raises(ValidationError, match="model_impl='transformers' is not supported"):
        _parse("--model-impl", "transformers")
    with pytest.raises(ValidationError, match="model_impl='torch'; allowed: 'auto', 'vllm'"):
        EngineConfig.from_kwargs(model_impl="torch")


def test_vllms_other_short_names() -> None:
    """``-ep`` (``--enable-expert-parallel``) and ``-sc`` (``--speculative-config``) were
    unrecognized arguments; ``--disable-cascade-attn`` is accepted (no cascade attention)."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    config = _parse("-ep", "-sc", json.dumps(spec), "--disable-cascade-attn")
    assert config.parallel.enable_expert_parallel
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 2
    assert config.model.disable_cascade_attn


def test_max_cudagraph_capture_size_is_cuda_graph_sizes_one_value() -> None:
    """vLLM's ``--max-cudagraph-capture-size N`` (the largest decode graph; sizes 1, 2, 4,
    then every 8...) is ``cuda_graph_sizes=[N]``; it was an unrecognized argument."""
    assert _parse("--max-cudagraph-capture-size", "64").device.cuda_graph_sizes == [64]
    assert EngineConfig.from_kwargs(max_cudagraph_capture_size=32).device.cuda_graph_sizes \
        == [32]
    assert EngineConfig.from_kwargs(cuda_graph_sizes=[1, 2], max_cudagraph_capture_size=None) \
        .device.cuda_graph_sizes == [1, 2]
    with pytest.raises(ValueError, match="not both"):
        EngineConfig.from_kwargs(cuda_graph_sizes=[8], max_cudagraph_capture_size=16)
