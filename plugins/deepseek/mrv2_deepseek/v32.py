"""DeepSeek-V3.2 / V3.2-Exp (``DeepseekV32ForCausalLM``), as transformers models it:
DeepSeek-V3 (:mod:`mrv2_deepseek.model`) with DeepSeek Sparse Attention on every layer.

- Attention: the core's sparse MLA (:mod:`mrv2.layers.sparse_mla`): MLA with ``q_lora_rank``
  (RoPE in interleaved pairs), over the ``index_topk`` cached tokens the layer's lightning
  indexer picks per query (``index_n_heads`` heads of ``index_head_dim``; its RoPE half-split,
  as HF rotates it). The indexer keys are cached per token beside the latents.
- MLP: per ``mlp_layer_types`` (from ``first_k_dense_replace`` when absent) a dense SwiGLU MLP
  or DeepSeek-V3's noaux_tc MoE block.
- The checkpoints' MTP layer (``model.layers.{num_hidden_layers}.*``): the main model skips
  it; :meth:`DeepseekV32ForCausalLM.build_mtp` builds it for the ``mtp`` speculator (a sparse
  MLA layer with its own indexer, the MoE block, DeepSeek-V3's enorm / hnorm / eh_proj).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from torch import nn

from mrv2.layers import CausalLM, DecoderModel, GatedMLP, RotaryEmbedding
from mrv2.layers.mla import MLADecoderLayer, mla_rope
from mrv2.layers.mtp import MultiTokenPredictor, build_mtp
from mrv2.layers.sparse_mla import (
    check_dsa_config,
    indexer_cache_layers,
    mtp_indexer_cache_layer,
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
              indexer_idx: int | None, cache_idx: int | None = None) -> MLADecoderLayer:
    """Layer ``layer_idx``: sparse MLA (KV cache layer ``cache_idx``, default ``layer_idx``;
    its indexer caching in layer ``indexer_idx``), then the dense MLP or the MoE block (an
    MTP layer, past :func:`mlp_types_of`'s list: the MoE block)."""
    attn = sparse_mla_attention_layer(config, layer_idx if cache_idx is None else cache_idx,
                                      rope, indexer_idx, indexer_interleaved=False)
    types = mlp_types_of(config)
    mlp: nn.Module
    if layer_idx < len(types) and types[layer_idx] == "dense":
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    else:
        mlp = moe_block(config, True)
    return MLADecoderLayer(config, attn, mlp)


class DeepseekV32ForCausalLM(CausalLM):
    """DeepSeek-V3.2 causal LM in the mrv2 model contract (module docstring), with
    ``num_nextn_predict_layers`` MTP layers for a drafter (:meth:`build_mtp`)."""

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

    def build_mtp(self, first_layer_idx: int | None = None) -> MultiTokenPredictor:
        """The checkpoint's MTP layers (:class:`mrv2.layers.mtp.MultiTokenPredictor` over
        DeepSeek-V3.2 decoder blocks: sparse MLA with an indexer of its own, and the MoE),
        sharing this model's embedding and LM head. MTP layer ``i`` caches its latents in KV
        cache layer ``first_layer_idx + i`` (default ``num_hidden_layers``) and its indexer
        keys after every MTP layer's latents
        (:func:`mrv2.layers.sparse_mla.mtp_indexer_cache_layer`); weights unloaded (see
        :func:`mrv2.layers.mtp.build_mtp`)."""
        config = self.config
        rope = mla_rope(config)

        def block(layer_idx: int, cache_idx: int) -> nn.Module:
            return v32_layer(config, layer_idx, rope, mtp_indexer_cache_layer(config, cache_idx),
                             cache_idx=cache_idx)

        return cast(MultiTokenPredictor, build_mtp(self, MultiTokenPredictor, block, GATE_UP,
                                                   first_layer_idx))
