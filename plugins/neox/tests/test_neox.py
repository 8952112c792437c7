"""GPT-NeoX (``GPTNeoXForCausalLM``), StableLM (``StableLmForCausalLM``) and GPT-J
(``GPTJForCausalLM``) against HF transformers on tiny random checkpoints saved with
``save_pretrained``: prefill and decode logits through the paged cache (LayerNorms with biases,
partial RoPE over each head's first dims, parallel and sequential blocks, GPT-NeoX's fused
per-head q/k/v split as it loads and its ungated biased MLP, StableLM's q/k/v biases, per-head
q/k LayerNorms and GQA, GPT-J's interleaved partial RoPE (q/k rows reordered as they load) and
biased head, tied and untied heads), the same on the Triton kernels (interpreted), greedy
tokens and prompt
log-probabilities through the engine with prompts split over steps, tensor parallelism (each
rank's heads of the fused q/k/v and of the q/k norms), and the loader's refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.layers import LayerNorm, ParallelDecoderLayer
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import check_steps_against_hf, hf_greedy, make_tiny_checkpoint, poisoned_caches
from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_neox.gptj import GPTJForCausalLM
from mrv2_neox.layers import HeadLayerNorm
from mrv2_neox.model import GPTNeoXForCausalLM, StableLmForCausalLM

NEOX, STABLELM, GPTJ = "GPTNeoXForCausalLM", "StableLmForCausalLM", "GPTJForCausalLM"
CASES: dict[str, tuple[str, type[Any], dict[str, Any]]] = {
    # Pythia: parallel residual, rotary_pct 0.25 (4 of 16 dims), gelu, untied embed_out;
    # TINY's num_key_value_heads (2) is not GPT-NeoX's: HF and mrv2 ignore it
    "pythia": (NEOX, GPTNeoXForCausalLM, {}),
    # the sequential block, half the head rotated, GPT-NeoX-20B's gelu_fast, a tied head
    "neox-sequential": (NEOX, GPTNeoXForCausalLM, {
        "use_parallel_residual": False, "hidden_act": "gelu_fast", "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                            "partial_rotary_factor": 0.5}}),
    # StableLM-2-12B's layout: per-head q/k LayerNorms, parallel block off the input norm, GQA
    # (q/k/v biases too, for the loader's sake)
    "stablelm-12b": (STABLELM, StableLmForCausalLM, {
        "qk_layernorm": True, "use_qkv_bias": True, "use_parallel_residual": True}),
    # StableLM-2-1.6B: q/k/v biases, sequential blocks, partial_rotary_factor 0.25
    "stablelm-2": (STABLELM, StableLmForCausalLM, {"use_qkv_bias": True}),
    # GPT-J: the parallel block off ln_1, 6 of 16 dims rotated in interleaved pairs, gelu_new
    # MLP n_inner wide (TINY's intermediate_size is not GPT-J's: HF and mrv2 ignore it), the
    # biased untied lm_head
    "gptj": (GPTJ, GPTJForCausalLM, {"rotary_dim": 6, "n_inner": 96}),
}
#: The dims of each 16-wide head RoPE rotates, by case.
ROTARY = {"neox-sequential": 8, "gptj": 6}
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
    attention = model.model.layers[0].self_attn
    caches = poisoned_caches(attention.qkv_proj.num_kv_heads, attention.head_dim,
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (9, 3, 13), vocab=config.vocab_size, max_len=16)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path: Path, case: str) -> None:
    path = _checkpoint(tmp_path / "m", case)
    model, config = _load(path, case)
    layers = list(model.model.layers)
    attention = [layer.self_attn for layer in layers]
    rotary = ROTARY.get(case, 4)  # of head_dim 16
    assert all(a.rotary_emb.rotary_dim == rotary and a.head_dim == 16 for a in attention)
    kv_heads = 2 if CASES[case][0] == STABLELM else 4
    assert all(a.qkv_proj.num_kv_heads == kv_heads for a in attention)
    assert all(isinstance(a.q_layernorm, HeadLayerNorm) == (case == "stablelm-12b")
               for a in attention if hasattr(a, "q_layernorm")) and (
        hasattr(attention[0], "q_layernorm") == (case == "stablelm-12b"))
    assert isinstance(model.model.norm, LayerNorm)
    assert all(isinstance(layer, ParallelDecoderLayer)
               == (case in ("pythia", "stablelm-12b", "gptj")) for layer in layers)
    # the sums in HF's order: (attn + mlp) + x for GPT-NeoX and GPT-J, (x + attn) + mlp for
    # StableLM
    assert all(layer.residual_last == (case != "stablelm-12b") for layer in layers
               if isinstance(layer, ParallelDecoderLayer))
    # StableLM's and GPT-J's parallel blocks have no post-attention norm
    assert all((layer.post_attention_layernorm is None) == (case in ("stablelm-12b", "gptj"))
               for layer in layers)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (case == "neox-sequential")
    _check_steps(path, model, config)


@pytest.mark.parametrize("case", ["pythia", "stablelm-12b", "gptj"])
def test_logits_match_hf_on_the_triton_kernels(tmp_path: Path, case: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps on the GPU's kernels, interpreted (``MRV2_KERNELS=triton``; the Triton
    attention backend, which leaves a partial rotation to the RoPE kernel before it)."""
    import mrv2.testing
    from mrv2.attention import ForwardContext
    from mrv2.attention.triton_backend import TritonAttentionBackend

    path = _checkpoint(tmp_path / "m", case)
    model, config = _load(path, case)
    backend = TritonAttentionBackend()
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata: ForwardContext(
        metadata, caches, [backend] * len(caches)))
    _check_steps(path, model, config)


@pytest.mark.parametrize("case", list(CASES))
def test_engine_matches_hf(tmp_path: Path, case: str) -> None:
    """Greedy tokens (prompts split over steps of 8 tokens) and every prompt position's
    log-probability are HF's."""
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
    """At TP=2 each rank keeps its heads' rows of the q/k/v projections and of the per-head
    q/k norms (one of the two key heads each): the tokens and the prompt log-probabilities
    are HF's (the log-probabilities see a norm row of the wrong head, which greedy tokens of
    a tiny model may not)."""
    path = _checkpoint(tmp_path / "m", "stablelm-12b")
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             tensor_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
        check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[0]}, PROMPTS[0], logits)


@pytest.mark.parametrize(("case", "targets"), [
    ("pythia", ("dense", "dense_h_to_4h", "dense_4h_to_h")),
    ("stablelm-12b", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))])
def test_lora_matches_hf_on_the_merged_checkpoint(tmp_path: Path, case: str,
                                                  targets: tuple[str, ...]) -> None:
    """An adapter on GPT-NeoX's ``attention.dense`` and MLP (HF's names: the core's
    ``o_proj`` / ``up_proj`` / ``down_proj``), or on StableLM's projections, gives HF's tokens
    on the merged checkpoint."""
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


def test_lora_on_the_fused_qkv_is_refused(tmp_path: Path) -> None:
    """An adapter on GPT-NeoX's fused ``query_key_value`` (its ``B`` rows in the per-head
    layout, which the core's fused q/k/v slots do not take) is refused naming the module, not
    applied to the wrong rows."""
    base = _checkpoint(tmp_path / "base", "pythia")
    adapter = make_lora_adapter(base, tmp_path / "lora", rank=4, targets=("query_key_value",))
    with LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
             enable_lora=True) as llm, pytest.raises(ValueError, match="query_key_value"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("qkv", 1, str(adapter)))


def test_fused_qkv_is_split_per_head() -> None:
    """Row ``(h, j, i)`` of ``query_key_value`` (head ``h``, part ``j`` of q/k/v, dim ``i``)
    is row ``h * head_dim + i`` of part ``j``: HF's ``view(..., heads, 3 * head_dim)``."""
    config = transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        vocab_size=64)
    model = GPTNeoXForCausalLM(config)
    rows = torch.arange(3 * 32, dtype=torch.float32)
    weight = rows[:, None].expand(-1, 32).contiguous()
    split = dict(model._split_qkv([("gpt_neox.layers.0.attention.query_key_value.weight",
                                    weight), ("embed_out.weight", rows)]))
    heads, d = 2, 16
    for j, part in enumerate("qkv"):
        got = split[f"gpt_neox.layers.0.attention.{part}_proj.weight"][:, 0]
        want = torch.tensor([float(h * 3 * d + j * d + i) for h in range(heads)
                             for i in range(d)])
        assert torch.equal(got, want), part
    assert "lm_head.weight" in split


def test_gpt_neox_names_and_skipped_buffers() -> None:
    """HF's GPT-NeoX names map onto the core's; the causal-mask buffers and RoPE caches older
    exports (Pythia's own) carry are skipped, not refused as unknown tensors."""
    config = transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        vocab_size=64)
    model = GPTNeoXForCausalLM(config)
    for skipped in ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"):
        assert model.rename(f"gpt_neox.layers.0.{skipped}") is None, skipped
    assert model.rename("gpt_neox.layers.0.attention.dense.bias") == (
        "model.layers.0.self_attn.o_proj.bias")
    assert model.rename("gpt_neox.layers.0.mlp.dense_4h_to_h.weight") == (
        "model.layers.0.mlp.down_proj.weight")
    assert model.rename("gpt_neox.final_layer_norm.bias") == "model.norm.bias"
    assert model.rename("embed_out.weight") == "lm_head.weight"
    mask = torch.tril(torch.ones(1, 1, 8, 8, dtype=torch.bool))
    assert model.load_weights([("gpt_neox.layers.0.attention.bias", mask),
                               ("gpt_neox.layers.0.attention.masked_bias",
                                torch.tensor(-1e9))]) == set()


def test_packed_qkv_tensors_are_refused() -> None:
    """A fused q/k/v tensor that cannot be split by rows (GPTQ's packed ``qweight``) is
    refused by name, not loaded scrambled."""
    config = transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        vocab_size=64)
    model = GPTNeoXForCausalLM(config)
    packed = torch.zeros(32 // 8, 96, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"gpt_neox\.layers\.0\.attention\.query_key_value"
                                         r"\.qweight"):
        model.load_weights([("gpt_neox.layers.0.attention.query_key_value.qweight", packed)])


def test_missing_head_norm_fails_the_load(tmp_path: Path) -> None:
    """A checkpoint that lacks one head's q norm weight fails the strict load naming the
    norm (its row would keep the init's ones)."""
    path = _checkpoint(tmp_path / "m", "stablelm-12b")
    config = transformers.AutoConfig.from_pretrained(path)
    dropped = "model.layers.1.self_attn.q_layernorm.norms.2.weight"
    weights = ((n, t) for n, t in iter_safetensors(path) if n != dropped)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_layernorm\.weight"):
        load_model_weights(StableLmForCausalLM(config), weights)
