"""LlamaForCausalLM against HF transformers: prefill and decode logits through the paged cache."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mrv2.layers.rotary import get_rope, rope_parameters_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import TEST_BLOCK_SIZE, TEST_NUM_BLOCKS, poisoned_caches, redraw_weights, run_step
from mrv2_llama.model import LlamaForCausalLM

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_config(tie: bool, bias: bool = False, rope: dict | None = None) -> Any:
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attention_bias=bias,
        mlp_bias=bias,
        rope_parameters=rope,
    )


def save_hf_model(config: Any, path: Path) -> torch.nn.Module:
    """A random HF model (weights far from their init values) saved to ``path``."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize(
    "tie,bias,rope",
    [(True, False, None), (False, True, None), (False, False, LLAMA3_ROPE)],
    ids=["tied", "untied-bias", "llama3-rope"],
)
def test_matches_hf(tmp_path: Path, tie: bool, bias: bool, rope: dict | None) -> None:
    hf = save_hf_model(tiny_config(tie, bias, rope), tmp_path)
    model = LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    load_model_weights(model, iter_safetensors(tmp_path))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 2, 6)]
    per_req = math.ceil(11 / TEST_BLOCK_SIZE)
    perm = torch.randperm(TEST_NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[i * per_req : (i + 1) * per_req] for i in range(len(prompts))]
    caches = poisoned_caches(num_kv_heads=2, head_dim=16, count=2)

    prefill, _ = run_step(model, caches, tables, [0, 0, 0], prompts, num_pad=3)
    next_tokens = torch.randint(0, 128, (len(prompts),), generator=gen).tolist()
    decode, _ = run_step(model, caches, tables, [len(p) for p in prompts],
                         [[t] for t in next_tokens])
    with torch.no_grad():
        for prompt, token, logits, last in zip(prompts, next_tokens, prefill, decode, strict=True):
            expected = hf(torch.tensor([prompt + [token]])).logits[0]
            torch.testing.assert_close(logits, expected[:-1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(last, expected[-1:], atol=1e-4, rtol=1e-4)


def test_llama3_rope_matches_hf() -> None:
    config = tiny_config(tie=False, rope=LLAMA3_ROPE)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    positions = torch.randperm(128)
    freqs = torch.outer(positions.float(), inv_freq.float())
    cos, sin = torch.cat([freqs, freqs], dim=-1).cos(), torch.cat([freqs, freqs], dim=-1).sin()

    def hf_rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.view(128, -1, 16)
        rotated_half = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
        return (x * cos[:, None] + rotated_half * sin[:, None]).flatten(1)

    q, k = torch.randn(128, 4 * 16), torch.randn(128, 2 * 16)
    q_out, k_out = get_rope(config, head_dim=16)(positions, q, k)
    torch.testing.assert_close(q_out, hf_rotate(q))
    torch.testing.assert_close(k_out, hf_rotate(k))


def test_legacy_rope_attributes() -> None:
    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters_of(legacy) == (5e5, {"type": "linear", "factor": 2.0})
    assert rope_parameters_of(SimpleNamespace(rope_theta=5e5, rope_scaling=None)) == (5e5, None)
    with pytest.raises(NotImplementedError, match="dynamic"):
        get_rope(
            SimpleNamespace(
                rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
                max_position_embeddings=64,
            ),
            head_dim=16,
        )


def test_wrong_gate_shape_names_the_parameter(tmp_path: Path) -> None:
    save_hf_model(tiny_config(tie=True), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(96, 63)
    save_file(tensors, tmp_path / "model.safetensors")
    model = LlamaForCausalLM(tiny_config(tie=True))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.gate_up_proj\.weight.*\(96, 63\)"):
        load_model_weights(model, iter_safetensors(tmp_path))
