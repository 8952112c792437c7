"""Nemotron-H (``NemotronHForCausalLM``: Nemotron-H 8B/47B, Nemotron Nano 2 9B/12B): a stack of
pre-norm blocks, each ``x + mixer(RMSNorm(x))`` with one mixer per ``config.layers_block_type``:

* ``"linear_attention"`` (``M``): the core's Mamba-2 mixer (:class:`~mrv2.layers.Mamba2Mixer`,
  built by :func:`mamba2_mixer` from Nemotron-H's fields). ``in_proj`` gives
  the gate ``z`` (``mamba_num_heads * mamba_head_dim``), ``xBC`` (``x``, then ``n_groups``
  ``B`` and ``C`` vectors of ``ssm_state_size``) and ``dt`` per head; ``xBC`` goes through a
  causal depthwise convolution of width ``conv_kernel`` (bias: ``use_conv_bias``) and
  ``mamba_hidden_act``; ``dt = softplus(dt + dt_bias)`` clamped below at ``time_step_min`` (as
  transformers 5.17 does; no upper limit), ``A = -exp(A_log)``; per head the SSM ``S =
  exp(dt A) S + outer(B, dt x)``, ``y = S^T C + D x`` (head ``h`` reads group ``h / (heads /
  groups)``; :func:`mrv2_kernels.linear_attention.gated_delta_rule` with ``delta=False``);
  then ``y * silu(z)`` RMS-normed per group of ``heads * head_dim / n_groups`` channels
  (Zamba2's gated norm, gate before norm) and ``out_proj``. Per request the mixer keeps the
  convolution's last inputs and the fp32 SSM state (:mod:`mrv2.contract.request_state`):
  prefix caching keeps snapshots of it, and speculative decoding keeps it after each token of
  a verify step.
* ``"full_attention"`` (``*``): multi-head attention with grouped key/value heads, no
  positional encoding (no RoPE: position comes from the Mamba layers), no biases.
* ``"mlp"`` (``-``): ``down_proj(act(up_proj(x)))``, ``act``: ``mlp_hidden_act`` (``relu2``,
  squared ReLU, in the published checkpoints).
* ``"moe"`` (``E``, Nemotron 3's sparse layers) is refused: its routed experts are non-gated
  MLPs, which the core's :class:`~mrv2.layers.FusedMoE` (gated experts) does not run.

Checkpoint names: transformers 5's ``model.*`` and the published ``backbone.*``
(``embeddings``, ``layers.{i}.norm``, ``layers.{i}.mixer.*``, ``norm_f``); ``mtp.*`` (the
multi-token-prediction head) is not loaded. Tensor parallelism splits each Mamba-2 mixer by
whole groups (``n_groups`` and ``mamba_num_heads`` divisible by the ranks: each rank projects,
convolves and scans its heads and groups, norms its groups, all-reduces after ``out_proj``;
one group: replicated, its norm's statistics all-reduced), the attention by heads and the
MLPs by columns, as the core's layers do.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mrv2.layers import (
    Attention,
    CausalLM,
    ColumnLinear,
    DecoderModel,
    Mamba2Mixer,
    QKVLinear,
    RMSNorm,
    RowLinear,
    head_dim_of,
)
from mrv2.layers.linear import norm_linear
from mrv2.layers.mamba import MAMBA_ACTIVATIONS
from mrv2.layers.weights import StackedMapping

if TYPE_CHECKING:
    from transformers import PretrainedConfig

BLOCK_TYPES = ("linear_attention", "full_attention", "mlp")
#: The published checkpoints' one-letter layer pattern (``hybrid_override_pattern``).
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
#: The names older configs (the published remote code) give the layer types.
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


#: The activations HF's ``ACT2FN`` names that these layers take (``mlp_hidden_act``,
#: ``mamba_hidden_act``): the core's table.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = MAMBA_ACTIVATIONS


def activation_of(config: Any, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ``config.<field>`` names; ValueError naming the field otherwise."""
    name = getattr(config, field)
    if name not in ACTIVATIONS:
        raise ValueError(f"Nemotron-H: {field} must be one of {sorted(ACTIVATIONS)}, "
                         f"got {name!r}")
    return ACTIVATIONS[name]


def block_types_of(config: Any) -> list[str]:
    """Each layer's mixer (``layers_block_type``, else ``hybrid_override_pattern``; the older
    names ``mamba`` / ``attention`` read as the new ones); ValueError naming ``"moe"`` layers
    (not supported) or an unknown type."""
    types = getattr(config, "layers_block_type", None)
    if types is None and getattr(config, "hybrid_override_pattern", None) is not None:
        types = [PATTERN.get(c, c) for c in config.hybrid_override_pattern]
    if not types:
        raise ValueError("Nemotron-H: the config names no layers (layers_block_type)")
    types = [LEGACY.get(t, t) for t in types]
    moe = [i for i, t in enumerate(types) if t == "moe"]
    if moe:
        raise ValueError(
            f"Nemotron-H: layers {moe} are 'moe' layers; their routed experts are non-gated "
            f"{getattr(config, 'mlp_hidden_act', '?')} MLPs, which the core's FusedMoE (gated "
            f"experts only) does not run: Nemotron-H MoE checkpoints are not supported")
    bad = sorted({t for t in types if t not in BLOCK_TYPES})
    if bad:
        raise ValueError(f"Nemotron-H: layers_block_type must list one of {list(BLOCK_TYPES)} "
                         f"per layer; got {bad}")
    return types


def mamba2_mixer(config: Any) -> Mamba2Mixer:
    """The core's :class:`~mrv2.layers.Mamba2Mixer` from Nemotron-H's fields
    (``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``, ``ssm_state_size``,
    ``conv_kernel``, ``mamba_hidden_act``, ``time_step_min``, ``use_bias``, ``use_conv_bias``,
    ``layer_norm_epsilon``; the gated norm per group); ValueError naming the field."""
    heads, groups = int(config.mamba_num_heads), int(config.n_groups)
    if groups < 1 or heads % groups:
        raise ValueError(f"Nemotron-H: mamba_num_heads ({heads}) must be a multiple of "
                         f"n_groups ({groups})")
    activation_of(config, "mamba_hidden_act")
    return Mamba2Mixer(
        int(config.hidden_size), heads, int(config.mamba_head_dim), groups,
        int(config.ssm_state_size), int(config.conv_kernel), str(config.mamba_hidden_act),
        dt_min=float(config.time_step_min), proj_bias=bool(config.use_bias),
        conv_bias=bool(config.use_conv_bias), norm_eps=float(config.layer_norm_epsilon),
        norm_per_group=True)


class NemotronHAttention(nn.Module):
    """Nemotron-H's attention: q/k/v fused into ``qkv_proj``, no RoPE, no biases (HF builds
    none whatever ``attention_bias`` says), scale ``head_dim ** -0.5``."""

    def __init__(self, config: Any, cache_idx: int) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, heads, kv_heads)
        self.o_proj = RowLinear(heads * self.head_dim, config.hidden_size)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                              self.head_dim, self.head_dim ** -0.5, cache_idx)

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """After the projection: attend (no rotation), project."""
        q, k, v = self.qkv_proj.split(qkv)
        return cast(torch.Tensor, self.o_proj(self.attn(q, k, v)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``."""
        return self.attend(cast(torch.Tensor, self.qkv_proj(x)))


class NemotronHMLP(nn.Module):
    """``down_proj(act(up_proj(x)))`` (no gate), ``act``: ``mlp_hidden_act``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.act = activation_of(config, "mlp_hidden_act")
        self.up_proj = ColumnLinear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = RowLinear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``."""
        return cast(torch.Tensor, self.down_proj(self.act(self.up_proj(x))))


class NemotronHBlock(nn.Module):
    """One pre-norm block: ``norm``, then ``mixer`` (its type's), added to the residual stream
    (the add fused into the next block's norm, as the core's decoder layers do; HF keeps the
    residual in the model dtype too)."""

    def __init__(self, config: Any, kind: str, cache_idx: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer: Mamba2Mixer | NemotronHAttention | NemotronHMLP
        if kind == "linear_attention":
            self.mixer = mamba2_mixer(config)
        elif kind == "full_attention":
            self.mixer = NemotronHAttention(config, cache_idx)
        else:
            self.mixer = NemotronHMLP(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.mixer
        if isinstance(mixer, Mamba2Mixer):
            proj, residual = norm_linear(self.norm, mixer.in_proj, hidden_states, residual)
            return mixer.mix(proj), residual
        if isinstance(mixer, NemotronHAttention):
            qkv, residual = norm_linear(self.norm, mixer.qkv_proj, hidden_states, residual)
            return mixer.attend(qkv), residual
        up, residual = norm_linear(self.norm, mixer.up_proj, hidden_states, residual)
        return cast(torch.Tensor, mixer.down_proj(mixer.act(up))), residual


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H in the mrv2 model contract (module docstring)."""

    #: Only the attention's q/k/v are fused (the MLPs' ``up_proj`` stands alone).
    stacked_params: ClassVar[StackedMapping] = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        types = block_types_of(config)
        cache_idx = [types[:i].count("full_attention") for i in range(len(types))]
        shape = SimpleNamespace(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                num_hidden_layers=len(types),
                                rms_norm_eps=config.layer_norm_epsilon)
        super().__init__(config, DecoderModel(shape, lambda i: NemotronHBlock(
            config, types[i], cache_idx[i])))
        self.block_types = types

    def rename(self, name: str) -> str | None:
        """``backbone.*`` -> ``model.*``; ``embeddings`` / ``norm_f`` -> the core's
        ``embed_tokens`` / ``norm``; ``mixer.conv1d.*`` -> ``conv_weight`` / ``conv_bias``;
        ``mtp.*`` skipped."""
        if name.startswith(("mtp.", "model.mtp.", "backbone.mtp.")):
            return None
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        for old, new in (("model.embeddings.", "model.embed_tokens."),
                         ("model.norm_f.", "model.norm.")):
            if name.startswith(old):
                name = new + name[len(old):]
        name = name.replace(".mixer.conv1d.weight", ".mixer.conv_weight")
        name = name.replace(".mixer.conv1d.bias", ".mixer.conv_bias")
        return super().rename(name)
