"""Arcee's AFMoE (``AfmoeForCausalLM``) and Tencent's Youtu-LLM (``YoutuForCausalLM``) against
HF transformers on tiny random checkpoints saved by transformers itself: every logit of a
prefill and a decode step through the paged (AFMoE) or latent (Youtu, the MLA backend) KV
cache, then greedy tokens through the engine with prompts split over steps of 8 tokens
(chunked prefill), at TP=1 and, for one case of each, TP=2.

AFMoE: sandwich norms around gated attention (per-head q/k norms; sliding RoPE layers and
global NoPE ones) and around a dense first layer, then DeepSeek-V3's sigmoid router with its
expert bias (one group, renormalized, scaled) beside shared experts; muP-scaled embeddings,
biased attention and tied embeddings in one case; per-expert checkpoint tensors as
transformers saves them, or stacked as it holds them. Youtu: MLA (a q LoRA and YaRN with
DeepSeek's mscale terms, interleaved RoPE and tied embeddings; or a plain q projection,
half-split RoPE, an untied head) over dense SwiGLU MLPs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

import mrv2.testing
from mrv2 import SamplingParams
from mrv2.attention import ForwardContext
from mrv2.attention.mla_backend import MLABackend
from mrv2.contract.kv_cache import LatentKVSpec, layer_specs
from mrv2.layers import GroupedTopKRouter, MLAAttention
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import (
    TEST_BLOCK_SIZE,
    TEST_NUM_BLOCKS,
    check_steps_against_hf,
    hf_greedy,
    make_tiny_checkpoint,
)
from mrv2.testing_engine import tokens_at_tp
from mrv2_deepseek.afmoe import AfmoeForCausalLM
from mrv2_deepseek.youtu import YoutuForCausalLM

AFMOE: dict[str, Any] = {"num_experts": 8, "moe_intermediate_size": 32,
                         "num_experts_per_tok": 3, "num_hidden_layers": 4, "head_dim": 16,
                         "num_dense_layers": 1}
MLA: dict[str, Any] = {"num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32,
                       "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # 3 local layers (window 4) then a global one; 2 shared experts, scaled weights
    "afmoe-windowed": ("AfmoeForCausalLM", {
        **AFMOE, "sliding_window": 4, "global_attn_every_n_layers": 4,
        "num_shared_experts": 2, "route_scale": 2.5}),
    # alternating local (window 6) and global layers, muP embeddings, biased attention,
    # tied embeddings, one shared expert; stacked experts (transformers' in-memory names)
    "afmoe-mup-tied-stacked": ("AfmoeForCausalLM", {
        **AFMOE, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_shared_experts": 1, "route_scale": 1.5, "mup_enabled": True,
        "attention_bias": True, "tie_word_embeddings": True}),
    "youtu-q-lora-yarn": ("YoutuForCausalLM", {**MLA, "q_lora_rank": 24,
                                               "rope_parameters": YARN}),
    "youtu-plain-untied": ("YoutuForCausalLM", {**MLA, "q_lora_rank": None,
                                                "rope_interleave": False,
                                                "tie_word_embeddings": False}),
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


def _checkpoint(path: Path, case: str) -> Path:
    arch, overrides = CASES[case]
    path = make_tiny_checkpoint(path, arch, std=0.15, **overrides)
    if case.endswith("stacked"):  # rewrite with transformers' in-memory (stacked) names
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        assert "model.layers.1.mlp.experts.gate_up_proj" in state
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _check_layout(model: Any, case: str, loaded: set[str]) -> None:
    layers = model.model.layers
    if case.startswith("youtu"):
        assert all(isinstance(layer.self_attn, MLAAttention) for layer in layers)
        assert not any(hasattr(layer.mlp, "gate") for layer in layers)
        return
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.0.self_attn.output_gate.weight"} <= loaded
    windows = [4, 4, 4, None] if case == "afmoe-windowed" else [6, None, 6, None]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == windows
    assert [layer.self_attn.rotary_emb is None for layer in layers] == \
        [w is None for w in windows]
    assert not hasattr(layers[0].mlp, "gate")
    assert all(isinstance(layer.mlp.gate, GroupedTopKRouter) for layer in layers[1:])


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _checkpoint(tmp_path / "m", case)
    config = transformers.AutoConfig.from_pretrained(path)
    model = (AfmoeForCausalLM if case.startswith("afmoe") else YoutuForCausalLM)(config)
    loaded = load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    model.eval()
    _check_layout(model, case, loaded)
    specs = layer_specs(model)
    caches = [specs[i].allocate(TEST_NUM_BLOCKS, TEST_BLOCK_SIZE, torch.float32,
                                torch.device("cpu")).fill_(1e4) for i in sorted(specs)]
    if isinstance(specs[0], LatentKVSpec):
        monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata:
                            ForwardContext(metadata, caches, [MLABackend()] * len(caches)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_steps_against_hf(model, hf, caches, [9, 3, 13], vocab=config.vocab_size, max_len=16)

    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tp_sizes = (1, 2) if case in ("afmoe-windowed", "youtu-q-lora-yarn") else (1,)
    for tp, got in tokens_at_tp(path, PROMPTS, params, tp_sizes=tp_sizes,
                                max_num_batched_tokens=8).items():
        assert got == want, tp
