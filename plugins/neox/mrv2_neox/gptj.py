"""EleutherAI's GPT-J (``GPTJForCausalLM``: GPT-J-6B and its fine-tunes), as HF transformers'
``modeling_gptj``.

- A parallel block (:class:`~mrv2.layers.ParallelDecoderLayer`, StableLM's form: no
  ``post_attention_layernorm``): ``ln_1`` feeds both the attention and the MLP, summed as HF
  does, ``(attn + mlp) + x``. LayerNorms with a bias (``layer_norm_epsilon``), the final
  ``ln_f`` too.
- Attention: multi-head, q/k/v and ``out_proj`` without biases, head size ``n_embd //
  n_head``; RoPE (base 10000, fixed in HF) over each head's first ``rotary_dim`` dims in
  *interleaved* pairs ``(x0, x1), (x2, x3), ...`` (HF's ``rotate_every_two``), the rest
  passed through. The core rotates halves, so as each q/k projection weight loads, every
  head's first ``rotary_dim`` rows are put in the halves order, even rows then odd
  (:func:`~mrv2.layers.qk_tensor_to_halves` with ``leading=True``): q and k move alike, so
  the scores are GPT-J's, and v / o are untouched; a LoRA adapter's ``B`` rows take the same
  order (``qkv_proj.row_order``). ``rotary_dim`` null (HF then builds a table over the whole
  ``n_embd``, which only broadcasts for one head) is refused, as an odd one or one past the
  head size.
- MLP: ``fc_in`` -> ``activation_function`` (``gelu_new``) -> ``fc_out``, both biased,
  ``n_inner`` wide (``4 * n_embd`` where null): the core's
  :class:`~mrv2.layers.DenseMLP`.
- The head ``lm_head`` has a bias; untied in the published checkpoints, tied (the weight,
  not the bias) where ``tie_word_embeddings`` says so, as HF ties it.

The checkpoints' causal-mask buffers (``attn.bias``, ``attn.masked_bias``) and RoPE tables
(``attn.embed_positions``) are skipped. Dropout is ignored (inference).
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
    DecoderModel,
    DenseMLP,
    LayerNorm,
    LMHead,
    ParallelDecoderLayer,
    RotaryEmbedding,
    SelfAttention,
    qk_rows_to_halves,
    qk_tensor_to_halves,
)
from mrv2.layers.weights import StackedMapping
from mrv2_neox.model import config_shape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: GPT-J's RoPE base (HF's ``create_sinusoidal_positions``: not a config field).
GPTJ_ROPE_BASE = 10000.0
#: A q or k projection's tensor, by the core's names: (``q`` / ``k``, what it is).
_QK = re.compile(r"\.self_attn\.([qk])_proj\.(\w+)$")
#: Buffers older GPT-J exports save with the weights.
_BUFFER = re.compile(r"\.attn\.(bias|masked_bias|embed_positions)$")
#: GPT-J layer names -> the core's, first match wins.
_LAYER_RENAMES = (("ln_1.", "input_layernorm."), ("attn.out_proj.", "self_attn.o_proj."),
                  ("attn.", "self_attn."), ("mlp.fc_in.", "mlp.up_proj."),
                  ("mlp.fc_out.", "mlp.down_proj."))


def gptj_rotary_dim(config: PretrainedConfig, head_dim: int) -> int:
    """``config.rotary_dim``: the leading dims of each head RoPE rotates; a ValueError naming
    the field unless it is even and in ``(0, head_dim]``."""
    rotary = getattr(config, "rotary_dim", None)
    if rotary is None or not 0 < int(rotary) <= head_dim or int(rotary) % 2:
        raise ValueError(f"GPTJForCausalLM: config.json rotary_dim = {rotary!r}: must be an "
                         f"even number of dims in (0, head_dim = {head_dim}]")
    return int(rotary)


class GPTJForCausalLM(CausalLM):
    """GPT-J in the mrv2 model contract (module docstring)."""

    #: q/k/v only: the MLP's ``up_proj`` (``fc_in``) is a projection of its own.
    stacked_params: ClassVar[StackedMapping] = QKV_PARAMS

    def __init__(self, config: PretrainedConfig) -> None:
        shape = config_shape(config, eps_field="layer_norm_epsilon")
        head_dim, hidden, eps = shape.head_dim, shape.hidden_size, shape.rms_norm_eps
        self._rotary_dim = gptj_rotary_dim(config, head_dim)
        rope = RotaryEmbedding(head_dim, max_position=int(config.max_position_embeddings),
                               base=GPTJ_ROPE_BASE, rotary_dim=self._rotary_dim)
        inner = getattr(config, "n_inner", None) or 4 * hidden

        def norm() -> LayerNorm:
            return LayerNorm(hidden, eps)

        def layer(i: int) -> ParallelDecoderLayer:
            attention = SelfAttention(shape, i, rope)
            attention.qkv_proj.row_order = functools.partial(
                qk_rows_to_halves, attention.qkv_proj, rotary_dim=self._rotary_dim,
                leading=True)
            mlp = DenseMLP(hidden, int(inner), str(config.activation_function), bias=True,
                           act_field="activation_function")
            return ParallelDecoderLayer(attention, mlp, norm, residual_last=True)

        super().__init__(config, DecoderModel(shape, layer, norm=norm))
        tied = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(shape.vocab_size, hidden, bias=True, tied_to=tied)
        self._head_dim = head_dim
        self._qk_rows = shape.num_attention_heads * head_dim

    def rename(self, name: str) -> str | None:
        """HF's GPT-J names as the core's (``transformer.wte`` -> ``model.embed_tokens``,
        ``transformer.h.{i}`` -> ``model.layers.{i}``, ``ln_1`` -> ``input_layernorm``,
        ``attn.out_proj`` -> ``self_attn.o_proj``, ``attn.{q,k,v}_proj`` ->
        ``self_attn.{q,k,v}_proj``, ``mlp.fc_in`` / ``fc_out`` -> ``mlp.up_proj`` /
        ``down_proj``, ``transformer.ln_f`` -> ``model.norm``); the saved buffers skipped."""
        if _BUFFER.search(name):
            return None
        if name.startswith("transformer."):
            name = "model." + name.removeprefix("transformer.")
            name = name.replace("model.wte.", "model.embed_tokens.", 1).replace(
                "model.ln_f.", "model.norm.", 1).replace("model.h.", "model.layers.", 1)
            for old, new in _LAYER_RENAMES:
                if f".{old}" in name:
                    name = name.replace(f".{old}", f".{new}", 1)
                    break
        return super().rename(name)

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, each q/k projection tensor with every head's first
        ``rotary_dim`` rows in the halves order (module docstring)."""
        for name, t in weights:
            target = self.rename(name)
            m = _QK.search(target) if target is not None else None
            if m is not None:
                t = qk_tensor_to_halves(name, m.group(2), t, self._qk_rows, self._head_dim,
                                        "GPT-J", rotary_dim=self._rotary_dim, leading=True)
            yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, the q/k rows reordered as they stream."""
        return super().load_weights(self._convert(weights))
