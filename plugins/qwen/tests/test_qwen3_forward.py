"""Qwen3ForCausalLM against HF transformers: prefill and decode logits through the paged cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2.layers import head_dim_of
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import check_steps_against_hf, poisoned_caches, redraw_weights
from mrv2_qwen.model import Qwen3ForCausalLM


def tiny_config(tie: bool, attention_bias: bool = False) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden_size // heads: head_dim must come from the config
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
    )


def save_hf_model(config: transformers.PretrainedConfig, path: Path) -> torch.nn.Module:
    """A random HF model (weights far from their init values) saved to ``path``."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    return hf


def check_against_hf(model_cls: type, hf: torch.nn.Module, path: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(path)
    model = model_cls(config)
    load_model_weights(model, iter_safetensors(path))
    caches = poisoned_caches(config.num_key_value_heads, head_dim_of(config),
                             config.num_hidden_layers)
    check_steps_against_hf(model, hf, caches, (7, 3, 10), vocab=128, max_len=12)


@pytest.mark.parametrize(
    "tie,attention_bias", [(True, False), (False, False), (False, True)], ids=str
)
def test_matches_hf(tmp_path: Path, tie: bool, attention_bias: bool) -> None:
    hf = save_hf_model(tiny_config(tie, attention_bias), tmp_path)
    check_against_hf(Qwen3ForCausalLM, hf, tmp_path)


def test_tied_checkpoint_may_hold_lm_head(tmp_path: Path) -> None:
    save_hf_model(tiny_config(tie=True), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    embed = tensors.pop("model.embed_tokens.weight")
    save_file({**tensors, "lm_head.weight": embed}, tmp_path / "model.safetensors")
    model = Qwen3ForCausalLM(tiny_config(tie=True))
    load_model_weights(model, iter_safetensors(tmp_path))
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path: Path) -> None:
    save_hf_model(tiny_config(tie=False), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model_weights(Qwen3ForCausalLM(tiny_config(tie=False)), iter_safetensors(tmp_path))


def test_wrong_shape_names_the_parameter(tmp_path: Path) -> None:
    save_hf_model(tiny_config(tie=False), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = torch.randn(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, tmp_path / "model.safetensors")
    model = Qwen3ForCausalLM(tiny_config(tie=False))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight.*\(49, 64\)"):
        load_model_weights(model, iter_safetensors(tmp_path))


def test_missing_weights_dir(tmp_path: Path) -> None:
    tiny_config(tie=False).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        iter_safetensors(tmp_path)
