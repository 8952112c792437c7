"""IBM Granite 4.0-H (``GraniteMoeHybridForCausalLM``: H-Micro 3B dense, H-Tiny 7B-A1B,
H-Small 32B-A9B) and IBM's Bamba (``BambaForCausalLM``): stacks of pre-norm layers, each

    h = h + m * mixer(input_layernorm(h));  h = h + m * ffn(post_attention_layernorm(h))

with ``m`` Granite's ``residual_multiplier`` (1 for Bamba) and one mixer per
``config.layers_block_type`` (Granite's ``layer_types``; Bamba's from ``attn_layer_indices``):

* ``"linear_attention"`` (older configs: ``"mamba"``): the core's Mamba-2 mixer
  (:class:`~mrv2.layers.Mamba2Mixer`, HF's ``mamba.*`` names) of ``mamba_n_heads`` heads of
  ``mamba_d_head`` channels, ``mamba_n_groups`` B/C groups of ``mamba_d_state``, a
  convolution of width ``mamba_d_conv`` (bias: ``mamba_conv_bias``), ``hidden_act`` after it,
  ``dt`` clamped to ``time_step_limit``, biases on the projections per ``mamba_proj_bias`` and
  the gated RMSNorm over all of the mixer's channels (not per group).
* ``"full_attention"`` (``"attention"``): grouped-query attention scaled by Granite's
  ``attention_multiplier`` (Bamba: ``head_dim ** -0.5``); Granite rotates q/k only where
  ``position_embedding_type`` is ``"rope"`` (``"nope"`` / None: no positional encoding, as
  the published 4.0-H checkpoints), Bamba always with its partial RoPE.

The feed-forward: Granite's ``block_sparse_moe`` (a router of ``num_experts_per_tok`` among
``num_local_experts`` SwiGLU experts of ``intermediate_size``, weights a softmax over the
chosen logits; the checkpoint's ``input_linear`` ``[E, 2I, H]`` holds each expert's gate rows
then its up rows, ``output_linear`` ``[E, H, I]``) plus the ``shared_mlp`` (SwiGLU of
``shared_intermediate_size``, its ``input_linear`` ``[2S, H]`` gate rows then up rows), or
the ``shared_mlp`` alone where ``num_local_experts`` is 0 (H-Micro); Bamba's
``feed_forward`` (Llama's gated MLP). Granite also scales the token embeddings by
``embedding_multiplier`` and divides the logits by ``logits_scaling``.

Checkpoint names: the published ones (``block_sparse_moe.input_linear`` / ``output_linear`` /
``router.layer``) and transformers 5's (``experts.gate_up_proj`` / ``down_proj``,
``router.weight``). Tensor parallelism splits the mixers by heads (``mamba_n_heads``
divisible by the ranks): whole groups per rank where ``mamba_n_groups`` divides by the
ranks, else (the published checkpoints' one group) the group's ``B`` / ``C`` replicated,
the gated norm's statistics all-reduced; the attention by heads, the MLPs and experts by
columns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    Mamba2Mixer,
    MoEBlock,
    RMSNorm,
    SelfAttention,
    SoftmaxTopKRouter,
    get_rope,
    head_dim_of,
    norm_linear,
    norm_mlp,
)
from mrv2.layers.activation import ACTIVATIONS as MLP_ACTIVATIONS
from mrv2.layers.embedding import ScaledEmbedding
from mrv2.layers.linear import resolve_tp
from mrv2.layers.mamba import MAMBA_ACTIVATIONS
from mrv2.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig

BLOCK_TYPES = ("linear_attention", "full_attention")
#: The names older configs give the layer types.
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
#: Granite's ``position_embedding_type`` values: whether the attention rotates q/k.
POSITION_TYPES = {None: False, "nope": False, "rope": True}


def block_types_of(config: Any, family: str) -> list[str]:
    """Each layer's mixer (``layers_block_type``; ``mamba`` / ``attention`` read as
    ``linear_attention`` / ``full_attention``); ValueError naming the field otherwise."""
    types = [LEGACY.get(t, t) for t in (getattr(config, "layers_block_type", None) or [])]
    if not types:
        raise ValueError(f"{family}: the config names no layers (layer_types)")
    bad = sorted({t for t in types if t not in BLOCK_TYPES})
    if bad:
        raise ValueError(f"{family}: layer_types must list one of {list(BLOCK_TYPES)} per "
                         f"layer; got {bad}")
    if len(types) != int(config.num_hidden_layers):
        raise ValueError(f"{family}: layer_types lists {len(types)} layers, "
                         f"num_hidden_layers is {config.num_hidden_layers}")
    return types


def time_step_limit_of(config: Any, family: str) -> tuple[float, float]:
    """``time_step_limit`` as ``(dt_min, dt_max)`` (None: ``(0, inf)``)."""
    limit = getattr(config, "time_step_limit", None)
    if limit is None:
        return 0.0, math.inf
    lo, hi = (float(v) for v in limit)
    if not 0.0 <= lo < hi:
        raise ValueError(f"{family}: time_step_limit must be (min, max) with 0 <= min < max, "
                         f"got {tuple(limit)}")
    return lo, hi


def mamba2_mixer(config: Any, family: str) -> Mamba2Mixer:
    """The core's Mamba-2 mixer from the ``mamba_*`` fields (module docstring); ValueError
    naming the field for sizes it cannot run."""
    heads, groups = int(config.mamba_n_heads), int(config.mamba_n_groups)
    if groups < 1 or heads % groups:
        raise ValueError(f"{family}: mamba_n_heads ({heads}) must be a multiple of "
                         f"mamba_n_groups ({groups})")
    _, size = resolve_tp(None)
    if groups % size and size % groups:
        raise ValueError(f"{family}: mamba_n_groups ({groups}) and tensor_parallel_size "
                         f"({size}) must divide one another (the Mamba-2 mixers split by "
                         f"whole groups, or replicate one group over several ranks)")
    if config.hidden_act not in MAMBA_ACTIVATIONS:
        raise ValueError(f"{family}: hidden_act (the Mamba-2 mixers' too) must be one of "
                         f"{sorted(MAMBA_ACTIVATIONS)}, got {config.hidden_act!r}")
    dt_min, dt_max = time_step_limit_of(config, family)
    return Mamba2Mixer(
        int(config.hidden_size), heads, int(config.mamba_d_head), groups,
        int(config.mamba_d_state), int(config.mamba_d_conv), str(config.hidden_act),
        dt_min=dt_min, dt_max=dt_max, proj_bias=bool(config.mamba_proj_bias),
        conv_bias=bool(config.mamba_conv_bias), norm_eps=float(config.rms_norm_eps),
        norm_per_group=False)


def shared_size_of(config: Any) -> int:
    """The ``shared_mlp``'s width: ``shared_intermediate_size``, else (Bamba: none)
    ``intermediate_size``."""
    shared = getattr(config, "shared_intermediate_size", None)
    return int(config.intermediate_size if shared is None else shared)


def feed_forward(config: Any, family: str, shared: int) -> MoEBlock | GatedMLP:
    """Granite's ``block_sparse_moe`` with the ``shared_mlp`` of width ``shared`` as its
    shared expert (none where ``shared`` is 0: HF's zero-width MLP adds nothing, Granite
    3.x's ``GraniteMoe`` has none), or (no experts, or Bamba: no ``num_local_experts``) a
    dense SwiGLU MLP."""
    act = str(config.hidden_act)
    experts = int(getattr(config, "num_local_experts", 0) or 0)
    if act not in MLP_ACTIVATIONS or (experts and act != "silu"):
        raise ValueError(f"{family}: hidden_act must be 'silu' (the gated MLPs' and experts' "
                         f"activation), got {act!r}")
    if shared < 0 or not (shared or experts):
        raise ValueError(f"{family}: shared_intermediate_size = {shared}: must be at least 1 "
                         "(0 only with num_local_experts: a layer with neither adds nothing)")
    mlp = GatedMLP(config.hidden_size, shared, act,
                   bias=bool(getattr(config, "mlp_bias", False))) if shared else None
    if not experts:
        assert mlp is not None
        return mlp
    router = SoftmaxTopKRouter(config.hidden_size, experts, int(config.num_experts_per_tok),
                               renormalize=True)
    return MoEBlock(router, FusedMoE(experts, config.hidden_size, config.intermediate_size),
                    mlp)


class HybridLayer(nn.Module):
    """One layer (module docstring): ``input_layernorm``, then ``mamba`` or ``self_attn``
    (``sinks``: with a learned attention sink per head, Granite MoE SWA),
    ``post_attention_layernorm``, then ``block_sparse_moe`` (its shared expert: the
    checkpoint's ``shared_mlp``) or ``shared_mlp``; each output times ``residual_multiplier``
    before it joins the residual stream (the add fused into the next norm)."""

    def __init__(self, config: Any, kind: str, cache_idx: int, rope: RotaryEmbedding | None,
                 attn_scale: float | None, residual_multiplier: float, family: str,
                 shared: int, sinks: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.residual_multiplier = residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: SelfAttention | None = None
        if kind == "linear_attention":
            self.mamba = mamba2_mixer(config, family)
        else:
            bias = bool(getattr(config, "attention_bias", False))
            self.self_attn = SelfAttention(config, cache_idx, rope, qkv_bias=bias, o_bias=bias,
                                           scale=attn_scale, sinks=sinks)
        ffn = feed_forward(config, family, shared)
        self.block_sparse_moe: MoEBlock | None = ffn if isinstance(ffn, MoEBlock) else None
        self.shared_mlp: GatedMLP | None = ffn if isinstance(ffn, GatedMLP) else None

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
        m = self.residual_multiplier
        if m != 1.0:
            out = out * m
        ffn = cast(nn.Module, self.block_sparse_moe or self.shared_mlp)
        out, residual = norm_mlp(self.post_attention_layernorm, ffn, out, residual)
        return (out * m if m != 1.0 else out), residual


class GraniteMoeHybridForCausalLM(CausalLM):
    """Granite 4.0-H in the mrv2 model contract (module docstring)."""

    family: ClassVar[str] = "Granite 4.0-H"
    #: Whether the attention layers have a learned sink per head (Granite MoE SWA).
    sinks: ClassVar[bool] = False
    #: Checkpoint name fragments -> this model's (published and transformers 5 names).
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.gate.weight"),
        (".block_sparse_moe.router.weight", ".block_sparse_moe.gate.weight"),
        (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
        (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
        (".mamba.conv1d.weight", ".mamba.conv_weight"),
        (".mamba.conv1d.bias", ".mamba.conv_bias"),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        family = self.family
        types = self._layer_types(config)
        cache_idx = [types[:i].count("full_attention") for i in range(len(types))]
        ropes = self._ropes(config, len(types))
        scale = self._attention_scale(config)
        m = float(getattr(config, "residual_multiplier", 1.0) or 1.0)
        shared = self._shared_size(config)
        model = DecoderModel(config, lambda i: HybridLayer(
            config, types[i], cache_idx[i], ropes[i], scale, m, family, shared, self.sinks),
            num_layers=len(types))
        multiplier = float(getattr(config, "embedding_multiplier", 1.0) or 1.0)
        if multiplier != 1.0:
            model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                                 multiplier, scales_given=True)
        super().__init__(config, model)
        self.block_types = types
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0) or 1.0)
        self.moe = int(getattr(config, "num_local_experts", 0) or 0) > 0

    def _layer_types(self, config: Any) -> list[str]:
        return block_types_of(config, self.family)

    def _shared_size(self, config: Any) -> int:
        return shared_size_of(config)

    def _ropes(self, config: Any, count: int) -> list[RotaryEmbedding | None]:
        """Each of the ``count`` layers' RoPE: the config's one where :meth:`_uses_rope`."""
        rope = get_rope(config, head_dim_of(config)) if self._uses_rope(config) else None
        return [rope] * count

    def _uses_rope(self, config: Any) -> bool:
        kind = getattr(config, "position_embedding_type", None)
        if kind not in POSITION_TYPES:
            raise ValueError(f"{self.family}: position_embedding_type must be 'rope', 'nope' "
                             f"or None, got {kind!r}")
        return POSITION_TYPES[kind]

    def _attention_scale(self, config: Any) -> float | None:
        return float(config.attention_multiplier)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head's logits divided by ``logits_scaling``."""
        logits = super().compute_logits(hidden_states)
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits

    def rename(self, name: str) -> str | None:
        """The published and transformers 5 names onto this model's (module docstring); the
        ``shared_mlp`` of a MoE layer is its block's ``shared_experts``."""
        for old, new in self.renames:
            name = name.replace(old, new)
        if self.moe:
            name = name.replace(".shared_mlp.", ".block_sparse_moe.shared_experts.")
        return super().rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF checkpoint tensors (a ``shared_mlp.input_linear`` ``[2S, H]`` as its gate
        and up halves); returns the parameter names loaded."""
        return super().load_weights(_split_input_linear(weights))


def _split_input_linear(weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    suffix = ".shared_mlp.input_linear.weight"
    for name, tensor in weights:
        if name.endswith(suffix):
            if tensor.shape[0] % 2:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, not gate and up halves")
            base = name[: -len("input_linear.weight")]
            gate, up = tensor.chunk(2, dim=0)
            yield base + "gate_proj.weight", gate
            yield base + "up_proj.weight", up
        else:
            yield name, tensor


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """Bamba in the mrv2 model contract: Granite 4.0-H's dense layers without the multipliers,
    its attention always rotated (partial RoPE, ``head_dim ** -0.5``), HF's
    ``feed_forward`` / ``pre_ff_layernorm`` / ``final_layernorm`` names."""

    family: ClassVar[str] = "Bamba"
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        *GraniteMoeHybridForCausalLM.renames,
        (".feed_forward.", ".shared_mlp."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        ("model.final_layernorm.", "model.norm."),
    )

    def _ropes(self, config: Any, count: int) -> list[RotaryEmbedding | None]:
        """Each of the ``count`` layers' RoPE: the config's one where :meth:`_uses_rope`."""
        rope = get_rope(config, head_dim_of(config)) if self._uses_rope(config) else None
        return [rope] * count

    def _uses_rope(self, config: Any) -> bool:
        return True

    def _attention_scale(self, config: Any) -> float | None:
        return None
