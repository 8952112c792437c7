"""Granite 3.x MoE (``GraniteMoeForCausalLM``, ``GraniteMoeSharedForCausalLM``) through the
engine against HF transformers: greedy tokens of several requests at once, prompts split
across steps, every prompt position's log-probability; the checkpoint's published names
(``input_linear`` / ``output_linear`` / ``router.layer``, the shared MLP's fused
``input_linear``) and transformers' in-memory ones map onto the core's fused MoE weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers import FusedMoE, GatedMLP, MoEBlock, SoftmaxTopKRouter
from mrv2.testing import hf_greedy
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_granite_hybrid.granite_moe import GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM
from mrv2_granite_hybrid.testing import save_tiny_granite_moe

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(29)]]
MAX_TOKENS = 8
#: name -> (architecture, overrides): GraniteMoe with tied embeddings (as granite-3.x
#: 1b-a400m / 3b-a800m); GraniteMoeShared with its shared expert, an untied LM head and
#: attention biases; GraniteMoeShared with ``shared_intermediate_size`` 0 (no shared MLP);
#: GraniteMoeSWA with windows shorter than the prompts (local and global layers), sinks far
#: from HF's zeros and a RoPE base per layer (one NoPE), without and with a shared expert.
SWA: dict[str, Any] = {"layer_types": ["sliding_attention", "full_attention",
                                       "sliding_attention"],
                       "sliding_window": 5, "layer_rope_theta": [10000.0, 0, 500.0]}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "moe": ("GraniteMoeForCausalLM", {}),
    "shared": ("GraniteMoeSharedForCausalLM",
               {"tie_word_embeddings": False, "attention_bias": True}),
    "shared-zero": ("GraniteMoeSharedForCausalLM", {"shared_intermediate_size": 0}),
    "swa": ("GraniteMoeSWAForCausalLM", SWA),
    "swa-shared": ("GraniteMoeSWAForCausalLM",
                   {**SWA, "sliding_window": 3, "shared_intermediate_size": 80,
                    "tie_word_embeddings": False}),
}
Checkpoint = tuple[Path, torch.nn.Module]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for name, (arch, overrides) in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, save_tiny_granite_moe(path, shared="Shared" in arch,
                                                 swa="SWA" in arch, **overrides))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_and_prompt_logprobs_match_hf(checkpoints: dict[str, Checkpoint],
                                             variant: str) -> None:
    path, hf = checkpoints[variant]
    want = [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    arch = type(llm.engine.runner.model).__name__
    assert arch == VARIANTS[variant][0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


def test_structure_and_checkpoint_names(checkpoints: dict[str, Checkpoint]) -> None:
    """Every layer attention with RoPE and Granite's scale, its MoE block on the core's
    fused experts (a shared expert only for ``GraniteMoeShared`` of nonzero width); the
    published names (what transformers saves) and the in-memory ones load every parameter
    alike, each expert's gate rows then up rows as the fused ``w13``."""
    from mrv2.model_loader import iter_safetensors, load_model_weights

    for variant, cls in (("moe", GraniteMoeForCausalLM),
                         ("shared", GraniteMoeSharedForCausalLM),
                         ("shared-zero", GraniteMoeSharedForCausalLM)):
        path, hf = checkpoints[variant]
        config = transformers.AutoConfig.from_pretrained(path)
        model = cls(config)
        assert model.block_types == ["full_attention"] * 3
        for i, layer in enumerate(model.model.layers):
            assert layer.mamba is None and layer.self_attn is not None
            assert layer.self_attn.attn.layer_idx == i
            assert layer.self_attn.rotary_emb is not None
            assert layer.self_attn.attn.scale == pytest.approx(0.2)
            moe = layer.block_sparse_moe
            assert isinstance(moe, MoEBlock) and isinstance(moe.experts, FusedMoE)
            assert isinstance(moe.gate, SoftmaxTopKRouter) and moe.gate.renormalize
            assert moe.gate.top_k == 2 and layer.shared_mlp is None
            assert isinstance(moe.shared_experts, GatedMLP) == (variant == "shared")
        every = {n for n, _ in model.named_parameters()}
        names = [n for n, _ in iter_safetensors(path)]
        for published in (".block_sparse_moe.input_linear.weight",
                          ".block_sparse_moe.output_linear.weight",
                          ".block_sparse_moe.router.layer.weight"):
            assert any(n.endswith(published) for n in names), published
        assert any(".shared_mlp.input_linear." in n for n in names) == (variant == "shared")
        assert load_model_weights(model, iter_safetensors(path)) == every
        again = cls(config)
        state = hf.state_dict()
        assert any(n.endswith("experts.gate_up_proj") for n in state)
        assert again.load_weights(state.items()) == every
        for (name, mine), theirs in zip(again.named_parameters(), model.parameters(),
                                        strict=True):
            assert torch.equal(mine, theirs), name
        hf_layer: Any = cast(Any, hf).model.layers[1]
        moe = model.model.layers[1].block_sparse_moe
        assert torch.equal(moe.experts.w13_weight, hf_layer.block_sparse_moe.experts.gate_up_proj)
        assert torch.equal(moe.experts.w2_weight, hf_layer.block_sparse_moe.experts.down_proj)
        assert torch.equal(moe.gate.weight, hf_layer.block_sparse_moe.router.weight)
        if variant == "shared":
            fused = hf_layer.shared_mlp.input_linear.weight  # [2S, H]: gate rows, up rows
            assert torch.equal(moe.shared_experts.gate_up_proj.weight, fused)
            assert torch.equal(moe.shared_experts.down_proj.weight,
                               hf_layer.shared_mlp.output_linear.weight)


def test_tensor_parallel_matches_hf(checkpoints: dict[str, Checkpoint]) -> None:
    """Two ranks (processes on the CPU): half the attention heads, half of every expert's and
    the shared MLP's columns; greedy tokens equal HF's, prompts split across steps."""
    from mrv2.testing_engine import tokens_at_tp

    path, _ = checkpoints["shared"]
    want = [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for tp, got in tokens_at_tp(path, PROMPTS, params, (2,),
                                max_num_batched_tokens=8).items():
        assert got == want, tp


def test_refusals(checkpoints: dict[str, Checkpoint]) -> None:
    """Configs the layers cannot run are refused naming the field (and the family)."""
    config = transformers.AutoConfig.from_pretrained(checkpoints["moe"][0])
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="Granite MoE: hidden_act must be 'silu'"):
        GraniteMoeForCausalLM(config)
    config = transformers.AutoConfig.from_pretrained(checkpoints["shared"][0])
    config.num_experts_per_tok = 5
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4\]"):
        GraniteMoeSharedForCausalLM(config)
