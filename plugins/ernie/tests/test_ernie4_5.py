"""ERNIE 4.5 (``Ernie4_5ForCausalLM``, ``Ernie4_5_MoeForCausalLM``) against HF transformers:
prefill and decode logits through the paged cache (biased projections, the interleaved RoPE's
q/k rows reordered as they load, dense layers between MoE ones, softmax routing with a
correction bias, a shared expert, a biased LM head), what goes wrong without the reorder or
the bias, which layers route, greedy tokens through the engine at TP=1 and TP=2, and a LoRA
adapter on the fused q/k/v projection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

import mrv2_ernie.model as ernie
from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.layers import GatedMLP, MoEBlock, head_dim_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import (
    check_steps_against_hf,
    hf_greedy,
    make_tiny_checkpoint,
    poisoned_caches,
    run_step,
)
from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint
from mrv2.testing_engine import tokens_at_tp
from mrv2_ernie.model import Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM

#: head_dim 24, not hidden_size // heads (16): it must come from the config.
DENSE: dict[str, Any] = {"head_dim": 24, "use_bias": True, "tie_word_embeddings": False}
#: Layers 1 and 2 route (start 1, end 2), 0 and 3 stay dense.
MOE: dict[str, Any] = {
    "head_dim": 24, "num_hidden_layers": 4, "moe_num_experts": 8, "moe_k": 2,
    "moe_intermediate_size": 32, "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
    "moe_layer_end_index": 2, "moe_layer_interval": 1, "use_bias": True}
CASES = {"dense": ("Ernie4_5ForCausalLM", Ernie4_5ForCausalLM, DENSE),
         "moe": ("Ernie4_5_MoeForCausalLM", Ernie4_5_MoeForCausalLM, MOE)}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250], [3 + i for i in range(9)] + [40], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _checkpoint(path: Path, case: str) -> Path:
    """std 0.15 (attention and the experts shape the tokens); the correction biases are
    redrawn too (uniform in [-0.3, 0.3), zeros at HF's init), far above the softmax
    probabilities' spread: they change which experts are picked."""
    architecture, _, overrides = CASES[case]
    path = make_tiny_checkpoint(path, architecture, std=0.15, **overrides)
    biases = [t for n, t in load_file(path / "model.safetensors").items()
              if n.endswith("moe_statics.e_score_correction_bias")]
    assert len(biases) == (2 if case == "moe" else 0)
    assert all(b.shape == (1, 8) and b.abs().min() > 0 for b in biases)
    return path


def _load(path: Path, case: str) -> tuple[Any, torch.nn.Module, transformers.PretrainedConfig]:
    config = transformers.AutoConfig.from_pretrained(path)
    model = CASES[case][1](config)
    load_model_weights(model, iter_safetensors(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, hf, config


def _caches(config: transformers.PretrainedConfig) -> list[torch.Tensor]:
    return poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                           config.num_hidden_layers)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    model, hf, config = _load(_checkpoint(tmp_path / "m", case), case)
    if case == "moe":
        kinds = [type(layer.mlp) for layer in model.model.layers]
        assert kinds == [GatedMLP, MoEBlock, MoEBlock, GatedMLP]
        assert model.lm_head.bias is not None and model.model.layers[1].mlp.shared_experts
    check_steps_against_hf(model, hf, _caches(config), (9, 3, 13), vocab=config.vocab_size,
                           max_len=16)


def test_without_the_correction_bias_other_experts_are_picked(tmp_path: Path) -> None:
    model, hf, config = _load(_checkpoint(tmp_path / "m", "moe"), "moe")
    prompt = [5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11, 19]
    want = hf(torch.tensor([prompt])).logits[0].detach()
    (logits,), _ = run_step(model, _caches(config), [[0, 1, 2, 3]], [0], [prompt])
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    for layer in (1, 2):
        bias = model.model.layers[layer].mlp.gate.e_score_correction_bias
        assert bias.dtype == torch.float32
        bias.data.zero_()
    (unbiased,), _ = run_step(model, _caches(config), [[0, 1, 2, 3]], [0], [prompt])
    assert (unbiased - want).abs().amax() > 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_the_rope_reorder_matters(tmp_path: Path, case: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded without the q/k row reorder, the first token (position 0: no rotation, and it
    attends to itself only) still gets HF's logits, every later one not: the reorder is what
    makes the half-split rotation ERNIE's interleaved one."""
    path = _checkpoint(tmp_path / "m", case)
    monkeypatch.setattr(ernie, "deinterleave_heads", lambda rows, head_dim: rows)
    model, hf, config = _load(path, case)
    prompt = [5, 17, 42, 9, 100, 3]
    want = hf(torch.tensor([prompt])).logits[0].detach()
    (logits,), _ = run_step(model, _caches(config), [[0, 1]], [0], [prompt])
    torch.testing.assert_close(logits[0], want[0], atol=1e-4, rtol=1e-4)
    assert all((logits[i] - want[i]).abs().amax() > 1e-2 for i in range(1, len(prompt)))


def test_layers_route_where_the_config_says() -> None:
    """``(i + 1) % moe_layer_interval == 0`` between the start and end indices (-1: the last
    layer); the router's weight stays fp32 in a bf16 model, as HF keeps it."""
    config = transformers.Ernie4_5_MoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, moe_num_experts=4, moe_k=2,
        moe_intermediate_size=16, moe_layer_start_index=2, moe_layer_end_index=-1,
        moe_layer_interval=2, moe_num_shared_experts=0)
    model = Ernie4_5_MoeForCausalLM(config).to(torch.bfloat16)
    routes = [isinstance(layer.mlp, MoEBlock) for layer in model.model.layers]
    assert routes == [False, False, False, True, False, True]
    gate = model.model.layers[3].mlp.gate
    assert gate.weight.dtype == torch.float32 and model.model.layers[3].mlp.shared_experts is None
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied by default


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_hf_at_tp1_and_tp2(tmp_path: Path, case: str) -> None:
    path = _checkpoint(tmp_path / "m", case)
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    for tp, got in tokens_at_tp(path, PROMPTS, GREEDY, max_num_batched_tokens=8).items():
        assert got == want, tp


def test_lora_on_the_reordered_qkv_projection(tmp_path: Path) -> None:
    """An adapter on q_proj, k_proj and v_proj (the fused ``qkv_proj``'s three shards: the
    q and k ``B`` rows reordered as their weights, v's not) gives HF's tokens on the merged
    checkpoint."""
    base = _checkpoint(tmp_path / "base", "dense")
    adapter = make_lora_adapter(base, tmp_path / "lora", rank=4, seed=3, std=1.0,
                                targets=("q_proj", "k_proj", "v_proj"))
    want = hf_greedy(merge_lora_checkpoint(base, adapter, tmp_path / "merged"), PROMPTS[0], 8)
    assert want != hf_greedy(base, PROMPTS[0], 8)
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
              enable_lora=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("qkv", 1, str(adapter)))[0]
    assert out.outputs[0].token_ids == want
