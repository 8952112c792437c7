"""The start-up warm-up runs every sampling kind through the step path, then leaves the engine
exactly as an engine that never ran it: the same request ids, seeds, outputs and counters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.warmup import (
    PENALTY_BATCHES,
    WARMUP_BATCHES,
    WARMUP_ID_PREFIX,
    warm_up,
    warmup_prompt,
)
from mrv2.testing import make_tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM")


def _engine(ckpt: Path, **kwargs: Any) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(
        **{"model": str(ckpt), "device": "cpu", "dtype": "float32", "block_size": 4, "seed": 3,
           **kwargs}))


def _run(engine: LLMEngine) -> tuple[list[tuple[str, list[int]]], dict[str, Any]]:
    """A workload whose outputs depend on the engine's ids, seeds and prefix cache: unseeded
    sampled requests, a greedy one, and a prompt sharing another's first blocks."""
    shared = [9, 8, 7, 6, 5, 4, 3, 2, 9, 8, 7, 6]
    prompts = [shared + [1, 2], [4, 4, 5, 5, 4, 4, 5], shared + [3], list(range(20, 31)),
               [3, 3, 3, 4, 4]]
    params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=30, top_p=0.8, max_tokens=6,
                             ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logprobs=1),
              # the counters the warm-up freed, allocated again (a strong penalty, so they
              # decide the tokens)
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                             repetition_penalty=5.0, frequency_penalty=2.0)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    return [(i, finished[i]) for i in ids], engine.stats()


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_warm_up_leaves_the_engine_as_it_found_it(ckpt: Path, spec: dict[str, Any] | None
                                                   ) -> None:
    kwargs: dict[str, Any] = {"speculative_config": spec} if spec else {}
    cold = _engine(ckpt, **kwargs)
    warm = _engine(ckpt, **kwargs)
    before_reset: dict[str, Any] = {}
    steps: list[int] = []
    reset, execute = warm.reset_after_warmup, warm.runner.execute

    def spy_reset() -> None:
        before_reset.update(warm.stats())
        reset()

    def spy_execute(scheduled: Any) -> Any:
        steps.append(scheduled.num_scheduled_tokens)
        return execute(scheduled)

    state = warm.runner.sampler.state
    release = state.release_penalty_state
    released: list[bool] = []

    def spy_release() -> bool:
        released.append(release())
        return released[-1]

    warm.reset_after_warmup = spy_reset  # type: ignore[method-assign]
    warm.runner.execute = spy_execute  # type: ignore[method-assign]
    state.release_penalty_state = spy_release  # type: ignore[method-assign]
    seconds = warm_up(warm)
    assert seconds >= 0
    # it ran: every batch's prefill and decode steps, and the batches after the first found
    # the prompt's first block in the prefix cache
    assert len(steps) >= 2 * (len(WARMUP_BATCHES) + len(PENALTY_BATCHES))
    assert released == [True]  # the penalty batches allocated the counters; freed after
    assert before_reset["prefix_cache_hits"] > 0
    assert before_reset["num_running"] == before_reset["num_waiting"] == 0
    assert len(warm.runner.table) == 0  # every warm-up row freed
    assert warm.runner.sampler.state.output_counts is None  # no penalty counters allocated
    # and left nothing behind
    assert warm.stats() == cold.stats()
    assert warm.block_manager.num_cached_blocks == 0
    assert _run(warm) == _run(cold)


@pytest.mark.parametrize("kwargs", [
    {"max_num_seqs": 1}, {"max_num_batched_tokens": 8, "block_size": 16},
    {"enable_prefix_caching": False}, {"max_model_len": 12}, {"async_scheduling": False},
], ids=["one-seq", "chunked-prefill", "no-prefix-cache", "short-model", "sync"])
def test_warm_up_fits_any_engine_shape(ckpt: Path, kwargs: dict[str, Any]) -> None:
    engine = _engine(ckpt, **kwargs)
    assert warm_up(engine) >= 0
    assert not engine.has_unfinished() and len(engine.runner.table) == 0
    assert engine.stats() == _engine(ckpt, **kwargs).stats()


def test_warm_up_compiles_the_structured_outputs_mask_kernel(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """For the model's logits dtype and fp32, over the whole vocabulary (a mask allowing every
    token: nothing changes)."""
    import mrv2.engine.warmup as warmup_module

    engine = _engine(ckpt, dtype="bfloat16")
    seen = []

    def spy(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
        before = logits.clone()
        apply(logits, mask, rows)
        assert torch.equal(logits, before)
        seen.append((logits.dtype, logits.shape[1], mask.shape[1]))

    apply = warmup_module.apply_token_bitmask
    monkeypatch.setattr(warmup_module, "apply_token_bitmask", spy)
    warm_up(engine)
    vocab = engine.runner.vocab_size
    words = (vocab + 31) // 32
    assert seen == [(torch.bfloat16, vocab, words), (torch.float32, vocab, words)]


def test_penalties_are_left_out_where_their_counters_would_not_fit(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import mrv2.engine.warmup as warmup_module

    engine = _engine(ckpt)
    state = engine.runner.sampler.state
    monkeypatch.setattr(warmup_module, "PENALTY_STATE_MAX_ELEMENTS",
                        state.max_num_reqs * state.vocab_size - 1)
    seen: list[SamplingParams] = []
    add = engine.add_request

    def spy_add(prompt: list[int], params: SamplingParams, request_id: str | None = None
                ) -> str:
        seen.append(params)
        return add(prompt, params, request_id)

    engine.add_request = spy_add  # type: ignore[method-assign]
    caplog.set_level("INFO", logger="mrv2.engine.warmup")
    warm_up(engine)
    assert len(seen) == sum(map(len, WARMUP_BATCHES))
    assert not any(p.uses_penalties for p in seen) and state.output_counts is None
    assert "(penalties left out)" in caplog.text


def test_the_penalty_counters_are_freed_only_when_no_row_uses_them(ckpt: Path) -> None:
    engine = _engine(ckpt)
    state = engine.runner.sampler.state
    assert state.release_penalty_state() is False  # nothing held
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, presence_penalty=1.0))
    engine.step()
    assert state.output_counts is not None
    assert state.penalty_state_bytes() == state.output_counts.numel() * 5
    with pytest.raises(RuntimeError, match="1 rows still use penalties"):
        state.release_penalty_state()
    while engine.has_unfinished():
        engine.step()
    assert state.release_penalty_state() is True and state.output_counts is None


def test_warm_up_needs_an_idle_engine(ckpt: Path) -> None:
    engine = _engine(ckpt)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(engine)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.reset_after_warmup()


def test_warmup_prompt_fits_short_models() -> None:
    assert len(warmup_prompt(100, 4096, 16)) == 24
    assert len(warmup_prompt(100, 8, 16)) == 4  # room for 4 new tokens
    assert len(warmup_prompt(100, 3, 16)) == 1
    assert all(0 <= t < 5 for t in warmup_prompt(5, 4096, 16))


def test_warm_up_is_a_config_field_and_a_flag() -> None:
    assert EngineConfig().device.warmup is True
    assert EngineConfig.from_kwargs(warmup=False).device.warmup is False
    import argparse

    from mrv2.config_cli import add_cli_args, config_from_cli

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert config_from_cli(parser.parse_args(["--no-warmup"]), None).device.warmup is False
    assert WARMUP_ID_PREFIX.startswith("mrv2-")


@pytest.mark.parametrize("warmup", [True, False])
def test_an_engine_on_cuda_warms_up_at_start_and_stops_its_runner_if_that_fails(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch, warmup: bool) -> None:
    """The start-up wiring, on the CPU: a runner that says it is on CUDA gets the warm-up
    (unless ``warmup=False``); a warm-up that raises stops the runner (tensor-parallel workers)
    and fails the start."""
    import torch

    import mrv2.engine.engine as engine_module

    make_runner = engine_module.make_runner
    shut: list[bool] = []

    def cuda_runner(*args: Any) -> Any:
        runner = make_runner(*args)
        runner.device = torch.device("cuda")
        runner.shutdown = lambda: shut.append(True)
        return runner

    def failing_warm_up(engine: Any) -> float:
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(engine_module, "make_runner", cuda_runner)
    monkeypatch.setattr(engine_module, "warm_up", failing_warm_up)
    if warmup:
        with pytest.raises(RuntimeError, match="warm-up failed"):
            _engine(ckpt)
        assert shut == [True]
    else:
        assert _engine(ckpt, warmup=False).warmup_seconds is None
        assert shut == []


def test_warm_up_readies_structured_outputs(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tokenizer and llguidance: a constrained request goes through the step path, so
    llguidance's tokenizer is built once, before the first real constrained request (which
    then builds nothing), and the engine is left as a cold one; without llguidance the
    warm-up leaves it out."""
    from mrv2.contract.params import StructuredOutputsParams
    from mrv2.engine import grammars
    from mrv2.testing import make_tiny_tokenizer

    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path)
    built: list[int] = []
    llg = grammars.load_llguidance()
    from_tokenizer = llg.hf.from_tokenizer

    def spy(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return from_tokenizer(*args, **kwargs)

    monkeypatch.setattr(llg.hf, "from_tokenizer", spy)
    warm, cold = _engine(path), _engine(path)
    warm_up(warm)
    assert built == [1] and warm.stats() == cold.stats()
    params = SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
    outs = []
    for engine in (warm, cold):
        engine.add_request([5, 6, 7], params)
        while engine.has_unfinished():
            outs += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    assert built == [1, 1] and outs[0] == outs[1]  # the cold engine built it at its first
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    bare = _engine(path)
    warm_up(bare)
    assert bare._structured is None
