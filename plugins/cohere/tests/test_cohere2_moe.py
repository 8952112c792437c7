"""Cohere2-MoE (``Cohere2MoeForCausalLM``) against HF transformers on tiny random checkpoints:
greedy tokens and every prompt position's log-probability through the engine, prompts split
over steps of 8 tokens (past the sliding window), for both routers (softmax over the picked
logits; sigmoid, renormalized or not), shared experts averaged or summed, a dense prefix layer
with HF's forced RoPE, RMS and Layer norms; the layers built and the names loaded, dummy
weights, bad input refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers import GatedMLP, GroupedTopKRouter, MoEBlock, RMSNorm, SoftmaxTopKRouter
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import random_image, save_tiny_model
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_cohere.cohere2_moe import Cohere2MoeForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
BASE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "sliding_window": 4, "num_experts": 6,
    "num_experts_per_tok": 2, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 1,
}
CASES: dict[str, dict[str, Any]] = {
    # a dense prefix layer (full attention with RoPE: HF's force_rope), softmax routing, one
    # shared expert averaged in, LayerNorms, tied head
    "softmax-dense-average": {
        "mlp_layer_types": ["dense", "sparse", "sparse"], "prefix_dense_intermediate_size": 48,
        "layer_types": [FULL, SLIDING, FULL], "num_shared_experts": 1,
        "shared_expert_combination_strategy": "average"},
    # sigmoid routing renormalized, two shared experts summed, RMSNorms, untied head
    "sigmoid-renorm-sum-rms": {
        "expert_selection_fn": "sigmoid", "norm_topk_prob": True, "num_shared_experts": 2,
        "shared_expert_combination_strategy": "sum", "rms_norm_eps": 1e-5,
        "layer_types": [SLIDING, FULL, SLIDING], "mlp_layer_types": ["sparse"] * 3,
        "tie_word_embeddings": False, "logit_scale": 0.5},
    # sigmoid routing raw, no shared expert, a dense layer without forced RoPE (NoPE global)
    "sigmoid-raw-nope-dense": {
        "expert_selection_fn": "sigmoid", "norm_topk_prob": False,
        "prefix_dense_sliding_window_pattern": 2, "mlp_layer_types": ["dense", "sparse",
                                                                      "sparse"],
        "layer_types": [FULL, SLIDING, SLIDING]},
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 31, 7], [3 + i for i in range(9)], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _checkpoint(path: Path, case: str) -> Path:
    config = transformers.Cohere2MoeConfig(**{**BASE, **CASES[case]})
    save_tiny_model(path, "Cohere2MoeForCausalLM", config, std=0.15)
    return path


def _greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_hf(tmp_path: Path, case: str) -> None:
    """The layers the config asks for; then HF's greedy tokens and prompt log-probabilities
    (the logit scale and the routing weights count there), prompts split over steps."""
    path = _checkpoint(tmp_path / "m", case)
    config = transformers.AutoConfig.from_pretrained(path)
    model = Cohere2MoeForCausalLM(config)
    layers = model.model.layers
    kinds = config.mlp_layer_types
    assert [isinstance(x.mlp, MoEBlock) for x in layers] == [k == "sparse" for k in kinds]
    rope = [x.self_attn.rotary_emb is not None for x in layers]
    assert rope == {"softmax-dense-average": [True, True, False],
                    "sigmoid-renorm-sum-rms": [True, False, True],
                    "sigmoid-raw-nope-dense": [False, True, True]}[case]
    sparse = next(x.mlp for x in layers if isinstance(x.mlp, MoEBlock))
    want_router = SoftmaxTopKRouter if "softmax" in case else GroupedTopKRouter
    assert type(sparse.gate) is want_router
    assert (sparse.shared_experts is not None) == (config.num_shared_experts > 0)
    assert isinstance(model.model.norm, RMSNorm) == ("rms" in case)
    if "dense" in case:
        dense = layers[0].mlp
        assert isinstance(dense, GatedMLP) and dense.down_proj.weight.shape[1] == (
            48 if case == "softmax-dense-average" else 32)
    loaded = load_model_weights(model, iter_safetensors(path))
    assert loaded == {n for n, _ in model.named_parameters()}

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = [_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
        check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[0]}, PROMPTS[0], logits)


def test_dummy_weights_and_bad_input(tmp_path: Path) -> None:
    """``load_format="dummy"`` needs only the config; an image for this text model, and
    configs HF would refuse, are refused naming the field."""
    path = _checkpoint(tmp_path / "m", "softmax-dense-average")
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             load_format="dummy") as llm:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
        with pytest.raises(ValueError, match=r"multi_modal_data: Cohere2MoeForCausalLM takes "
                                             r"text only"):
            llm.generate([{"prompt_token_ids": PROMPTS[0],
                           "multi_modal_data": {"image": random_image(8, 8, 0)}}], GREEDY,
                         use_tqdm=False)
    config = transformers.AutoConfig.from_pretrained(path)
    for field, value, pattern in [
            ("expert_selection_fn", "relu", r"expert_selection_fn must be one of"),
            ("shared_expert_combination_strategy", "max",
             r"shared_expert_combination_strategy must be one of"),
            ("mlp_layer_types", ["dense", "sparse"], r"mlp_layer_types must list")]:
        bad = transformers.AutoConfig.from_pretrained(path)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=pattern):
            Cohere2MoeForCausalLM(bad)
    assert config.expert_selection_fn == "softmax"


def test_fp8_checkpoint_matches_hf_on_dequantized_weights(tmp_path: Path) -> None:
    """A block-FP8 checkpoint (16 x 16 blocks; the experts split per expert, as published):
    HF's greedy tokens on the dequantized weights."""
    from mrv2.testing_checkpoints import fp8_checkpoint

    _checkpoint(tmp_path / "src", "sigmoid-renorm-sum-rms")
    fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", (16, 16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref",
                                                           dtype=torch.float32).eval()
    want = [_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", block_size=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_expert_parallel_matches_hf(tmp_path: Path) -> None:
    """Two ranks holding three whole experts each (the shared experts and the dense layer
    split by columns): HF's tokens."""
    from mrv2.testing_engine import tokens_at_tp

    path = _checkpoint(tmp_path / "m", "softmax-dense-average")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = [_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    got = tokens_at_tp(path, PROMPTS, GREEDY, tp_sizes=(2,), enable_expert_parallel=True)
    assert got[2] == want
