"""Tencent's Youtu-LLM (``YoutuForCausalLM``: Youtu-LLM-2B), as transformers models it:
DeepSeek-V3's multi-head latent attention in a dense Llama stack.

- Attention: the core's MLA (:class:`~mrv2.layers.MLAAttention`): ``q_lora_rank`` (or a plain
  ``q_proj`` without one), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``; RoPE over the rotated part, interleaved pairs per ``rope_interleave``
  (default true), YaRN with DeepSeek's ``mscale`` terms where the config asks.
- MLP: every layer a dense SwiGLU MLP of ``intermediate_size``; no experts.
- Embeddings tied to the LM head by default (``tie_word_embeddings``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from mrv2.layers import CausalLM, DecoderModel, GatedMLP, RotaryEmbedding
from mrv2.layers.mla import MLAAttention, MLADecoderLayer, check_mla_config, mla_rope
from mrv2.layers.weights import StackedMapping
from mrv2_deepseek.model import GATE_UP

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "YoutuForCausalLM"


def youtu_layer(config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding
                ) -> MLADecoderLayer:
    """Layer ``layer_idx``: MLA, then a dense SwiGLU MLP."""
    attn = MLAAttention(config, layer_idx, rope,
                        bool(getattr(config, "rope_interleave", True)))
    mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    return MLADecoderLayer(config, attn, mlp)


class YoutuForCausalLM(CausalLM):
    """Youtu-LLM causal LM in the mrv2 model contract (module docstring)."""

    stacked_params: ClassVar[StackedMapping] = GATE_UP

    def __init__(self, config: PretrainedConfig) -> None:
        check_mla_config(config, ARCH)
        rope = mla_rope(config)
        super().__init__(config, DecoderModel(config, lambda i: youtu_layer(config, i, rope)))
