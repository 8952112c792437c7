"""Liquid AI's LFM2-MoE (``Lfm2MoeForCausalLM``: LFM2-8B-A1B): LFM2's stack
(:mod:`mrv2_lfm2.model`: the same ``layer_types`` of gated short convolutions and attention
layers, the same norms, names and per-request convolution state) whose feed-forwards are, as
transformers 5.17's ``modeling_lfm2_moe`` builds them:

* layers ``0 .. num_dense_layers - 1``: a dense SwiGLU (``w1``, ``w3``, ``w2``) of exactly
  ``intermediate_size`` (no ``block_auto_adjust_ff_dim`` sizing: LFM2-MoE's config has none);
* every later layer: a sparse MoE block (HF's ``Lfm2MoeSparseMoeBlock``) of ``num_experts``
  SwiGLU experts of ``moe_intermediate_size``, no shared expert. The router (``gate``, no
  bias) scores each expert ``sigmoid(gate(x))``; the ``num_experts_per_tok`` experts with the
  best ``score + expert_bias`` are picked (``use_expert_bias``; else the best scores), their
  uncorrected scores are the weights, divided by their sum when ``norm_topk_prob``, then
  times ``routed_scaling_factor``. That is DeepSeek-V3's routing with one group: the core's
  :class:`~mrv2.layers.GroupedTopKRouter` (``n_group = topk_group = 1``, sigmoid, the
  checkpoint's ``feed_forward.expert_bias`` as its fp32 correction bias) before the core's
  :class:`~mrv2.layers.FusedMoE`.

Two differences from HF's arithmetic, both below fp32 rounding of the outputs: the router's
logits are computed in fp32 (HF: the model dtype; vLLM likewise scores in fp32), and the
renormalizing sum gets 1e-20 added where HF adds 1e-6 (vLLM adds nothing): a relative
change of the weights of 1e-6 over the picked sigmoid scores' sum (near 1 and above in
trained routers).

Checkpoints keep each expert's ``feed_forward.experts.{e}.w1`` / ``w3`` / ``w2`` (or
transformers 5's stacked ``gate_up_proj`` / ``down_proj`` in memory); the loader stacks them.
Tensor parallelism: as LFM2, plus each expert's intermediate columns split over the ranks
(the router replicated), or with expert parallelism whole experts per rank (the core's
:class:`~mrv2.layers.FusedMoE`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mrv2.layers import FusedMoE, GatedMLP, GroupedTopKRouter, MoEBlock
from mrv2_lfm2.model import Lfm2ForCausalLM

FAMILY = "LFM2-MoE"


def is_dense_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` keeps a dense SwiGLU (``layer_idx < num_dense_layers``,
    HF's test) rather than the MoE block."""
    return layer_idx < int(getattr(config, "num_dense_layers", 2))


def lfm2_moe_block(config: Any) -> MoEBlock:
    """The sparse MoE block (module docstring): the sigmoid router ``gate`` with the expert
    bias as its correction, the routed ``experts``; ValueError naming the field for a bad
    ``num_experts`` / ``num_experts_per_tok`` / ``moe_intermediate_size``."""
    experts, top_k = int(config.num_experts), int(config.num_experts_per_tok)
    width = int(config.moe_intermediate_size)
    if experts < 1 or width < 1:
        raise ValueError(f"{FAMILY}: num_experts ({experts}) and moe_intermediate_size "
                         f"({width}) must be at least 1")
    router = GroupedTopKRouter(
        int(config.hidden_size), experts, top_k, n_group=1, topk_group=1,
        renormalize=bool(getattr(config, "norm_topk_prob", True)),
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)),
        scoring="sigmoid", correction_bias=bool(getattr(config, "use_expert_bias", True)))
    return MoEBlock(router, FusedMoE(experts, int(config.hidden_size), width))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE in the mrv2 model contract (module docstring): LFM2's layers with a dense
    SwiGLU or a sparse MoE block as each one's ``feed_forward``."""

    @classmethod
    def feed_forward_of(cls, config: Any, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s dense SwiGLU of ``intermediate_size`` or its MoE block."""
        if is_dense_layer(config, layer_idx):
            return GatedMLP(int(config.hidden_size), int(config.intermediate_size), "silu")
        return lfm2_moe_block(config)

    def rename(self, name: str) -> str | None:
        """LFM2's names, plus the MoE block's ``feed_forward.expert_bias`` (a buffer in HF)
        onto its router's ``gate.e_score_correction_bias``; skipped where
        ``use_expert_bias`` is off (HF reads no bias then)."""
        if name.endswith(".feed_forward.expert_bias"):
            if not getattr(self.config, "use_expert_bias", True):
                return None
            name = name[:-len("expert_bias")] + "gate.e_score_correction_bias"
        return super().rename(name)
