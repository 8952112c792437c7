"""Kimi-Linear (Kimi Delta Attention + MLA without RoPE + MoE) through the engine against HF
transformers: greedy tokens of several requests at once (HF's full forward per token: its
chunked KDA, an independent form of our token-serial one), prompts split across steps (the
conv and recurrent states carried between chunks, the latent KV cache read back), every
prompt position's log-probability; prefix caching through state snapshots and n-gram
speculation; the layers, the names loaded, dummy weights."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers import MoEBlock
from mrv2.layers.mla import MLAAttention
from mrv2.plugins import get_plugin_manager
from mrv2.testing import hf_greedy
from mrv2.testing_engine import (
    check_prompt_logprobs,
    check_state_prefix_cache,
    check_state_speculation,
    tokens_at_tp,
)
from mrv2_kimi.model import KimiDeltaAttention, KimiLinearForCausalLM
from mrv2_kimi.testing import save_tiny_kimi_linear

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(23)]]


@pytest.fixture(autouse=True)
def _registered() -> None:
    """The plugin's registration where it is not installed (its entry point then loads it)."""
    manager = get_plugin_manager()
    if not manager.pm.has_plugin("kimi"):
        import mrv2_kimi.plugin

        manager.register(mrv2_kimi.plugin, name="kimi")


@pytest.mark.parametrize("mode", ["plain", "chunked", "prefix_cache", "speculation",
                                  "tensor_parallel", "plain_chunked_kda",
                                  "prefix_cache_chunked_kda"])
def test_greedy_and_logprobs_match_hf(tmp_path: Path, mode: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's greedy tokens and prompt log-probabilities, whole prompts or in chunks of 8; with
    prefix caching, requests resuming from state snapshots; with n-gram speculation, rejected
    drafts leaving no trace in the KDA states; over two ranks (CPU processes: each holds one
    KDA head, its conv channels, decays and states, half the MLA heads and of each expert),
    which needs the plugin installed (its entry point: the workers load plugins from there).
    ``*_chunked_kda``: every query of 4 tokens or more through the chunked delta rule's
    per-channel form (its snapshots and resumed rows with prefix caching)."""
    chunked_calls: list[int] = []
    kda = mode.endswith("_chunked_kda")
    if kda:
        from mrv2_kernels import chunk_delta_rule

        chunked = chunk_delta_rule.chunk_gated_delta_rule

        def spy(*args: Any, **kw: Any) -> torch.Tensor:
            chunked_calls.append(args[3].dim())  # g: [T, H, K]
            return chunked(*args, **kw)

        monkeypatch.setattr(chunk_delta_rule, "CHUNKED_MIN_QUERY_LEN_DELTA", 4)
        monkeypatch.setenv(chunk_delta_rule.CHUNKED_ENV_VAR, "1")
        monkeypatch.setattr(chunk_delta_rule, "chunk_gated_delta_rule", spy)
        mode = mode.removesuffix("_chunked_kda")
    if mode == "tensor_parallel" and not any(
            ep.name == "kimi" for ep in metadata.entry_points(group="mrv2")):
        pytest.skip("tensor parallel workers load plugins from entry points: install "
                    "plugins/kimi (scripts/setup.sh)")
    hf = save_tiny_kimi_linear(tmp_path)
    if mode == "prefix_cache":
        check_state_prefix_cache(tmp_path)
        assert not kda or chunked_calls and set(chunked_calls) == {3}
        return
    if mode == "speculation":
        check_state_speculation(tmp_path, enable_prefix_caching=True)
        return
    kwargs: dict[str, Any] = {"max_num_batched_tokens": 8} if mode == "chunked" else {}
    if mode == "tensor_parallel":
        want = [hf_greedy(tmp_path, p, 6) for p in PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = tokens_at_tp(tmp_path, PROMPTS, params, (2,), max_num_batched_tokens=8)
        assert got[2] == want
        return
    want = [hf_greedy(tmp_path, p, 8) for p in PROMPTS]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)
    assert not kda or chunked_calls and set(chunked_calls) == {3}


def test_structure_names_and_dummy_weights(tmp_path: Path) -> None:
    save_tiny_kimi_linear(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = KimiLinearForCausalLM(config)
    layers = model.model.layers
    assert [type(layer.self_attn) for layer in layers] == [
        KimiDeltaAttention, KimiDeltaAttention, MLAAttention, KimiDeltaAttention]
    assert layers[2].self_attn.layer_idx == 0 and layers[2].self_attn.rotary_emb is None
    assert type(layers[0].mlp).__name__ == "GatedMLP" and isinstance(layers[1].mlp, MoEBlock)
    assert layers[0].self_attn.request_state_shapes() == {
        "conv": ((3, 3 * 32), None), "recurrent": ((2, 16, 16), torch.float32)}

    from mrv2.model_loader import iter_safetensors, load_model_weights
    loaded = load_model_weights(model, iter_safetensors(tmp_path))
    assert loaded == {n for n, _ in model.named_parameters()}

    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, load_format="dummy")
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3

    bad = transformers.AutoConfig.from_pretrained(tmp_path)
    bad.layer_types = ["linear_attention", "sliding_attention", "full_attention",
                       "linear_attention"]
    with pytest.raises(ValueError, match=r"layer_types must list one of"):
        KimiLinearForCausalLM(bad)
