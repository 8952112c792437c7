"""Karpathy's nanochat (``NanoChatForCausalLM``: nanochat-d20 / d32 in transformers' format), as
transformers 5.17 builds it (``transformers.models.nanochat``): Llama's pre-norm layers with

- weightless RMS norms everywhere (HF's ``L2Norm``: the core's ``RMSNorm(affine=False)``),
  the final norm also run once on the embeddings before the first layer (the same module);
- RoPE rotating the other way (HF's ``rotate_half`` with its signs flipped: the core's
  ``RotaryEmbedding.reverse``), then per-head weightless q/k norms (after the rotation in HF;
  fused before it here, the same since a rotation keeps each head's norm); biases on all four
  attention projections per ``attention_bias``;
- a dense MLP ``fc2(act(fc1(x)))`` of ``hidden_act`` (squared ReLU in the published
  checkpoints), loaded as the core's ``up_proj`` / ``down_proj``;
- the logits soft-capped, ``tanh(logits / cap) * cap`` with ``final_logit_softcapping``
  (15 by default; null: none), as Gemma 2's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

import torch

from mrv2.layers import (
    QKV_PARAMS,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    DenseMLP,
    RMSNorm,
    SelfAttention,
    get_rope,
    head_dim_of,
)
from mrv2.layers.weights import StackedMapping

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class NanoChatModel(DecoderModel):
    """:class:`~mrv2.layers.DecoderModel` whose final norm also normalizes the embeddings
    before the first layer (given embeddings too, as HF's)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return super().forward(input_ids, positions, cast(torch.Tensor, self.norm(embeds)))


class NanoChatForCausalLM(CausalLM):
    """nanochat in the mrv2 model contract (module docstring)."""

    stacked_params: ClassVar[StackedMapping] = QKV_PARAMS

    def __init__(self, config: PretrainedConfig) -> None:
        head_dim = head_dim_of(config)
        rope = get_rope(config, head_dim)
        rope.reverse = True
        bias = bool(getattr(config, "attention_bias", False))
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)

        def norm() -> RMSNorm:
            return RMSNorm(hidden, eps, affine=False)

        def layer(i: int) -> DecoderLayer:
            attn = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias, qk_norm=True)
            attn.q_norm = RMSNorm(head_dim, eps, affine=False)
            attn.k_norm = RMSNorm(head_dim, eps, affine=False)
            mlp = DenseMLP(hidden, config.intermediate_size, config.hidden_act)
            return DecoderLayer(config, attn, mlp, norm=norm)

        super().__init__(config, NanoChatModel(config, layer, norm=norm))
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_softcap = None if cap is None else float(cap)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def rename(self, name: str) -> str | None:
        """HF's ``mlp.fc1`` / ``mlp.fc2`` as the core MLP's ``up_proj`` / ``down_proj``."""
        renamed = super().rename(name)
        if renamed is None:
            return None
        return renamed.replace(".mlp.fc1.", ".mlp.up_proj.").replace(".mlp.fc2.",
                                                                       ".mlp.down_proj.")
