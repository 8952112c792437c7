"""AI21 Jamba (``JambaForCausalLM``: Jamba-v0.1, Jamba 1.5 / 1.6 Mini and Large):
a stack of pre-norm layers, each

    h = h + mixer(input_layernorm(h));  h = h + feed_forward(pre_ff_layernorm(h))

with the mixer per ``config.layers_block_type`` (layer ``i`` is attention where ``i %
attn_layer_period == attn_layer_offset``, else Mamba) and the feed-forward per
``layers_num_experts`` (routed experts where ``i % expert_layer_period ==
expert_layer_offset``, else a dense SwiGLU MLP of ``intermediate_size``):

* ``"mamba"``: the core's Mamba-1 mixer (:class:`~mrv2.layers.Mamba1Mixer`, HF's ``mamba.*``
  names) of ``mamba_expand * hidden_size`` channels, a ``mamba_d_state`` state per channel, a
  convolution of width ``mamba_d_conv`` (bias: ``mamba_conv_bias``) then ``hidden_act``, a
  time step of rank ``mamba_dt_rank``, biases on the projections per ``mamba_proj_bias``, and
  RMSNorms with weights (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``, epsilon
  ``rms_norm_eps``) on ``dt``, ``B`` and ``C``.
* ``"attention"``: grouped-query attention without any positional encoding (no RoPE: the
  Mamba layers carry position), ``head_dim ** -0.5``, no biases.
* The experts: a softmax router (``router``) over ``num_experts``, the ``num_experts_per_tok``
  best weighted by their probabilities as they are (not renormalized), SwiGLU experts of
  ``intermediate_size`` (the core's :class:`~mrv2.layers.FusedMoE`).

Checkpoint names: the published ones (``feed_forward.router.weight``,
``feed_forward.experts.{e}.gate_proj.weight``, ...) and transformers 5's stacked
``feed_forward.experts.gate_up_proj`` / ``down_proj``; ``model.final_layernorm``. Tensor
parallelism splits the Mamba mixers by channels, the attention by heads, the MLPs and
experts by columns.

This family lives in the Mamba plugin (not a plugin of its own) because its mixer is the
Mamba-1 mixer the plugin's ``MambaForCausalLM`` runs, and one plugin keeps one registration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    Mamba1Mixer,
    MoEBlock,
    RMSNorm,
    SelfAttention,
    SoftmaxTopKRouter,
    norm_linear,
    norm_mlp,
)
from mrv2.layers.linear import resolve_tp
from mrv2.layers.mamba import MAMBA_ACTIVATIONS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILY = "Jamba"
KINDS = ("mamba", "attention")


def layer_kinds_of(config: Any) -> list[str]:
    """Each layer's mixer (HF's ``layers_block_type``); ValueError naming the fields unless the
    periods and offsets are valid."""
    layers = int(config.num_hidden_layers)
    if layers < 1:
        raise ValueError(f"{FAMILY}: num_hidden_layers must be at least 1, got {layers}")
    for period, offset in (("attn_layer_period", "attn_layer_offset"),
                           ("expert_layer_period", "expert_layer_offset")):
        p, o = int(getattr(config, period)), int(getattr(config, offset))
        if p < 1 or not 0 <= o < p:
            raise ValueError(f"{FAMILY}: {offset} ({o}) must be in [0, {period} = {p})")
    kinds = [str(k) for k in config.layers_block_type]
    if len(kinds) != layers or any(k not in KINDS for k in kinds):
        raise ValueError(f"{FAMILY}: layers_block_type must list 'mamba' or 'attention' for "
                         f"each of the {layers} layers, got {kinds}")
    return kinds


def jamba_mixer(config: Any) -> Mamba1Mixer:
    """The core's Mamba-1 mixer from Jamba's ``mamba_*`` fields (module docstring)."""
    hidden = int(config.hidden_size)
    intermediate = int(config.mamba_expand) * hidden
    rank = config.mamba_dt_rank
    rank = -(-hidden // 16) if rank == "auto" else int(rank)
    _, size = resolve_tp(None)
    if intermediate % size:
        raise ValueError(f"{FAMILY}: mamba_expand * hidden_size ({intermediate}) must be "
                         f"divisible by tensor_parallel_size ({size})")
    act = str(config.hidden_act)
    if act not in MAMBA_ACTIVATIONS or act not in ("silu", "swish"):
        raise ValueError(f"{FAMILY}: hidden_act (the mixers' and MLPs' activation) must be "
                         f"'silu', got {act!r}")
    return Mamba1Mixer(
        hidden, intermediate, int(config.mamba_d_state), int(config.mamba_d_conv), rank, act,
        proj_bias=bool(config.mamba_proj_bias), conv_bias=bool(config.mamba_conv_bias),
        bcdt_norm="weighted", norm_eps=float(config.rms_norm_eps))


def feed_forward(config: Any, experts: int) -> MoEBlock | GatedMLP:
    """Routed experts (``experts`` > 1: a softmax router, top-k not renormalized) or a dense
    SwiGLU MLP."""
    if experts <= 1:
        return GatedMLP(config.hidden_size, config.intermediate_size, "silu")
    router = SoftmaxTopKRouter(config.hidden_size, experts, int(config.num_experts_per_tok),
                               renormalize=False)
    return MoEBlock(router, FusedMoE(experts, config.hidden_size, config.intermediate_size))


class JambaLayer(nn.Module):
    """One layer (module docstring): ``input_layernorm``, then ``mamba`` or ``self_attn``,
    ``pre_ff_layernorm``, then ``feed_forward`` (each add fused into the next norm)."""

    def __init__(self, config: Any, kind: str, cache_idx: int, experts: int) -> None:
        super().__init__()
        self.kind = kind
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mamba: Mamba1Mixer | None = None
        self.self_attn: SelfAttention | None = None
        if kind == "mamba":
            self.mamba = jamba_mixer(config)
        else:
            self.self_attn = SelfAttention(config, cache_idx, None)
        self.feed_forward = feed_forward(config, experts)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, residual)`` in and out, as the core's decoder layers."""
        if self.mamba is not None:
            proj, residual = norm_linear(self.input_layernorm, self.mamba.in_proj,
                                         hidden_states, residual)
            out = self.mamba.mix(proj)
        else:
            attn = cast(SelfAttention, self.self_attn)
            qkv, residual = norm_linear(self.input_layernorm, attn.qkv_proj, hidden_states,
                                        residual)
            out = attn.attend(positions, qkv)
        return norm_mlp(self.pre_ff_layernorm, self.feed_forward, out, residual)


class JambaForCausalLM(CausalLM):
    """Jamba in the mrv2 model contract (module docstring)."""

    #: Checkpoint name fragments -> this model's.
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (".feed_forward.router.weight", ".feed_forward.gate.weight"),
        (".mamba.conv1d.weight", ".mamba.conv_weight"),
        (".mamba.conv1d.bias", ".mamba.conv_bias"),
        ("model.final_layernorm.", "model.norm."),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        kinds = layer_kinds_of(config)
        experts = [int(e) for e in config.layers_num_experts]
        cache_idx = [kinds[:i].count("attention") for i in range(len(kinds))]
        model = DecoderModel(config, lambda i: JambaLayer(config, kinds[i], cache_idx[i],
                                                          experts[i]),
                             num_layers=len(kinds))
        super().__init__(config, model)
        self.layer_kinds = kinds

    def rename(self, name: str) -> str | None:
        """The published and transformers 5 names onto this model's (module docstring)."""
        for old, new in self.renames:
            name = name.replace(old, new)
        return super().rename(name)
