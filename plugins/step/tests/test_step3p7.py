"""Step-3.7's text decoder through the engine against HF transformers (the
``Step3p7ForConditionalGeneration`` checkpoint, text prompts): greedy tokens of several requests
at once and every prompt position's log-probability, whole prompts or split across steps
(sliding and full layers with their own heads and RoPE, the gated attention, dense, routed
and clamped experts); the names loaded, dummy weights, and the refusals (images without a
tokenizer, configs it cannot run); images: test_step3p7_vision.py."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers import MoEBlock
from mrv2.plugins import get_plugin_manager
from mrv2.testing import random_image
from mrv2.testing_engine import check_prompt_logprobs, tokens_at_tp
from mrv2_step.model import ClampedGatedMLP, Step3p7ForConditionalGeneration
from mrv2_step.testing import save_tiny_step3p7

#: The third is longer than the sliding window (8) and than a chunk of 8 tokens.
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [2 + (7 * i) % 120 for i in range(23)]]


@pytest.fixture(autouse=True)
def _registered() -> None:
    """The plugin's registration where it is not installed (its entry point then loads it)."""
    manager = get_plugin_manager()
    if not manager.pm.has_plugin("step"):
        import mrv2_step.plugin

        manager.register(mrv2_step.plugin, name="step")


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("mode", ["plain", "chunked", "tensor_parallel"])
def test_greedy_and_logprobs_match_hf(tmp_path: Path, mode: str) -> None:
    """HF's greedy tokens and prompt log-probabilities, whole prompts or in chunks of 8
    tokens (the sliding layers' window crossing chunk boundaries) with prefix caching (a
    second round from the cache); over two ranks (CPU processes: each holds half of every
    layer's query heads and gates, one key/value head, half of each expert and MLP), which
    needs the plugin installed (its entry point: the workers load plugins from there)."""
    if mode == "tensor_parallel" and not any(
            ep.name == "step" for ep in metadata.entry_points(group="mrv2")):
        pytest.skip("tensor parallel workers load plugins from entry points: install "
                    "plugins/step (scripts/setup.sh)")
    hf = save_tiny_step3p7(tmp_path)
    if mode == "tensor_parallel":
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = tokens_at_tp(tmp_path, PROMPTS, params, (2,), max_num_batched_tokens=8)
        assert got[2] == [_hf_greedy(hf, p, 6) for p in PROMPTS]
        return
    want = [_hf_greedy(hf, p, 8) for p in PROMPTS]
    kwargs: dict[str, Any] = ({"max_num_batched_tokens": 8, "enable_prefix_caching": True}
                              if mode == "chunked" else {})
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    if mode == "chunked":  # again, from the prefix cache (past the window on the long prompt)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.stats()["prefix_cache_hits"] >= 20
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)
    if mode == "plain":  # images without the image tokens' tokenizer: refused by name
        with pytest.raises(ValueError, match=r"multi_modal_data\.image: .*needs the "
                                             r"checkpoint's tokenizer"):
            llm.generate([{"prompt_token_ids": [127, 5, 6],
                           "multi_modal_data": {"image": random_image(20, 20, seed=0)}}],
                         params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        assert again[0].outputs[0].token_ids == want[0]


def test_structure_names_and_dummy_weights(tmp_path: Path) -> None:
    """Per-layer heads, RoPE, windows and MLPs as the config says; every parameter loaded
    from the published layout (the decoder's renames skip the vision tensors: the encoder
    loads them); dummy weights run; bad configs are
    refused naming the field."""
    save_tiny_step3p7(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = Step3p7ForConditionalGeneration(config)
    layers = model.model.layers
    attn = [layer.self_attn for layer in layers]
    assert [a.attn.num_heads for a in attn] == [8, 4, 8, 4]
    assert [a.attn.sliding_window for a in attn] == [8, None, 8, None]
    assert [a.rotary_emb.rotary_dim for a in attn] == [16, 8, 16, 8]
    assert [a.rotary_emb.base for a in attn] == [10000.0, 500000.0, 10000.0, 500000.0]
    assert type(layers[0].mlp).__name__ == "GatedMLP"
    assert all(isinstance(layer.mlp, MoEBlock) for layer in layers[1:])
    assert [layer.mlp.experts.activation for layer in layers[1:]] == ["silu", "silu",
                                                                      "silu_clamp"]
    assert isinstance(layers[3].mlp.shared_experts, ClampedGatedMLP)

    from mrv2.model_loader import iter_safetensors, load_model_weights
    loaded = load_model_weights(model, iter_safetensors(tmp_path))
    assert loaded == {n for n, _ in model.named_parameters()}

    bf16 = model.to(torch.bfloat16).model.layers[1].mlp.gate  # the router stays fp32
    assert bf16.weight.dtype == torch.float32
    for name, want in [  # per-expert layouts, transformers' names, what is skipped
        ("model.layers.1.moe.experts.3.up_proj.weight",
         "model.layers.1.mlp.experts.3.up_proj.weight"),
        ("model.layers.2.moe.0.down_proj.weight",
         "model.layers.2.mlp.experts.0.down_proj.weight"),
        ("model.language_model.layers.1.mlp.experts.gate_up_proj",
         "model.layers.1.mlp.experts.gate_up_proj"),
        ("model.layers.4.self_attn.q_proj.weight", None),  # a multi-token-prediction layer
        ("vision_model.conv1.weight", None), ("vit_large_projector.weight", None),
        ("model.vision_model.embeddings.patch_embedding.weight", None),
    ]:
        assert model.rename(name) == want, name

    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, load_format="dummy")
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3

    for field, value, pattern in [
        ("mlp_layer_types", ["dense", "sparse", "moe", "sparse"], "must list 'dense' or"),
        ("use_bidirectional_attention", True, "only causal attention"),
        ("swiglu_limits", [0, 1], "must be null or list a bound"),
    ]:
        bad = transformers.AutoConfig.from_pretrained(tmp_path)
        setattr(bad.text_config, field, value)
        with pytest.raises(ValueError, match=rf"text_config\.{field} = .*{pattern}"):
            Step3p7ForConditionalGeneration(bad)
