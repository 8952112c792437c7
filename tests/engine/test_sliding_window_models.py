"""Families whose configs set a sliding window get it as HF applies it (``sliding_window_of``):
Mistral on every layer, Qwen2 with ``use_sliding_window`` on the layers past
``max_window_layers``; greedy tokens through the engine (prompts and outputs past the window,
chunked prefill) are HF's."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

CASES: dict[str, tuple[str, dict[str, Any], list[int | None]]] = {
    "mistral": ("MistralForCausalLM", {"sliding_window": 5}, [5, 5]),
    "qwen2": ("Qwen2ForCausalLM", {"sliding_window": 6, "use_sliding_window": True,
                                   "max_window_layers": 1}, [None, 6]),
    "mistral-no-window": ("MistralForCausalLM", {"sliding_window": None}, [None, None]),
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_hf(case: str, tmp_path: Path) -> None:
    arch, overrides, windows = CASES[case]
    path = make_tiny_checkpoint(tmp_path / "m", arch, std=0.15, **overrides)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == windows
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]


def test_sliding_tables_free_and_share_blocks(tmp_path: Path) -> None:
    """Qwen2 with two full and two sliding layers: the sliding layers get a block table of
    their own, sharing the full layers' tensors (a block id costs two layers, not four); their
    blocks out of the window go back to the pool while requests run, in a cache too small to
    hold every request's blocks in every layer; a second round of the same prompts hits the
    prefix cache through both tables; the tokens are HF's throughout."""
    path = make_tiny_checkpoint(tmp_path / "m", "Qwen2ForCausalLM", std=0.15,
                                num_hidden_layers=4, sliding_window=6,
                                use_sliding_window=True, max_window_layers=2)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8,
              num_gpu_blocks_override=24, enable_prefix_caching=True)
    runner, engine = llm.engine.runner, llm.engine
    assert runner.kv_table_windows == (None, 6)
    tensors = runner.kv.tensors
    assert tensors[0] is tensors[2] and tensors[1] is tensors[3] and tensors[0] is not tensors[1]
    prompts = [[(7 * i + 3 * j) % 200 + 2 for j in range(21)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [hf_greedy(path, p, 10) for p in prompts]
    for round_ in range(2):  # (the second in reverse: the last one's blocks are cached yet)
        order = list(range(3)) if round_ == 0 else [2, 1, 0]
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], params,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [expected[i] for i in order], round_
        assert engine.block_manager.num_free_blocks == 24  # nothing leaked
    # 31 tokens: 8 blocks a table; the sliding table holds at most 4 of them at a time
    assert engine.scheduler.tables.num_freed >= 2 * 3 * 4
    assert engine.stats()["kv_window_freed_blocks"] == engine.scheduler.tables.num_freed
    assert engine.block_manager.num_hit_tokens > 0


def test_sliding_tables_with_drafts(tmp_path: Path) -> None:
    """n-gram drafts over sliding tables: a step's result takes back rejected drafts after
    the scheduler freed blocks for the count that assumed them kept, so the freeing keeps
    ``num_speculative_tokens`` more keys of each window. Greedy tokens stay HF's; drafts
    were both kept and rejected."""
    path = make_tiny_checkpoint(tmp_path / "m", "MistralForCausalLM", std=0.15,
                                sliding_window=3)
    # (a pool so small that a freed block is written again at once)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=2, max_num_batched_tokens=8,
              num_gpu_blocks_override=10, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 2})
    assert llm.engine.runner.kv_table_windows == (3,)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 9, 9], [3 + i for i in range(9)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 12) for p in prompts]
    proposed = sum(n * steps for n, steps in enumerate(llm.engine._drafted_hist))
    kept = sum(n * steps for n, steps in enumerate(llm.engine._accepted_hist))
    assert 0 < kept < proposed, (kept, proposed)
    assert llm.engine.scheduler.tables.num_freed > 0
    assert llm.engine.block_manager.num_free_blocks == 10


def test_disable_sliding_window_attends_over_every_key_up_to_the_window(
        tmp_path: Path) -> None:
    """vLLM's ``--disable-sliding-window``: every layer attends over all keys (no window, no
    table of its own), ``max_model_len`` is the window (a longer one is refused, a prompt past
    it is the usual too-long error), and the greedy tokens are HF's with the window removed.
    Without a window (none set, or Qwen2's ``use_sliding_window`` false) it changes nothing."""
    path = make_tiny_checkpoint(tmp_path / "m", "MistralForCausalLM", std=0.15,
                                sliding_window=12)
    plain = tmp_path / "plain"  # the same checkpoint, its window removed: HF's reference
    shutil.copytree(path, plain)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    kwargs: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4,
                                  max_num_batched_tokens=8)
    llm = LLM(str(path), disable_sliding_window=True, **kwargs)
    runner = llm.engine.runner
    assert [layer.self_attn.attn.sliding_window for layer in runner.model.model.layers] == [
        None, None]
    assert runner.kv_table_windows == (None,)
    assert llm.engine.max_model_len == runner.max_model_len == 12
    prompts = [[5, 17, 42, 9, 100, 3], [64]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(plain, p, 6) for p in prompts]
    with pytest.raises(ValueError, match="the prompt has 12 tokens, but max_model_len is 12"):
        llm.generate([{"prompt_token_ids": list(range(2, 14))}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=64 exceeds the model's sliding_window=12"):
        LLM(str(path), disable_sliding_window=True, max_model_len=64, **kwargs)
    # no window: the flag changes nothing (max_model_len stays max_position_embeddings)
    qwen2 = make_tiny_checkpoint(tmp_path / "q", "Qwen2ForCausalLM", sliding_window=6,
                                 use_sliding_window=False)
    for checkpoint in (plain, qwen2):
        engine = LLM(str(checkpoint), disable_sliding_window=True, **kwargs).engine
        assert engine.max_model_len == 256 and engine.runner.kv_table_windows == (None,)


def test_disable_sliding_window_keeps_the_layers_kinds(tmp_path: Path) -> None:
    """Gemma 3's local layers (their own RoPE) and gpt-oss's: full attention under the flag,
    each layer's RoPE as built, ``max_model_len`` the window; greedy tokens within it are the
    same as with the window (a query there sees no more keys than the window holds), and
    ``mrv2 serve --disable-sliding-window`` sets it."""
    from mrv2.config_cli import add_cli_args, config_from_cli
    from mrv2.testing import TINY_FAMILIES

    for family in ("gemma3", "gpt-oss"):
        arch, overrides = TINY_FAMILIES[family]
        path = make_tiny_checkpoint(tmp_path / family, arch, std=0.15, **overrides)
        kwargs: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4)
        windowed, full = (LLM(str(path), disable_sliding_window=flag, **kwargs)
                          for flag in (False, True))
        window = int(overrides["sliding_window"])
        assert full.engine.max_model_len == window < windowed.engine.max_model_len
        assert full.engine.runner.kv_table_windows == (None,)
        assert windowed.engine.runner.kv_table_windows == (None, window)
        prompt = [{"prompt_token_ids": [5, 17]}]
        params = SamplingParams(temperature=0.0, max_tokens=window - 2, ignore_eos=True)
        assert ([o.outputs[0].token_ids for o in full.generate(prompt, params, use_tqdm=False)]
                == [o.outputs[0].token_ids
                    for o in windowed.generate(prompt, params, use_tqdm=False)]), family
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(["--disable-sliding-window"])
    assert config_from_cli(args, "m").model.disable_sliding_window
    assert not config_from_cli(parser.parse_args([]), "m").model.disable_sliding_window
