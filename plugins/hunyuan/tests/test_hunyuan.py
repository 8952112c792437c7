"""HunYuanDenseV1ForCausalLM and HunYuanMoEV1ForCausalLM against HF transformers on tiny
random checkpoints, NTK-alpha RoPE on: every logit of a prefill and a decode step through the
paged cache, greedy tokens and prompt log-probabilities through the engine; what goes wrong
with the q/k norms before the rotation or without the alpha; per-layer MoE sizes, the router's
top-1 weights, tensor parallelism, and the configs refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import mrv2_hunyuan.model as hunyuan
from mrv2 import LLM, SamplingParams
from mrv2.layers import GatedMLP, MoEBlock, head_dim_of, rope_parameters_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import (
    check_steps_against_hf,
    hf_greedy,
    make_tiny_checkpoint,
    poisoned_caches,
    run_step,
)
from mrv2.testing_engine import check_prompt_logprobs, tokens_at_tp

#: Hunyuan's NTK-alpha RoPE (as the published configs: ``dynamic`` with ``factor`` 1 and an
#: ``alpha``; alpha 1000 over head_dim 16 multiplies the base by ~2700).
ALPHA: dict[str, Any] = {"rope_type": "dynamic", "factor": 1.0, "alpha": 1000.0,
                         "rope_theta": 10000.0}
#: head_dim 24, not hidden_size // heads (16): it must come from the config.
DENSE: dict[str, Any] = {"head_dim": 24, "rope_parameters": ALPHA}
#: Softmax top-2 of 4 experts with HF's shared MLP; tied embeddings (as Hunyuan-A13B).
MOE: dict[str, Any] = {"head_dim": 16, "num_experts": 4, "moe_topk": 2, "intermediate_size": 32,
                       "tie_word_embeddings": True, "rope_parameters": ALPHA}
CASES = {"dense": ("HunYuanDenseV1ForCausalLM", DENSE), "moe": ("HunYuanMoEV1ForCausalLM", MOE)}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _checkpoint(path: Path, case: str, **extra: Any) -> Path:
    """std 0.15: attention, positions and the experts shape the tokens."""
    architecture, overrides = CASES[case]
    return make_tiny_checkpoint(path, architecture, std=0.15, **{**overrides, **extra})


def _load(path: Path) -> tuple[Any, torch.nn.Module, transformers.PretrainedConfig]:
    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(hunyuan, config.architectures[0])(config)
    load_model_weights(model, iter_safetensors(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, hf, config


def _caches(config: transformers.PretrainedConfig) -> list[torch.Tensor]:
    return poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                           config.num_hidden_layers)


def _prefill(model: Any, config: Any, prompt: list[int]) -> torch.Tensor:
    (logits,), _ = run_step(model, _caches(config), [[0, 1, 2, 3]], [0], [prompt])
    return logits


@pytest.mark.parametrize("case", list(CASES))
def test_logits_greedy_tokens_and_prompt_logprobs_match_hf(tmp_path: Path, case: str) -> None:
    path = _checkpoint(tmp_path / "m", case)
    model, hf, config = _load(path)
    assert rope_parameters_of(config)[1] == {**ALPHA}  # (the alpha reached the config)
    kinds = {type(layer.mlp) for layer in model.model.layers}
    assert kinds == ({MoEBlock} if case == "moe" else {GatedMLP})
    check_steps_against_hf(model, hf, _caches(config), (11, 3, 13), vocab=config.vocab_size,
                           max_len=16)

    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[1]])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[1]}, PROMPTS[1], logits)


def test_qk_norms_come_after_the_rotation(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Normalizing q and k before the rotation (the core's fused order) gets HF's first
    token only (position 0: no rotation), every later one not."""
    model, hf, config = _load(_checkpoint(tmp_path / "m", "dense"))
    prompt = [5, 17, 42, 9, 100, 3]
    want = hf(torch.tensor([prompt])).logits[0].detach()
    torch.testing.assert_close(_prefill(model, config, prompt), want, atol=1e-4, rtol=1e-4)

    def norms_first(self: Any, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(qkv)
        norms = (self.query_layernorm.weight, self.key_layernorm.weight,
                 self.query_layernorm.eps)
        return self.o_proj(self.attn(q, k, v, positions=positions, rotary=self.rotary_emb,
                                     qk_norm=norms))

    monkeypatch.setattr(hunyuan.HunYuanAttention, "attend", norms_first)
    logits = _prefill(model, config, prompt)
    torch.testing.assert_close(logits[0], want[0], atol=1e-4, rtol=1e-4)
    assert all((logits[i] - want[i]).abs().amax() > 1e-2 for i in range(1, len(prompt)))


def test_without_the_alpha_the_logits_differ(tmp_path: Path) -> None:
    """The alpha's larger base is what HF rotates with: the plain base (same checkpoint)
    misses HF's logits past position 0."""
    path = _checkpoint(tmp_path / "m", "moe")
    model, hf, config = _load(path)
    prompt = [5, 17, 42, 9, 100, 3]
    want = hf(torch.tensor([prompt])).logits[0].detach()
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain = hunyuan.HunYuanMoEV1ForCausalLM(config)
    load_model_weights(plain, iter_safetensors(path))
    torch.testing.assert_close(_prefill(model, config, prompt), want, atol=1e-4, rtol=1e-4)
    logits = _prefill(plain, config, prompt)
    torch.testing.assert_close(logits[0], want[0], atol=1e-4, rtol=1e-4)
    assert (logits[1:] - want[1:]).abs().amax() > 1e-2


def test_per_layer_sizes_and_shared_experts() -> None:
    """Hunyuan-A13B's config lists ``moe_topk``, ``moe_intermediate_size`` and
    ``num_shared_expert`` per layer: each layer takes its entry (the shared MLP
    ``intermediate_size`` times its count, none where ``use_mixed_mlp_moe`` is off); top-1
    keeps the softmax probability, top-k > 1 renormalizes (vLLM's routing)."""
    config = transformers.HunYuanMoEV1Config(
        hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, num_experts=4, head_dim=16)
    config.moe_topk, config.moe_intermediate_size = [1, 3], [8, 16]
    config.num_shared_expert, config.use_mixed_mlp_moe = [1, 2], True
    model = hunyuan.HunYuanMoEV1ForCausalLM(config)
    blocks = [layer.mlp for layer in model.model.layers]
    assert [b.gate.top_k for b in blocks] == [1, 3]
    assert [b.gate.renormalize for b in blocks] == [False, True]
    assert [b.experts.intermediate_size for b in blocks] == [8, 16]
    assert [b.shared_experts.down_proj.weight.shape[1] for b in blocks] == [24, 48]
    assert all(b.gate.weight.dtype == torch.float32 for b in blocks)
    config.use_mixed_mlp_moe = False
    assert all(layer.mlp.shared_experts is None
               for layer in hunyuan.HunYuanMoEV1ForCausalLM(config).model.layers)
    config.moe_topk = [2]
    with pytest.raises(ValueError, match="moe_topk lists 1 values; layer 1 needs one"):
        hunyuan.HunYuanMoEV1ForCausalLM(config)


def test_moe_tokens_at_tp2_equal_tp1(tmp_path: Path) -> None:
    """Tensor parallelism: heads (and their q/k norms), experts' and the shared MLP's columns
    split over two ranks; with expert parallelism, each rank's half of the experts whole. The
    same greedy tokens as one rank."""
    path = _checkpoint(tmp_path / "m", "moe")
    tokens = tokens_at_tp(path, PROMPTS[:2], GREEDY)
    assert tokens[2] == tokens[1]
    experts = tokens_at_tp(path, PROMPTS[:2], GREEDY, (2,), enable_expert_parallel=True)
    assert experts[2] == tokens[1]


@pytest.mark.parametrize(("fields", "match"), [
    ({"use_cla": True, "cla_share_factor": 2}, r"use_cla = true with cla_share_factor = 2"),
    ({"hidden_act": "gelu"}, r"hidden_act 'silu' only, got 'gelu'"),
    ({"mlp_bias": True}, r"mlp_bias = true"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"rope type 'dynamic' without alpha"),
])
def test_unsupported_configs_name_the_field(fields: dict[str, Any], match: str) -> None:
    config = transformers.HunYuanDenseV1Config(
        hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=64, head_dim=16)
    for name, value in fields.items():  # (set after HF's own checks)
        setattr(config, name, value)
    with pytest.raises((ValueError, NotImplementedError), match=match):
        hunyuan.HunYuanDenseV1ForCausalLM(config)
