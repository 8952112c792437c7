"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's decoder with the query, key and value
projections stored as one ``qkv_proj`` tensor and the gate and up projections as one
``gate_up_proj`` (``[gate | up]``), partial rotary dimensions (Phi-4-mini: 3/4 of each head)
and LongRoPE scaling (Phi-3.5, Phi-4-mini: :mod:`mrv2.layers.rotary`'s ``longrope``); the
config's ``sliding_window`` where set (Phi-3-mini-4k).

The fused checkpoint tensors are cut into their parts as they load, so every part goes
through the core's fused layers like a Llama checkpoint's (and tensor parallelism splits
each part by heads / rows as usual).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Phi3ForCausalLM(CausalLM):
    """Phi-3 / Phi-4 causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        head_dim = head_dim_of(config)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        #: Rows of the checkpoint's fused tensors: q, k, v; gate, up.
        self.qkv_sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.gate_up_sizes = [int(config.intermediate_size)] * 2

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return DecoderLayer(config, attention, mlp)

        super().__init__(config, DecoderModel(config, layer))

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        fused = {".qkv_proj.": (("q_proj", "k_proj", "v_proj"), self.qkv_sizes),
                 ".gate_up_proj.": (("gate_proj", "up_proj"), self.gate_up_sizes)}
        for name, tensor in weights:
            kind = next((k for k in fused if k in name and name.endswith((".weight", ".bias"))),
                        None)
            if kind is None:
                yield name, tensor
                continue
            parts, sizes = fused[kind]
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the "
                                 f"config's {'/'.join(parts)} need {sum(sizes)}")
            for part, t in zip(parts, tensor.split(sizes), strict=True):
                yield name.replace(kind, f".{part}."), t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, the fused ``qkv_proj`` / ``gate_up_proj`` cut into their
        parts (a tensor of the wrong size is a ValueError naming it)."""
        return super().load_weights(self._split(weights))
