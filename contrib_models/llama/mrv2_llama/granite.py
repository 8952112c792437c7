"""IBM Granite 3.x (``GraniteForCausalLM``): Llama's layers with four scalars from the
config: the token embeddings times ``embedding_multiplier``, the scores scaled by
``attention_multiplier`` (in place of ``head_dim ** -0.5``), each block's output times
``residual_multiplier`` before it joins the residual stream, and the logits divided by
``logits_scaling``.

Granite SWA (``GraniteSWAForCausalLM``) adds to those layers, on the core's attention:
local layers (``config.layer_types``' ``sliding_attention``: a query sees its last
``sliding_window`` keys, its own included), a learned attention sink per head (``sinks``:
HF scales each head's output by ``sigmoid(logsumexp(scores) - sink)``, the same as one more
logit in the softmax's denominator, gpt-oss's sinks) and a RoPE base per layer
(``layer_rope_theta``; 0: that layer is NoPE)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    SelfAttention,
    get_rope,
    head_dim_of,
    layer_ropes,
    norm_linear,
)
from mrv2.layers.decoder import norm_mlp
from mrv2.layers.embedding import ScaledEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mrv2.layers import RotaryEmbedding


class GraniteDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer, each block's output times ``residual_multiplier``."""

    def __init__(self, config: PretrainedConfig, attn: SelfAttention, mlp: GatedMLP) -> None:
        super().__init__(config, attn, mlp)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                    hidden_states, residual)
        attn = self.self_attn.attend(positions, qkv) * self.residual_multiplier
        out, residual = norm_mlp(self.post_attention_layernorm, self.mlp, attn, residual)
        return out * self.residual_multiplier, residual


class GraniteForCausalLM(CausalLM):
    """Granite causal LM in the mrv2 model contract (module docstring)."""

    #: Whether each attention layer has a learned sink per head (Granite SWA).
    sinks: ClassVar[bool] = False

    def __init__(self, config: PretrainedConfig) -> None:
        ropes = self._ropes(config)
        bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        def layer(i: int) -> GraniteDecoderLayer:
            attn = SelfAttention(config, i, ropes[i], qkv_bias=bias, o_bias=bias,
                                 scale=float(config.attention_multiplier), sinks=self.sinks)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           bias=mlp_bias)
            return GraniteDecoderLayer(config, attn, mlp)

        model = DecoderModel(config, layer)
        model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                             float(config.embedding_multiplier),
                                             scales_given=True)  # (HF scales inputs_embeds)
        super().__init__(config, model)
        self.logits_scaling = float(config.logits_scaling)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling

    def _ropes(self, config: PretrainedConfig) -> list[RotaryEmbedding | None]:
        """Each layer's RoPE: the config's on every layer."""
        return [get_rope(config, head_dim_of(config))] * int(config.num_hidden_layers)


class GraniteSWAForCausalLM(GraniteForCausalLM):
    """Granite SWA in the mrv2 model contract (module docstring): Granite's layers, local ones
    per ``layer_types``, attention sinks, a RoPE base per layer."""

    sinks: ClassVar[bool] = True

    def _ropes(self, config: PretrainedConfig) -> list[RotaryEmbedding | None]:
        """A RoPE per ``layer_rope_theta`` entry (0: none)."""
        return layer_ropes(config, head_dim_of(config),
                           getattr(config, "layer_rope_theta", None))
