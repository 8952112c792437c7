"""DeepSeek-V2/V3 against HF transformers on tiny random configs: logits at every position
(prefill with padding tokens, then decode, through the paged latent cache), greedy tokens
through ``LLM`` with prefix caching and preemption; the MLA cache holds ``kv_lora_rank +
qk_rope_head_dim`` values per token; config errors name the field."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.attention import ForwardContext, set_forward_context
from mrv2.attention.mla_backend import MLABackend
from mrv2.contract.kv_cache import LatentKVSpec, layer_specs
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import hf_greedy, redraw_weights, step_inputs, step_metadata
from mrv2.testing_checkpoints import fp8_checkpoint
from mrv2_deepseek.model import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

VOCAB = 128
BLOCK_SIZE = 4
NUM_BLOCKS = 32
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.5,
    "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # V3: q_lora_rank, groups (2 of 4 kept), YaRN with mscale terms, interleaved rope
    "v3-q-lora-yarn": ("DeepseekV3", {"q_lora_rank": 24, "n_group": 4, "topk_group": 2,
                                      "rope_parameters": YARN}),
    # V3 without q_lora_rank, half-split rope, raw (not renormalized) weights, two dense layers
    "v3-plain": ("DeepseekV3", {"q_lora_rank": None, "rope_interleave": False, "n_group": 1,
                                "topk_group": 1,
                                "norm_topk_prob": False, "first_k_dense_replace": 2}),
    # V2-Lite: no q_lora_rank, greedy softmax routing, two shared experts
    "v2-lite": ("DeepseekV2", {"q_lora_rank": None, "topk_method": "greedy",
                               "n_shared_experts": 2}),
    # V2: q_lora_rank, group-limited greedy
    "v2-grouped": ("DeepseekV2", {"q_lora_rank": 24, "topk_method": "group_limited_greedy",
                                  "n_group": 4, "topk_group": 2}),
    # V2 with mlp_bias: the dense MLPs and the shared experts biased (the routed ones not)
    "v2-mlp-bias": ("DeepseekV2", {"q_lora_rank": None, "topk_method": "greedy",
                                   "mlp_bias": True}),
}


def save_hf(path: Path, case: str) -> Any:
    family, overrides = CASES[case]
    config = getattr(transformers, f"{family}Config")(**{**COMMON, **overrides})
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    return hf


def load(path: Path) -> Any:
    config = transformers.AutoConfig.from_pretrained(path)
    cls = DeepseekV3ForCausalLM if config.model_type == "deepseek_v3" else DeepseekV2ForCausalLM
    model = cls(config)
    load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    return model.eval()


def run_step(model: Any, caches: list[torch.Tensor], tables: list[list[int]],
             contexts: list[int], new_tokens: list[list[int]], num_pad: int = 0
             ) -> list[torch.Tensor]:
    ids, positions = step_inputs(contexts, new_tokens, num_pad)
    metadata = step_metadata(contexts, [len(t) for t in new_tokens], tables, num_pad,
                             BLOCK_SIZE)
    context = ForwardContext(metadata, caches, [MLABackend()] * len(caches))
    with torch.inference_mode(), set_forward_context(context):
        logits = model.compute_logits(model(ids, positions))
    real = len(ids) - num_pad
    return list(logits[:real].split([len(t) for t in new_tokens]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    """Prefill three prompts (two padding tokens), then decode one token each: every logit row
    equals HF's full forward; the cache is poisoned where nothing was written."""
    hf = save_hf(tmp_path, case)
    model = load(tmp_path)
    specs = layer_specs(model)
    assert set(specs.values()) == {LatentKVSpec(32 + 8)}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (7, 3, 10)]
    max_blocks = math.ceil(12 / BLOCK_SIZE)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[i * max_blocks:(i + 1) * max_blocks] for i in range(len(prompts))]
    caches = [torch.full((NUM_BLOCKS, BLOCK_SIZE, 40), 1e4) for _ in specs]
    prefill = run_step(model, caches, tables, [0] * len(prompts), prompts, num_pad=2)
    with torch.no_grad():
        for prompt, logits in zip(prompts, prefill, strict=True):
            expected = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    nxt = torch.randint(0, VOCAB, (len(prompts),), generator=gen).tolist()
    decode = run_step(model, caches, tables, [len(p) for p in prompts], [[t] for t in nxt])
    with torch.no_grad():
        for prompt, token, logits in zip(prompts, nxt, decode, strict=True):
            expected = hf(torch.tensor([prompt + [token]])).logits[0, -1:]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["v3-q-lora-yarn", "v2-lite"])
def test_greedy_tokens_match_hf_with_prefix_cache_and_preemption(tmp_path: Path,
                                                                  case: str) -> None:
    save_hf(tmp_path, case)
    prompts = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + i % 100 for i in range(21)],
               [5, 17, 42, 9, 100, 3, 77, 1]]
    expected = [hf_greedy(tmp_path, p, 10) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for kwargs in ({}, {"num_gpu_blocks_override": 12}):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                  enable_prefix_caching=True, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        if kwargs:
            assert llm.engine.stats()["num_preemptions"] > 0
        else:  # the first prompt again: its blocks come from the prefix cache
            again = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
            assert again[0].outputs[0].token_ids == expected[0]
            assert llm.engine.stats()["prefix_cache_hits"] > 0


def test_yarn_context_past_max_position_embeddings(tmp_path: Path) -> None:
    """MLA's own RoPE table reaches the length YaRN derives (original 64 * factor 4 = 256,
    past max_position_embeddings 64, as vLLM allows): greedy tokens of a 100-token prompt
    equal HF's, and one token more than 256 is refused."""
    family, overrides = CASES["v3-q-lora-yarn"]
    config = transformers.DeepseekV3Config(**{**COMMON, **overrides,
                                              "max_position_embeddings": 64})
    config.architectures = [f"{family}ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(tmp_path)
    prompt = [(7 * i + 3) % VOCAB for i in range(100)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
              max_model_len=256)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tmp_path, prompt, 6)
    with pytest.raises(ValueError, match="max_model_len=257 exceeds the limit 256"):
        LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=257)


def _check_greedy_against_hf(quantized: Path, reference: Path) -> None:
    """The quantized checkpoint's greedy tokens are HF's on its dequantized twin."""
    prompts = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120]]
    expected = [hf_greedy(reference, p, 8) for p in prompts]
    llm = LLM(str(quantized), device="cpu", dtype="float32", block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_fp8_checkpoint_matches_hf_on_dequantized_weights(tmp_path: Path) -> None:
    """Every MLA projection, dense MLP and routed expert in FP8 (16 x 32 blocks: the q rope
    rows, the latent / rope split and the experts' gate / up split fall mid-block), saved per
    expert as DeepSeek-V3-FP8 is: HF's greedy tokens on the dequantized weights."""
    save_hf(tmp_path / "src", "v3-q-lora-yarn")
    fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", (16, 32))
    _check_greedy_against_hf(tmp_path / "fp8", tmp_path / "ref")


@pytest.mark.parametrize(("case", "quant"), [
    ("v2-lite", {"bits": 4, "group_size": 16, "sym": False, "desc_act": True}),
    ("v2-grouped", {"bits": 8, "group_size": -1, "sym": True}),
])
def test_gptq_checkpoint_matches_hf_on_dequantized_weights(tmp_path: Path, case: str,
                                                           quant: dict[str, Any]) -> None:
    """Every MLA projection and dense MLP as GPTQ (AutoGPTQ's layout, written independently
    of the loader): the interleaved rope rows of the integer q and kv_a projections reordered
    as a float one's, the absorbed up-projections taken from the integer kv_b_proj (inputs in
    their activation order): HF's greedy tokens on the dequantized weights."""
    from mrv2.testing_quant import gptq_checkpoint

    save_hf(tmp_path / "src", case)
    gptq_checkpoint(tmp_path / "src", tmp_path / "q", tmp_path / "ref", **quant)
    _check_greedy_against_hf(tmp_path / "q", tmp_path / "ref")


def test_config_errors_name_the_field() -> None:
    config = transformers.DeepseekV2Config(**{**COMMON, "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match=r"config.topk_method = 'noaux_tc'"):
        DeepseekV2ForCausalLM(config)
    config = transformers.DeepseekV3Config(**{**COMMON, "qk_rope_head_dim": 7})
    with pytest.raises(ValueError, match=r"config.qk_rope_head_dim = 7: must be even"):
        DeepseekV3ForCausalLM(config)


def test_mla_is_the_cores_and_the_old_module_re_exports_it() -> None:
    """MLA lives in the core (:mod:`mrv2.layers.mla`, the backend registered by the core's own
    plugin); ``mrv2_deepseek.mla`` and ``mrv2_deepseek.model.mla_rope`` still give the same
    objects to plugins written against them, and this plugin registers no backend of its own."""
    import mrv2_deepseek
    from mrv2.layers import mla as core
    from mrv2_deepseek import mla, model, plugin

    assert set(mla.__all__) == {"LATENT_NORM_EPS", "MLAAttention", "MLABackend",
                                "MLADecoderLayer", "mla_rope"}
    for name in mla.__all__:
        assert getattr(mla, name) is getattr(core, name), name
    assert model.mla_rope is core.mla_rope
    assert mrv2_deepseek.MLAAttention is core.MLAAttention
    assert mrv2_deepseek.MLABackend is core.MLABackend
    assert not hasattr(plugin, "mrv2_register_attention_backends")
