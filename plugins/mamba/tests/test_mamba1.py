"""Mamba-1 mixers through the engine against HF transformers: state-spaces Mamba and
FalconMamba (state-space layers only: no KV cache layer) and Jamba (Mamba-1 layers, an
attention layer, MoE layers). Greedy tokens of several requests at once equal HF's (its full
forward per token), with prompts split across steps (a chunk continuing the conv and SSM
states) and decode steps; every prompt position's log-probability equals HF's logits'; one
round runs the conv and the selective scan on their Triton kernels (interpreted), one at two
tensor-parallel ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.contract.kv_cache import layer_specs
from mrv2.testing import emulate_cuda_graphs, hf_greedy
from mrv2.testing_engine import (
    check_prompt_logprobs,
    check_state_prefix_cache,
    check_state_speculation,
    tokens_at_tp,
)
from mrv2_mamba.testing import save_tiny_mamba1

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(21)]]
MAX_TOKENS = 6
ENGINE: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                          "max_model_len": 256, "max_num_batched_tokens": 8}
#: name -> (HF family, overrides): Mamba with biased projections and an untied head;
#: FalconMamba with its weightless dt / B / C norms, no biases, tied embeddings; Jamba.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba": ("Mamba", {}),
    "falcon-mamba": ("FalconMamba", {"use_bias": False, "tie_word_embeddings": True,
                                     "mixer_rms_eps": 1e-6}),
    "jamba": ("Jamba", {}),
}
Checkpoint = tuple[Path, torch.nn.Module, list[list[int]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for name, (family, overrides) in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        hf = save_tiny_mamba1(path, family, **overrides)
        out[name] = (path, hf, [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS])
    return out


@pytest.mark.parametrize("variant,mode", [
    ("mamba", ""), ("falcon-mamba", ""), ("jamba", ""), ("falcon-mamba", "triton"),
    ("jamba", "tp2"), ("jamba", "graphs"),
], ids=["mamba", "falcon-mamba", "jamba", "falcon-mamba-triton", "jamba-tp2", "jamba-graphs"])
def test_greedy_and_logprobs_match_hf(checkpoints: dict[str, Checkpoint], variant: str,
                                      mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of at most 8 tokens: the 21-token prompt takes three steps (each continuing
    from the state rows), then decode steps; the Jamba layers' kinds as HF's. ``triton``: the
    conv and the selective scan on their Triton kernels (interpreted); ``tp2``: two ranks
    (processes on the CPU), each with half of every mixer's channels (``x_proj`` and
    ``out_proj`` all-reduced), half the attention heads and the experts' columns; ``graphs``:
    the CUDA-graph step path emulated on the CPU (padded decode and mixed steps, padding
    requests on stale state rows)."""
    path, hf, want = checkpoints[variant]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    if mode == "tp2":
        kwargs = {k: v for k, v in ENGINE.items() if k != "device"}
        assert tokens_at_tp(path, PROMPTS, params, (2,), **kwargs) == {2: want}
        return
    if mode == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")
        from mrv2_kernels import linear_attention, selective_scan

        monkeypatch.setattr(linear_attention, "use_triton", lambda t: True)
        monkeypatch.setattr(selective_scan, "use_triton", lambda t: True)
    llm = LLM(str(path), enable_prefix_caching=True, **ENGINE)
    runner = llm.engine.runner
    if mode == "graphs":
        emulate_cuda_graphs(runner)
        assert runner.graphs is not None
    assert runner.keeps_request_state
    model = runner.model
    if variant == "jamba":
        assert model.layer_kinds == ["mamba", "attention", "mamba", "mamba"]
        assert len(layer_specs(model)) == 1  # (one attention layer's KV cache)
        assert [type(layer.feed_forward).__name__ for layer in model.model.layers] == [
            "GatedMLP", "MoEBlock", "GatedMLP", "MoEBlock"]
    else:
        assert runner.kv.specs == {}
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    if mode:
        return
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


@pytest.mark.parametrize("variant", ["falcon-mamba", "jamba"])
def test_dummy_weights_load(checkpoints: dict[str, Checkpoint], variant: str) -> None:
    """``load_format="dummy"`` (benchmarks): every parameter drawn, tokens generated."""
    path = checkpoints[variant][0]
    llm = LLM(str(path), load_format="dummy", **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("variant,check", [("mamba", "prefix-cache"), ("jamba", "prefix-cache"),
                                           ("falcon-mamba", "speculation")])
def test_state_snapshots_and_speculation(checkpoints: dict[str, Checkpoint], variant: str,
                                         check: str) -> None:
    """Requests resume from snapshots of the SSM and conv states (Jamba: beside its attention
    layer's cached blocks); n-gram drafts verified through the Mamba-1 mixers leave no trace
    of rejected tokens in the states (greedy tokens equal HF's)."""
    path = checkpoints[variant][0]
    if check == "prefix-cache":
        check_state_prefix_cache(path, max_tokens=4, max_model_len=256)
    else:
        check_state_speculation(path, max_model_len=256)
