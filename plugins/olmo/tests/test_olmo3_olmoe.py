"""OlmoForCausalLM, Olmo3ForCausalLM, OlmoeForCausalLM and FlexOlmoForCausalLM against HF
transformers on tiny random checkpoints: every logit of a prefill and a decode step through the
paged cache, greedy tokens and the prompt's log-probabilities through the engine (chunked
prefill, prompts and outputs past OLMo 3's window)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import mrv2_olmo
from mrv2 import LLM, SamplingParams
from mrv2.layers import head_dim_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import (
    check_steps_against_hf,
    hf_greedy,
    make_tiny_checkpoint,
    poisoned_caches,
)
from mrv2.testing_engine import check_prompt_logprobs

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]

#: ``{name: (architecture, make_tiny_checkpoint overrides, each layer's window)}``.
FAMILIES: dict[str, tuple[str, dict[str, Any], list[int | None]]] = {
    # OLMo 1: parameter-free LayerNorms, a tied head (OLMo-1B's)
    "olmo": ("OlmoForCausalLM", {"tie_word_embeddings": True}, [None, None]),
    # OLMo-7B-0424's clip_qkv (8 there), 1 here: q, k and v are ~1.2 in scale at std 0.15,
    # so many entries are clamped; an untied head
    "olmo-clip_qkv": ("OlmoForCausalLM", {"clip_qkv": 1.0}, [None, None]),
    # a local layer (window 4, shorter than the prompts) with plain RoPE, then a global one
    # with its own base and YaRN: each layer type's rope_parameters entry
    "olmo3": ("Olmo3ForCausalLM", {
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                               "original_max_position_embeddings": 64}}}, [4, None]),
    # softmax top-2 of 4 experts, the picked weights as they are (norm_topk_prob false, as
    # the published checkpoints)
    "olmoe": ("OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                   "intermediate_size": 32, "norm_topk_prob": False},
              [None, None]),
    # FlexOlmo: OLMo 2's post-norm layers with OLMoE's experts (top-2 of 4, as they are)
    "flex-olmo": ("FlexOlmoForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                          "intermediate_size": 32}, [None, None]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_tokens_match_hf(tmp_path: Path, family: str) -> None:
    arch, overrides, windows = FAMILIES[family]
    path = make_tiny_checkpoint(tmp_path / "m", arch, std=0.15, pad_token_id=0, **overrides)
    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(mrv2_olmo, arch)(config)
    load_model_weights(model, iter_safetensors(path))
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == windows
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (11, 3, 13), vocab=config.vocab_size,
                           max_len=16)

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in PROMPTS]
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[1]])).logits[0]
        check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[1]}, PROMPTS[1], logits)



@pytest.mark.parametrize(("arch", "fields", "match"), [
    ("OlmoeForCausalLM", {"clip_qkv": 8.0}, r"clip_qkv = 8.0: clamping q, k and v"),
    ("Olmo3ForCausalLM", {"layer_types": ["sliding_attention", "chunked_attention"]},
     r"layer_types must give each of the 2 layers one of sliding_attention, full_attention"),
])
def test_unsupported_configs_name_the_field(arch: str, fields: dict[str, Any],
                                            match: str) -> None:
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=64)
    for name, value in fields.items():  # (set after HF's own checks)
        setattr(config, name, value)
    with pytest.raises(ValueError, match=match):
        getattr(mrv2_olmo, arch)(config)
