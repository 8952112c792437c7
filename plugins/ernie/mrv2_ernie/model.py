"""ERNIE 4.5 (``Ernie4_5ForCausalLM``: ERNIE-4.5-0.3B; ``Ernie4_5_MoeForCausalLM``:
ERNIE-4.5-21B-A3B, 300B-A47B): a Llama-like pre-norm decoder whose projections are biased per
``use_bias``, with two twists.

- Interleaved RoPE: ERNIE rotates the pairs ``(x0, x1), (x2, x3), ...`` of each head (GPT-J's
  layout), the core's attention the halves ``(x_i, x_{i + d/2})`` (NeoX's). As each q/k
  projection tensor loads, every head's output rows (and bias) are put in the halves order,
  even rows then odd (:func:`deinterleave_heads`): q and k are permuted alike, so the scores
  are ERNIE's, and v and o are untouched. The whole checkpoint tensor is permuted before a
  rank takes its heads (a permutation inside each head), and a LoRA adapter's ``B`` rows take
  the same order (``qkv_proj.row_order``).
- The MoE model: layer ``i`` routes to experts where ``(i + 1) % moe_layer_interval == 0``
  and ``moe_layer_start_index <= i <= moe_layer_end_index`` (-1: the last layer), else it keeps
  a dense MLP of ``intermediate_size``. The router (HF's ``mlp.gate``, fp32 weight) picks the
  top ``moe_k`` of ``softmax(logits) + e_score_correction_bias`` (``mlp.moe_statics.*`` in the
  checkpoints, ``[1, E]``) and weighs them by their softmax probabilities renormalized by
  their sum, clamped at ``moe_norm_min``: the core's
  :class:`~mrv2.layers.moe.GroupedTopKRouter` with softmax scores and one group. Shared
  experts (one SwiGLU MLP ``moe_num_shared_experts * moe_intermediate_size`` wide, biased per
  ``use_bias``) see every token and add to the routed output. The LM head is biased per
  ``use_bias`` there (the dense model's never is).

Embeddings are tied per ``tie_word_embeddings`` (the published models tie them). The published
multi-token-prediction modules (``mtp_*``) are not loaded: no speculator drafts with them yet.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    GroupedTopKRouter,
    LMHead,
    MoEBlock,
    SelfAttention,
    get_rope,
    head_dim_of,
    qk_rows_to_halves,
    rope_heads_to_halves,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: Each head's q/k rows from RoPE pairs to halves (a module name: the reorder test swaps it).
deinterleave_heads = rope_heads_to_halves
#: A checkpoint tensor of a q or k projection: (``q`` / ``k``, what it is).
_QK = re.compile(r"\.self_attn\.([qk])_proj\.(\w+)$")
#: The published multi-token-prediction modules (``model.mtp_block.0.*``, ``mtp_emb_norm``...).
_MTP = re.compile(r"(^|\.)mtp_")


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` routes to experts (module docstring)."""
    end = getattr(config, "moe_layer_end_index", -1)
    last = int(config.num_hidden_layers) - 1 if end is None or int(end) == -1 else int(end)
    start = int(getattr(config, "moe_layer_start_index", 0) or 0)
    interval = int(getattr(config, "moe_layer_interval", 1) or 1)
    return (int(getattr(config, "moe_num_experts", 0) or 0) > 0
            and (layer_idx + 1) % interval == 0 and start <= layer_idx <= last)


def ernie_moe_block(config: Any) -> MoEBlock:
    """The router ``gate``, the routed ``experts`` and the ``shared_experts`` (module
    docstring)."""
    if config.hidden_act != "silu":
        raise ValueError(f"ERNIE 4.5 experts support hidden_act 'silu' only, got "
                         f"{config.hidden_act!r}")
    hidden, inter = int(config.hidden_size), int(config.moe_intermediate_size)
    experts, top_k = int(config.moe_num_experts), int(config.moe_k)
    norm_min = getattr(config, "moe_norm_min", None)
    router = GroupedTopKRouter(hidden, experts, top_k, renormalize=True, scoring="softmax",
                               correction_bias=True, fp32_weight=True,
                               norm_min=1e-12 if norm_min is None else float(norm_min))
    shared = None
    num_shared = int(getattr(config, "moe_num_shared_experts", 0) or 0)
    if num_shared:
        shared = GatedMLP(hidden, inter * num_shared, config.hidden_act,
                          bias=bool(getattr(config, "use_bias", False)))
    return MoEBlock(router, FusedMoE(experts, hidden, inter), shared)


class _Ernie(CausalLM):
    """What both ERNIE 4.5 models share: biased attention with q/k rows reordered for the
    interleaved RoPE, the checkpoints' names (module docstring)."""

    def __init__(self, config: PretrainedConfig, make_mlp: Callable[[int], nn.Module],
                 lm_head_bias: bool) -> None:
        bias = bool(getattr(config, "use_bias", False))
        head_dim = head_dim_of(config)
        rope = get_rope(config, head_dim)

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias)
            qkv = attention.qkv_proj
            qkv.row_order = functools.partial(qk_rows_to_halves, qkv)
            return DecoderLayer(config, attention, make_mlp(i))

        super().__init__(config, DecoderModel(config, layer))
        if lm_head_bias:
            tied = self.model.embed_tokens if self.tie_word_embeddings else None
            self.lm_head = LMHead(config.vocab_size, config.hidden_size, bias=True, tied_to=tied)
        self._qk_head_dim = head_dim
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        #: The whole q and k projections' output rows.
        self._qk_rows = {"q": heads * head_dim, "k": kv_heads * head_dim}

    def rename(self, name: str) -> str | None:
        """The correction bias (``mlp.moe_statics.*``, HF's ``mlp.gate.moe_statics.*``) on the
        router; the MTP modules skipped."""
        if _MTP.search(name):
            return None
        name = name.replace(".mlp.gate.moe_statics.", ".mlp.gate.")
        return super().rename(name.replace(".mlp.moe_statics.", ".mlp.gate."))

    def _qk_tensor(self, name: str, kind: str, what: str, t: torch.Tensor) -> torch.Tensor:
        """A q/k projection's checkpoint tensor with its heads' rows in the halves order:
        the weight, the bias and per-row scales permuted; a per-tensor scale, and block
        scales whose blocks hold whole heads, kept as they are."""
        rows, d = self._qk_rows[kind], self._qk_head_dim
        if what in ("weight", "bias", "weight_scale", "weight_scale_inv") and (
                t.dim() >= 1 and t.shape[0] == rows):
            return deinterleave_heads(t, d)
        if what.endswith("scale") and t.numel() == 1 or (
                what == "weight_scale_inv" and t.dim() == 2 and -(-rows // t.shape[0]) % d == 0):
            return t  # (no row leaves its block)
        raise ValueError(f"checkpoint tensor {name!r} {tuple(t.shape)}: ERNIE 4.5 reorders "
                         f"the q/k projections' rows for its interleaved RoPE, which this "
                         f"tensor's layout does not allow (a quantized format?)")

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            m = _QK.search(name)
            if m is not None and not _MTP.search(name):
                t = self._qk_tensor(name, m.group(1), m.group(2), t)
            elif name.endswith("e_score_correction_bias") and t.dim() == 2:
                t = t.reshape(-1)  # [1, E] (one expert group) -> [E]
            yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, the q/k rows reordered and the correction bias flattened as
        they stream (module docstring)."""
        return super().load_weights(self._convert(weights))


class Ernie4_5ForCausalLM(_Ernie):
    """ERNIE 4.5 dense causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        bias = bool(getattr(config, "use_bias", False))
        super().__init__(config, lambda i: GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, bias=bias),
            lm_head_bias=False)


class Ernie4_5_MoeForCausalLM(_Ernie):
    """ERNIE 4.5 MoE causal LM in the mrv2 model contract: the MoE block or a dense MLP per
    layer (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        bias = bool(getattr(config, "use_bias", False))

        def mlp(i: int) -> nn.Module:
            if is_moe_layer(config, i):
                return ernie_moe_block(config)
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=bias)

        super().__init__(config, mlp, lm_head_bias=bias)
