"""Tensor parallelism on the CPU (gloo, two processes): every family gives the same greedy and
seeded tokens at TP=2 as at TP=1, with prefix caching on (two prompts share a prefix), for
dense models with split and with replicated key/value heads (Cohere's per-head q/k norms
among them; Apertus' dense xIELU MLPs, Helium's reordered interleaved-RoPE rows, StarCoder's
absolute position embeddings), MoE
(experts split inside), GLM's partial rotary with shared experts, DeepSeek's MLA (and V3.2's
sparse form), dots.llm1
and Phi-3.5-MoE, and an FP8 block-quantized checkpoint.
A bad split fails with an error naming the field, before any worker process starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import TINY_FAMILIES, TINY_MLA, make_tiny_checkpoint
from mrv2.testing_checkpoints import fp8_checkpoint
from mrv2.testing_quant import compressed_tensors_checkpoint, gptq_checkpoint, mxfp4_checkpoint

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", {}),
    # one key/value head: both ranks hold it
    "llama-one-kv-head": ("LlamaForCausalLM", {"num_key_value_heads": 1, "vocab_size": 255}),
    **TINY_FAMILIES,
    # per-head q/k LayerNorms (each rank's heads' rows), one key/value head on both ranks
    "cohere-qk-norm": ("CohereForCausalLM", {"use_qk_norm": True, "num_key_value_heads": 1}),
    # StarCoder: one key/value head on both ranks, the absolute position table replicated
    "gpt-bigcode-mqa": ("GPTBigCodeForCausalLM", {"multi_query": True, "num_key_value_heads": 1}),
    # dense xIELU MLPs split by columns (each layer's scalars on both ranks), q/k RMSNorms
    "apertus": ("ApertusForCausalLM", {}),
    # interleaved RoPE: the whole q/k tensors reordered before a rank takes its heads
    "helium": ("HeliumForCausalLM", {"head_dim": 16, "attention_bias": True}),
    "deepseek-v3": ("DeepseekV3ForCausalLM", {**TINY_MLA, "q_lora_rank": 24, "n_group": 2,
                                              "topk_group": 1}),
    # DeepSeek Sparse Attention: the indexer replicated (one selection on both ranks), heads split;
    # a top-k of 4 below the prompts' lengths
    "deepseek-v32": ("DeepseekV32ForCausalLM", {**TINY_MLA, "q_lora_rank": 24, "n_group": 2,
                                                "topk_group": 1, "index_topk": 4,
                                                "index_n_heads": 4, "index_head_dim": 16}),
    # DeepSeek-V3's MoE (groups, shared expert, a dense layer) under per-head q/k norms
    "dots1": ("Dots1ForCausalLM", {"n_routed_experts": 8, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, "n_shared_experts": 1,
                                   "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2}),
    # biased LayerNorms (replicated), attention and LM head (vocabulary rows); SparseMixer
    "phimoe": ("PhimoeForCausalLM", {"num_local_experts": 4, "intermediate_size": 32,
                                     "attention_bias": True, "lm_head_bias": True}),
}
PREFIX = [3 + i for i in range(9)]
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], PREFIX + [30, 31], PREFIX + [40], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)


def _tokens(model: Path, tp: int) -> list[list[int]]:
    with LLM(str(model), device="cpu", dtype="float32", block_size=4, max_model_len=128,
             tensor_parallel_size=tp) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               [GREEDY, GREEDY, GREEDY, SEEDED], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_equals_tp1(family: str, tmp_path: Path) -> None:
    """std 0.15: attention and the experts shape the tokens (at HF's init a wrong expert or
    head slice on one rank can leave them unchanged)."""
    architecture, overrides = FAMILIES[family]
    model = make_tiny_checkpoint(tmp_path / "m", architecture, std=0.15, **overrides)
    assert _tokens(model, 2) == _tokens(model, 1)


@pytest.mark.parametrize("family", ["qwen3-moe", "glm4-moe", "deepseek-v2-lite", "gpt-oss",
                                    "ernie4.5-moe", "dots1", "phimoe", "fp8-experts",
                                    "gptq-experts"])
def test_expert_parallel_equals_one_rank(family: str, tmp_path: Path) -> None:
    """``enable_expert_parallel`` at TP=2: each rank holds half the experts whole (shared
    experts and attention still split by columns / heads; gpt-oss's expert biases on the
    rank of their expert; FP8 and GPTQ experts loaded expert by expert); the same tokens as
    one rank."""
    if family == "fp8-experts" or family == "gptq-experts":
        src = make_tiny_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", std=0.15,
                                   num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32)
        model = tmp_path / "q"
        if family == "fp8-experts":
            fp8_checkpoint(src, model, tmp_path / "ref", block=(16, 16))
        else:
            gptq_checkpoint(src, model, tmp_path / "ref", bits=4, group_size=16, sym=False,
                            experts=True)
    else:
        architecture, overrides = FAMILIES[family]
        model = make_tiny_checkpoint(tmp_path / "m", architecture, std=0.15, **overrides)
    want = _tokens(model, 1)
    with LLM(str(model), device="cpu", dtype="float32", block_size=4, max_model_len=128,
             tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               [GREEDY, GREEDY, GREEDY, SEEDED], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want


def test_classifier_tp2_equals_tp1(tmp_path: Path) -> None:
    """A sequence classifier's label probabilities at TP=2 are TP=1's (the score head,
    replicated, over the gathered final hidden states)."""
    model = make_tiny_checkpoint(tmp_path / "cls", "Qwen3ForSequenceClassification",
                                 num_labels=3)

    def probs(tp: int) -> list[list[float]]:
        with LLM(str(model), device="cpu", dtype="float32", block_size=4, max_model_len=128,
                 tensor_parallel_size=tp) as llm:
            return [o.outputs.probs for o in llm.classify(
                [{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)]

    for a, b in zip(probs(2), probs(1), strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_fp8_checkpoint_tp2_equals_tp1(tmp_path: Path) -> None:
    """Block scales split with the weights: rows of column-parallel layers, column blocks of
    row-parallel ones (16 x 16 blocks, so the tiny layers' slices are whole blocks)."""
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32)
    fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", block=(16, 16))
    assert _tokens(tmp_path / "fp8", 2) == _tokens(tmp_path / "fp8", 1)


def test_indivisible_heads_fail_clearly(tmp_path: Path) -> None:
    """The error names the field and the sizes the model does split into."""
    model = make_tiny_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", num_attention_heads=3,
                                 num_key_value_heads=1, head_dim=16)
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\).*tensor_parallel_size "
                                         r"\(2\) \(this model splits into tensor_parallel_size "
                                         r"1\)"):
        LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=2)
    # the MLP's width (90: 2 ranks, not 4), named as the config names it
    model = make_tiny_checkpoint(tmp_path / "w", "Qwen3ForCausalLM", intermediate_size=90)
    with pytest.raises(ValueError, match=r"intermediate_size \(90\) must be divisible by "
                                         r"tensor_parallel_size \(4\) \(this model splits "
                                         r"into tensor_parallel_size 1, 2\)"):
        LLM(str(model), device="cpu", dtype="float32", tensor_parallel_size=4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_passes_the_shardability_check(family: str, tmp_path: Path) -> None:
    """The meta-device build that checks a split before any worker starts accepts every
    family at TP=2 (it only constructs: no constructor may need real data or a group), and
    leaves this process outside any group."""
    from mrv2.distributed.parallel_state import tp_size
    from mrv2.model_loader.build import check_shardable, load_hf_config
    from mrv2.plugins import get_plugin_manager

    architecture, overrides = FAMILIES[family]
    model = make_tiny_checkpoint(tmp_path / "m", architecture, **overrides)
    registries = get_plugin_manager().registries
    check_shardable(str(model), load_hf_config(model), registries, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\)"):  # the family's rule
        check_shardable(str(model), load_hf_config(model), registries, 3)
    assert tp_size() == 1


@pytest.mark.parametrize("opts", [dict(bits=4, group_size=16, sym=False),
                                  dict(bits=8, group_size=-1, sym=True),
                                  dict(ct=True, bits=4, group_size=16, sym=False),
                                  dict(moe=32, bits=4, group_size=16, sym=False),
                                  dict(moe=96, bits=4, group_size=32, sym=False),
                                  dict(mxfp4=True)],
                         ids=["gptq4-asym-g16", "gptq8-channel", "compressed-tensors4-asym",
                              "gptq4-moe-experts", "gptq4-moe-experts-padded",
                              "mxfp4-gpt-oss-padded"])
def test_int_checkpoint_tp2_equals_tp1(tmp_path: Path, opts: dict[str, Any]) -> None:
    """Packed integers, scales and zero points split with the weights: rows of
    column-parallel layers, whole groups of row-parallel ones (a single group per output:
    on every rank), for GPTQ's layout and compressed-tensors' (packed the other way). Experts
    whose slice per rank is not whole groups (48 of 96 rows at groups of 32; gpt-oss's MXFP4
    experts, 16 of 32 at 32) are padded to whole groups on each rank."""
    if opts.pop("mxfp4", False):
        arch, tiny = TINY_FAMILIES["gpt-oss"]
        src = make_tiny_checkpoint(tmp_path / "src", arch, std=0.15, **tiny)  # experts matter
        mxfp4_checkpoint(src, tmp_path / "q", tmp_path / "ref")
        assert _tokens(tmp_path / "q", 2) == _tokens(tmp_path / "q", 1)
        return
    if inter := opts.pop("moe", 0):  # experts too: gate / up rows and down's groups per rank
        src = make_tiny_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=inter)
        opts["experts"] = True
    else:
        src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    writer = compressed_tensors_checkpoint if opts.pop("ct", False) else gptq_checkpoint
    writer(src, tmp_path / "q", tmp_path / "ref", **opts)
    assert _tokens(tmp_path / "q", 2) == _tokens(tmp_path / "q", 1)


def test_gptq_desc_act_is_refused_under_tp(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", desc_act=True)
    with pytest.raises(Exception, match=r"desc_act = true \(an activation order\) is not "
                                        r"supported for row-parallel"):
        _tokens(tmp_path / "q", 2)
