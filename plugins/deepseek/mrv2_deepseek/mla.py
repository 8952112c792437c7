"""Multi-head latent attention moved into the core: :mod:`mrv2.layers.mla` (the layer, its
decoder layer and RoPE) and :mod:`mrv2.attention.mla_backend` (the ``mla`` backend, registered
by the core). This module re-exports them so code written against ``mrv2_deepseek.mla`` keeps
working; new code imports from the core."""

from mrv2.layers.mla import (
    LATENT_NORM_EPS,
    MLAAttention,
    MLABackend,
    MLADecoderLayer,
    mla_rope,
)

__all__ = ["LATENT_NORM_EPS", "MLAAttention", "MLABackend", "MLADecoderLayer", "mla_rope"]
