"""DeepSeek-V3.2 / V3.2-Exp (``DeepseekV32ForCausalLM``), as transformers models it:
DeepSeek-V3 (:mod:`mrv2_deepseek.model`) with DeepSeek Sparse Attention on every layer.

- Attention: the core's sparse MLA (:mod:`mrv2.layers.sparse_mla`): MLA with ``q_lora_rank``
  (RoPE in interleaved pairs), over the ``index_topk`` cached tokens the layer's lightning
  indexer picks per query (``index_n_heads`` heads of ``index_head_dim``; its RoPE half-split,
  as HF rotates it). The indexer keys are cached per token beside the latents.
- MLP: per ``mlp_layer_types`` (from ``first_k_dense_replace`` when absent) a dense SwiGLU MLP
  or DeepSeek-V3's noaux_tc MoE block.
- The checkpoints' MTP layer (``model.layers.{num_hidden_layers}.*``) is skipped: no MTP
  drafter for this architecture yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from mrv2.layers import CausalLM, DecoderModel, GatedMLP, RotaryEmbedding
from mrv2.layers.mla import MLADecoderLayer, mla_rope
from mrv2.layers.sparse_mla import (
    check_dsa_config,
    indexer_cache_layers,
    sparse_mla_attention_layer,
)
from mrv2_deepseek.model import GATE_UP, LAYER_NAME, moe_block, validate_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "DeepseekV32ForCausalLM"

__all__ = ["DeepseekV32ForCausalLM"]


def mlp_types_of(config: Any) -> list[str]:
    """Each main layer's MLP, ``"dense"`` or ``"sparse"``: ``mlp_layer_types``, else
    ``first_k_dense_replace`` dense layers then sparse ones (HF's default)."""
    count = int(config.num_hidden_layers)
    types = getattr(config, "mlp_layer_types", None)
    if types is None:
        dense = min(int(getattr(config, "first_k_dense_replace", 0) or 0), count)
        return ["dense"] * dense + ["sparse"] * (count - dense)
    return [str(t) for t in types]


def v32_layer(config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding,
              indexer_idx: int | None) -> MLADecoderLayer:
    """Layer ``layer_idx``: sparse MLA (its indexer caching in layer ``indexer_idx``), then
    the dense MLP or the MoE block."""
    attn = sparse_mla_attention_layer(config, layer_idx, rope, indexer_idx,
                                      indexer_interleaved=False)
    mlp: nn.Module
    if mlp_types_of(config)[layer_idx] == "dense":
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    else:
        mlp = moe_block(config, True)
    return MLADecoderLayer(config, attn, mlp)


class DeepseekV32ForCausalLM(CausalLM):
    """DeepSeek-V3.2 causal LM in the mrv2 model contract (module docstring)."""

    stacked_params = GATE_UP

    def __init__(self, config: PretrainedConfig) -> None:
        validate_config(config, ARCH, True)
        check_dsa_config(config, ARCH)
        types = mlp_types_of(config)
        if len(types) != int(config.num_hidden_layers) or not set(types) <= {"dense", "sparse"}:
            raise ValueError(f"{ARCH}: config.mlp_layer_types = {types!r}: must give each "
                             f"of the {config.num_hidden_layers} layers 'dense' or 'sparse'")
        indexers = indexer_cache_layers(config)
        rope = mla_rope(config)
        super().__init__(config, DecoderModel(
            config, lambda i: v32_layer(config, i, rope, indexers[i])))

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; None for the MTP layer's tensors."""
        m = LAYER_NAME.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return None
        return super().rename(name)
