"""Meituan's LongCat-Flash (``LongcatFlashForCausalLM``: LongCat-Flash-Chat / -Thinking), as
transformers models it: MLA blocks in pairs around a shortcut-connected MoE with
"zero-computation" experts.

- Layers: ``num_layers`` logical layers (``num_hidden_layers`` counts the attention sublayers,
  twice as many), each two pre-norm sublayers (``input_layernorm.{0,1}``,
  ``self_attn.{0,1}``, ``post_attention_layernorm.{0,1}``, ``mlps.{0,1}``: MLA then a dense
  SwiGLU MLP of ``ffn_hidden_size``). Sublayer ``j`` of layer ``i`` caches in KV cache layer
  ``2 i + j``. The MoE (``mlp``) reads the first sublayer's MLP input (its
  ``post_attention_layernorm.0`` output) and its output joins the residual after the second
  sublayer's MLP.
- Attention: the core's MLA (:class:`~mrv2.layers.MLAAttention`, ``q_lora_rank`` required,
  interleaved RoPE over ``qk_rope_head_dim``), with LongCat's LoRA scales: the query times
  ``sqrt(hidden_size / q_lora_rank)`` (folded into the softmax scale) and the normed KV latent
  times ``sqrt(hidden_size / kv_lora_rank)`` (before it is cached, as transformers caches it);
  a config's ``mla_scale_q_lora`` / ``mla_scale_kv_lora`` false drops either (as vLLM).
- MoE: a softmax router (``router.classifier``, fp32) over ``n_routed_experts +
  zero_expert_num`` experts picks the top ``moe_topk`` of ``score + e_score_correction_bias``
  (the choice only), weighted by the unrenormalized scores times ``routed_scaling_factor``.
  Ids from ``n_routed_experts`` on are zero-computation experts: they return their input, so
  their weights scale ``x`` itself (computed in torch); the others are SwiGLU experts of
  ``expert_ffn_hidden_size`` (the core's :class:`~mrv2.layers.FusedMoE`).
- Checkpoints: transformers' names; per-expert (``mlp.experts.{e}.gate_proj`` ..., the zero
  experts' unused gate/up rows skipped) or stacked (``experts.gate_up_proj``, whose rows past
  the routed experts are dropped); the router loads into the core router's ``mlp.gate.*``.
  The MTP layers (``model.mtp.*``) are skipped, as transformers skips them.
- Tensor parallelism: MLA's heads, the experts' and MLPs' intermediate dimensions split as
  DeepSeek's; the zero experts' term is the same on every rank, added after the reduce.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    GroupedTopKRouter,
    RMSNorm,
    RotaryEmbedding,
)
from mrv2.layers.mla import MLAAttention, check_mla_config, mla_rope
from mrv2.layers.weights import StackedMapping
from mrv2_deepseek.model import GATE_UP, config_check

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "LongcatFlashForCausalLM"
#: A per-expert checkpoint tensor: ``(prefix, expert)``.
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.")


def validate_longcat_config(config: PretrainedConfig) -> None:
    """Raise a ``ValueError`` naming the field if ``config`` is not a LongCat-Flash model this
    plugin runs (before anything is built)."""
    need = config_check(config, ARCH)
    check_mla_config(config, ARCH)
    need(config.q_lora_rank is not None, "q_lora_rank",
         "LongCat-Flash's attention always has a query LoRA")
    rope_dim = getattr(config, "head_dim", None)
    need(rope_dim is None or int(rope_dim) == int(config.qk_rope_head_dim), "head_dim",
         f"transformers ropes head_dim dims; must equal qk_rope_head_dim "
         f"({config.qk_rope_head_dim})")
    need(int(config.num_layers or 0) >= 1, "num_layers", "must be at least 1")
    need(int(config.n_routed_experts or 0) >= 1, "n_routed_experts", "must be at least 1")
    need(int(config.zero_expert_num or 0) >= 0, "zero_expert_num", "must be >= 0")
    need(getattr(config, "zero_expert_type", None) in (None, "identity"), "zero_expert_type",
         "the zero-computation experts must be 'identity'")
    need(not getattr(config, "router_bias", False), "router_bias",
         "a biased router classifier is not supported")


class LongcatMLA(MLAAttention):
    """The core's MLA with LongCat's LoRA scales (module docstring): the query's in the
    softmax scale (the scores are linear in the query), the latent's on the latent itself,
    so the cache holds what transformers caches. A config's ``mla_scale_q_lora`` /
    ``mla_scale_kv_lora`` false drops that scale (as vLLM and Meituan's own code read them;
    transformers always scales, and the published configs set both true)."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rope, interleaved_rope=True)
        hidden = float(config.hidden_size)
        if getattr(config, "mla_scale_q_lora", True):
            self.scale *= (hidden / float(config.q_lora_rank)) ** 0.5
        self.latent_scale = 1.0
        if getattr(config, "mla_scale_kv_lora", True):
            self.latent_scale = (hidden / float(config.kv_lora_rank)) ** 0.5

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q_nope, q_pe, latent, k_pe, q_resid = super().project(positions, x)
        return q_nope, q_pe, latent * self.latent_scale, k_pe, q_resid


class LongcatMoE(nn.Module):
    """The routed experts plus the zero-computation ones (module docstring): ``gate`` (the
    core router over every expert id), ``experts`` (the routed experts only)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_routed = int(config.n_routed_experts)
        total = self.num_routed + int(config.zero_expert_num or 0)
        self.gate = GroupedTopKRouter(
            config.hidden_size, total, int(config.moe_topk), renormalize=False,
            routed_scaling_factor=float(config.routed_scaling_factor), scoring="softmax",
            correction_bias=True, fp32_weight=True)
        self.experts = FusedMoE(self.num_routed, config.hidden_size,
                                int(config.expert_ffn_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        zero = topk_ids >= self.num_routed
        # the zero experts' pairs: routed expert 0 with weight 0 (no host sync, fixed shapes)
        out = self.experts(x, torch.where(zero, 0.0, topk_weights),
                           torch.where(zero, 0, topk_ids).to(topk_ids.dtype))
        identity = torch.where(zero, topk_weights, 0.0).sum(-1, keepdim=True)
        return cast(torch.Tensor, out + x * identity.to(x.dtype))


class LongcatDecoderLayer(nn.Module):
    """Logical layer ``layer_idx``: two MLA + dense-MLP sublayers and the shortcut MoE (module
    docstring), HF's names; the residual add fused into the next norm."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, rope: RotaryEmbedding
                 ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = nn.ModuleList(
            [LongcatMLA(config, 2 * layer_idx + j, rope) for j in (0, 1)])
        self.mlps = nn.ModuleList(
            [GatedMLP(hidden, config.intermediate_size, config.hidden_act) for _ in (0, 1)])
        self.input_layernorm = nn.ModuleList([RMSNorm(hidden, eps=eps) for _ in (0, 1)])
        self.post_attention_layernorm = nn.ModuleList([RMSNorm(hidden, eps=eps) for _ in (0, 1)])
        self.mlp = LongcatMoE(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            x = self.input_layernorm[0](hidden_states)
        else:
            x, residual = self.input_layernorm[0](hidden_states, residual)
        x, residual = self.post_attention_layernorm[0](self.self_attn[0](positions, x), residual)
        shortcut = self.mlp(x)
        x, residual = self.input_layernorm[1](self.mlps[0](x), residual)
        x, residual = self.post_attention_layernorm[1](self.self_attn[1](positions, x), residual)
        return self.mlps[1](x) + shortcut, residual


class LongcatFlashForCausalLM(CausalLM):
    """LongCat-Flash causal LM in the mrv2 model contract (module docstring)."""

    stacked_params: ClassVar[StackedMapping] = GATE_UP

    def __init__(self, config: PretrainedConfig) -> None:
        validate_longcat_config(config)
        rope = mla_rope(config)
        model = DecoderModel(config, lambda i: LongcatDecoderLayer(config, i, rope),
                             num_layers=int(config.num_layers))
        super().__init__(config, model)

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name: the router into ``mlp.gate``; None for the MTP
        layers and the zero experts' per-expert tensors."""
        if name.startswith("model.mtp."):
            return None
        m = _EXPERT.match(name)
        if m is not None and int(m.group(2)) >= int(self.config.n_routed_experts):
            return None
        name = name.replace(".mlp.router.classifier.", ".mlp.gate.")
        name = name.replace(".mlp.router.e_score_correction_bias",
                            ".mlp.gate.e_score_correction_bias")
        return super().rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As :meth:`CausalLM.load_weights`, a stacked ``experts.gate_up_proj`` cut to the
        routed experts (transformers sizes it for the zero experts too)."""
        routed = int(self.config.n_routed_experts)

        def cut() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.endswith(".mlp.experts.gate_up_proj"):
                    tensor = tensor[:routed]
                yield name, tensor

        return super().load_weights(cut())
