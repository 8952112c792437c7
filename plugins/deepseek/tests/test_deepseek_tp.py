"""MLA under tensor parallelism (heads split across the ranks; ``q_a_proj`` and
``kv_a_proj_with_mqa`` replicated).

In one process, with the group faked at build time: each rank of two holds half the heads of
``q_proj`` / ``q_b_proj``, ``kv_b_proj`` (hence ``W_UK`` / ``W_UV``) and ``o_proj``, writes the
same latent cache as one rank does, and the two ranks' partial outputs (``o_proj`` not reduced)
sum to the single rank's output, through prefill and decode; an indivisible head count fails
naming the fields. Across two processes (gloo): an FP8 checkpoint with attention biases and
the MTP drafter give the same tokens at TP=2 as at TP=1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.attention import ForwardContext, set_forward_context
from mrv2.attention.mla_backend import MLABackend
from mrv2.distributed import parallel_state
from mrv2.layers.linear import ColumnLinear, LinearBase, RowLinear
from mrv2.layers.mla import MLAAttention, mla_rope
from mrv2.testing import make_tiny_checkpoint, redraw_weights, step_inputs, step_metadata
from mrv2.testing_checkpoints import fp8_checkpoint, make_mtp_checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 16
MLA: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "max_position_embeddings": 256, "tie_word_embeddings": False,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # q_lora_rank, interleaved rope, biases on q_a / kv_a / o_proj
    "v3-q-lora-bias": ("DeepseekV3", {"q_lora_rank": 24, "n_group": 2, "topk_group": 1,
                                      "attention_bias": True}),
    # plain q_proj, interleaved rope
    "v2-lite": ("DeepseekV2", {"q_lora_rank": None, "topk_method": "greedy"}),
}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [3, 4, 5, 6, 7, 8, 9, 10, 11, 30]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def hf_attention(case: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny config and the whole tensors of HF's layer-0 ``self_attn`` (redrawn)."""
    family, overrides = CASES[case]
    config = getattr(transformers, f"{family}Config")(**{**MLA, **overrides})
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    redraw_weights(hf)
    prefix = "model.layers.0.self_attn."
    return config, {k[len(prefix):]: v.detach().clone() for k, v in hf.state_dict().items()
                    if k.startswith(prefix)}


def build(config: Any, tensors: dict[str, torch.Tensor]) -> MLAAttention:
    """Layer 0's attention, every parameter loaded from the whole checkpoint tensor."""
    attn = MLAAttention(config, 0, mla_rope(config), interleaved_rope=True)
    params = dict(attn.named_parameters())
    assert set(params) == set(tensors)
    for name, param in params.items():
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensors[name])
        else:
            with torch.no_grad():
                param.copy_(tensors[name])
    attn.process_weights_after_loading()
    for module in attn.modules():
        if isinstance(module, LinearBase):
            module.process_weights_after_loading()
    return attn.eval()


def step(attn: MLAAttention, cache: torch.Tensor, x: torch.Tensor, contexts: list[int],
         queries: list[int], tables: list[list[int]]) -> torch.Tensor:
    _, positions = step_inputs(contexts, [[0] * n for n in queries])
    metadata = step_metadata(contexts, queries, tables, 0, BLOCK_SIZE)
    with torch.inference_mode(), set_forward_context(
            ForwardContext(metadata, [cache], [MLABackend()])):
        return attn(positions, x)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_split_heads_and_partials_sum_to_one_rank(case: str) -> None:
    config, tensors = hf_attention(case)
    whole = build(config, tensors)
    ranks = []
    for rank in range(2):
        with parallel_state.as_rank(rank, 2):
            attn = build(config, tensors)
        attn.o_proj.reduce_output = False  # summed below, as the all-reduce would
        ranks.append(attn)

    nope, v, r = 16, 12, 32
    kv_b = tensors["kv_b_proj.weight"].view(4, nope + v, r)
    for rank, attn in enumerate(ranks):
        assert (attn.total_num_heads, attn.num_heads) == (4, 2)
        replicated = [attn.kv_a_proj_with_mqa, *([attn.q_a_proj] if attn.q_a_proj else [])]
        for layer in replicated:
            assert type(layer) is LinearBase and layer.tp_size == 1
        q = attn.q_proj if attn.q_proj is not None else attn.q_b_proj
        assert isinstance(q, ColumnLinear) and q.weight.shape[0] == 2 * (nope + 8)
        assert isinstance(attn.kv_b_proj, ColumnLinear)
        assert attn.kv_b_proj.weight.shape[0] == 2 * (nope + v)
        assert isinstance(attn.o_proj, RowLinear) and attn.o_proj.weight.shape == (64, 2 * v)
        assert attn.o_proj.adds_bias == (rank == 0)
        heads = kv_b[2 * rank: 2 * rank + 2]  # this rank's heads, whole
        torch.testing.assert_close(attn.w_uk, heads[:, :nope, :])
        torch.testing.assert_close(attn.w_uv_t, heads[:, nope:, :].transpose(1, 2))
        assert attn.kv_cache_spec() == whole.kv_cache_spec()

    gen = torch.Generator().manual_seed(1)
    tables = [[3, 7, 1], [0, 5, 2]]
    caches = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 40) for _ in range(3)]
    for contexts, queries in (([0, 0], [7, 5]), ([7, 5], [1, 1])):  # prefill, then decode
        x = torch.randn(sum(queries), 64, generator=gen)
        expected = step(whole, caches[0], x, contexts, queries, tables)
        partials = [step(attn, caches[1 + i], x, contexts, queries, tables)
                    for i, attn in enumerate(ranks)]
        torch.testing.assert_close(partials[0] + partials[1], expected, atol=1e-5, rtol=1e-5)
        for cache in caches[1:]:  # the latent cache is per token: the same on every rank
            torch.testing.assert_close(cache, caches[0], atol=0, rtol=0)


def test_indivisible_heads_fail_naming_the_fields() -> None:
    """Three heads on two ranks: the projections' row counts (3 * 24, 3 * 28, 3 * 12) would
    split, mid-head; the head count is checked first."""
    family, overrides = CASES["v3-q-lora-bias"]
    config = getattr(transformers, f"{family}Config")(
        **{**MLA, **overrides, "num_attention_heads": 3})
    with parallel_state.as_rank(1, 2), pytest.raises(
            ValueError, match=r"num_attention_heads \(3\).*tensor_parallel_size \(2\)"):
        MLAAttention(config, 0, mla_rope(config), interleaved_rope=True)


def _tokens(model: Path, tp: int, **kwargs: Any) -> tuple[list[list[int]], dict[str, Any]]:
    with LLM(str(model), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
             max_model_len=128, tensor_parallel_size=tp, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats()


def test_fp8_checkpoint_with_biases_tp2_equals_tp1(tmp_path: Path) -> None:
    """Every MLA projection in FP8 (16 x 8 blocks: a rank's 56 ``kv_b_proj`` rows end
    mid-block, its 24 ``o_proj`` columns are whole blocks), attention biases on: the
    dequantized ``kv_b_proj`` the absorbed weights come from is this rank's heads."""
    family, overrides = CASES["v3-q-lora-bias"]
    src = make_tiny_checkpoint(tmp_path / "src", f"{family}ForCausalLM", **{**MLA, **overrides})
    fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", block=(16, 8))
    assert _tokens(tmp_path / "fp8", 2)[0] == _tokens(tmp_path / "fp8", 1)[0]


def test_mtp_drafter_tp2_equals_tp1(tmp_path: Path) -> None:
    """The MTP layer's MLA block is split like the main layers': the same tokens and drafts."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    family, overrides = CASES["v3-q-lora-bias"]
    model = make_mtp_checkpoint(tmp_path, f"{family}ForCausalLM", DeepseekV3DecoderLayer,
                                **{**MLA, **overrides, "num_nextn_predict_layers": 1})
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    tokens2, stats2 = _tokens(model, 2, **spec)
    tokens1, stats1 = _tokens(model, 1, **spec)
    assert tokens2 == tokens1 == _tokens(model, 1)[0]
    assert stats2["spec_num_draft_tokens"] == stats1["spec_num_draft_tokens"] > 0
