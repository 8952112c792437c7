"""Granite 4.0-H (hybrid Mamba-2 / attention, MoE or dense) and Bamba through the engine
against HF transformers: greedy tokens of several requests at once (HF's full forward per
token: its chunked SSD scan, an independent form of our token-serial recurrence), prompts
split across steps (the SSM and convolution states carried between chunks), preemption (the
request computed again from a zero state), every prompt position's log-probability; NoPE and
RoPE attention; tensor parallelism by whole groups; checkpoint names of both layouts; bad
configs refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers import FusedMoE, GatedMLP, Mamba2Mixer, MoEBlock, SelfAttention
from mrv2.testing import hf_greedy
from mrv2.testing_engine import check_prompt_logprobs
from mrv2_granite_hybrid.model import (
    BambaForCausalLM,
    GraniteMoeHybridForCausalLM,
    block_types_of,
)
from mrv2_granite_hybrid.testing import save_tiny_bamba, save_tiny_granite_hybrid

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(29)]]
MAX_TOKENS = 8
#: name -> (saver, overrides): Granite MoE without RoPE (as published), Granite dense with
#: RoPE and attention biases, Bamba (partial RoPE, biased mixer projections).
VARIANTS: dict[str, tuple[Any, dict[str, Any]]] = {
    "moe-nope": (save_tiny_granite_hybrid, {}),
    "dense-rope": (save_tiny_granite_hybrid, {"num_local_experts": 0,
                                              "position_embedding_type": "rope",
                                              "attention_bias": True}),
    "bamba": (save_tiny_bamba, {}),
    "one-group": (save_tiny_granite_hybrid, {"mamba_n_groups": 1}),
    # HF's zero-width shared MLP (saved as empty tensors) adds nothing: mrv2 builds none
    "moe-no-shared": (save_tiny_granite_hybrid, {"shared_intermediate_size": 0}),
}
Checkpoint = tuple[Path, torch.nn.Module, list[list[int]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for name, (save, overrides) in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        hf = save(path, **overrides)
        out[name] = (path, hf, [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS])
    return out


def _prompt_logprobs_match(llm: LLM, hf: torch.nn.Module) -> None:
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


@pytest.mark.parametrize("variant,kwargs", [
    ("moe-nope", {"max_num_batched_tokens": 8}),
    ("moe-nope", {"num_gpu_blocks_override": 12}),
    ("dense-rope", {"max_num_batched_tokens": 8}),
    ("bamba", {"max_num_batched_tokens": 8}),
    ("moe-no-shared", {}),
], ids=["moe-nope-chunked", "moe-nope-preempt", "dense-rope-chunked", "bamba-chunked",
        "moe-no-shared"])
def test_greedy_and_logprobs_match_hf(checkpoints: dict[str, Checkpoint], variant: str,
                                      kwargs: dict[str, Any]) -> None:
    path, hf, want = checkpoints[variant]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              enable_prefix_caching=True, **kwargs)
    assert llm.engine.prefix_caching is True  # (with snapshots of the state)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
        return
    _prompt_logprobs_match(llm, hf)


def test_prefix_cache_resumes_from_state_snapshots(
        checkpoints: dict[str, Checkpoint]) -> None:
    """Requests resume from snapshots of the mixers' SSM and conv states (the attention's KV
    from the cached blocks beside them), routed experts and NoPE attention: greedy tokens
    equal HF's."""
    from mrv2.testing_engine import check_state_prefix_cache

    check_state_prefix_cache(checkpoints["moe-nope"][0], max_tokens=4)


def test_structure_and_names(checkpoints: dict[str, Checkpoint]) -> None:
    """Layer kinds, KV-cache indices, state shapes and the feed-forward of each variant; the
    published names (``input_linear``, ``router.layer``: what transformers saves) and
    transformers' in-memory names (``experts.gate_up_proj``, ``router.weight``) load every
    parameter alike."""
    from mrv2.model_loader import iter_safetensors, load_model_weights

    path, hf, _ = checkpoints["moe-nope"]
    config = transformers.AutoConfig.from_pretrained(path)
    model = GraniteMoeHybridForCausalLM(config)
    layers = list(model.model.layers)
    assert [layer.kind for layer in layers] == ["linear_attention", "full_attention"] * 2
    mixer = layers[0].mamba
    assert isinstance(mixer, Mamba2Mixer) and layers[0].self_attn is None
    assert isinstance(layers[3].self_attn, SelfAttention)
    assert layers[3].self_attn.attn.layer_idx == 1 and layers[3].self_attn.rotary_emb is None
    assert mixer.request_state_shapes() == {"conv": ((3, 128 + 2 * 2 * 16), None),
                                            "ssm": ((8, 16, 16), torch.float32)}
    assert (mixer.dt_min, mixer.dt_max) == (0.05, 0.6)
    moe = layers[0].block_sparse_moe
    assert isinstance(moe, MoEBlock) and isinstance(moe.experts, FusedMoE)
    assert isinstance(moe.shared_experts, GatedMLP) and layers[0].shared_mlp is None
    every = {n for n, _ in model.named_parameters()}
    names = [n for n, _ in iter_safetensors(path)]
    assert any(".block_sparse_moe.input_linear." in n for n in names)
    assert load_model_weights(model, iter_safetensors(path)) == every
    again = GraniteMoeHybridForCausalLM(config)
    state = hf.state_dict()
    assert any(n.endswith("experts.gate_up_proj") for n in state)
    assert again.load_weights(state.items()) == every
    for (name, mine), theirs in zip(again.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    hf_layer: Any = cast(Any, hf).model.layers[0]
    assert torch.equal(moe.experts.w13_weight, hf_layer.block_sparse_moe.experts.gate_up_proj)
    shared = hf_layer.shared_mlp.input_linear.weight
    assert torch.equal(moe.shared_experts.gate_up_proj.weight, shared)
    assert torch.equal(mixer.conv_weight, hf_layer.mamba.conv1d.weight[:, 0])

    dense = GraniteMoeHybridForCausalLM(
        transformers.AutoConfig.from_pretrained(checkpoints["dense-rope"][0]))
    assert isinstance(dense.model.layers[0].shared_mlp, GatedMLP)
    assert dense.model.layers[0].block_sparse_moe is None
    assert dense.model.layers[1].self_attn.rotary_emb is not None
    bamba_path = checkpoints["bamba"][0]
    bamba = BambaForCausalLM(transformers.AutoConfig.from_pretrained(bamba_path))
    rope = bamba.model.layers[1].self_attn.rotary_emb
    assert rope is not None and rope.rotary_dim == 8  # (half of each 16-dim head)
    every = {n for n, _ in bamba.named_parameters()}
    assert load_model_weights(bamba, iter_safetensors(bamba_path)) == every
    no_shared = GraniteMoeHybridForCausalLM(
        transformers.AutoConfig.from_pretrained(checkpoints["moe-no-shared"][0]))
    assert no_shared.model.layers[0].block_sparse_moe.shared_experts is None


def test_refusals(checkpoints: dict[str, Checkpoint]) -> None:
    path = checkpoints["moe-nope"][0]

    def bad(**fields: Any) -> Any:
        config = transformers.AutoConfig.from_pretrained(path)
        for key, value in fields.items():
            setattr(config, key, value)
        return config

    with pytest.raises(ValueError, match=r"layer_types must list one of .* got \['mlp'\]"):
        GraniteMoeHybridForCausalLM(bad(layer_types=["mamba", "mlp", "mamba", "attention"]))
    with pytest.raises(ValueError, match=r"mamba_n_heads \(6\) must be a multiple of "
                                         r"mamba_n_groups \(4\)"):
        GraniteMoeHybridForCausalLM(bad(mamba_n_heads=6, mamba_n_groups=4))
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        GraniteMoeHybridForCausalLM(bad(hidden_act="relu2"))
    with pytest.raises(ValueError, match="position_embedding_type must be 'rope', 'nope' or "
                                         "None, got 'alibi'"):
        GraniteMoeHybridForCausalLM(bad(position_embedding_type="alibi"))
    with pytest.raises(ValueError, match="time_step_limit must be"):
        GraniteMoeHybridForCausalLM(bad(time_step_limit=(0.5, 0.1)))
    with pytest.raises(ValueError, match="shared_intermediate_size = 0: must be at least 1"):
        GraniteMoeHybridForCausalLM(bad(shared_intermediate_size=0, num_local_experts=0))
    legacy = bad(layer_types=None)
    legacy.layers_block_type = None
    with pytest.raises(ValueError, match="names no layers"):
        block_types_of(legacy, "Granite 4.0-H")


@pytest.mark.parametrize("variant", ["moe-nope", "one-group"])
def test_tensor_parallel_matches_hf(checkpoints: dict[str, Checkpoint], variant: str) -> None:
    """Two ranks (processes on the CPU): each holds four heads of every Mamba-2 mixer and
    one group (``moe-nope``: its own of two; ``one-group``, as the published checkpoints: the
    one group, replicated), the gated norm's statistics all-reduced (Granite norms over all
    channels), half the attention heads, half of every expert's and the shared MLP's
    columns; greedy tokens equal HF's, prompts split across steps."""
    from mrv2.testing_engine import tokens_at_tp

    path, _, want = checkpoints[variant]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for tp, got in tokens_at_tp(path, PROMPTS, params, (2,),
                                max_num_batched_tokens=8).items():
        assert got == want, tp
