"""Nemotron-H (hybrid Mamba-2 / attention / squared-ReLU MLP) through the engine against HF
transformers: greedy tokens of several requests at once (HF's full forward per token: its
chunked SSD scan, an independent form of our token-serial recurrence), prompts split across
steps (the SSM and convolution states carried between chunks), preemption (the request
computed again from a zero state), every prompt position's log-probability; prefix caching
turned off; checkpoint names of both layouts; MoE and bad configs refused by name."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy
from mrv2.testing_engine import check_prompt_logprobs, check_state_prefix_cache
from mrv2_nemotron_h.model import (
    Mamba2Mixer,
    NemotronHAttention,
    NemotronHForCausalLM,
    NemotronHMLP,
    block_types_of,
)
from mrv2_nemotron_h.testing import save_tiny_nemotron_h

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(29)]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module,
                                                                 list[list[int]]]:
    path = tmp_path_factory.mktemp("nemotron_h")
    hf = save_tiny_nemotron_h(path)
    return path, hf, [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("kwargs", [{"max_num_batched_tokens": 8},
                                    {"num_gpu_blocks_override": 12},
                                    {"max_num_batched_tokens": 8, "triton": True}],
                         ids=["chunked", "preempt", "chunked-triton"])
def test_greedy_and_logprobs_match_hf(checkpoint: tuple[Path, Any, list[list[int]]],
                                      kwargs: dict[str, Any],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``triton``: the mixers' conv and delta-free rule on their Triton kernels (interpreted on
    the CPU; the other ops stay on torch; one round, for time)."""
    path, hf, want = checkpoint
    triton = kwargs.pop("triton", False)
    if triton:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
        from mrv2_kernels import linear_attention

        monkeypatch.setattr(linear_attention, "use_triton", lambda t: True)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              enable_prefix_caching=True, **kwargs)
    assert llm.engine.prefix_caching is True  # (with snapshots of the state)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    if triton:
        return
    if "num_gpu_blocks_override" in kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    # a second round on the rows the first one left (each request starts from a zero state)
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[::-1]], params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want[::-1]

    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


#: The prefix-cache test's mixers: 2 heads in one group (heads per group still 2), so the
#: interpreted kernels launch half the programs a step: one per head (the delta rule's grid is
#: ``(N + 1, heads, 1)``) and one 64-channel block of the conv's 48 channels (16 + 2 x 16,
#: where the module's 96 take two).
SNAPSHOT_MIXERS = {"mamba_num_heads": 2, "n_groups": 1}


@pytest.fixture(scope="module")
def snapshot_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("nemotron_h_snapshots")
    save_tiny_nemotron_h(path, **SNAPSHOT_MIXERS)
    return path


@pytest.mark.parametrize("triton", [False, True], ids=["ref", "triton"])
def test_prefix_cache_resumes_from_state_snapshots(
        snapshot_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, triton: bool) -> None:
    """Requests resume from snapshots of the SSM and conv states
    through the reference ops and through the Triton kernels (interpreted), on
    :data:`SNAPSHOT_MIXERS`' narrower mixers (the same layers and snapshot paths)."""
    if triton:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
        from mrv2_kernels import linear_attention

        monkeypatch.setattr(linear_attention, "use_triton", lambda t: True)
        from mrv2_kernels import chunk_delta_rule  # (prompt chunks of 4+ tokens: chunked)

        monkeypatch.setattr(chunk_delta_rule, "_use_triton", lambda t: True)
        monkeypatch.setattr(chunk_delta_rule, "CHUNKED_MIN_QUERY_LEN", 4)
    check_state_prefix_cache(snapshot_checkpoint, max_tokens=4)


def test_structure_and_names(checkpoint: tuple[Path, Any, list[list[int]]]) -> None:
    """Layer kinds, KV-cache indices and state shapes; the published ``backbone.*`` names (what
    transformers saves) and transformers' in-memory ``model.*`` names load every parameter."""
    path, hf, _ = checkpoint
    config = transformers.AutoConfig.from_pretrained(path)
    model = NemotronHForCausalLM(config)
    mixers = [layer.mixer for layer in model.model.layers]
    assert [type(m) for m in mixers] == [Mamba2Mixer, NemotronHMLP, NemotronHAttention,
                                         Mamba2Mixer, NemotronHMLP]
    assert mixers[2].attn.layer_idx == 0  # (the only KV cache layer)
    assert mixers[0].request_state_shapes() == {"conv": ((3, 32 + 2 * 2 * 16), None),
                                                "ssm": ((4, 16, 8), torch.float32)}

    from mrv2.model_loader import iter_safetensors, load_model_weights
    names = [n for n, _ in iter_safetensors(path)]
    assert any(n.startswith("backbone.") for n in names)
    every = {n for n, _ in model.named_parameters()}
    assert load_model_weights(model, iter_safetensors(path)) == every
    again = NemotronHForCausalLM(config)
    assert again.load_weights(hf.state_dict().items()) == every  # (model.* names)
    for (name, mine), theirs in zip(again.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    assert torch.equal(model.model.layers[0].mixer.conv_weight,
                       hf.model.layers[0].mixer.conv1d.weight[:, 0])
    mtp = [("mtp.layers.0.norm.weight", torch.randn(64)), ("backbone.norm_f.weight",
                                                           torch.randn(64))]
    assert model.load_weights(mtp) == {"model.norm.weight"}


def test_refusals(checkpoint: tuple[Path, Any, list[list[int]]]) -> None:
    path, _, _ = checkpoint
    config = transformers.AutoConfig.from_pretrained(path)
    bad = transformers.AutoConfig.from_pretrained(path)
    bad.layers_block_type = ["linear_attention", "moe", "full_attention", "mlp", "moe"]
    with pytest.raises(ValueError, match=r"layers \[1, 4\] are 'moe' layers; their routed "
                                         r"experts are non-gated relu2 MLPs"):
        NemotronHForCausalLM(bad)
    bad = transformers.AutoConfig.from_pretrained(path)
    bad.mamba_num_heads = 3
    with pytest.raises(ValueError, match=r"mamba_num_heads \(3\) must be a multiple of "
                                         r"n_groups \(2\)"):
        NemotronHForCausalLM(bad)
    bad = transformers.AutoConfig.from_pretrained(path)
    bad.mlp_hidden_act = "quick_gelu"
    with pytest.raises(ValueError, match="mlp_hidden_act must be one of"):
        NemotronHForCausalLM(bad)
    assert config.layers_block_type[0] == "linear_attention"
    pattern = SimpleNamespace(layers_block_type=None, hybrid_override_pattern="M-*M")
    assert block_types_of(pattern) == ["linear_attention", "mlp", "full_attention",
                                       "linear_attention"]
    legacy = SimpleNamespace(layers_block_type=["mamba", "attention", "mlp"])
    assert block_types_of(legacy) == ["linear_attention", "full_attention", "mlp"]
    with pytest.raises(ValueError, match=r"layers \[1\] are 'moe' layers"):
        block_types_of(SimpleNamespace(layers_block_type=None, hybrid_override_pattern="ME*"))
    with pytest.raises(ValueError, match=r"must list one of .* got \['sliding_attention'\]"):
        block_types_of(SimpleNamespace(layers_block_type=["mlp", "sliding_attention"]))


def test_tensor_parallel_matches_hf(checkpoint: tuple[Path, Any, list[list[int]]]) -> None:
    """Two ranks (processes on the CPU): each holds one group (two heads) of every Mamba-2
    mixer (its rows of ``in_proj``, conv channels, decays, norm and states), half the attention
    heads and MLP columns; greedy tokens equal HF's, prompts split across steps."""
    from mrv2.testing_engine import tokens_at_tp

    path, _, want = checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for tp, got in tokens_at_tp(path, PROMPTS, params, (2,),
                                max_num_batched_tokens=8).items():
        assert got == want, tp
