"""MiniMaxM2ForCausalLM against HF transformers: prefill and decode logits through the paged
cache (whole-projection q/k norms, partial rotary dimensions, sigmoid routing with a correction
bias), greedy tokens through the engine, the published checkpoint names (``block_sparse_moe``,
MTP layers skipped), and tensor parallelism equal to one rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2 import SamplingParams
from mrv2.layers import head_dim_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import check_steps_against_hf, hf_greedy, make_tiny_checkpoint, poisoned_caches
from mrv2.testing_engine import tokens_at_tp
from mrv2_minimax.model import MiniMaxM2ForCausalLM

TINY: dict[str, Any] = {
    "head_dim": 16, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250], [3 + i for i in range(9)] + [40], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _checkpoint(path: Path) -> Path:
    """std 0.15 (attention and the experts shape the tokens), and correction biases written
    in (zeros at HF's init) large enough to change which experts are picked."""
    path = make_tiny_checkpoint(path, "MiniMaxM2ForCausalLM", std=0.15, **TINY)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.rand(tensors[name].shape, generator=gen) * 0.5
    assert any(n.endswith("e_score_correction_bias") for n in tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_logits_match_hf(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "m")
    config = transformers.AutoConfig.from_pretrained(path)
    model = MiniMaxM2ForCausalLM(config)
    load_model_weights(model, iter_safetensors(path))
    assert model.model.layers[0].self_attn.rotary_emb.rotary_dim == 8
    hf = transformers.MiniMaxM2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (9, 3, 13), vocab=config.vocab_size, max_len=16)


def test_published_names_and_tensor_parallelism(tmp_path: Path) -> None:
    """The checkpoint renamed as MiniMax publishes it (``block_sparse_moe.*``, the correction
    bias on the block, ``rotary_dim`` in the config, an MTP layer past the last) gives HF's
    greedy tokens through the engine, at TP=1 and TP=2."""
    path = _checkpoint(tmp_path / "m")
    want = [hf_greedy(path, p, 10) for p in PROMPTS]
    tensors = load_file(path / "model.safetensors")
    published = {n.replace(".mlp.", ".block_sparse_moe."): t for n, t in tensors.items()}
    assert any(".block_sparse_moe.experts.0.w1." in n for n in published)  # Mixtral's names
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    published[f"model.layers.{layers}.self_attn.q_proj.weight"] = torch.zeros(4, 4)  # MTP
    save_file(published, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["rotary_dim"] = 8
    config["rope_parameters"].pop("partial_rotary_factor")
    (path / "config.json").write_text(json.dumps(config))
    for tp, got in tokens_at_tp(path, PROMPTS, GREEDY, max_num_batched_tokens=8).items():
        assert got == want, tp
