"""MiniMaxForCausalLM (MiniMax-Text-01 / M1: lightning attention + softmax attention, a MoE in
every layer, DeepNorm-style residual factors) through the engine against HF transformers:
greedy tokens of several requests at once (HF's prefill runs its blocked lightning attention,
its decode the token-serial one), every prompt position's log-probability, prompts split
across steps (the recurrent state carried between chunks), the checkpoint names of
transformers 5 (stacked experts) and the original configs' field names, prefix caching through
state snapshots, n-gram speculation, two tensor-parallel ranks, dummy weights."""

from __future__ import annotations

import copy
import json
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2 import LLM, SamplingParams
from mrv2.plugins import get_plugin_manager
from mrv2.testing import hf_greedy
from mrv2.testing_engine import (
    check_prompt_logprobs,
    check_state_prefix_cache,
    check_state_speculation,
    tokens_at_tp,
)
from mrv2_minimax.testing import save_tiny_minimax
from mrv2_minimax.text01 import MiniMaxForCausalLM

#: The last prompt runs the chunked form of the recurrence when whole (32 tokens or more).
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(37)]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True)
def _registered() -> None:
    """The plugin's registration where it is not installed (its entry point then loads it)."""
    manager = get_plugin_manager()
    if not manager.pm.has_plugin("minimax"):
        import mrv2_minimax.plugin

        manager.register(mrv2_minimax.plugin, name="minimax")


def _stacked_experts(path: Path) -> None:
    """Rewrite the checkpoint with transformers 5's names: ``mlp.gate``, the experts stacked
    as ``mlp.experts.gate_up_proj`` ``[E, 2 I, H]`` and ``down_proj`` ``[E, H, I]``."""
    tensors = load_file(path / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        if ".block_sparse_moe.experts." in name:
            prefix, rest = name.split(".block_sparse_moe.experts.")
            e, w, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(int(e), {})[w] = tensor
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for prefix, per in experts.items():
        order = sorted(per)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["w1"], per[e]["w3"]]) for e in order])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([per[e]["w2"] for e in order])
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})


def _original_config(path: Path) -> None:
    """Rewrite config.json with the original remote-code fields: ``attn_type_list`` (no
    ``layer_types``), ``layernorm_*_alpha / beta``, ``rotary_dim`` equal to the head size,
    ``postnorm``, ``rope_theta`` on its own, the model type ``minimax_text_01`` (unknown to
    transformers: the engine reads it as a plain config) and the architecture
    ``MiniMaxText01ForCausalLM``."""
    config = json.loads((path / "config.json").read_text())
    config["attn_type_list"] = [int(t == "full_attention") for t in config.pop("layer_types")]
    for hf, original in (("full_attn", "full_attention"), ("linear_attn", "linear_attention"),
                         ("mlp", "mlp")):
        for which in ("alpha", "beta"):
            config[f"layernorm_{original}_{which}"] = config.pop(f"{hf}_{which}_factor")
    config.update(rotary_dim=config["head_dim"], postnorm=True, model_type="minimax_text_01",
                  architectures=["MiniMaxText01ForCausalLM"], rope_theta=config.pop(
                      "rope_parameters")["rope_theta"])
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("mode", ["plain", "chunked_stacked", "original_config", "prefix_cache",
                                  "speculation", "tensor_parallel", "dummy"])
def test_greedy_and_logprobs_match_hf(tmp_path: Path, mode: str) -> None:
    """HF's greedy tokens (whole prompts, and in chunks of 8 from transformers 5's stacked
    expert tensors, and from the original config's field names) and prompt log-probabilities;
    with prefix caching, requests resuming from state snapshots; with n-gram speculation,
    rejected drafts leaving no trace in the lightning states; over two ranks (CPU
    processes: each holds two lightning heads, their decays and states, half the output norm,
    which all-reduces its mean square), which needs the plugin installed; dummy weights run,
    and configs this model does not run (``postnorm=False``, a sliding window, a shared
    expert) are refused by name."""
    if mode == "tensor_parallel" and not any(
            ep.name == "minimax" for ep in metadata.entry_points(group="mrv2")):
        pytest.skip("tensor parallel workers load plugins from entry points: install "
                    "plugins/minimax (scripts/setup.sh)")
    hf = save_tiny_minimax(tmp_path)
    if mode == "prefix_cache":
        check_state_prefix_cache(tmp_path)
        return
    if mode == "speculation":
        check_state_speculation(tmp_path, enable_prefix_caching=True)
        return
    if mode == "dummy":
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
                  load_format="dummy")
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == MAX_TOKENS
        config = transformers.AutoConfig.from_pretrained(tmp_path)
        for field, value, match in (("postnorm", False, "postnorm=False"),
                                    ("sliding_window", 16, "sliding_window"),
                                    ("shared_intermediate_size", 8, "shared expert")):
            bad = copy.deepcopy(config)
            setattr(bad, field, value)
            with pytest.raises(ValueError, match=match):
                MiniMaxForCausalLM(bad)
        return
    want = [hf_greedy(tmp_path, p, MAX_TOKENS) for p in PROMPTS]
    if mode == "tensor_parallel":
        got = tokens_at_tp(tmp_path, PROMPTS, GREEDY, (2,), max_num_batched_tokens=8)
        assert got[2] == want
        return
    kwargs: dict[str, Any] = {}
    if mode == "chunked_stacked":
        _stacked_experts(tmp_path)
        kwargs["max_num_batched_tokens"] = 8
    elif mode == "original_config":
        _original_config(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)
