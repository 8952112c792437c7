"""BigCode's GPTBigCode (``GPTBigCodeForCausalLM``: StarCoder, StarCoderBase, SantaCoder,
WizardCoder and the other fine-tunes), as HF transformers' ``modeling_gpt_bigcode``.

- No rotary embedding: learned absolute position embeddings, ``wpe`` ``[n_positions,
  hidden]``, added to the token embeddings (to prompts given as embeddings too, as HF adds
  them to ``inputs_embeds``) at each token's position, which the core passes every forward.
  ``n_positions`` is the context limit: the engine refuses a longer ``max_model_len``
  naming that field.
- Multi-query attention (``multi_query``, every published model: one key/value head, which
  every tensor-parallel rank keeps whole) or, with ``multi_query: false``, multi-head
  attention. The checkpoint fuses the projections into ``c_attn``, whose rows HF splits
  differently in the two modes: ``[q | k | v]`` with multi-query, one ``[q_h | k_h | v_h]``
  run of ``3 * head_dim`` rows a head without; both are split into the core's q/k/v shards
  as they load. (vLLM reads the multi-head layout as ``[q | k | v]`` too; HF is followed
  here.)
- Scores scaled by ``head_dim ** -0.5`` where ``scale_attn_weights`` (the default), else not
  at all. ``attention_softmax_in_fp32`` / ``scale_attention_softmax_in_fp32`` change no
  result: the softmax is in fp32 here as in HF's attention functions.
- The pre-norm layers of :mod:`mrv2_starcoder.model` (the core's LayerNorms with biases,
  ``layer_norm_epsilon``; the non-gated MLP ``c_fc`` / ``c_proj``, ``n_inner`` rows or
  ``4 * hidden``, ``activation_function``), biases everywhere, the LM head tied per
  ``tie_word_embeddings``.

Checkpoint names (``transformer.h.{i}.attn.c_attn`` ...) map to the core's (``model.layers.
{i}.self_attn.qkv_proj`` ...); LoRA adapters on ``c_attn`` (multi-query only: the multi-head
layout's rows are not the fused layer's), ``attn.c_proj``, ``mlp.c_fc`` and ``mlp.c_proj``
find their layers through the same mapping.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers import (
    QKV_PARAMS,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    DenseMLP,
    LayerNorm,
    SelfAttention,
)
from mrv2.layers.decoder import NormFactory
from mrv2.layers.weights import StackedMapping

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PretrainedConfig

#: A layer's fused ``c_attn`` tensor (with or without the ``transformer.`` prefix).
_C_ATTN = re.compile(r"^(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.(\w+)$")
#: HF's module names -> the core's, in order.
_NAMES = (
    ("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.wpe."),
    ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."),
    (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
    (".attn.c_proj.", ".self_attn.o_proj."), (".mlp.c_fc.", ".mlp.up_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
)


class PositionEmbedding(nn.Module):
    """A learned table ``[num_positions, dim]`` looked up at ``positions``; replicated on
    every tensor-parallel rank."""

    def __init__(self, num_positions: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_positions, dim))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)


class GPTBigCodeModel(DecoderModel):
    """:class:`~mrv2.layers.DecoderModel` with the absolute position embeddings ``wpe``
    added to its input embeddings (module docstring)."""

    def __init__(self, config: Any, make_layer: Callable[[int], nn.Module],
                 num_positions: int, norm: NormFactory) -> None:
        super().__init__(config, make_layer, norm=norm)
        self.wpe = PositionEmbedding(num_positions, int(config.hidden_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return super().forward(input_ids, positions, embeds + self.wpe(positions))


def check_config(config: Any) -> None:
    """ValueErrors naming the field for what this model does not run."""
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPTBigCode: add_cross_attention=true (an encoder-decoder) is not "
                         "supported; GPTBigCodeForCausalLM is a decoder")
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    if hidden % heads:
        raise ValueError(f"GPTBigCode: n_embd={hidden} is not divisible by n_head={heads}")


class GPTBigCodeForCausalLM(CausalLM):
    """GPTBigCode in the mrv2 model contract (module docstring)."""

    stacked_params: ClassVar[StackedMapping] = QKV_PARAMS

    def __init__(self, config: PretrainedConfig) -> None:
        check_config(config)
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        self.multi_query = bool(getattr(config, "multi_query", True))
        head_dim = hidden // heads
        kv_heads = 1 if self.multi_query else heads
        # (the config's own num_key_value_heads is not read: multi_query decides, as in HF)
        shape = SimpleNamespace(hidden_size=hidden, num_attention_heads=heads,
                                num_key_value_heads=kv_heads, head_dim=head_dim)
        scale = head_dim ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        eps = float(config.layer_norm_epsilon)
        inner = getattr(config, "n_inner", None) or 4 * hidden
        act = str(config.activation_function)

        def norm() -> LayerNorm:
            return LayerNorm(hidden, eps)

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(shape, i, None, qkv_bias=True, o_bias=True, scale=scale)
            mlp = DenseMLP(hidden, inner, act, bias=True, act_field="activation_function")
            return DecoderLayer(shape, attention, mlp, norm=norm)

        super().__init__(config, GPTBigCodeModel(config, layer,
                                                 int(config.max_position_embeddings), norm))
        self._head_dim, self._heads, self._kv_heads = head_dim, heads, kv_heads

    def rename(self, name: str) -> str | None:
        """HF's names as the core's (module docstring); the attention-mask buffers of old
        checkpoints (``attn.bias``, ``attn.masked_bias``) are skipped. ``c_attn`` maps to
        ``qkv_proj`` with multi-query attention only (what a LoRA adapter of it finds; the
        weights themselves are split before they get here)."""
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "transformer.bias":
            return None
        if name.startswith(("h.", "wte.", "wpe.", "ln_f.")):
            name = "transformer." + name  # (a GPTBigCodeModel saved without its LM head)
        for old, new in _NAMES:
            name = name.replace(old, new)
        if self.multi_query:
            name = name.replace(".attn.c_attn.", ".self_attn.qkv_proj.")
        else:
            name = name.replace(".attn.c_attn.", ".self_attn.c_attn.")
        return super().rename(name)

    def _split_c_attn(self, name: str, layer: str, what: str, t: torch.Tensor
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """The q, k and v rows of a fused ``c_attn`` weight or bias (module docstring), as
        the core's ``q_proj`` / ``k_proj`` / ``v_proj`` tensors of layer ``layer``."""
        d, heads, kv = self._head_dim, self._heads, self._kv_heads
        rows = (heads + 2 * kv) * d
        if what not in ("weight", "bias") or t.dim() < 1 or t.shape[0] != rows:
            raise ValueError(f"checkpoint tensor {name!r} {tuple(t.shape)}: mrv2 loads the "
                             f"fused c_attn's weight and bias ({rows} rows: q, k and v), whose "
                             f"rows it splits by head; this tensor (a quantized checkpoint's?) "
                             f"cannot be split so")
        if self.multi_query:
            q, k, v = t.split([heads * d, d, d])
        else:  # one [q_h | k_h | v_h] run of rows a head
            per_head = t.reshape(heads, 3, d, *t.shape[1:])
            q, k, v = (per_head[:, j].reshape(heads * d, *t.shape[1:]) for j in range(3))
        prefix = f"model.layers.{layer}.self_attn"
        yield f"{prefix}.q_proj.{what}", q
        yield f"{prefix}.k_proj.{what}", k
        yield f"{prefix}.v_proj.{what}", v

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            m = _C_ATTN.match(name)
            if m is None:
                yield name, t
            else:
                yield from self._split_c_attn(name, m.group(1), m.group(2), t)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, each ``c_attn`` split into q, k and v as it streams."""
        return super().load_weights(self._convert(weights))
