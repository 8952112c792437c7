"""Proportional RoPE (Gemma 4's global layers) against transformers: the inverse frequencies
of ``_compute_proportional_rope_parameters`` and the rotation HF applies with them (the whole
head rotated under ``rotate_half``, the pairs past the kept frequencies left as they are),
which a partial ``rotary_dim`` does not reproduce."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mrv2.layers.rotary import RotaryEmbedding, _inv_freq, get_rope


def _hf_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    config = transformers.Gemma4TextConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, head_dim=16,
        global_head_dim=head_dim, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": params})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu",
                                                            layer_type="full_attention")
    assert factor == 1.0
    return inv_freq


def _rotate_half_hf(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor
                    ) -> torch.Tensor:
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


@pytest.mark.parametrize(("head_dim", "partial", "factor"),
                         [(32, 0.25, None), (64, 0.5, 2.0), (24, 0.4, None), (16, 1.0, None)])
def test_inv_freq_and_rotation_match_transformers(head_dim: int, partial: float,
                                                  factor: float | None) -> None:
    params: dict[str, Any] = {"rope_type": "proportional", "partial_rotary_factor": partial,
                              "rope_theta": 1e6}
    if factor is not None:
        params["factor"] = factor
    expected = _hf_inv_freq(head_dim, params)
    ours = _inv_freq(head_dim, 1e6, params)
    kept = int(partial * head_dim // 2)
    assert ours.shape == (head_dim // 2,) and bool((ours[kept:] == 0).all())
    assert bool((ours[:kept] > 0).all())
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)

    rope = RotaryEmbedding(head_dim, 64, 1e6, params)
    assert rope.whole_head_table(torch.arange(3)) is not None  # (attention may rotate it)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 3 * head_dim, generator=gen)
    k = torch.randn(7, head_dim, generator=gen)
    positions = torch.tensor([0, 1, 5, 17, 30, 63, 2])
    q_rot, k_rot = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(q_rot.view(7, 3, head_dim),
                               _rotate_half_hf(q.view(7, 3, head_dim), expected, positions),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot.view(7, 1, head_dim),
                               _rotate_half_hf(k.view(7, 1, head_dim), expected, positions),
                               atol=1e-5, rtol=1e-5)
    if partial < 1.0:  # a partial rotary_dim pairs other dimensions: not the same rotation
        partial_rope = RotaryEmbedding(head_dim, 64, 1e6, rotary_dim=2 * kept)
        q_partial, _ = partial_rope(positions, q.clone(), k.clone())
        assert not torch.allclose(q_partial, q_rot, atol=1e-3)


def test_get_rope_rotates_the_whole_head() -> None:
    """An HF config with proportional RoPE: the factor picks frequencies, the whole head turns
    (not ``head_dim * partial_rotary_factor`` dimensions)."""
    params = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e4}
    config = transformers.PretrainedConfig(rope_parameters=params, max_position_embeddings=32)
    rope = get_rope(config, 32)
    assert rope.rotary_dim == 32
    torch.testing.assert_close(rope._table(torch.device("cpu"))[:, :16],
                               torch.outer(torch.arange(32.0), _inv_freq(32, 1e4, params)).cos())
