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


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LONGROPE = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize(("params", "limit"), [
    (None, 256),
    ({**YARN, "original_max_position_embeddings": 64}, 256),  # original * factor
    ({**YARN, "original_max_position_embeddings": 32}, 256),  # never below max_position
    ({**YARN, "factor": 8.0, "original_max_position_embeddings": 48}, 384),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, 512),  # max_position * factor
    (LLAMA3, 256),  # (llama3 and longrope configs state the scaled length)
    (LONGROPE, 256),
])
def test_context_limit_is_derived_as_vllm_does(params: dict[str, Any] | None, limit: int
                                               ) -> None:
    from mrv2.layers.rotary import context_limit, get_rope

    config = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16,
                                      max_position_embeddings=256,
                                      rope_parameters=params or {"rope_type": "default",
                                                                 "rope_theta": 1e4})
    assert context_limit(config)[0] == limit
    assert get_rope(config, 16)._table(torch.device("cpu")).shape[0] == limit


def test_per_layer_rope_parameters_keep_max_position_embeddings() -> None:
    """Gemma 3's linear factor 8 is already in its 128K ``max_position_embeddings`` (vLLM
    skips it too): per-layer-type ``rope_parameters`` derive nothing."""
    from mrv2.layers.rotary import context_limit

    config = transformers.Gemma3TextConfig(max_position_embeddings=4096, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    assert context_limit(config) == (4096, "the model's max_position_embeddings=4096")


def test_context_limit_names_the_configs_own_field() -> None:
    """A config class that maps ``max_position_embeddings`` to a field of its own (GPT-2's and
    GPTBigCode's ``n_positions``) is told by that name, the one its config.json holds."""
    from mrv2.layers.rotary import context_limit

    config = transformers.GPTBigCodeConfig(n_positions=512)
    assert context_limit(config) == (512, "the model's n_positions=512")
    config = transformers.Qwen3Config(max_position_embeddings=512)
    assert context_limit(config) == (512, "the model's max_position_embeddings=512")


@pytest.mark.parametrize("params", [YARN, {**YARN, "factor": None},
                                    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
                                    LONGROPE])
def test_a_longer_table_keeps_the_rows_below_max_position(params: dict[str, Any]) -> None:
    """The table past ``max_position_embeddings`` is more rows of the same RoPE: YaRN's math
    (its ramp from ``original_max_position_embeddings``, its attention factor, DeepSeek's
    factor from the lengths' ratio) does not depend on the table's length."""
    from mrv2.layers.rotary import get_rope

    params = {**params, "original_max_position_embeddings": 1024}
    config = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16,
                                      max_position_embeddings=2048, rope_parameters=params)
    old = RotaryEmbedding(16, 2048, params["rope_theta"], params)._table(torch.device("cpu"))
    rope = get_rope(config, 16)
    new = rope._table(torch.device("cpu"))
    assert new.shape[0] == rope.positions >= 2048
    assert torch.equal(new[:2048], old)


@pytest.mark.parametrize("kind", ["sliding_attention", "full_attention"])
def test_get_rope_of_a_layer_type_matches_transformers(kind: str) -> None:
    """OLMo 3's per-layer-type ``rope_parameters`` (a checkpoint's flat ``rope_scaling``
    lands on the full-attention layers only): each kind's table as HF's rotary embedding
    computes it; a flat config gives every kind its one RoPE."""
    from transformers.models.olmo3.modeling_olmo3 import Olmo3RotaryEmbedding

    from mrv2.layers.rotary import get_rope

    legacy: dict[str, Any] = {  # (config.json's fields as OLMo 3's checkpoints write them)
        "rope_theta": 5e5, "rope_scaling": {
            "rope_type": "yarn", "factor": 8.0, "attention_factor": 1.2,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}}
    config = transformers.Olmo3Config(hidden_size=64, num_attention_heads=4,
                                      max_position_embeddings=512, **legacy)
    positions = torch.arange(512)
    cos, sin = Olmo3RotaryEmbedding(config)(torch.zeros(1), positions[None], kind)
    half = cos.shape[-1] // 2
    expected = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)
    table = get_rope(config, 16, kind)._table(torch.device("cpu"))
    torch.testing.assert_close(table, expected, atol=1e-4, rtol=1e-4)
    flat = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16,
                                    max_position_embeddings=256, rope_parameters=YARN)
    assert torch.equal(get_rope(flat, 16, kind)._table(torch.device("cpu")),
                       get_rope(flat, 16)._table(torch.device("cpu")))


@pytest.mark.parametrize("alpha", [50.0, 1000.0])
def test_ntk_alpha_matches_transformers_hunyuan(alpha: float) -> None:
    """Hunyuan's ``dynamic`` RoPE with an ``alpha`` (config.json's ``rope_scaling`` as its
    checkpoints write it, YaRN-like keys included): one larger base for every position, as
    HF's HunYuan rotary embedding computes it; ``factor`` 1 leaves the context as it is."""
    from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import (
        HunYuanDenseV1RotaryEmbedding,
    )

    from mrv2.layers.rotary import context_limit, get_rope

    legacy: dict[str, Any] = {"rope_theta": 1e4, "rope_scaling": {
        "alpha": alpha, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "type": "dynamic"}}
    config = transformers.HunYuanDenseV1Config(hidden_size=64, num_attention_heads=4,
                                               head_dim=16, max_position_embeddings=512,
                                               **legacy)
    positions = torch.arange(512)
    cos, sin = HunYuanDenseV1RotaryEmbedding(config)(torch.zeros(1), positions[None])
    expected = torch.cat([cos[0, :, :8], sin[0, :, :8]], dim=-1)
    table = get_rope(config, 16)._table(torch.device("cpu"))
    torch.testing.assert_close(table, expected, atol=1e-4, rtol=1e-4)
    assert context_limit(config)[0] == 512


def test_dynamic_ntk_without_alpha_is_refused() -> None:
    """Plain dynamic NTK (the base rescaled by each sequence's length) is not implemented:
    the error says so at construction."""
    with pytest.raises(NotImplementedError, match="rope type 'dynamic' without alpha"):
        RotaryEmbedding(16, 256, 1e4, {"rope_type": "dynamic", "factor": 2.0})
