"""StepFun's Step-3.7 (``Step3p7ForConditionalGeneration``: stepfun-ai/Step-3.7-Flash, the
Step-3.5 text decoder under a vision tower), its text decoder as transformers 5.17 models it.

- Norms: Gemma's RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + w)``) everywhere: the layers'
  two, the final one and the per-head ``q_norm`` / ``k_norm``; the checkpoint's ``w`` loads as
  ``1 + w``.
- Attention: grouped-query attention with per-head q/k norms, then RoPE on the first
  ``partial_rotary_factor * head_dim`` dimensions (GPT-NeoX halves), a RoPE per layer type
  (``rope_parameters["full_attention"]`` / ``["sliding_attention"]``: their own
  ``rope_theta`` and factor); the layers ``layer_types`` calls ``sliding_attention`` attend
  over ``sliding_window`` keys with ``num_sliding_attention_heads`` query heads (the others
  ``num_attention_heads``; the same key/value heads everywhere); scores scaled by
  ``query_pre_attn_scalar ** -0.5``; the output gated per head before ``o_proj``,
  ``attn * sigmoid(g_proj(x))`` (``g_proj``: ``hidden -> heads``).
- MLP: ``mlp_layer_types`` ``"dense"`` layers a SwiGLU of ``intermediate_size``; ``"sparse"``
  ones ``n_routed_experts`` SwiGLU experts of ``moe_intermediate_size`` picked by the top
  ``num_experts_per_tok`` of ``sigmoid`` scores plus the router's correction bias (the choice
  only), weighted by their scores renormalized, times ``moe_router_scaling_factor``, plus a
  shared SwiGLU expert of ``share_expert_dim`` that sees every token.
- Clamps: a non-zero ``swiglu_limits[i]`` clamps layer ``i``'s routed experts,
  ``min(silu(gate), L) * clamp(up, -L, L)``; ``swiglu_limits_shared[i]`` likewise its shared
  expert or dense MLP (Step-3.7-Flash: its last two layers).
- Checkpoints: the published layout (``model.layers.*``; the experts stacked per layer as
  ``moe.gate_proj`` / ``moe.up_proj`` ``[E, I, H]`` and ``moe.down_proj`` ``[E, H, I]``, the
  router ``moe.gate.weight`` (kept fp32, as vLLM runs it) and ``moe.router_bias``, the shared
  expert ``share_expert.*``), which transformers 5.17's ``save_pretrained`` writes too (a
  block-FP8 checkpoint, as Step-3.5-Flash-FP8: the stacked experts in e4m3 with stacked
  ``moe.*_proj.weight_scale_inv`` ``[E, ...]``, split per expert with them; an fp8 router is
  refused); experts per expert (``moe.experts.{e}.*`` or ``moe.{e}.*``); or transformers'
  in-memory names (``model.language_model.*``). The multi-token-prediction layers past
  ``num_hidden_layers`` are skipped here and built by :meth:`build_mtp`
  (:mod:`mrv2_step.mtp`) for the ``mtp`` speculator; the vision tower's and projector's
  tensors go to the image encoder (:mod:`mrv2_step.vision`; images: :mod:`mrv2_step.vision_inputs`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers import (
    CausalLM,
    ColumnLinear,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    GroupedTopKRouter,
    MoEBlock,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
    norm_mlp,
)
from mrv2.layers.mtp import build_mtp
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_step.mtp import Step3p7MTP, mtp_layer_kinds
from mrv2_step.vision import VISION_CHECKPOINT_PREFIXES, Step3p7VisionEncoder

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ARCH = "Step3p7ForConditionalGeneration"
#: The layer types Step's decoder has.
LAYER_TYPES = ("full_attention", "sliding_attention")


def _need(config: Any, ok: bool, field: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{ARCH}: config.json text_config.{field} = "
                         f"{getattr(config, field, None)!r}: {what}")


def validate_step_config(config: Any) -> None:
    """Raise a ``ValueError`` naming the text config's field if this plugin cannot run it
    (before anything is built)."""
    layers = int(config.num_hidden_layers)
    kinds = list(getattr(config, "layer_types", None) or [])
    _need(config, len(kinds) == layers and set(kinds) <= set(LAYER_TYPES), "layer_types",
          f"must list 'full_attention' or 'sliding_attention' for each of the {layers} layers")
    mlps = list(getattr(config, "mlp_layer_types", None) or [])
    _need(config, len(mlps) == layers and set(mlps) <= {"dense", "sparse"}, "mlp_layer_types",
          f"must list 'dense' or 'sparse' for each of the {layers} layers")
    _need(config, not getattr(config, "use_bidirectional_attention", False),
          "use_bidirectional_attention", "only causal attention is supported")
    _need(config, getattr(config, "gating", True) in (True, "per-head"), "gating",
          "only the per-head output gate is supported")
    _need(config, not getattr(config, "mlp_bias", False), "mlp_bias",
          "biased MLPs are not supported")
    for field in ("swiglu_limits", "swiglu_limits_shared"):
        limits = getattr(config, field, None)
        _need(config, limits is None or (len(limits) == layers
                                         and all((v or 0) >= 0 for v in limits)),
              field, f"must be null or list a bound >= 0 (0: none) for each of the {layers} "
              f"layers")


def _limit(config: Any, field: str, layer_idx: int) -> float | None:
    """Layer ``layer_idx``'s bound of ``config.<field>`` (None: unclamped)."""
    limits = getattr(config, field, None)
    value = limits[layer_idx] if limits else None
    return float(value) if value else None


def layer_heads(config: Any, layer_idx: int) -> int:
    """Layer ``layer_idx``'s query heads: HF's ``per_layer_config`` entry (a sliding layer's
    ``num_sliding_attention_heads``), else ``num_attention_heads``."""
    per_layer = getattr(config, "per_layer_config", None)
    try:
        return int(per_layer[layer_idx].num_attention_heads)  # type: ignore[index]
    except (TypeError, KeyError, IndexError, AttributeError):
        pass
    if config.layer_types[layer_idx] == "sliding_attention":
        return int(getattr(config, "num_sliding_attention_heads", None)
                   or config.num_attention_heads)
    return int(config.num_attention_heads)


def allow_global_heads(config: Any) -> None:
    """Let ``config.num_attention_heads`` be read as the full-attention layers' count
    (transformers 5.17 refuses a per-layer attribute's global read unless told; the core's
    generic readers, such as the tensor-parallel split's message, read it)."""
    if "_heterogeneity_spec" in vars(config):
        config.allow_global_per_layer_attribute_access = True


class _LayerConfig:
    """The text config as one layer's attention reads it: ``num_attention_heads`` that
    layer's (HF's ``per_layer_config``)."""

    def __init__(self, config: Any, num_heads: int) -> None:
        self._config = config
        self.num_attention_heads = num_heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class ClampedGatedMLP(GatedMLP):
    """A SwiGLU MLP whose activations are clamped: ``down(min(silu(gate), L) * clamp(up, -L,
    L))`` (HF's ``swiglu_limits_shared``). Not fused with the norm before it."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__(hidden_size, intermediate_size, "silu")
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = cast(torch.Tensor, self.gate_up_proj(x)).chunk(2, dim=-1)
        act = F.silu(gate).clamp(max=self.limit) * up.clamp(-self.limit, self.limit)
        return cast(torch.Tensor, self.down_proj(act))

    def extra_repr(self) -> str:
        return f"limit={self.limit}"


def step_mlp(hidden_size: int, intermediate_size: int, limit: float | None) -> GatedMLP:
    """A SwiGLU MLP, clamped at ``limit`` when one is set."""
    if limit is None:
        return GatedMLP(hidden_size, intermediate_size, "silu")
    return ClampedGatedMLP(hidden_size, intermediate_size, limit)


def step_moe(config: Any, layer_idx: int) -> MoEBlock:
    """Layer ``layer_idx``'s routed and shared experts (module docstring)."""
    router = GroupedTopKRouter(
        config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
        renormalize=True, routed_scaling_factor=float(config.moe_router_scaling_factor),
        scoring="sigmoid", fp32_weight=True)
    limit = _limit(config, "swiglu_limits", layer_idx)
    experts = FusedMoE(config.n_routed_experts, config.hidden_size,
                       config.moe_intermediate_size,
                       activation="silu" if limit is None else "silu_clamp",
                       swiglu_limit=7.0 if limit is None else limit)
    shared = step_mlp(config.hidden_size, config.share_expert_dim,
                      _limit(config, "swiglu_limits_shared", layer_idx))
    return MoEBlock(router, experts, shared)


class StepAttention(SelfAttention):
    """The core's attention (q/k norms, RoPE, the window) with this layer's query heads and
    Step's per-head output gate (``g_proj``: this rank's heads' rows)."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding, heads: int
                 ) -> None:
        scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim_of(config)
        super().__init__(_LayerConfig(config, heads), layer_idx, rope,
                         qkv_bias=bool(config.attention_bias),
                         o_bias=bool(config.attention_bias), qk_norm=True,
                         scale=float(scalar) ** -0.5)
        self.g_proj = ColumnLinear(config.hidden_size, heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.attention_output(positions, self.qkv_proj(hidden_states))
        gate = torch.sigmoid(cast(torch.Tensor, self.g_proj(hidden_states)))
        out = (out.view(*gate.shape, self.head_dim) * gate.unsqueeze(-1)).view(out.shape)
        return cast(torch.Tensor, self.o_proj(out))


class StepDecoderLayer(nn.Module):
    """``input_layernorm``, the gated attention, ``post_attention_layernorm``, the MLP (dense
    or MoE); the residual add fused into the next norm."""

    def __init__(self, config: Any, layer_idx: int, ropes: dict[str, RotaryEmbedding],
                 heads: int) -> None:
        super().__init__()
        self.self_attn = StepAttention(config, layer_idx, ropes[config.layer_types[layer_idx]],
                                       heads)
        self.mlp: nn.Module
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = step_moe(config, layer_idx)
        else:
            self.mlp = step_mlp(config.hidden_size, config.intermediate_size,
                                _limit(config, "swiglu_limits_shared", layer_idx))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            x = cast(torch.Tensor, self.input_layernorm(hidden_states))
        else:
            x, residual = self.input_layernorm(hidden_states, residual)
        attn = cast(torch.Tensor, self.self_attn(positions, x))
        if isinstance(self.mlp, ClampedGatedMLP):  # (norm_mlp would fuse a plain SwiGLU)
            normed, residual = self.post_attention_layernorm(attn, residual)
            return cast(torch.Tensor, self.mlp(normed)), residual
        return norm_mlp(self.post_attention_layernorm, self.mlp, attn, residual)


#: The published checkpoint's MoE names -> the model's (after the layer's prefix).
_RENAMES = (
    (".moe.gate.weight", ".mlp.gate.weight"),
    (".moe.router_bias", ".mlp.gate.e_score_correction_bias"),
    (".share_expert.", ".mlp.shared_experts."),
)
#: Per-expert checkpoints' names: ``moe.experts.{e}.*`` and the older ``moe.{e}.*``.
_PER_EXPERT = re.compile(r"\.moe\.(?:experts\.)?(\d+)\.")
#: The published stacked experts: ``moe.<kind>.weight`` ``[E, ...]`` and, in an FP8
#: checkpoint (Step-3.5-Flash-FP8), their block scales ``moe.<kind>.weight_scale_inv``
#: ``[E, ceil(N/bn), ceil(K/bk)]``.
_STACKED_EXPERTS = re.compile(r"\.moe\.(gate_proj|up_proj|down_proj)\.(weight(?:_scale_inv)?)$")
#: An FP8 router's scales (the router runs unquantized: refused).
_ROUTER_SCALE = re.compile(r"\.moe\.gate\.weight_scale(?:_inv)?$")


def step_block_name(name: str) -> str:
    """A checkpoint's decoder-layer tensor name with the core's MoE names (:data:`_RENAMES`,
    per-expert tensors as ``mlp.experts.{e}.*``; a stacked expert tensor as its first
    expert's, the parameter it fills). A ``ValueError`` names ``quantization_config`` for a
    checkpoint whose router is quantized."""
    if _ROUTER_SCALE.search(name):
        raise ValueError(
            f"{ARCH}: config.json quantization_config: the checkpoint quantizes the MoE "
            f"router ({name}); the router runs unquantized here (fp32, as vLLM runs it), so "
            f"only checkpoints that keep moe.gate.weight unquantized are supported")
    name = _STACKED_EXPERTS.sub(r".mlp.experts.0.\1.\2", name)
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return _PER_EXPERT.sub(r".mlp.experts.\1.", name)


def expand_step_tensors(weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stacked published experts (and an FP8 checkpoint's stacked scales) as one tensor
    per expert (the core's names), norm weights as ``1 + w``; the rest as they come."""
    for name, tensor in weights:
        stacked = _STACKED_EXPERTS.search(name)
        if stacked is not None:
            prefix = name[:stacked.start()] + ".mlp.experts"
            kind, suffix = stacked.groups()
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.{kind}.{suffix}", tensor[e]
        elif name.endswith("norm.weight") and "vision" not in name:
            yield name, tensor.float() + 1.0
        else:
            yield name, tensor


class Step3p7ForConditionalGeneration(CausalLM):
    """Step-3.7 in the mrv2 model contract: the text decoder (module docstring), built from
    the composite config's ``text_config``, and the image encoder (``vision``)."""

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: PretrainedConfig) -> None:
        text = vl_text_config(config, ARCH)
        allow_global_heads(text)
        validate_step_config(text)
        heads = [layer_heads(text, i) for i in range(int(text.num_hidden_layers))]
        head_dim = head_dim_of(text)
        ropes = {kind: get_rope(text, head_dim, layer_type=kind)
                 for kind in sorted(set(text.layer_types))}
        super().__init__(text, DecoderModel(text, lambda i: StepDecoderLayer(text, i, ropes,
                                                                           heads[i])))
        self._ropes = ropes  # (the MTP layers' too)
        self.hf_config = config
        self.vision = Step3p7VisionEncoder(config)

    def embed_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Views ``[N, 3, H, W]`` of one size -> ``[N * features, hidden]`` in the model
        dtype, view by view (HF's ``get_image_features``)."""
        return self.vision(pixel_values).to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name (module docstring); None skips the vision
        tower, the projector and the MTP layers."""
        name = vl_text_name(name)
        if not name.startswith(("model.", "lm_head.", "layers.", "embed_tokens.", "norm.")):
            return None  # vision_model.*, vit_large_projector.*, model.vision_model.* below
        if name.startswith(("model.vision_model.", "model.multi_modal_projector.")):
            return None
        parts = name.split(".")
        if (len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit()
                and int(parts[2]) >= int(self.config.num_hidden_layers)):
            return None  # a multi-token-prediction layer
        return super().rename(step_block_name(name))

    def build_mtp(self, first_layer_idx: int | None = None) -> Step3p7MTP:
        """The checkpoint's MTP layers (:mod:`mrv2_step.mtp`) for the ``mtp`` speculator,
        sharing this model's embedding and LM head, their attention caching from
        ``first_layer_idx`` (default ``num_hidden_layers``); weights unloaded (see
        :func:`mrv2.layers.mtp.build_mtp`). A ``ValueError`` names the text config's field
        when the config declares no MTP layers or none it can run."""
        text = self.config
        mtp_layer_kinds(text)  # (before anything is built)

        def block(layer_config: Any, cache_idx: int) -> nn.Module:
            kind = layer_config.layer_types[cache_idx]
            heads = int(text.num_attention_heads)
            if kind == "sliding_attention":
                heads = int(getattr(text, "num_sliding_attention_heads", None) or heads)
            return StepDecoderLayer(layer_config, cache_idx, self._ropes, heads)

        return cast(Step3p7MTP, build_mtp(self, Step3p7MTP, block, expand_step_tensors,
                                          step_block_name, first_layer_idx))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors (module docstring): the encoder's through its loader; returns
        the parameter names loaded."""
        return load_text_and_encoder(lambda text: super(Step3p7ForConditionalGeneration, self)
                                     .load_weights(expand_step_tensors(text)), self.vision,
                                     VISION_CHECKPOINT_PREFIXES, weights, "vision")
