"""Phi-3.5-MoE (``PhiMoEForCausalLM``, as the published config names it; transformers'
``PhimoeForCausalLM``), as transformers' ``modeling_phimoe`` runs it in eval mode.

- Norms: LayerNorms with a weight and a bias (mean subtracted; ``rms_norm_eps``, the config's
  only eps), before the attention, before the MoE block and at the end: the core's
  :class:`~mrv2.layers.LayerNorm` (the residual add fused); the fused norm + GEMV kernel of
  decode steps, an RMSNorm's, does not apply.
- Attention: GQA, the q/k/v and output projections biased per ``attention_bias`` (the
  published model: biased), whole-head neox RoPE with LongRoPE (the core's ``longrope``:
  ``short_factor`` rows below ``original_max_position_embeddings``, ``long_factor`` rows from
  there, each scaled by the config's ``short_mscale`` / ``long_mscale``); the config's
  ``sliding_window`` on every layer where set. Past the original length transformers keeps the
  short factors with ``long_mscale`` (its PhiMoE recomputes the frequencies without the
  sequence length) and vLLM switches to the long ones: this follows vLLM there.
- MoE: ``num_local_experts`` SwiGLU experts of ``intermediate_size`` on the core's fused MoE,
  no shared expert, routed by SparseMixer (:func:`sparsemixer_top2`: the eval-mode top-2 of
  ``router_jitter_noise``'s masked softmaxes; the noise itself, ``router_jitter_noise`` and
  ``input_jitter_noise``, is training only).
- The LM head biased per ``lm_head_bias``.

Checkpoint names: the published ``block_sparse_moe.gate`` / ``block_sparse_moe.experts.{e}.w1``
(gate), ``w3`` (up), ``w2`` (down), and transformers 5's ``mlp.router`` with stacked
``mlp.experts.gate_up_proj`` / ``down_proj``, both load into the MoE block's ``gate`` and its
fused experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    LayerNorm,
    LMHead,
    MoEBlock,
    SelfAttention,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def sparsemixer_top2(logits: torch.Tensor, jitter_eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMixer's inference routing (transformers' ``sparsemixer`` in eval mode): ``logits``
    ``[T, E]`` -> ``(topk_weights fp32, topk_ids int32)`` ``[T, 2]``.

    The first expert is the best logit ``m1``; its weight is its probability in a softmax over
    the experts whose ``(m1 - s) / max(|s|, m1)`` is at most ``2 * jitter_eps`` (the others
    masked out). The second is the best of the rest ``m2``, weighted by its probability in a
    softmax over the rest within ``2 * jitter_eps`` of it, measured the same way against
    ``m2``. The weights are not renormalized. Computed in ``logits``' dtype with transformers'
    operations (so its numbers, bf16 included), then widened; device ops of fixed shapes only
    (no host read: it records into a CUDA graph)."""
    ids1, weights1, rest = _sparsemixer_pick(logits, logits, jitter_eps)
    ids2, weights2, _ = _sparsemixer_pick(rest, logits, jitter_eps)
    weights = torch.cat([weights1, weights2], dim=-1).float()
    return weights, torch.cat([ids1, ids2], dim=-1).to(torch.int32)


def _sparsemixer_pick(candidates: torch.Tensor, scores: torch.Tensor, jitter_eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best of ``candidates`` (``scores`` with the experts already picked at -inf): its
    index ``[T, 1]``, its masked-softmax weight ``[T, 1]`` (the mask measured on ``scores``),
    and ``candidates`` with it at -inf too."""
    best, ids = candidates.max(dim=-1, keepdim=True)
    factor = scores.abs().clamp(min=best)
    outside = ((best - scores) / factor) > (2 * jitter_eps)
    probs = torch.softmax(candidates.masked_fill(outside, float("-inf")), dim=-1)
    return ids, probs.gather(-1, ids), candidates.scatter(-1, ids, float("-inf"))


class SparseMixerRouter(nn.Module):
    """Phi-3.5-MoE's router: ``x @ weight.T`` in the model dtype (no bias), then
    :func:`sparsemixer_top2`; ``forward(x)`` returns ``(topk_weights fp32, topk_ids int32)``
    ``[T, 2]`` as :class:`~mrv2.layers.FusedMoE` takes them. Replicated on every rank."""

    def __init__(self, hidden_size: int, num_experts: int, jitter_eps: float) -> None:
        super().__init__()
        self.jitter_eps = float(jitter_eps)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        return sparsemixer_top2(logits.reshape(-1, logits.shape[-1]), self.jitter_eps)

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k=2, jitter_eps={self.jitter_eps}"


def validate_phimoe_config(config: Any, arch: str) -> None:
    """Raise a ``ValueError`` naming the field if ``config`` is not a Phi-3.5-MoE model this
    plugin runs (before anything is built)."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{arch}: config.{field} = {getattr(config, field, None)!r}: {what}")

    need(config.hidden_act == "silu", "hidden_act", "the experts support 'silu' only")
    need(int(config.num_experts_per_tok) == 2, "num_experts_per_tok",
         "SparseMixer routes every token to 2 experts")
    need(int(config.num_local_experts) >= 2, "num_local_experts", "must be at least 2")


class PhiMoEForCausalLM(CausalLM):
    """Phi-3.5-MoE causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        validate_phimoe_config(config, type(self).__name__)
        head_dim = head_dim_of(config)
        rope = get_rope(config, head_dim)
        eps = float(config.rms_norm_eps)
        bias = bool(getattr(config, "attention_bias", False))
        experts = int(config.num_local_experts)
        jitter = float(getattr(config, "router_jitter_noise", 0.0) or 0.0)

        def norm() -> LayerNorm:
            return LayerNorm(config.hidden_size, eps)

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias)
            router = SparseMixerRouter(config.hidden_size, experts, jitter)
            moe = MoEBlock(router, FusedMoE(experts, config.hidden_size,
                                            config.intermediate_size))
            return DecoderLayer(config, attention, moe, norm=norm)

        super().__init__(config, DecoderModel(config, layer, norm=norm))
        if getattr(config, "lm_head_bias", False):
            tied = self.model.embed_tokens if self.tie_word_embeddings else None
            self.lm_head = LMHead(config.vocab_size, config.hidden_size, bias=True, tied_to=tied)

    def rename(self, name: str) -> str | None:
        """The published ``block_sparse_moe`` and transformers 5's ``mlp.router`` as the MoE
        block's ``mlp`` / ``mlp.gate``."""
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
        return super().rename(name)


class PhimoeForCausalLM(PhiMoEForCausalLM):
    """transformers' name of :class:`PhiMoEForCausalLM` (what its ``save_pretrained`` writes in
    ``architectures``)."""
