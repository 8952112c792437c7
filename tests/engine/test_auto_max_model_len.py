"""vLLM's ``max_model_len="auto"`` / ``-1``: the longest length, at most the model's context
length, one request of which the KV cache holds once it is sized, counted as the scheduler
counts (sliding tables hold their window), logged at start-up; every buffer, check and
route of the engine then sees that length. It was refused before."""

from __future__ import annotations

import json
import logging
import operator
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.llm import LLM
from mrv2.logs import _Handler
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

TINY_LEN = 256  # the tiny checkpoints' max_position_embeddings


def _cpu_budget_gb(path: Path, blocks: int, block_size: int = 4, kv_heads_per_rank: int = 2
                   ) -> float:
    """A CPU KV budget (``cpu_kv_cache_gb``) of ``blocks`` float32 blocks of the checkpoint
    (half a block more: never one short)."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = cfg["num_hidden_layers"] * 2 * block_size * kv_heads_per_rank * head_dim * 4
    return (blocks + 0.5) * per_block / (1 << 30)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "one-step-prompts"])
@pytest.mark.parametrize("value", ["auto", -1])
def test_auto_takes_the_longest_length_the_kv_cache_holds(
        qwen3: Path, value: str | int, chunked: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A CPU cache of 20 blocks of 4 holds one request of 80 tokens, not the model's 256:
    auto takes 80 (the runner, the engine and the scheduler alike; the engine starts, where
    256 is refused), says so at start-up, and a request reaching 80 tokens runs to its end
    while an 80-token prompt is refused; with chunked prefill off too (a prompt in one
    step)."""
    caplog.set_level(logging.INFO, logger="mrv2")
    llm = LLM(str(qwen3), device="cpu", dtype="float32", block_size=4,
              cpu_kv_cache_gb=_cpu_budget_gb(qwen3, 20), max_model_len=value,
              enable_chunked_prefill=chunked)
    engine = llm.engine
    assert engine.block_manager.num_blocks == 20
    assert engine.max_model_len == engine.runner.max_model_len == 80
    assert engine.scheduler.max_model_len == 80 and engine.runner.max_blocks_per_req == 20
    assert engine.config.model.max_model_len == -1  # (the config keeps what was asked)
    assert engine.runner.startup.facts["max_model_len"] == 80
    text = caplog.text
    assert "max_model_len auto: 80, reduced from the model's 256" in text
    assert "1.0 requests of max_model_len 80 fit at once" in text
    prompt = [(5 * i) % 200 + 2 for i in range(70)]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"  # 70 + 10 = 80
    assert engine.validate(prompt + prompt[:9], SamplingParams()) == 1  # 79 tokens
    with pytest.raises(ValueError, match="the prompt has 80 tokens, but max_model_len is 80"):
        engine.validate(prompt + prompt[:10], SamplingParams())
    llm.shutdown()


def test_auto_keeps_the_models_length_where_it_fits(
        qwen3: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The default CPU cache (2 GiB) holds the model's whole context: auto is the model's
    length, as when unset."""
    caplog.set_level(logging.INFO, logger="mrv2")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(qwen3), device="cpu",
                                                dtype="float32", max_model_len="auto"))
    assert engine.max_model_len == engine.scheduler.max_model_len == TINY_LEN
    assert "max_model_len auto: 256, the model's context length, fits in the KV cache" in (
        caplog.text)
    engine.shutdown()


def test_auto_fits_the_blocks_num_gpu_blocks_override_gives(qwen3: Path) -> None:
    """As in vLLM, the override's blocks are the cache auto fits: 10 blocks of 4, 40."""
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(qwen3), device="cpu", dtype="float32", block_size=4,
        num_gpu_blocks_override=10, max_model_len=-1))
    assert engine.max_model_len == 40 and engine.runner.max_model_len == 40
    engine.shutdown()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 with two full-attention layers and two sliding ones (window 6): two tables."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "Qwen2ForCausalLM",
                                std=0.15, num_hidden_layers=4, sliding_window=6,
                                use_sliding_window=True, max_window_layers=2)


def test_auto_counts_sliding_tables_as_the_scheduler_does(hybrid: Path) -> None:
    """A full and a sliding table over 24 blocks of 4, steps of 8 tokens: a request of L
    tokens holds ceil(L / 4) full blocks and at most 5 sliding ones (window, step, two
    boundaries), so 76 fits and 77 does not, which is what the scheduler's count (the one
    its start-up check and every request's check use) says; not 48 (every table holding
    every block) nor 96 (one table). A request of 76 tokens runs to its end."""
    llm = LLM(str(hybrid), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8, num_gpu_blocks_override=24, max_model_len="auto")
    engine = llm.engine
    assert engine.runner.kv_table_windows == (None, 6)
    assert engine.max_model_len == 76
    scheduler = engine.scheduler
    count = scheduler.tables.most_held  # (most_blocks caps a request at max_model_len)
    assert count(76, scheduler.max_step_tokens) == 24 < count(77, scheduler.max_step_tokens)
    engine.scheduler.check_capacity(76, "num_gpu_blocks_override")  # (passes)
    prompt = [(7 * i) % 200 + 2 for i in range(60)]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    assert engine.block_manager.num_free_blocks == 24
    llm.shutdown()


def test_auto_of_a_sliding_only_model_is_its_whole_length(tmp_path: Path) -> None:
    """Every layer sliding (window 5): a request holds its window's blocks whatever its
    length, so a cache of 8 blocks of 4 (32 tokens) serves the model's whole 256."""
    ckpt = make_tiny_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=5)
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(ckpt), device="cpu", dtype="float32", block_size=4,
        max_num_batched_tokens=8, cpu_kv_cache_gb=_cpu_budget_gb(ckpt, 8),
        max_model_len="auto"))
    assert engine.runner.kv_table_windows == (5,) and engine.block_manager.num_blocks == 8
    assert engine.max_model_len == TINY_LEN
    engine.shutdown()


def test_auto_refuses_a_cache_that_holds_not_one_token(hybrid: Path) -> None:
    """One block over two tables: not even a one-token request fits (vLLM refuses to start
    too), named with the setting that sized the cache."""
    with pytest.raises(ValueError, match=(
            r"max_model_len='auto': the KV cache holds 1 blocks, but a request of one token "
            r"needs 2 .*2 block tables\): not even one token fits\. Raise "
            r"num_gpu_blocks_override")):
        LLMEngine(EngineConfig.from_kwargs(
            model=str(hybrid), device="cpu", dtype="float32", block_size=4,
            max_num_batched_tokens=8, num_gpu_blocks_override=1, max_model_len="auto"))


def test_every_tensor_parallel_rank_takes_the_same_length(qwen3: Path) -> None:
    """Two ranks (processes) each size their half of the cache from the same budget and
    agree on the fewest blocks: each takes the same length (a kv head each: 40 blocks of 4,
    160 tokens), and requests up to it run."""
    with LLM(str(qwen3), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=2,
             cpu_kv_cache_gb=_cpu_budget_gb(qwen3, 40, kv_heads_per_rank=1),
             max_model_len="auto") as llm:
        assert llm.engine.max_model_len == 160
        assert llm.collective_rpc(operator.attrgetter("max_model_len")) == [160, 160]
        prompt = [(3 * i) % 200 + 2 for i in range(150)]
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 10


@pytest.fixture
def clean_logging() -> Iterator[None]:
    """The ``mrv2`` logger as a library leaves it, after a ``main`` that configured it."""
    yield
    root = logging.getLogger("mrv2")
    for handler in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(handler)
    root.setLevel(logging.NOTSET)


@pytest.mark.parametrize("flag", ["auto", "-1"])
def test_the_cli_flag_takes_auto(qwen3: Path, tmp_path: Path, flag: str, clean_logging: None,
                                 caplog: pytest.LogCaptureFixture) -> None:
    """``mrv2 generate --max-model-len auto`` (or ``-1``) starts an engine of the length
    that fits (``mrv2 serve`` builds its config from the same flags)."""
    from mrv2.entrypoints.cli import main

    model = Path(shutil.copytree(qwen3, tmp_path / "m"))
    make_tiny_tokenizer(model, vocab_size=256)
    caplog.set_level(logging.INFO, logger="mrv2")
    assert main(["generate", "Hello", "--model", str(model), "--raw", "--max-tokens", "3",
                 "--device", "cpu", "--dtype", "float32", "--block-size", "4",
                 "--num-gpu-blocks-override", "12", "--max-model-len", flag]) == 0
    assert "max_model_len auto: 48, reduced from the model's 256" in caplog.text
