"""EXAONE 4 (``Exaone4ForCausalLM``: LG EXAONE 4.0 1.2B and 32B): a post-norm decoder (each
block's output normalized before the residual add, as OLMo 2's: the core's
:class:`~mrv2.layers.PostNormDecoderLayer`) with per-head q/k RMSNorms. Where the config sets a
``sliding_window`` (32B), the layers ``layer_types`` marks ``sliding_attention`` attend over
the window with RoPE, and the global layers use no positional encoding at all (NoPE; their
q/k norms then run on their own, with no rotation to fuse into); without one (1.2B) every
layer is global with RoPE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    PostNormDecoderLayer,
    SelfAttention,
    get_rope,
    head_dim_of,
    sliding_window_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Exaone4ForCausalLM(CausalLM):
    """EXAONE 4 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        windowed = getattr(config, "sliding_window", None) is not None

        def layer(i: int) -> PostNormDecoderLayer:
            local = sliding_window_of(config, i) is not None
            attention = SelfAttention(config, i, rope if local or not windowed else None,
                                      qk_norm=True)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return PostNormDecoderLayer(config, attention, mlp)

        super().__init__(config, DecoderModel(config, layer))
