"""Gemma3ForCausalLM against HF transformers: prefill and decode logits through the paged
cache (local layers' windows shorter than the prompts, a global layer with linearly scaled
RoPE, norms as offsets, scaled embeddings), greedy tokens through the engine, bad configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers import head_dim_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import (
    TINY_FAMILIES,
    check_steps_against_hf,
    hf_greedy,
    make_tiny_checkpoint,
    poisoned_caches,
    redraw_weights,
)
from mrv2_gemma.model import Gemma3ForCausalLM

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _config(**overrides: Any) -> transformers.Gemma3TextConfig:
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        sliding_window=4, query_pre_attn_scalar=24, layer_types=LAYERS,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1e6}},
        **overrides)
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def _save(config: transformers.Gemma3TextConfig, path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    redraw_weights(hf)  # (norm offsets drawn far from 0 too)
    hf.save_pretrained(path)
    return hf


def test_logits_match_hf(tmp_path: Path) -> None:
    hf = _save(_config(), tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = Gemma3ForCausalLM(config)
    load_model_weights(model, iter_safetensors(tmp_path))
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [4, None, 4, None]
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (9, 3, 13), vocab=128, max_len=16)


def test_greedy_tokens_match_hf_through_the_engine(tmp_path: Path) -> None:
    """Prompts and outputs past the window, chunked prefill and the prefix cache on."""
    arch, overrides = TINY_FAMILIES["gemma3"]
    path = make_tiny_checkpoint(tmp_path / "m", arch, **overrides)
    prompts = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250], [3 + i for i in range(9)] + [40], [64]]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 10) for p in prompts]


@pytest.mark.parametrize(("overrides", "match"), [
    ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping = 30.0: soft-capping"),
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping = 50.0"),
])
def test_unsupported_configs_name_the_field(tmp_path: Path, overrides: dict[str, Any],
                                            match: str) -> None:
    _save(_config(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), device="cpu", dtype="float32")


def test_speculation_and_the_prefix_cache_keep_the_tokens(tmp_path: Path) -> None:
    """n-gram drafts verified through the local layers' windows (several query tokens a
    step), and a second request whose prompt hits the prefix cache past the window: the
    same greedy tokens as plain decoding."""
    arch, overrides = TINY_FAMILIES["gemma3"]
    path = make_tiny_checkpoint(tmp_path / "m", arch, **overrides)
    prefix = [7, 3, 9, 7, 3, 9, 7, 3, 9, 7, 3, 9]  # repeats: the n-gram drafter proposes
    prompts = [prefix + [5, 6], prefix + [5, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    stats: dict[str, Any] = {}

    def run(**kwargs: Any) -> list[list[int]]:
        llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        second = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)
        stats.update(llm.engine.stats())
        return [first[0].outputs[0].token_ids, second[0].outputs[0].token_ids]

    plain = run(enable_prefix_caching=False)
    assert plain == [hf_greedy(path, p, 12) for p in prompts]
    llm_kwargs = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 3, "prompt_lookup_min": 2}}
    assert run(**llm_kwargs) == plain
    assert stats["spec_num_draft_tokens"] > 0  # drafts were verified
    assert run() == plain  # prefix cache on (the default): the second prompt hits it


def test_gemma2_logits_match_hf(tmp_path: Path) -> None:
    """Gemma 2: soft-capped attention scores and final logits (caps small enough to bite),
    alternating local and global layers, no q/k norms."""
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0)
    config.architectures = ["Gemma2ForCausalLM"]
    config._attn_implementation = "eager"  # (HF's sdpa path leaves the attention cap out)
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(tmp_path)
    from mrv2_gemma.model import Gemma2ForCausalLM

    model = Gemma2ForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    load_model_weights(model, iter_safetensors(tmp_path))
    assert [layer.self_attn.attn.logit_softcap for layer in model.model.layers] == [2.0] * 4
    prefill, _ = check_steps_against_hf(model, hf, poisoned_caches(2, 16, 4), (9, 3, 13),
                                        vocab=128, max_len=16)
    assert all(logits.abs().max() <= 3.0 for logits in prefill)  # the final cap
