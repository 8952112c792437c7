"""DeepSeek-V3's MTP layer as the ``mtp`` speculator's drafter (``mrv2-plugin-mtp``), on the
CPU: greedy output identical with speculation off (also on the emulated CUDA-graph path and
with an FP8 checkpoint whose MTP layer is FP8 too), drafts really made; V2 has no MTP layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
from safetensors.torch import load_file

from mrv2 import LLM, SamplingParams
from mrv2.testing import emulate_cuda_graphs
from mrv2.testing_checkpoints import fp8_checkpoint, make_mtp_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + i % 100 for i in range(21)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 2}
V3: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
    "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 whose checkpoint also holds an MTP layer (HF does not model it: a
    V3 decoder block plus enorm / hnorm / eh_proj / shared_head.norm, named as published)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    return make_mtp_checkpoint(tmp_path_factory.mktemp("dsv3"), "DeepseekV3ForCausalLM",
                               DeepseekV3DecoderLayer, **V3)


def _run(path: Path, spec: dict[str, Any] | None, graphs: bool = False
         ) -> tuple[list[list[int]], LLM]:
    kwargs: dict[str, Any] = {} if spec is None else {"speculative_config": spec}
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=4, **kwargs)
    if graphs:
        emulate_cuda_graphs(llm.engine.runner)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_mtp_greedy_equals_plain(checkpoint: Path, graphs: bool) -> None:
    expected = _run(checkpoint, None)[0]
    got, llm = _run(checkpoint, MTP, graphs)
    assert got == expected
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    if graphs:  # MLA's flat grid (the default): prompts and MTP's verify steps replay too
        mixed = llm.engine.runner.graphs.mixed_graphs
        assert sum(g.graph.replays for g in mixed.values()) > 0  # type: ignore[attr-defined]


def test_mla_request_grid_keeps_prompt_steps_eager(checkpoint: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With the MLA kernel's (query tile, request) grid (``MRV2_MLA_FLAT_GRID=0``) steps with
    prompt tokens run eager (no mixed graphs are captured) and give the same tokens."""
    expected = _run(checkpoint, None)[0]
    monkeypatch.setenv("MRV2_MLA_FLAT_GRID", "0")
    got, llm = _run(checkpoint, MTP, graphs=True)
    assert got == expected
    assert llm.engine.runner.graphs.graphs and not llm.engine.runner.graphs.mixed_graphs


def test_fp8_checkpoint_with_fp8_mtp_layer(checkpoint: Path, tmp_path: Path) -> None:
    fp8_checkpoint(checkpoint, tmp_path / "fp8", tmp_path / "ref", (16, 32))
    assert "model.layers.2.eh_proj.weight_scale_inv" in load_file(tmp_path / "fp8" /
                                                                 "model.safetensors")
    expected = _run(tmp_path / "fp8", None)[0]
    got, llm = _run(tmp_path / "fp8", MTP)
    assert got == expected
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_v2_has_no_mtp_layers(tmp_path: Path) -> None:
    config = transformers.DeepseekV2Config(**{k: v for k, v in V3.items()
                                              if k not in ("n_group", "topk_group")},
                                           topk_method="greedy")
    config.architectures = ["DeepseekV2ForCausalLM"]
    transformers.DeepseekV2ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no MTP layers"):
        LLM(str(tmp_path), device="cpu", dtype="float32", speculative_config=MTP)
