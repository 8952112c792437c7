"""dots.llm1 (``Dots1ForCausalLM``) against HF transformers on tiny random checkpoints saved by
transformers itself: every logit of a prefill and a decode step through the paged KV cache,
then greedy tokens and every prompt position's log-probability through the engine. Dense
first layers, then DeepSeek-V3's MoE: several expert groups of which fewer are kept
(``topk_group < n_group``, so the group limit changes the picks), a correction bias, shared
experts; the attention is Qwen3's (per-head q/k norms), biased or not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers import GroupedTopKRouter
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import check_steps_against_hf, hf_greedy, make_tiny_checkpoint, poisoned_caches
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_deepseek.dots1 import Dots1ForCausalLM

VOCAB = 256
MOE: dict[str, Any] = {"n_routed_experts": 8, "moe_intermediate_size": 32,
                       "num_hidden_layers": 3}
CASES: dict[str, dict[str, Any]] = {
    # one dense layer, 4 groups of 2 experts with 2 kept, 3 picks renormalized and scaled,
    # one shared expert
    "groups": {**MOE, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
               "num_experts_per_tok": 3, "norm_topk_prob": True, "n_shared_experts": 1,
               "routed_scaling_factor": 2.5},
    # two dense layers, 2 groups of 4 with 1 kept, raw weights, two shared experts (one MLP
    # twice as wide), every attention projection biased
    "one-group-biased": {**MOE, "first_k_dense_replace": 2, "n_group": 2, "topk_group": 1,
                         "num_experts_per_tok": 2, "norm_topk_prob": False,
                         "n_shared_experts": 2, "routed_scaling_factor": 1.5,
                         "attention_bias": True},
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _checkpoint(path: Path, case: str) -> Path:
    return make_tiny_checkpoint(path, "Dots1ForCausalLM", std=0.15, **CASES[case])


def _load(path: Path) -> Dots1ForCausalLM:
    model = Dots1ForCausalLM(transformers.AutoConfig.from_pretrained(path))
    load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    """Three prompts prefilled (two padding rows), then one decode token each: every logit row
    equals HF's full forward; the layers are dense then MoE as configured, the MoE's router
    group-limited with a correction bias."""
    path = _checkpoint(tmp_path / "m", case)
    model, config = _load(path), CASES[case]
    dense = config["first_k_dense_replace"]
    routers = [layer.mlp.gate for layer in model.model.layers[dense:]]
    assert len(routers) == 3 - dense and not hasattr(model.model.layers[0].mlp, "gate")
    for router in routers:
        assert isinstance(router, GroupedTopKRouter)
        assert (router.n_group, router.topk_group) == (config["n_group"], config["topk_group"])
        assert router.e_score_correction_bias is not None and router.scoring == "sigmoid"
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(2, 16, 3)
    check_steps_against_hf(model, hf, caches, [7, 3, 10], VOCAB, 12)


def test_logits_match_hf_on_the_triton_kernels(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps on the GPU's kernels, interpreted (``MRV2_KERNELS=triton``: the grouped
    router kernel, the fused MoE kernel, the Triton attention backend normalizing and rotating
    q and k inside attention)."""
    import mrv2.testing
    from mrv2.attention import ForwardContext
    from mrv2.attention.triton_backend import TritonAttentionBackend

    path = _checkpoint(tmp_path / "m", "groups")
    model = _load(path)
    backend = TritonAttentionBackend()
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata: ForwardContext(
        metadata, caches, [backend] * len(caches)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_steps_against_hf(model, hf, poisoned_caches(2, 16, 3), [7, 3, 10], VOCAB, 12)


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_hf(tmp_path: Path, case: str) -> None:
    """Greedy tokens (prompts split over steps of 8 tokens) and every prompt position's
    log-probability through the engine are HF's."""
    path = _checkpoint(tmp_path / "m", case)
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
        check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[0]}, PROMPTS[0], logits)


def test_config_errors_name_the_field() -> None:
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, **CASES["groups"]}
    config = transformers.Dots1Config(**{**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"Dots1ForCausalLM: config.hidden_act = 'gelu'"):
        Dots1ForCausalLM(config)
    config = transformers.Dots1Config(**{**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"config.num_key_value_heads = 3: must divide"):
        Dots1ForCausalLM(config)
