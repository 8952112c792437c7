"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``), as HF transformers' ``modeling_starcoder2``,
and the pieces it shares with :mod:`mrv2_starcoder.gpt_bigcode` (StarCoder, SantaCoder).

- The core's pre-norm layers (``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``) whose norms are
  LayerNorms with a bias (the core's :class:`~mrv2.layers.LayerNorm`: mean subtracted, fp32
  math rounded once as ``nn.LayerNorm``, ``norm_epsilon``; one kernel with the residual add
  before it), not RMSNorms: the core's fused norm + GEMV decode kernel does not apply, and
  each norm runs before its projection (the unfused path).
- A non-gated MLP, ``c_proj(act(c_fc(x)))`` (``hidden_act``, GELU with the tanh approximation
  in the published models), loaded as ``up_proj`` / ``down_proj`` so LoRA adapters on
  ``c_fc`` / ``c_proj`` find them; biases on every projection per ``use_bias``.
- Grouped-query attention with RoPE over halves (``rope_parameters``' ``rope_theta``, the core's
  rotation, fused into the attention kernel); ``sliding_window`` on every layer (null: full
  attention), so the layers keep block tables of their own.
- The LM head tied to the embedding per ``tie_word_embeddings`` (the published models tie it).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar

from mrv2.layers import (
    QKV_PARAMS,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    DenseMLP,
    LayerNorm,
    SelfAttention,
    get_rope,
    head_dim_of,
)
from mrv2.layers.weights import StackedMapping

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def pre_norm_layer(hidden_size: int, eps: float, self_attn: SelfAttention,
                   mlp: DenseMLP) -> DecoderLayer:
    """The core's pre-norm :class:`~mrv2.layers.DecoderLayer` (``input_layernorm``,
    ``self_attn``, ``post_attention_layernorm``, ``mlp``) with LayerNorms with biases."""
    layer = DecoderLayer(SimpleNamespace(hidden_size=hidden_size, rms_norm_eps=eps),
                         self_attn, mlp)
    layer.input_layernorm = LayerNorm(hidden_size, eps)
    layer.post_attention_layernorm = LayerNorm(hidden_size, eps)
    return layer


def decoder_shape(vocab_size: int, hidden_size: int, num_layers: int, eps: float
                  ) -> SimpleNamespace:
    """What :class:`~mrv2.layers.DecoderModel` reads of a config (its final RMSNorm's
    ``rms_norm_eps`` too, which a :class:`~mrv2.layers.LayerNorm` then replaces)."""
    return SimpleNamespace(vocab_size=vocab_size, hidden_size=hidden_size,
                           num_hidden_layers=num_layers, rms_norm_eps=eps)


class Starcoder2ForCausalLM(CausalLM):
    """StarCoder2 in the mrv2 model contract (module docstring)."""

    stacked_params: ClassVar[StackedMapping] = QKV_PARAMS

    def __init__(self, config: PretrainedConfig) -> None:
        head_dim = head_dim_of(config)
        rope = get_rope(config, head_dim)
        eps = float(config.norm_epsilon)
        bias = bool(getattr(config, "use_bias", True))
        act = str(config.hidden_act)
        hidden = int(config.hidden_size)

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias)
            mlp = DenseMLP(hidden, int(config.intermediate_size), act, bias)
            return pre_norm_layer(hidden, eps, attention, mlp)

        model = DecoderModel(decoder_shape(int(config.vocab_size), hidden,
                                           int(config.num_hidden_layers), eps), layer)
        model.norm = LayerNorm(hidden, eps)
        super().__init__(config, model)

    def rename(self, name: str) -> str | None:
        """HF's ``mlp.c_fc`` / ``mlp.c_proj`` as ``mlp.up_proj`` / ``mlp.down_proj``."""
        renamed = super().rename(name)
        if renamed is None:
            return None
        return renamed.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(
            ".mlp.c_proj.", ".mlp.down_proj.")
