"""Phi-3.5-MoE (``PhimoeForCausalLM`` as transformers saves it, ``PhiMoEForCausalLM`` as the
published config names it) against HF transformers on tiny random checkpoints saved by
transformers itself: every logit of a prefill and a decode step through the paged KV cache,
greedy tokens and every prompt position's log-probability through the engine. 8 experts, so
the top-2 SparseMixer routing varies from token to token; biased LayerNorms, attention and
LM head; LongRoPE with Phi-3.5-MoE's own ``short_mscale`` / ``long_mscale``; a sliding window
with tied embeddings. The router alone against transformers' ``sparsemixer`` in eval mode, in
fp32 and bf16."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.phimoe import modeling_phimoe

from mrv2 import LLM, SamplingParams
from mrv2.layers.rotary import get_rope
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import check_steps_against_hf, hf_greedy, make_tiny_checkpoint, poisoned_caches
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_phi.phimoe import PhiMoEForCausalLM, SparseMixerRouter, sparsemixer_top2

VOCAB = 256
HALF = 8  # rotary frequencies of a 16-dim head
LONGROPE: dict[str, Any] = {
    "rope_type": "longrope", "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
    "long_factor": [1.5 + 0.3 * i for i in range(HALF)],
    "short_mscale": 1.3, "long_mscale": 1.1, "original_max_position_embeddings": 64}
EXPERTS: dict[str, Any] = {"num_local_experts": 8, "num_experts_per_tok": 2,
                           "intermediate_size": 32, "num_hidden_layers": 3}
CASES: dict[str, dict[str, Any]] = {
    # the published layout: every projection and the LM head biased, LongRoPE (every position
    # here below the original length: the short factors, scaled by short_mscale)
    "longrope-biased": {**EXPERTS, "attention_bias": True, "lm_head_bias": True,
                        "rope_parameters": LONGROPE, "tie_word_embeddings": False},
    # no biases, a sliding window on every layer, tied embeddings, a wider jitter band (more
    # experts inside each masked softmax)
    "window-tied": {**EXPERTS, "sliding_window": 6, "tie_word_embeddings": True,
                    "router_jitter_noise": 0.3},
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _checkpoint(path: Path, case: str) -> Path:
    return make_tiny_checkpoint(path, "PhimoeForCausalLM", std=0.15, **CASES[case])


def _load(path: Path) -> PhiMoEForCausalLM:
    model = PhiMoEForCausalLM(transformers.AutoConfig.from_pretrained(path))
    load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    """Three prompts prefilled (two padding rows), then one decode token each: every logit row
    equals HF's full forward; the first layer's router sends the prompt's tokens to more than
    two experts (the routing varies per token)."""
    path = _checkpoint(tmp_path / "m", case)
    model = _load(path)
    biased = case == "longrope-biased"
    assert (model.lm_head.bias is not None) == biased
    assert (model.model.layers[0].self_attn.o_proj.bias is not None) == biased
    tokens = torch.tensor(PROMPTS[0] + PROMPTS[1])
    with torch.no_grad():
        normed = model.model.layers[0].input_layernorm(model.model.embed_tokens(tokens))
        _, ids = model.model.layers[0].mlp.gate(normed)
    assert ids.shape == (len(tokens), 2) and len(set(ids.flatten().tolist())) > 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(2, 16, 3)
    check_steps_against_hf(model, hf, caches, [7, 3, 10], VOCAB, 12)


def test_logits_match_hf_on_the_triton_kernels(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps on the GPU's kernels, interpreted (``MRV2_KERNELS=triton``: the fused
    MoE kernel with SparseMixer's weights and ids, the Triton attention backend rotating q and
    k inside attention from the mscale-scaled LongRoPE table)."""
    import mrv2.testing
    from mrv2.attention import ForwardContext
    from mrv2.attention.triton_backend import TritonAttentionBackend

    path = _checkpoint(tmp_path / "m", "longrope-biased")
    model = _load(path)
    backend = TritonAttentionBackend()
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata: ForwardContext(
        metadata, caches, [backend] * len(caches)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_steps_against_hf(model, hf, poisoned_caches(2, 16, 3), [7, 3, 10], VOCAB, 12)


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_hf(tmp_path: Path, case: str) -> None:
    """Greedy tokens (prompts split over steps of 8 tokens, past the window) and every prompt
    position's log-probability through the engine are HF's; the checkpoint saved under the
    published architecture name loads the same."""
    path = _checkpoint(tmp_path / "m", case)
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
    config_file = path / "config.json"
    for arch in ("PhimoeForCausalLM", "PhiMoEForCausalLM"):
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                           "architectures": [arch]}))
        with LLM(str(path), device="cpu", dtype="float32", block_size=4,
                 max_num_batched_tokens=8) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
            check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[0]}, PROMPTS[0], logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("jitter", [0.01, 0.3])
def test_sparsemixer_is_transformers_eval_routing(dtype: torch.dtype, jitter: float) -> None:
    """The router's weights and experts equal transformers' ``sparsemixer(training=False)`` on
    the same logits bit for bit (bf16 too: the same operations in the logits' dtype), with
    ties, negative maxima and zeros among the rows."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 8, generator=gen) * 2).to(dtype)
    logits[0] = 0.0  # all tied
    logits[1] = -torch.arange(1, 9, dtype=dtype)  # every logit negative
    logits[2, :2] = logits[2].max() + 1  # a tie for the best
    want_weights, want_ids = modeling_phimoe.sparsemixer(logits, jitter_eps=jitter,
                                                         training=False)
    weights, ids = sparsemixer_top2(logits, jitter)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights.float(), rtol=0, atol=0, equal_nan=True)
    assert len({tuple(row) for row in ids.tolist()}) > 8  # the pairs vary per token
    router = SparseMixerRouter(16, 8, jitter)
    torch.nn.init.normal_(router.weight, generator=gen)
    x = torch.randn(5, 16, generator=gen)
    torch.testing.assert_close(router(x), sparsemixer_top2(x @ router.weight.T, jitter))


def test_longrope_rows_take_the_configs_mscales() -> None:
    """Below ``original_max_position_embeddings`` the table is HF PhiMoE's (short factors times
    ``short_mscale``); from there on the long factors times ``long_mscale`` (vLLM's rows)."""
    config = transformers.PhimoeConfig(hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=256,
                                       rope_parameters=dict(LONGROPE))
    table = get_rope(config, 16)._table(torch.device("cpu"))
    assert table.shape[0] == 256
    hf = modeling_phimoe.PhimoeRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = hf(x, torch.arange(64)[None])
    torch.testing.assert_close(table[:64], torch.cat([cos[0, :, :HALF], sin[0, :, :HALF]], -1),
                               rtol=1e-5, atol=1e-5)
    base = 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    long_freq = 1.0 / (torch.tensor(LONGROPE["long_factor"], dtype=torch.float64) * base)
    freqs = torch.outer(torch.arange(64, 256, dtype=torch.float32), long_freq.float())
    want = torch.cat([freqs.cos(), freqs.sin()], -1) * LONGROPE["long_mscale"]
    torch.testing.assert_close(table[64:], want, rtol=1e-5, atol=1e-5)
    computed = math.sqrt(1 + math.log(4) / math.log(64))  # what the rows had before
    assert abs(computed - LONGROPE["short_mscale"]) > 0.1


def test_config_errors_name_the_field() -> None:
    base = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, **EXPERTS}
    config = transformers.PhimoeConfig(**{**base, "num_experts_per_tok": 3})
    with pytest.raises(ValueError, match=r"config.num_experts_per_tok = 3: SparseMixer"):
        PhiMoEForCausalLM(config)
    config = transformers.PhimoeConfig(**{**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"PhiMoEForCausalLM: config.hidden_act = 'gelu'"):
        PhiMoEForCausalLM(config)
