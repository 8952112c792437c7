"""Cohere's Command models (``CohereForCausalLM``, ``Cohere2ForCausalLM``) against HF
transformers on tiny random checkpoints: prefill and decode logits through the paged cache
(parallel blocks off one bias-free LayerNorm, the interleaved RoPE's q/k rows reordered as they
load, per-head q/k LayerNorms, biased projections, tied and untied LM heads, the logit scale;
Cohere2's sliding-window RoPE layers past their window beside global NoPE layers), greedy
tokens and prompt log-probabilities through the engine with prompts split over steps, tensor
parallelism (each rank's heads of the q/k norms), and a LoRA adapter on the reordered q/k/v
projection, a block-FP8 checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.layers import head_dim_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import check_steps_against_hf, hf_greedy, make_tiny_checkpoint, poisoned_caches
from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint
from mrv2.testing_engine import check_prompt_logprobs, tokens_at_tp
from mrv2_cohere.model import Cohere2ForCausalLM, CohereForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
CASES: dict[str, tuple[str, type[Any], dict[str, Any]]] = {
    # Command R: tied LM head, no q/k norm
    "command-r": ("CohereForCausalLM", CohereForCausalLM, {}),
    # Command R+: per-head q/k LayerNorms; biases and an untied head for the loader's sake
    "command-r-plus": ("CohereForCausalLM", CohereForCausalLM, {
        "use_qk_norm": True, "attention_bias": True, "tie_word_embeddings": False,
        "logit_scale": 0.5}),
    # Command R7B / A: a window of 4 on RoPE layers, global NoPE layers between them
    "command-r7b": ("Cohere2ForCausalLM", Cohere2ForCausalLM, {
        "num_hidden_layers": 3, "sliding_window": 4, "layer_types": [SLIDING, FULL, SLIDING]}),
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250], [3 + i for i in range(9)] + [40], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _checkpoint(path: Path, case: str) -> Path:
    architecture, _, overrides = CASES[case]
    return make_tiny_checkpoint(path, architecture, std=0.15, **overrides)


def _load(path: Path, case: str) -> tuple[Any, transformers.PretrainedConfig]:
    config = transformers.AutoConfig.from_pretrained(path)
    model = CASES[case][1](config)
    load_model_weights(model, iter_safetensors(path))
    return model, config


def _check_steps(path: Path, model: Any, config: transformers.PretrainedConfig) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (9, 3, 13), vocab=config.vocab_size, max_len=16)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    path = _checkpoint(tmp_path / "m", case)
    model, config = _load(path, case)
    attention = [layer.self_attn for layer in model.model.layers]
    if case == "command-r7b":
        assert [a.attn.sliding_window for a in attention] == [4, None, 4]
        assert [a.rotary_emb is not None for a in attention] == [True, False, True]
    else:
        assert all(a.rotary_emb is not None and a.attn.sliding_window is None
                   for a in attention)
    assert all((a.q_layernorm is not None) == (case == "command-r-plus") for a in attention)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (case != "command-r-plus")
    assert model.logit_scale == (0.5 if case == "command-r-plus" else 0.0625)
    _check_steps(path, model, config)


@pytest.mark.parametrize("case", ["command-r-plus", "command-r7b"])
def test_logits_match_hf_on_the_triton_kernels(tmp_path: Path, case: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps on the GPU's kernels, interpreted (``MRV2_KERNELS=triton``; the Triton
    attention backend, which rotates the reordered q and k inside attention, over the window
    on the sliding layers; the global NoPE layers write the cache on their own)."""
    import mrv2.testing
    from mrv2.attention import ForwardContext
    from mrv2.attention.triton_backend import TritonAttentionBackend

    path = _checkpoint(tmp_path / "m", case)
    model, config = _load(path, case)
    backend = TritonAttentionBackend()
    assert backend.rope_in_attention
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata: ForwardContext(
        metadata, caches, [backend] * len(caches)))
    _check_steps(path, model, config)


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_hf(tmp_path: Path, case: str) -> None:
    """Greedy tokens (prompts split over steps of 8 tokens, past the window) and every
    prompt position's log-probability (the logit scale counts there) are HF's."""
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


def test_tensor_parallel_matches_hf(tmp_path: Path) -> None:
    """At TP=2 each rank keeps its heads' rows of the q/k norms (and of the reordered q/k
    projections): the tokens are HF's."""
    path = _checkpoint(tmp_path / "m", "command-r-plus")
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    for tp, got in tokens_at_tp(path, PROMPTS, GREEDY, tp_sizes=(2,)).items():
        assert got == want, tp


def test_lora_on_the_reordered_qkv_projection(tmp_path: Path) -> None:
    """An adapter on q_proj, k_proj and v_proj (the fused ``qkv_proj``'s shards: the q and k
    ``B`` rows reordered as their weights are, v's not) gives HF's tokens on the merged
    checkpoint."""
    base = _checkpoint(tmp_path / "base", "command-r")
    adapter = make_lora_adapter(base, tmp_path / "lora", rank=4, seed=3, std=1.0,
                                targets=("q_proj", "k_proj", "v_proj"))
    want = hf_greedy(merge_lora_checkpoint(base, adapter, tmp_path / "merged"), PROMPTS[0], 8)
    assert want != hf_greedy(base, PROMPTS[0], 8)
    with LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
             enable_lora=True) as llm:
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("qkv", 1, str(adapter)))[0]
    assert list(out.outputs[0].token_ids) == want


def test_fp8_checkpoint_matches_hf_on_dequantized_weights(tmp_path: Path) -> None:
    """A block-FP8 checkpoint (16 x 16 blocks: a block's rows are one head's, so the q/k
    rows reorder within their blocks and the scales stay): HF's greedy tokens on the
    dequantized weights."""
    from mrv2.testing_checkpoints import fp8_checkpoint

    _checkpoint(tmp_path / "src", "command-r-plus")
    fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", (16, 16))
    want = [hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS]
    with LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", block_size=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_packed_integer_q_k_tensors_are_refused() -> None:
    """A checkpoint layout whose q/k rows cannot be reordered (GPTQ's packed ``qweight``) is
    refused by name, not loaded with the pairs unrotated."""
    config = transformers.CohereConfig(hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       num_key_value_heads=1, vocab_size=64)
    model = CohereForCausalLM(config)
    packed = torch.zeros(32 // 8, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.qweight"):
        model.load_weights([("model.layers.0.self_attn.q_proj.qweight", packed)])
