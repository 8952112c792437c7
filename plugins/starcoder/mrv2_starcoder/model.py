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

        def norm() -> LayerNorm:
            return LayerNorm(hidden, eps)

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias)
            mlp = DenseMLP(hidden, int(config.intermediate_size), act, bias)
            return DecoderLayer(config, attention, mlp, norm=norm)

        super().__init__(config, DecoderModel(config, layer, norm=norm))

    def rename(self, name: str) -> str | None:
        """HF's ``mlp.c_fc`` / ``mlp.c_proj`` as ``mlp.up_proj`` / ``mlp.down_proj``."""
        renamed = super().rename(name)
        if renamed is None:
            return None
        return renamed.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(
            ".mlp.c_proj.", ".mlp.down_proj.")
