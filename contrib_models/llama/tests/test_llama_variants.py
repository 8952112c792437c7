"""Arcee AFM, Jais 2, Apertus, Helium, Ministral 8B, Ministral 3 (text-only) and nanochat against
HF transformers on tiny random checkpoints: greedy tokens through the engine (prompts split over
steps of 8 tokens, block size 4) and every prompt position's log-probability.

Each case sets what makes the family differ from Llama apart: Arcee's squared-ReLU dense MLP
(YaRN RoPE, biased projections); Jais 2's biased LayerNorms around the same layers; Apertus'
xIELU with each layer's own ``alpha_p`` / ``alpha_n`` / ``beta`` (the checkpoint's, away from
HF's init values), per-head q/k norms, Llama 3 RoPE; Helium's interleaved RoPE (its q/k rows
reordered as they load, q/k/v biased, the output projection not); Ministral's sliding layers (a
window of 5, shorter than the prompts) beside full ones; Ministral 3's queries scaled by
position past ``original_max_position_embeddings`` (8, within the prompts) with YaRN; nanochat's
weightless norms (the embeddings normed too), reversed RoPE, squared-ReLU ``fc1`` / ``fc2`` MLP,
biased attention and soft-capped logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint
from mrv2.testing_engine import check_prompt_logprobs

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11, 60, 2], [3 + i for i in range(11)], [64]]
#: YaRN (its attention factor from ``factor``: Arcee's; Ministral 3's sets mscale to cancel it)
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
SLIDING, FULL = "sliding_attention", "full_attention"
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "arcee": ("ArceeForCausalLM", {"hidden_act": "relu2", "attention_bias": True,
                                   "mlp_bias": True, "rope_parameters": YARN}),
    "jais2": ("Jais2ForCausalLM", {"hidden_act": "relu2", "attention_bias": True,
                                   "mlp_bias": True, "layer_norm_eps": 1e-4}),
    "apertus": ("ApertusForCausalLM", {"hidden_act": "xielu", "rope_parameters": LLAMA3}),
    "helium": ("HeliumForCausalLM", {"head_dim": 16, "attention_bias": True}),
    "ministral": ("MinistralForCausalLM", {"head_dim": 16, "num_hidden_layers": 3,
                                           "sliding_window": 5,
                                           "layer_types": [SLIDING, FULL, SLIDING]}),
    "nanochat": ("NanoChatForCausalLM", {"head_dim": 16, "attention_bias": True,
                                         "final_logit_softcapping": 3.0}),
    "ministral3": ("Ministral3ForCausalLM", {
        "head_dim": 16, "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0,
                                            "llama_4_scaling_beta": 0.5}}),
}


def _checkpoint(path: Path, case: str) -> Path:
    architecture, overrides = CASES[case]
    path = make_tiny_checkpoint(path, architecture, std=0.15, pad_token_id=0, **overrides)
    if case == "apertus":  # each layer its own xIELU, far from HF's init (and beta from 0.5)
        file = path / "model.safetensors"
        tensors = load_file(file)
        for i, (p, n, beta) in enumerate([(1.2, -0.4, 0.3), (-0.6, 0.9, 0.8)]):
            prefix = f"model.layers.{i}.mlp.act_fn."
            tensors[prefix + "alpha_p"] = torch.tensor([p])
            tensors[prefix + "alpha_n"] = torch.tensor([n])
            tensors[prefix + "beta"] = torch.tensor(beta)
        save_file(tensors, file)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_and_prompt_logprobs_match_hf(tmp_path: Path, case: str) -> None:
    path = _checkpoint(tmp_path / "m", case)
    want = [hf_greedy(path, p, 8) for p in PROMPTS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             max_num_batched_tokens=8) as llm:
        layers = llm.engine.runner.model.model.layers
        if case == "ministral":
            assert [layer.self_attn.attn.sliding_window for layer in layers] == [5, None, 5]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
        check_prompt_logprobs(llm, {"prompt_token_ids": PROMPTS[0]}, PROMPTS[0], logits)
