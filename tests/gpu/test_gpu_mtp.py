"""GPU: MTP speculation (GLM-4.x's, DeepSeek-V3's, and DeepSeek-V3.2's / GLM-5's sparse-attention
MTP layers drafting) with its drafting in CUDA graphs.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint
from mrv2.testing_checkpoints import append_mtp_layer, make_mtp_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64],
           [3, 1, 4, 1, 5]]
GLM: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 64,
    "partial_rotary_factor": 0.5, "attention_bias": True, "num_nextn_predict_layers": 1,
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GLM-4.x with an MTP layer saved under GLM-4.5's names (random weights)."""
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("glm"), "Glm4MoeForCausalLM", **GLM)
    config = transformers.AutoConfig.from_pretrained(path)
    append_mtp_layer(path, Glm4MoeDecoderLayer(config, config.num_hidden_layers))
    return path

DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 256, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 (MLA, noaux_tc MoE) with an MTP layer under the published names."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    return make_mtp_checkpoint(tmp_path_factory.mktemp("dsv3"), "DeepseekV3ForCausalLM",
                               DeepseekV3DecoderLayer, **DEEPSEEK_V3)


DSA: dict[str, Any] = {
    **DEEPSEEK_V3, "hidden_size": 256, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": 96, "kv_lora_rank": 128, "qk_rope_head_dim": 64, "n_group": 2,
    "topk_group": 1, "index_topk": 16, "index_n_heads": 16, "index_head_dim": 128,
}
#: ``{family: (architecture, HF module, extra config fields)}``: the sparse-attention families.
DSA_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deepseek-v32": ("DeepseekV32ForCausalLM", "deepseek_v32.modeling_deepseek_v32", {}),
    "glm-moe-dsa": ("GlmMoeDsaForCausalLM", "glm_moe_dsa.modeling_glm_moe_dsa",
                    {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]}),
}


def _dsa_checkpoint(path: Path, family: str) -> Path:
    """A tiny DeepSeek-V3.2 / GLM-5 whose MTP layer is HF's decoder layer of index
    ``num_hidden_layers`` (the MoE, an indexer of its own), under the published names."""
    import copy
    import importlib

    arch, module, fields = DSA_CASES[family]
    layer_cls = getattr(importlib.import_module(f"transformers.models.{module}"),
                        arch.replace("ForCausalLM", "DecoderLayer"))

    def mtp_block(config: Any, index: int) -> Any:
        config = copy.deepcopy(config)
        config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
        if getattr(config, "indexer_types", None) is not None:
            config.indexer_types = [*config.indexer_types, "full"]
        return layer_cls(config, index)

    return make_mtp_checkpoint(path, arch, mtp_block, **{**DSA, **fields})


def _greedy(ckpt: Path, **kwargs: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(ckpt), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("family", ["glm", "deepseek", *DSA_CASES])
def test_mtp_greedy_equals_plain_with_drafting_graphs(
        family: str, request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    if family in DSA_CASES:  # the MTP layer's indexer selects 16 of up to ~60 tokens
        ckpt = _dsa_checkpoint(tmp_path_factory.mktemp(family), family)
    else:
        ckpt = request.getfixturevalue("ckpt" if family == "glm" else "deepseek")
    plain = _greedy(ckpt)[0]
    got, llm = _greedy(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert got == plain
    graphs = llm.engine.runner.graphs
    assert graphs is not None and (3, 8) in graphs.draft_graphs
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
