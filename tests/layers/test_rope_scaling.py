"""RoPE scaling types against transformers' own initialisation: the inverse frequencies and the
cos/sin factor of YaRN (with and without DeepSeek's mscale terms)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mrv2.layers.rotary import RotaryEmbedding

YARN: dict[str, Any] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 1024, "beta_fast": 32,
                        "beta_slow": 1}


@pytest.mark.parametrize("extra", [{}, {"mscale": 1.0, "mscale_all_dim": 1.0},
                                   {"mscale": 0.707, "mscale_all_dim": 1.0},
                                   {"factor": 40.0, "beta_fast": 16, "truncate": False}])
def test_yarn_matches_transformers(extra: dict[str, Any]) -> None:
    params = {**YARN, **extra}
    config = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4,
                                           qk_rope_head_dim=16, max_position_embeddings=4096,
                                           rope_parameters=params)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = RotaryEmbedding(16, 4096, 10000.0, params)
    assert rope.attention_factor == pytest.approx(factor)
    table = rope._table(torch.device("cpu"))
    positions = torch.arange(4096, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    expected = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor
    # fp64 frequencies here, fp32 in HF: angles at position 4k differ by ~3e-5
    torch.testing.assert_close(table, expected, atol=1e-4, rtol=1e-4)


def test_yarn_without_original_length_names_the_field() -> None:
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RotaryEmbedding(16, 4096, 10000.0, {"rope_type": "yarn", "factor": 4.0})
