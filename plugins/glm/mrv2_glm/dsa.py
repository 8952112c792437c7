"""GLM-5 (``GlmMoeDsaForCausalLM``), as transformers models it: GLM-4.7-Flash's layout
(:mod:`mrv2_glm.lite`: MLA, GLM-4.5's MoE per ``mlp_layer_types``) with DeepSeek Sparse
Attention.

- Attention: the core's sparse MLA (:mod:`mrv2.layers.sparse_mla`, shared with DeepSeek-V3.2;
  no other plugin needed): MLA (RoPE in interleaved pairs) over the ``index_topk`` cached
  tokens a lightning indexer picks per query; GLM-5's indexer rotates interleaved pairs too.
- Cross-layer top-k sharing: ``indexer_types`` (``"full"`` / ``"shared"``, HF derives it from
  ``index_topk_freq`` / ``index_skip_topk_offset`` / ``index_topk_pattern``): a shared layer
  has no indexer (no indexer cache either) and attends over the selection of the last full
  layer before it.
- The checkpoints' MTP layers (``model.layers.{num_hidden_layers + i}.*``): the main model
  skips them; :meth:`GlmMoeDsaForCausalLM.build_mtp` builds them for the ``mtp`` speculator
  (each a sparse MLA layer with an indexer of its own, as vLLM runs them, and the MoE block).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

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
from mrv2_glm.lite import GATE_UP, LAYER_NAME, mlp_layer_types_of, validate_config
from mrv2_glm.model import glm4_moe_block

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "GlmMoeDsaForCausalLM"

__all__ = ["GlmMoeDsaForCausalLM"]


def dsa_layer(config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding,
              indexer_idx: int | None, cache_idx: int | None = None) -> MLADecoderLayer:
    """Layer ``layer_idx``: sparse MLA (KV cache layer ``cache_idx``, default ``layer_idx``;
    an indexer caching in layer ``indexer_idx``; None: a shared layer), then a dense MLP or
    the MoE block per ``mlp_layer_types`` (an MTP layer, past the list: the MoE block)."""
    attn = sparse_mla_attention_layer(config, layer_idx if cache_idx is None else cache_idx,
                                      rope, indexer_idx, indexer_interleaved=True)
    types = mlp_layer_types_of(config)
    mlp: nn.Module
    if layer_idx < len(types) and types[layer_idx] == "dense":
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    else:
        mlp = glm4_moe_block(config)
    return MLADecoderLayer(config, attn, mlp)


class GlmMoeDsaForCausalLM(CausalLM):
    """GLM-5 causal LM in the mrv2 model contract (module docstring), with
    ``num_nextn_predict_layers`` MTP layers for a drafter (:meth:`build_mtp`)."""

    stacked_params = GATE_UP

    def __init__(self, config: PretrainedConfig) -> None:
        validate_config(config, ARCH)
        check_dsa_config(config, ARCH)
        indexers = indexer_cache_layers(config, getattr(config, "indexer_types", None))
        rope = mla_rope(config)
        super().__init__(config, DecoderModel(
            config, lambda i: dsa_layer(config, i, rope, indexers[i])))

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; None for the MTP layers' tensors."""
        m = LAYER_NAME.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return None
        return super().rename(name)

    def build_mtp(self, first_layer_idx: int | None = None) -> MultiTokenPredictor:
        """The checkpoint's MTP layers (:class:`mrv2.layers.mtp.MultiTokenPredictor` over
        GLM-5 decoder blocks: sparse MLA with an indexer of its own, and the MoE), sharing
        this model's embedding and LM head. MTP layer ``i`` caches its latents in KV cache
        layer ``first_layer_idx + i`` (default ``num_hidden_layers``) and its indexer keys
        after every MTP layer's latents (:func:`mrv2.layers.sparse_mla.mtp_indexer_cache_layer`);
        weights unloaded (see :func:`mrv2.layers.mtp.build_mtp`)."""
        config = self.config
        rope = mla_rope(config)

        def block(layer_idx: int, cache_idx: int) -> nn.Module:
            return dsa_layer(config, layer_idx, rope, mtp_indexer_cache_layer(config, cache_idx),
                             cache_idx=cache_idx)

        return cast(MultiTokenPredictor, build_mtp(self, MultiTokenPredictor, block, GATE_UP,
                                                   first_layer_idx))
