"""GLM-4.5/4.6/4.7's multi-token-prediction (MTP) layers: the shared
:class:`mrv2.layers.mtp.MultiTokenPredictor` (its module states the layout, the math and the
contract a speculator follows) over GLM-4.x decoder blocks (:func:`mrv2_glm.model.glm4_moe_layer`:
a MoE block, the MTP layer's index being past ``first_k_dense_replace``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrv2.layers import STACKED_PARAMS, LMHead, VocabEmbedding, get_rope, head_dim_of
from mrv2.layers.mtp import MultiTokenPredictor, mtp_layer_count
from mrv2_glm.model import glm4_moe_layer, validate_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["Glm4MoeMTP", "mtp_layer_count"]


class Glm4MoeMTP(MultiTokenPredictor):
    """The ``num_nextn_predict_layers`` MTP layers of a GLM-4.x checkpoint, built as
    ``Glm4MoeMTP(config, embed_tokens, lm_head)`` from the main model's shared embedding and
    LM head (usually through :meth:`mrv2_glm.model.Glm4MoeForCausalLM.build_mtp`). MTP layer
    ``i``'s attention uses KV cache layer ``first_layer_idx + i`` (default
    ``num_hidden_layers + i``)."""

    def __init__(
        self,
        config: PretrainedConfig,
        embed_tokens: VocabEmbedding,
        lm_head: LMHead,
        first_layer_idx: int | None = None,
    ) -> None:
        validate_config(config)
        if mtp_layer_count(config) < 1:
            raise ValueError(
                "Glm4MoeMTP: config.num_nextn_predict_layers is 0: the checkpoint has no MTP "
                "layers"
            )
        rope = get_rope(config, head_dim_of(config))
        super().__init__(
            config, embed_tokens, lm_head,
            lambda layer_idx, cache_idx: glm4_moe_layer(config, layer_idx, rope,
                                                         cache_idx=cache_idx),
            STACKED_PARAMS, first_layer_idx,
        )
