"""Microsoft's phi-1, phi-1.5 and phi-2 (``PhiForCausalLM``), as HF transformers'
``modeling_phi``:

- a parallel block off one LayerNorm with a bias: ``x + attn(ln(x)) + mlp(ln(x))``, summed in
  HF's order, ``(attn + mlp) + x`` (the core's :class:`~mrv2.layers.ParallelDecoderLayer`;
  the residual add runs in the next norm's kernel, the core's
  :class:`~mrv2.layers.LayerNorm`), and a final LayerNorm
  (``model.final_layernorm``);
- attention with biases on ``q_proj`` / ``k_proj`` / ``v_proj`` and on the output projection
  ``dense``, the head size ``config.head_dim`` or ``hidden_size // num_attention_heads``
  (phi-2: 80), grouped-query where ``num_key_value_heads`` says so;
- partial RoPE: the first ``int(head_dim * partial_rotary_factor)`` dims of each head rotate
  in halves (``rotate_half``: the core's layout), the rest pass through (phi-1 / 1.5: 32 of
  64, phi-2: 32 of 80);
- ``qk_layernorm``: queries and keys normalized per head by one LayerNorm with a bias over
  ``head_dim``, its weight shared by every head, before the rotation (:class:`PhiAttention`);
- the MLP ``fc1`` -> ``hidden_act`` (``gelu_new``) -> ``fc2``, with biases (the core's
  :class:`~mrv2.layers.DenseMLP`);
- the LM head with a bias, untied unless ``tie_word_embeddings`` (then the bias stays its own).

Dropout is ignored (inference). Checkpoints of the old remote-code format (``model_type``
``phi-msft``: ``transformer.h.*.mixer.Wqkv``, superseded on the Hub by transformers' format)
are not supported.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from mrv2.layers import (
    QKV_PARAMS,
    CausalLM,
    DecoderModel,
    DenseMLP,
    LayerNorm,
    LMHead,
    ParallelDecoderLayer,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
)
from mrv2.layers.weights import StackedMapping

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: HF's Phi names -> the core's (within a layer, and the final norm).
_RENAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."),
            (".mlp.fc2.", ".mlp.down_proj."), ("model.final_layernorm.", "model.norm."))


class PhiAttention(SelfAttention):
    """:class:`~mrv2.layers.SelfAttention` with Phi's optional q/k LayerNorms
    (``q_layernorm`` / ``k_layernorm``: one :class:`~mrv2.layers.LayerNorm` with a bias over
    ``head_dim`` each, shared by every head, so replicated under tensor parallelism) run on
    the projections' output before the rotation."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding | None,
                 eps: float) -> None:
        super().__init__(config, layer_idx, rope, qkv_bias=True, o_bias=True)
        self.q_layernorm = LayerNorm(self.head_dim, eps)
        self.k_layernorm = LayerNorm(self.head_dim, eps)

    def _per_head(self, norm: LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, norm(x.reshape(-1, self.head_dim))).reshape(x.shape)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The q/k LayerNorms, the rotation, attention, the output projection."""
        q, k, v = self.qkv_proj.split(qkv)
        q, k = self._per_head(self.q_layernorm, q), self._per_head(self.k_layernorm, k)
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb)
        return cast(torch.Tensor, self.o_proj(out))


def _shape(config: PretrainedConfig) -> SimpleNamespace:
    """What the core's decoder and attention read of ``config`` (Phi's config has LayerNorm's
    ``layer_norm_eps``, not the ``rms_norm_eps`` the core's defaults read)."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % kv:
        raise ValueError(f"{type(config).__name__}: num_key_value_heads ({kv}) must divide "
                         f"num_attention_heads ({heads})")
    return SimpleNamespace(
        vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
        num_hidden_layers=int(config.num_hidden_layers), num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim_of(config),
        rms_norm_eps=float(config.layer_norm_eps))


class PhiForCausalLM(CausalLM):
    """phi-1 / phi-1.5 / phi-2 in the mrv2 model contract (module docstring)."""

    #: q/k/v only: the MLP's ``fc1`` (the core's ``up_proj``) is a projection of its own.
    stacked_params: ClassVar[StackedMapping] = QKV_PARAMS

    def __init__(self, config: PretrainedConfig) -> None:
        shape = _shape(config)
        rope = get_rope(config, shape.head_dim)
        hidden, eps = shape.hidden_size, shape.rms_norm_eps
        qk_norm = bool(getattr(config, "qk_layernorm", False))

        def norm() -> LayerNorm:
            return LayerNorm(hidden, eps)

        def layer(i: int) -> ParallelDecoderLayer:
            attention = (PhiAttention(shape, i, rope, eps) if qk_norm
                         else SelfAttention(shape, i, rope, qkv_bias=True, o_bias=True))
            mlp = DenseMLP(hidden, int(config.intermediate_size), str(config.hidden_act),
                           bias=True)
            return ParallelDecoderLayer(attention, mlp, norm, residual_last=True)

        super().__init__(config, DecoderModel(shape, layer, norm=norm))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(shape.vocab_size, hidden, bias=True, tied_to=tied)

    def rename(self, name: str) -> str | None:
        """HF's Phi names as the core's: ``self_attn.dense`` -> ``self_attn.o_proj``,
        ``mlp.fc1`` / ``fc2`` -> ``mlp.up_proj`` / ``down_proj``, ``model.final_layernorm``
        -> ``model.norm`` (LoRA adapters' targets ``dense``, ``fc1``, ``fc2`` map the same)."""
        for old, new in _RENAMES:
            if old in name:
                name = name.replace(old, new, 1)
                break
        return super().rename(name)
