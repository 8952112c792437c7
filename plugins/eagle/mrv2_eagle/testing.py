"""Helpers for tests and benchmarks: random-weight EAGLE heads for a target checkpoint, saved as
the heads are published (``config.json`` and ``model.safetensors`` with the published tensor
names), so the loading path is the real one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

#: The reduced vocabulary of :func:`write_eagle3_head` by default.
DRAFT_VOCAB = 96


def _head_config(target: Path, **extra: Any) -> dict[str, Any]:
    config = json.loads((target / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta",
            "rope_parameters", "rope_scaling", "hidden_act", "bos_token_id", "eos_token_id")
    head = {k: config[k] for k in keep if k in config}
    head.update({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                 "num_hidden_layers": 1, "tie_word_embeddings": False, **extra})
    return head


def _layer(config: dict[str, Any], gen: torch.Generator, qkv_in: int, std: float
           ) -> dict[str, torch.Tensor]:
    """A Llama decoder layer's tensors (HF names, no prefix), drawn far from their init."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or hidden // heads

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        return torch.rand(hidden, generator=gen) + 0.5

    return {
        "self_attn.q_proj.weight": w(heads * hd, qkv_in),
        "self_attn.k_proj.weight": w(kv * hd, qkv_in),
        "self_attn.v_proj.weight": w(kv * hd, qkv_in),
        "self_attn.o_proj.weight": w(hidden, heads * hd),
        "mlp.gate_proj.weight": w(inter, hidden),
        "mlp.up_proj.weight": w(inter, hidden),
        "mlp.down_proj.weight": w(hidden, inter),
        "input_layernorm.weight": norm(),
        "post_attention_layernorm.weight": norm(),
    }


def write_eagle_head(path: Path, target: Path, seed: int = 0, *, eagle1: bool = True,
                     **config_extra: Any) -> Path:
    """An EAGLE-1 head (``fc`` with a bias, layer 0 without ``input_layernorm``, a copy of the
    target's ``embed_tokens`` as EAGLE saves it), or with ``eagle1=False`` one with the norm,
    no bias and no embedding."""
    path.mkdir(parents=True, exist_ok=True)
    config = _head_config(target, **config_extra)
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    tensors = {f"layers.0.{k}": v for k, v in _layer(config, gen, hidden, 0.15).items()}
    embed = load_file(target / "model.safetensors")["model.embed_tokens.weight"]
    fc = torch.randn(hidden, 2 * hidden, generator=gen) * 0.15
    fc[:, :hidden] /= float(embed.float().std()) * 4  # the token's part weighs as the hidden's
    tensors["fc.weight"] = fc
    if eagle1:
        del tensors["layers.0.input_layernorm.weight"]
        tensors["fc.bias"] = torch.randn(hidden, generator=gen) * 0.1
        tensors["embed_tokens.weight"] = embed.clone()
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_eagle3_head(path: Path, target: Path, seed: int = 0, *,
                      draft_vocab: int = DRAFT_VOCAB, aux_ids: list[int] | None = None,
                      own_embedding: bool = False, **config_extra: Any) -> Path:
    """An EAGLE-3 head with a reduced vocabulary: ``draft_vocab`` target ids drawn at random
    (``d2t`` offsets nonzero), ``t2d`` marking them; with ``own_embedding`` an
    ``embed_tokens`` of its own (random)."""
    path.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {"architectures": ["LlamaForCausalLMEagle3"],
                             "draft_vocab_size": draft_vocab, **config_extra}
    if aux_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids,
                                 "use_aux_hidden_state": True}
    config = _head_config(target, **extra)
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tensors = {f"midlayer.{k}": v for k, v in _layer(config, gen, 2 * hidden, 0.15).items()}
    tensors["midlayer.hidden_norm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    tensors["fc.weight"] = torch.randn(hidden, 3 * hidden, generator=gen) * 0.1
    tensors["norm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    tensors["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=gen) * 0.15
    chosen = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors["d2t"] = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    tensors["t2d"] = t2d
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return path
