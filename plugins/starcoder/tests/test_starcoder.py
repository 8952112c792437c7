"""BigCode's models against HF transformers on tiny random checkpoints: StarCoder2
(``Starcoder2ForCausalLM``: biased LayerNorms, the non-gated biased MLP, GQA with RoPE, a
sliding window of 4 under prompts of up to 13 tokens; biases off and an untied head for the
loader's sake) and GPTBigCode (``GPTBigCodeForCausalLM``: learned absolute position embeddings
instead of RoPE, the fused ``c_attn`` split as HF splits it with multi-query attention and
without, the scores unscaled where ``scale_attn_weights`` is false). Prefill and decode logits
through the paged cache; greedy tokens and every prompt position's log-probability through the
engine with prompts split over steps of 8 tokens (positions past the first chunk must reach the
position table and the rotation); n-gram drafts and a prompt given as embeddings, both through
the position table; tensor parallelism; LoRA on the fused ``c_attn`` and the MLP;
``max_model_len`` past ``n_positions`` refused naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import check_steps_against_hf, hf_greedy, make_tiny_checkpoint, poisoned_caches
from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint
from mrv2.testing_engine import check_prompt_logprobs, tokens_at_tp
from mrv2_starcoder.gpt_bigcode import GPTBigCodeForCausalLM
from mrv2_starcoder.model import Starcoder2ForCausalLM

#: ``{case: (architecture, model class, KV heads, config overrides)}``; GPTBigCode's own
#: ``num_key_value_heads`` is set to what ``multi_query`` makes it (HF saves what it is given).
CASES: dict[str, tuple[str, type[Any], int, dict[str, Any]]] = {
    "starcoder2": ("Starcoder2ForCausalLM", Starcoder2ForCausalLM, 2, {"sliding_window": 4}),
    "starcoder2-no-bias-untied": ("Starcoder2ForCausalLM", Starcoder2ForCausalLM, 2, {
        "use_bias": False, "tie_word_embeddings": False, "sliding_window": None}),
    # StarCoder / SantaCoder: one key/value head for 8 query heads
    "gpt-bigcode-mqa": ("GPTBigCodeForCausalLM", GPTBigCodeForCausalLM, 1, {
        "hidden_size": 128, "num_attention_heads": 8, "multi_query": True,
        "num_key_value_heads": 1, "n_inner": 96}),
    # multi-head: c_attn one [q_h | k_h | v_h] run a head; unscaled scores; HF's gelu_new
    "gpt-bigcode-mha": ("GPTBigCodeForCausalLM", GPTBigCodeForCausalLM, 4, {
        "multi_query": False, "num_key_value_heads": 4, "scale_attn_weights": False,
        "activation_function": "gelu_new"}),
}
ENGINE_CASES = ["starcoder2", "gpt-bigcode-mqa", "gpt-bigcode-mha"]
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250], [3 + i for i in range(9)] + [40], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _checkpoint(path: Path, case: str) -> Path:
    architecture, _, _, overrides = CASES[case]
    return make_tiny_checkpoint(path, architecture, std=0.15, **overrides)


def _load(path: Path, case: str) -> tuple[Any, transformers.PretrainedConfig]:
    config = transformers.AutoConfig.from_pretrained(path)
    model = CASES[case][1](config)
    load_model_weights(model, iter_safetensors(path))
    return model, config


def _check_steps(path: Path, model: Any, config: transformers.PretrainedConfig, case: str
                 ) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    caches = poisoned_caches(CASES[case][2], 16, config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (9, 3, 13), vocab=config.vocab_size, max_len=16)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    """Prefill (prompts of 9, 3 and 13 tokens, past the window of 4) and a decode step: every
    logit is HF's."""
    path = _checkpoint(tmp_path / "m", case)
    model, config = _load(path, case)
    attention = [layer.self_attn for layer in model.model.layers]
    kv_heads = CASES[case][2]
    assert all(a.qkv_proj.num_kv_heads == kv_heads for a in attention)
    starcoder2 = case.startswith("starcoder2")
    assert all((a.rotary_emb is not None) == starcoder2 for a in attention)
    window = 4 if case == "starcoder2" else None
    assert all(a.attn.sliding_window == window for a in attention)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (case != "starcoder2-no-bias-untied")
    _check_steps(path, model, config, case)


@pytest.mark.parametrize("case", ["starcoder2", "gpt-bigcode-mqa"])
def test_logits_match_hf_on_the_triton_kernels(tmp_path: Path, case: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps on the GPU's kernels, interpreted (``MRV2_KERNELS=triton``; the Triton
    attention backend, which rotates q and k inside attention over StarCoder2's window, and
    writes GPTBigCode's unrotated keys as they are)."""
    import mrv2.testing
    from mrv2.attention import ForwardContext
    from mrv2.attention.triton_backend import TritonAttentionBackend

    path = _checkpoint(tmp_path / "m", case)
    model, config = _load(path, case)
    backend = TritonAttentionBackend()
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata: ForwardContext(
        metadata, caches, [backend] * len(caches)))
    _check_steps(path, model, config, case)


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_engine_matches_hf(tmp_path: Path, case: str) -> None:
    """Greedy tokens (prompts split over steps of 8 tokens: the second chunk's positions
    index the position table and the rotation; decode steps past the window) and every
    prompt position's log-probability are HF's."""
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
    """At TP=2 StarCoder2's heads, biases and unfused MLP split by rank: the tokens are HF's.
    (GPTBigCode's one key/value head, whole on both ranks beside the replicated position
    table: ``tests/distributed/test_tensor_parallel.py``.)"""
    path = _checkpoint(tmp_path / "m", "starcoder2")
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    for tp, got in tokens_at_tp(path, PROMPTS, GREEDY, tp_sizes=(2,)).items():
        assert got == want, tp


def test_ngram_speculation_keeps_greedy_tokens(tmp_path: Path) -> None:
    """Draft tokens verified in steps of ``1 + k`` take their positions' rows of the position
    table: greedy tokens with n-gram speculation are HF's."""
    path = _checkpoint(tmp_path / "m", "gpt-bigcode-mqa")
    prompt = [5, 17, 42, 9] * 4
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 3, "prompt_lookup_min": 2}) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    assert list(out.outputs[0].token_ids) == hf_greedy(path, prompt, 12)


def test_prompt_embeds_get_the_position_embeddings(tmp_path: Path) -> None:
    """A prompt given as embeddings (rows of ``wte``) gets ``wpe`` added as HF adds it to
    ``inputs_embeds``: the same greedy tokens as HF from those embeddings."""
    path = _checkpoint(tmp_path / "m", "gpt-bigcode-mqa")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = PROMPTS[0]
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor(prompt)) * 1.5
        ids: list[int] = []
        for _ in range(6):
            extra = hf.get_input_embeddings()(torch.tensor(ids, dtype=torch.long))
            logits = hf(inputs_embeds=torch.cat([embeds, extra])[None]).logits[0, -1]
            ids.append(int(logits.argmax()))
    with LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
             enable_prompt_embeds=True) as llm:
        out = llm.generate([{"prompt_embeds": embeds}], SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == ids


@pytest.mark.parametrize(("case", "targets"), [
    ("gpt-bigcode-mqa", ("c_attn", "c_fc")), ("starcoder2", ("q_proj", "v_proj", "c_proj"))])
def test_lora_matches_the_merged_checkpoint(tmp_path: Path, case: str,
                                            targets: tuple[str, ...]) -> None:
    """An adapter on the fused ``c_attn`` (its ``B`` split into q, k and v rows as the
    weight is) and the MLP's ``c_fc`` / ``c_proj`` gives HF's tokens on the merged
    checkpoint."""
    base = _checkpoint(tmp_path / "base", case)
    adapter = make_lora_adapter(base, tmp_path / "lora", rank=4, seed=3, std=1.0,
                                targets=targets)
    want = hf_greedy(merge_lora_checkpoint(base, adapter, tmp_path / "merged"), PROMPTS[0], 8)
    assert want != hf_greedy(base, PROMPTS[0], 8)
    with LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
             enable_lora=True) as llm:
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("a", 1, str(adapter)))[0]
    assert list(out.outputs[0].token_ids) == want


def test_lora_on_multi_head_c_attn_is_refused(tmp_path: Path) -> None:
    """Multi-head ``c_attn`` rows interleave q, k and v per head, which the fused layer's
    rows are not: an adapter of it is refused, not applied to the wrong rows."""
    base = _checkpoint(tmp_path / "base", "gpt-bigcode-mha")
    adapter = make_lora_adapter(base, tmp_path / "lora", rank=4, targets=("c_attn",))
    with LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
             enable_lora=True) as llm, pytest.raises(ValueError, match=r"attn\.c_attn"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("a", 1, str(adapter)))


def test_max_model_len_past_n_positions_is_refused(tmp_path: Path) -> None:
    """The position table has ``n_positions`` rows (256 here): a longer ``max_model_len``
    is refused naming that field, and the default is that length."""
    path = _checkpoint(tmp_path / "m", "gpt-bigcode-mqa")
    with pytest.raises(ValueError, match=r"max_model_len=257 exceeds the model's "
                                         r"n_positions=256"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=257)
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        assert llm.engine.runner.max_model_len == 256


def test_unsplittable_c_attn_tensors_and_activations_are_refused() -> None:
    """A fused ``c_attn`` tensor that is not a plain weight or bias (a GPTQ ``qweight``) is
    refused by name; so is an activation HF names that is not implemented here."""
    config = transformers.GPTBigCodeConfig(n_embd=32, n_head=2, n_layer=1, vocab_size=64,
                                           n_positions=16)
    model = GPTBigCodeForCausalLM(config)
    packed = torch.zeros(32 // 8, 32 + 2 * 16, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.qweight"):
        model.load_weights([("transformer.h.0.attn.c_attn.qweight", packed)])
    config.activation_function = "gelu_10"
    with pytest.raises(ValueError, match="activation_function must be one of .*got 'gelu_10'"):
        GPTBigCodeForCausalLM(config)
