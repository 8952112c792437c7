"""Meituan's LongCat-Flash (``LongcatFlashForCausalLM``) against HF transformers on tiny random
checkpoints saved by transformers itself: every logit of a prefill (the prompt logprobs' rows)
and of a decode step through the latent KV cache (two MLA sublayers a layer, KV cache layers
``2 i`` and ``2 i + 1``), then greedy tokens through the engine with prompts split over steps
of 8 tokens (chunked prefill) and decode steps after, and the prompt log-probabilities.

The router's correction bias is redrawn (transformers inits it to zeros) so that it steers
the choice, and tilted towards the zero-computation experts so that tokens are routed to
them: the test asserts that some are. Cases: per-expert checkpoint tensors as transformers
saves them (the zero experts' unused gate/up rows among them, an MTP tensor) with YaRN and
DeepSeek's mscale terms, then dummy weights and the configs' ``mla_scale_*_lora`` switches; or
stacked, as transformers holds them, at TP=1 and TP=2."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import mrv2.testing
from mrv2 import LLM, SamplingParams
from mrv2.attention import ForwardContext
from mrv2.attention.mla_backend import MLABackend
from mrv2.contract.kv_cache import layer_specs
from mrv2.layers.mla import mla_rope
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import (
    TEST_BLOCK_SIZE,
    TEST_NUM_BLOCKS,
    check_steps_against_hf,
    hf_greedy,
    make_tiny_checkpoint,
)
from mrv2.testing_engine import check_prompt_logprobs, tokens_at_tp
from mrv2_deepseek.longcat import LongcatFlashForCausalLM, LongcatMLA, LongcatMoE

ROUTED, ZERO = 4, 3
LONGCAT: dict[str, Any] = {
    "num_layers": 2, "num_hidden_layers": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "head_dim": 8,
    "v_head_dim": 12, "n_routed_experts": ROUTED, "zero_expert_num": ZERO, "moe_topk": 3,
    "expert_ffn_hidden_size": 32, "routed_scaling_factor": 2.5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}
CASES: dict[str, dict[str, Any]] = {
    "per-expert-yarn": {**LONGCAT, "rope_parameters": YARN},
    "stacked": LONGCAT,
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


def _checkpoint(path: Path, case: str) -> Path:
    path = make_tiny_checkpoint(path, "LongcatFlashForCausalLM", std=0.15, **CASES[case])
    file = str(path / "model.safetensors")
    if case == "stacked":  # transformers' in-memory (stacked) names
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert state["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == ROUTED + ZERO
    else:
        state = load_file(file)
        assert f"model.layers.0.mlp.experts.{ROUTED}.gate_proj.weight" in state
        state["model.mtp.layers.0.eh_proj.weight"] = torch.zeros(2, 2)  # skipped, as by HF
    gen = torch.Generator().manual_seed(3)
    for i in range(int(CASES[case]["num_layers"])):  # a bias that steers, towards zero experts
        bias = torch.randn(ROUTED + ZERO, generator=gen) * 0.05
        bias[ROUTED:] += 0.08
        state[f"model.layers.{i}.mlp.router.e_score_correction_bias"] = bias
    save_file(state, file, metadata={"format": "pt"})
    return path


def _count_zero_routes(model: Any) -> list[int]:
    """Hook every MoE's router; the list fills with each call's number of zero-expert picks."""
    counts: list[int] = []
    for module in model.modules():
        if isinstance(module, LongcatMoE):
            num_routed = module.num_routed
            module.gate.register_forward_hook(
                lambda _m, _a, out, n=num_routed: counts.append(int((out[1] >= n).sum())))
    return counts


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf(tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _checkpoint(tmp_path / "m", case)
    config = transformers.AutoConfig.from_pretrained(path)
    model = LongcatFlashForCausalLM(config)
    loaded = load_model_weights(model, iter_safetensors(path))
    process_weights_after_loading(model)
    model.eval()
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.1.mlp.experts.w13_weight", "model.layers.1.mlps.1.gate_up_proj.weight",
            "model.layers.1.self_attn.1.kv_b_proj.weight"} <= loaded
    moe = model.model.layers[1].mlp
    assert isinstance(moe, LongcatMoE) and moe.gate.weight.dtype == torch.float32
    specs = layer_specs(model)
    assert sorted(specs) == [0, 1, 2, 3]
    caches = [specs[i].allocate(TEST_NUM_BLOCKS, TEST_BLOCK_SIZE, torch.float32,
                                torch.device("cpu")).fill_(1e4) for i in sorted(specs)]
    monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata:
                        ForwardContext(metadata, caches, [MLABackend()] * len(caches)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    counts = _count_zero_routes(model)
    check_steps_against_hf(model, hf, caches, [9, 3, 13], vocab=config.vocab_size, max_len=16)
    assert sum(counts) > 0, "no token was routed to a zero-computation expert"

    # the engine: greedy tokens and prompt log-probabilities, prompts in chunks of 8 tokens
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[1]])).logits[0]
        check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[1]}, PROMPTS[1], logits)
    if case == "stacked":
        assert tokens_at_tp(path, PROMPTS, params, tp_sizes=(2,),
                            max_num_batched_tokens=8)[2] == want
        return
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             load_format="dummy") as llm:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
    # the published configs' LoRA-scale switches (transformers ignores them; vLLM reads them)
    off = copy.deepcopy(config)
    off.mla_scale_q_lora, off.mla_scale_kv_lora = False, True
    rope = mla_rope(config)
    attn, plain = LongcatMLA(config, 0, rope), LongcatMLA(off, 0, rope)
    assert plain.scale == pytest.approx(attn.scale / (64 / 24) ** 0.5)
    assert plain.latent_scale == attn.latent_scale == pytest.approx((64 / 32) ** 0.5)
    off.mla_scale_kv_lora = False
    assert LongcatMLA(off, 0, rope).latent_scale == 1.0
