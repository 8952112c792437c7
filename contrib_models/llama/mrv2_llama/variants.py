"""Llama-like decoders that differ from Llama in one or two places, as transformers 5.17 builds
them (``transformers.models.{arcee,helium,ministral3,apertus,jais2}``):

- Arcee AFM (``ArceeForCausalLM``: AFM-4.5B): Llama's attention (biases per
  ``attention_bias``), a dense MLP ``down_proj(relu2(up_proj(x)))`` (squared ReLU, no gate;
  biases per ``mlp_bias``).
- Inception's Jais 2 (``Jais2ForCausalLM``: Jais-2-8B-Chat): Arcee's layers (a dense
  squared-ReLU MLP of ``hidden_act``, biases per ``mlp_bias``; all four attention projections
  biased per ``attention_bias``) under LayerNorms with biases (``layer_norm_eps``) in place of
  the RMSNorms, the final norm too.
- Swiss AI Apertus (``ApertusForCausalLM``: Apertus 8B / 70B): Llama's attention with per-head
  q/k RMSNorms before the rotation, Llama 3 RoPE scaling, a dense MLP with the xIELU activation
  whose ``alpha_p`` / ``alpha_n`` (before their softplus) and ``beta`` / ``eps`` each layer
  learns (``mlp.act_fn.*``; :class:`~mrv2.layers.XIELU`); the norms named
  ``attention_layernorm`` / ``feedforward_layernorm``.
- Kyutai Helium (``HeliumForCausalLM``: Helium-1 2B): Llama's layers, q/k/v biased per
  ``attention_bias`` and the output projection never, and RoPE over interleaved pairs
  ``(x0, x1), (x2, x3), ...`` of each head (GPT-J's layout) where the core rotates halves: as
  the q and k projections load, each head's rows (weight, bias, per-row scales) are put in
  the halves order (:func:`~mrv2.layers.qk_tensor_to_halves`); q and k permuted alike keep
  their scores, v and o are untouched, and a LoRA adapter's ``B`` rows take the same order
  (``qkv_proj.row_order``). HF's norms multiply by their weight in fp32 before rounding,
  the core's after (the same in fp32; in bf16 a rounding apart, as Gemma's).
- Ministral 3 text-only (``Ministral3ForCausalLM``): Mistral's layers (no biases, the
  config's ``sliding_window`` on every layer), each query at position ``p`` times ``1 + beta
  * log(1 + floor(p / original_max_position_embeddings))`` (``rope_parameters``'
  ``llama_4_scaling_beta``; the core's :class:`~mrv2.layers.ScaledQueryAttention`, which the
  vision-language Mistral 3 uses too), RoPE per ``rope_parameters`` (YaRN in the published
  models).

Ministral 8B's ``MinistralForCausalLM`` (``layer_types``: sliding and full layers) is Llama's
decoder as :class:`~mrv2_llama.model.LlamaForCausalLM` builds it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

import torch

from mrv2.layers import (
    QKV_PARAMS,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    DenseMLP,
    GatedMLP,
    LayerNorm,
    ScaledQueryAttention,
    SelfAttention,
    get_rope,
    head_dim_of,
    llama4_query_scaling,
    qk_rows_to_halves,
    qk_tensor_to_halves,
)
from mrv2.layers.decoder import NormFactory
from mrv2.layers.weights import StackedMapping

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: A q or k projection's checkpoint tensor (after renaming): ``q`` / ``k``, what it is.
_QK = re.compile(r"\.self_attn\.([qk])_proj\.(\w+)$")


class _DenseMLPDecoder(CausalLM):
    """Llama's attention (biases per ``attention_bias``; per-head q/k RMSNorms with
    ``qk_norm``) and a dense :class:`~mrv2.layers.DenseMLP` of ``hidden_act``; ``norm``: what
    builds every norm (default the config's RMSNorm)."""

    stacked_params: ClassVar[StackedMapping] = QKV_PARAMS

    def __init__(self, config: PretrainedConfig, qk_norm: bool, mlp_bias: bool,
                 norm: NormFactory | None = None) -> None:
        rope = get_rope(config, head_dim_of(config))
        bias = bool(getattr(config, "attention_bias", False))

        def layer(i: int) -> DecoderLayer:
            attn = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm)
            mlp = DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           bias=mlp_bias)
            return DecoderLayer(config, attn, mlp, norm=norm)

        super().__init__(config, DecoderModel(config, layer, norm=norm))


class ArceeForCausalLM(_DenseMLPDecoder):
    """Arcee AFM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, qk_norm=False,
                         mlp_bias=bool(getattr(config, "mlp_bias", False)))


class Jais2ForCausalLM(_DenseMLPDecoder):
    """Jais 2 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        hidden, eps = int(config.hidden_size), float(config.layer_norm_eps)
        super().__init__(config, qk_norm=False,
                         mlp_bias=bool(getattr(config, "mlp_bias", False)),
                         norm=lambda: LayerNorm(hidden, eps))


class ApertusForCausalLM(_DenseMLPDecoder):
    """Apertus in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, qk_norm=True, mlp_bias=False)  # (HF's MLP: never biased)

    def rename(self, name: str) -> str | None:
        """HF's ``attention_layernorm`` / ``feedforward_layernorm`` as the core layer's
        ``input_layernorm`` / ``post_attention_layernorm``."""
        renamed = super().rename(name)
        if renamed is None:
            return None
        return renamed.replace(".attention_layernorm.", ".input_layernorm.").replace(
            ".feedforward_layernorm.", ".post_attention_layernorm.")


class HeliumForCausalLM(CausalLM):
    """Helium in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        head_dim = head_dim_of(config)
        rope = get_rope(config, head_dim)
        bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))

        def layer(i: int) -> DecoderLayer:
            attn = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=False)
            attn.qkv_proj.row_order = functools.partial(qk_rows_to_halves, attn.qkv_proj)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                           bias=mlp_bias)
            return DecoderLayer(config, attn, mlp)

        super().__init__(config, DecoderModel(config, layer))
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self._head_dim = head_dim
        #: The whole q and k projections' output rows.
        self._qk_rows = {"q": heads * head_dim, "k": kv_heads * head_dim}

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            target = self.rename(name)
            m = _QK.search(target) if target is not None else None
            if m is not None:
                t = qk_tensor_to_halves(name, m.group(2), t, self._qk_rows[m.group(1)],
                                        self._head_dim, "Helium")
            yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, the q/k rows reordered as they stream (module docstring)."""
        return super().load_weights(self._convert(weights))


class Ministral3ForCausalLM(CausalLM):
    """Ministral 3's text-only decoder in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        scaling = llama4_query_scaling(config)
        rope = get_rope(config, head_dim_of(config))

        def layer(i: int) -> DecoderLayer:
            attn = ScaledQueryAttention(config, i, rope, scaling)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return DecoderLayer(config, attn, mlp)

        super().__init__(config, DecoderModel(config, layer))
