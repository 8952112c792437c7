"""Gemma 4's text decoder (``Gemma4ForCausalLM``, HF ``Gemma4TextConfig``).

Gemma 3's layer (four norms around attention and a GeGLU MLP, scaled embeddings, local and
global layers with a RoPE each) with these differences, each checked against transformers
5.17's ``modeling_gemma4.py``:

- **Shapes per layer.** ``config.per_layer_config[i]`` gives layer ``i``'s ``head_dim`` and
  ``num_key_value_heads`` (the global layers: ``global_head_dim``, 512 by default, and with
  ``attention_k_eq_v`` ``num_global_key_value_heads``): each layer declares its own KV cache.
- **Keys are values** (``attention_k_eq_v``) on global layers: no ``v_proj``; the value is
  the raw key projection. Here the checkpoint's ``k_proj`` fills both the k and the v rows
  of the fused projection (the same product, computed twice).
- **Norms are plain** ``x * weight`` (no ``1 +``): ``q_norm``, ``k_norm`` per head, ``v_norm``
  per head without a weight; attention scores are not scaled (scale 1.0).
- **KV sharing.** The last ``num_kv_shared_layers`` layers have no keys or values of their
  own: each attends over the cache of the last earlier layer of its type, which has written
  the step's keys by then (:class:`Gemma4SharedAttention`). They declare no cache.
- **Images' tokens attend both ways on the sliding layers only** (``use_bidirectional_attention:
  "vision"``; HF keeps the global layers causal, unlike Gemma 3): the forward context's
  :class:`~mrv2.contract.forward_context.BidirectionalSpan` s apply to those layers.
- **RoPE** per layer type; the global layers' default is ``proportional``
  (:func:`mrv2.layers.rotary._proportional_inv_freq`).
- **Per-layer embeddings** (``hidden_size_per_layer_input`` > 0): a second token table
  (``[vocab, layers * ple_dim]``, scaled by ``sqrt(ple_dim)``) plus a projection of the
  embeddings, one ``ple_dim`` slice per layer, gated into the stream after each MLP.
- ``layer_scalar`` (a saved buffer in HF) multiplies each layer's output stream; the
  kv-shared layers' MLP is twice as wide with ``use_double_wide_mlp``; logits soft-capped by
  ``final_logit_softcapping``; tied embeddings.
- **MoE** (``enable_moe_block``): routed experts beside the dense MLP, each with its own
  norms; the router (a weightless norm, ``scale``, softmax, top-k, renormalized,
  ``per_expert_scale``) is :class:`Gemma4Router`; the experts are the core's fused
  :class:`FusedMoE` with its GeGLU epilogue (``activation="gelu_tanh"``).

Refused with a ValueError naming the field: ``use_bidirectional_attention: "all"`` (HF's
``"vision"`` changes only media tokens' masks, causal for text), layer types other than
sliding/full, ``num_kv_shared_layers`` that leaves a shared layer no source (or a source of
another shape), ``per_layer_config`` overrides other than ``head_dim`` /
``num_key_value_heads`` or differing within a layer type, RoPE types with a partial rotary
factor other than ``default`` / ``proportional`` (or unknown to
:mod:`mrv2.layers.rotary`), an MoE block without its sizes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.forward_context import get_forward_context
from mrv2.layers import (
    Attention,
    CausalLM,
    ColumnLinear,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    LinearBase,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    norm_linear,
)
from mrv2.layers.bidirectional import attend_spans
from mrv2.layers.embedding import ScaledEmbedding
from mrv2.layers.rotary import SUPPORTED_ROPE_TYPES, context_limit
from mrv2.layers.weights import load_param, load_stacked_weights

__all__ = ["Gemma4ForCausalLM", "check_gemma4", "kv_source", "layer_shape"]

_KINDS = ("sliding_attention", "full_attention")
_PER_LAYER_FIELDS = {"head_dim", "num_key_value_heads"}
#: HF's activation names -> the per-layer input gate's activation (Gemma 3n's too).
GATE_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}
#: HF's activation names -> the fused expert kernels' GLU.
_EXPERT_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}
_ATTN_TENSOR = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|k_norm|"
                          r"v_norm)\.")


def layer_shape(config: Any, layer: int) -> tuple[int, int]:
    """``(head_dim, num_key_value_heads)`` of layer ``layer`` (its ``per_layer_config``)."""
    views = getattr(config, "per_layer_config", None)
    layer_config = views[layer] if views is not None else config
    return int(layer_config.head_dim), int(layer_config.num_key_value_heads)


def first_shared_layer(config: Any) -> int:
    """The first layer without keys or values of its own (``num_hidden_layers`` if none)."""
    return int(config.num_hidden_layers) - int(config.num_kv_shared_layers or 0)


def kv_source(config: Any, layer: int) -> int | None:
    """The layer whose cache kv-shared layer ``layer`` reads (the last one of its type before
    the shared ones), or None for a layer with keys and values of its own."""
    first = first_shared_layer(config)
    if layer < first:
        return None
    kind = config.layer_types[layer]
    earlier = [i for i in range(first) if config.layer_types[i] == kind]
    if not earlier:
        raise ValueError(f"config.json num_kv_shared_layers = {config.num_kv_shared_layers}: "
                         f"shared layer {layer} ({kind}) has no earlier {kind} layer to share")
    return earlier[-1]


def check_gemma4(config: Any) -> None:
    """ValueError naming the field for what this decoder cannot match (module docstring)."""
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    if bidirectional not in (None, "vision"):
        raise ValueError(f"config.json use_bidirectional_attention = {bidirectional!r} is not "
                         "supported: mrv2's attention over text is causal")
    layers, types = int(config.num_hidden_layers), list(config.layer_types)
    if len(types) != layers or not set(types) <= set(_KINDS):
        raise ValueError(f"config.json layer_types must list {layers} of {_KINDS}, got {types}")
    if not 0 <= layers - first_shared_layer(config) < layers:
        raise ValueError(f"config.json num_kv_shared_layers = {config.num_kv_shared_layers} "
                         f"must be in [0, {layers})")
    extra = set(getattr(config, "per_layer_attributes", None) or ()) - _PER_LAYER_FIELDS
    if extra:
        raise ValueError(f"config.json per_layer_config overrides {sorted(extra)}: Gemma 4 "
                         f"reads only {sorted(_PER_LAYER_FIELDS)} per layer")
    shapes = [layer_shape(config, i) for i in range(layers)]
    for kind in set(types):
        dims = {shapes[i][0] for i in range(layers) if types[i] == kind}
        if len(dims) > 1:
            raise ValueError(f"config.json per_layer_config gives {kind} layers head_dims "
                             f"{sorted(dims)}: their RoPE needs one")
        params = (getattr(config, "rope_parameters", None) or {}).get(kind)
        if not isinstance(params, Mapping) or "rope_theta" not in params:
            raise ValueError(f"config.json rope_parameters has no {kind!r} entry with a "
                             "rope_theta")
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"config.json rope_parameters[{kind!r}].rope_type = {rope_type!r} "
                             f"is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        if rope_type not in ("default", "proportional") and float(
                params.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"config.json rope_parameters[{kind!r}].partial_rotary_factor "
                             f"with rope_type {rope_type!r} is not supported")
    for i in range(first_shared_layer(config), layers):
        source = cast(int, kv_source(config, i))
        if shapes[i] != shapes[source]:
            raise ValueError(f"config.json per_layer_config: kv-shared layer {i} has (head_dim, "
                             f"kv heads) {shapes[i]}, its source layer {source} {shapes[source]}")
    if config.enable_moe_block:
        for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if not getattr(config, name, None):
                raise ValueError(f"config.json enable_moe_block = true needs {name}")


def gemma4_rope(config: Any, kind: str, head_dim: int) -> RotaryEmbedding:
    """The RoPE of ``kind`` layers over their whole ``head_dim``, from
    ``config.rope_parameters[kind]`` (HF's ``default`` ignores ``partial_rotary_factor``;
    ``proportional`` keeps that share of the frequencies)."""
    params = dict(config.rope_parameters[kind])
    scaling = None if params.get("rope_type", "default") == "default" else params
    return RotaryEmbedding(head_dim, max_position=int(config.max_position_embeddings),
                           base=float(params["rope_theta"]), scaling=scaling,
                           positions=context_limit(config)[0])


def _window(config: Any, kind: str) -> int | None:
    """The keys a query of a ``kind`` layer sees, its own included (None: all before it)."""
    window = config.sliding_window if kind == "sliding_attention" else None
    return int(window) if window else None


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over the last dimension, in fp32 (HF's ``with_scale=False``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Attention(nn.Module):
    """Attention of a layer with keys and values of its own: fused QKV projection (with
    ``k_eq_v``, the v rows hold the k projection's weights), per-head ``q_norm`` / ``k_norm``
    (fused into the rotation), weightless ``v_norm``, RoPE, paged attention over cache layer
    ``layer_idx`` at scale 1.0, output projection."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        head_dim, kv_heads = layer_shape(config, layer_idx)
        kind, bias = config.layer_types[layer_idx], bool(config.attention_bias)
        heads, eps = int(config.num_attention_heads), float(config.rms_norm_eps)
        self.head_dim, self.eps = head_dim, eps
        self.qkv_proj = QKVLinear(config.hidden_size, head_dim, heads, kv_heads, bias=bias)
        self.o_proj = RowLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps=eps)
        self.k_norm = RMSNorm(head_dim, eps=eps)
        self.rotary_emb = rope
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim,
                              1.0, layer_idx, sliding_window=_window(config, kind),
                              bidirectional_spans=kind == "sliding_attention")

    @property
    def in_proj(self) -> LinearBase:
        """The projection the input norm feeds."""
        return self.qkv_proj

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Everything after the QKV projection."""
        q, k, v = self.qkv_proj.split(qkv)
        v = unit_rms_norm(v.reshape(-1, self.head_dim), self.eps).reshape(v.shape)
        norms = (self.q_norm.weight, self.k_norm.weight, self.eps)
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb, qk_norm=norms)
        return cast(torch.Tensor, self.o_proj(out))


class Gemma4SharedAttention(nn.Module):
    """Attention of a kv-shared layer: its query (``q_proj``, ``q_norm``, RoPE) attends over
    the keys and values layer ``source`` cached, through that layer's cache, backend and
    metadata in the forward context. No cache of its own."""

    def __init__(self, config: Any, layer_idx: int, source: int, rope: RotaryEmbedding
                 ) -> None:
        super().__init__()
        head_dim, _ = layer_shape(config, layer_idx)
        kind, bias = config.layer_types[layer_idx], bool(config.attention_bias)
        heads = int(config.num_attention_heads)
        self.head_dim, self.source = head_dim, source
        self.q_proj = ColumnLinear(config.hidden_size, heads * head_dim, bias=bias)
        self.o_proj = RowLinear(heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rope
        self.sliding_window = _window(config, kind)

    @property
    def in_proj(self) -> LinearBase:
        """The projection the input norm feeds."""
        return self.q_proj

    def attend(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The projected query ``[T, heads * head_dim]`` -> the layer's attention output."""
        num_tokens, d = q.shape[0], self.head_dim
        query = cast(torch.Tensor, self.q_norm(q.reshape(-1, d))).view(num_tokens, -1, d)
        table = self.rotary_emb.whole_head_table(positions)
        if table is None:
            raise ValueError("a kv-shared layer rotates whole heads at [T] positions")
        cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)
        first, second = query.float().chunk(2, dim=-1)
        query = torch.cat([first * cos - second * sin, second * cos + first * sin],
                          dim=-1).to(q.dtype)
        ctx = get_forward_context()
        backend = ctx.backend(self.source)
        extra: dict[str, Any] = {}
        if self.sliding_window is not None:
            if not backend.sliding_window:
                raise ValueError(f"the {backend.name!r} attention backend does not take "
                                 "sliding_window")
            extra["sliding_window"] = self.sliding_window
        kv_cache, metadata = ctx.kv_cache(self.source), ctx.metadata_of(self.source)
        out = backend.forward(query, kv_cache, metadata, 1.0, **extra)
        if ctx.bidirectional and self.sliding_window is not None:  # an image's tokens
            out = out.reshape(query.shape)
            attend_spans(out, query, kv_cache, metadata, ctx.bidirectional, scale=1.0,
                         window=self.sliding_window, logit_softcap=None, sinks=None)
        return cast(torch.Tensor, self.o_proj(out.reshape(num_tokens, -1)))


class Gemma4Router(nn.Module):
    """Gemma 4's router: weightless RMSNorm, times ``scale`` and ``hidden ** -0.5``, ``proj``
    to expert logits, softmax (fp32), top-k, renormalized, times the experts'
    ``per_expert_scale``. ``forward(x)`` -> ``(weights fp32, ids int32)`` ``[T, k]``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"config.json top_k_experts must be in [1, {num_experts}], got "
                             f"{top_k}")
        self.top_k, self.eps, self.root = top_k, eps, hidden_size ** -0.5
        self.proj = LinearBase(hidden_size, num_experts)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = unit_rms_norm(x, self.eps) * self.scale * self.root
        probs = cast(torch.Tensor, self.proj(h)).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids.to(torch.int32)


def gemma4_experts(num_experts: int, hidden_size: int, intermediate_size: int,
                   activation: str) -> FusedMoE:
    """The routed experts: the core's :class:`FusedMoE` (HF's ``experts.gate_up_proj``
    ``[E, 2I, H]`` / ``down_proj`` ``[E, H, I]``) with the GeGLU the config names
    (``gelu_pytorch_tanh``: the fused kernels' ``"gelu_tanh"``; ``silu``: SwiGLU)."""
    kernel = _EXPERT_ACTS.get(activation)
    if kernel is None:
        raise ValueError(f"config.json hidden_activation must be one of "
                         f"{sorted(_EXPERT_ACTS)} for the experts, got {activation!r}")
    return FusedMoE(num_experts, hidden_size, intermediate_size, activation=kernel)


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 layer (HF's names): attention between ``input_layernorm`` and
    ``post_attention_layernorm``; the GeGLU ``mlp`` (and with MoE, ``router`` / ``experts``
    beside it, their outputs normed apart and summed) between ``pre_feedforward_layernorm``
    and ``post_feedforward_layernorm``; the per-layer input gated in; the stream times
    ``layer_scalar``. ``forward(positions, x, per_layer_input)`` -> the next stream."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        source = kv_source(config, layer_idx)
        self.self_attn: Gemma4Attention | Gemma4SharedAttention = (
            Gemma4Attention(config, layer_idx, rope) if source is None
            else Gemma4SharedAttention(config, layer_idx, source, rope))
        wide = 2 if config.use_double_wide_mlp and source is not None else 1
        act = str(config.hidden_activation)
        self.mlp = GatedMLP(hidden, int(config.intermediate_size) * wide, act)
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps=eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.router: Gemma4Router | None = None
        if config.enable_moe_block:
            self.router = Gemma4Router(hidden, int(config.num_experts),
                                       int(config.top_k_experts), eps)
            self.experts = gemma4_experts(int(config.num_experts), hidden,
                                          int(config.moe_intermediate_size), act)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps=eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps=eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps=eps)
        ple = int(config.hidden_size_per_layer_input or 0)
        self.per_layer_input_gate: LinearBase | None = None
        if ple:
            self.act = GATE_ACTS[act]
            self.per_layer_input_gate = LinearBase(hidden, ple)
            self.per_layer_projection = LinearBase(ple, hidden)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps=eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                per_layer_input: torch.Tensor | None) -> torch.Tensor:
        attn = self.self_attn
        projected, _ = norm_linear(self.input_layernorm, attn.in_proj, x, None)
        out = self.post_attention_layernorm(attn.attend(positions, projected))
        gate_up, stream = norm_linear(self.pre_feedforward_layernorm, self.mlp.gate_up_proj,
                                      out, x)  # (x consumed: stream = x + out)
        out = self.mlp.down_proj(self.mlp.act_fn(gate_up))
        if self.router is not None:
            weights, ids = self.router(stream)
            routed = self.experts(self.pre_feedforward_layernorm_2(stream), weights, ids)
            out = (self.post_feedforward_layernorm_1(out)
                   + self.post_feedforward_layernorm_2(routed))
        stream = stream + self.post_feedforward_layernorm(out)
        if self.per_layer_input_gate is not None and per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(stream)) * per_layer_input
            stream = stream + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return stream * self.layer_scalar


class Gemma4TextModel(DecoderModel):
    """``embed_tokens`` (times ``sqrt(hidden)`` rounded to the dtype), the layers, ``norm``;
    with per-layer embeddings also ``embed_tokens_per_layer``, ``per_layer_model_projection``
    and ``per_layer_projection_norm`` (HF's ``model.*`` names)."""

    def __init__(self, config: Any, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__(config, make_layer)
        hidden = int(config.hidden_size)
        self.embed_tokens = ScaledEmbedding(config.vocab_size, hidden, hidden ** 0.5,
                                            round_scale=True)
        self.ple_dim = int(config.hidden_size_per_layer_input or 0)
        if self.ple_dim:
            total = len(self.layers) * self.ple_dim
            self.embed_tokens_per_layer = ScaledEmbedding(
                config.vocab_size_per_layer_input, total, self.ple_dim ** 0.5, round_scale=True)
            self.per_layer_model_projection = LinearBase(hidden, total)
            self.per_layer_projection_norm = RMSNorm(self.ple_dim, eps=config.rms_norm_eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[T, layers, ple_dim]``: the per-layer token embedding and the normed projection of
        the embeddings, averaged (sum times ``2 ** -0.5``)."""
        shape = (embeds.shape[0], len(self.layers), self.ple_dim)
        tokens = cast(torch.Tensor, self.embed_tokens_per_layer(input_ids)).view(shape)
        projected = self.per_layer_model_projection(embeds) * self.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.view(-1, self.ple_dim))
        return (cast(torch.Tensor, projected).view(shape) + tokens) * 2 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (always: the per-layer embeddings read them, with ``inputs_embeds``
        too) and positions ``[T]`` -> final hidden states ``[T, hidden]``."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        ple = self.per_layer_inputs(input_ids, x) if self.ple_dim else None
        for i, layer in enumerate(self.layers):
            if self.aux_hidden_states is not None and i in self._aux_slots:
                self._keep(i, x, None)
            x = layer(positions, x, None if ple is None else ple[:, i])
        return cast(torch.Tensor, self.norm(x))


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4's text decoder in the mrv2 model contract (module docstring)."""

    def __init__(self, config: Any, model: Gemma4TextModel | None = None) -> None:
        """``model``: a decoder of the same checkpoint layout built by a subclass (Gemma 3n's,
        its config checked there); None: Gemma 4's from ``config``."""
        types = list(config.layer_types)
        if model is None:
            check_gemma4(config)
            ropes = {kind: gemma4_rope(config, kind, layer_shape(config, types.index(kind))[0])
                     for kind in set(types)}
            model = Gemma4TextModel(
                config, lambda i: Gemma4DecoderLayer(config, i, ropes[types[i]]))
        super().__init__(config, model)
        #: Prompts given as embeddings can't reach a model with per-layer embeddings (they
        #: read the prompt's token ids too): the runner refuses ``enable_prompt_embeds``.
        self.prompt_embeds_supported = not model.ple_dim
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_softcap = None if cap is None else float(cap)
        first = first_shared_layer(config)
        #: Layers with no keys or values of their own; global layers whose values are keys.
        self.shared = {i for i in range(len(types)) if i >= first}
        self.k_eq_v = {i for i in range(first) if getattr(config, "attention_k_eq_v", False)
                       and types[i] == "full_attention"}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def rename(self, name: str) -> str | None:
        """The base names (:meth:`CausalLM.rename`); a kv-shared layer's k/v projections and
        norms, which HF ignores too, skipped."""
        renamed = super().rename(name)
        m = _ATTN_TENSOR.match(renamed or "")
        if m is not None and int(m.group(1)) in self.shared and m.group(2) != "q_proj":
            return None
        return renamed

    def _tensors(self, weights: Iterable[tuple[str, torch.Tensor]], direct: set[str]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """Renamed checkpoint tensors for the stacked loader; a global ``k_eq_v`` layer's
        ``k_proj.*`` as its ``v_proj.*`` too; a kv-shared layer's ``q_proj.*`` (no fused
        projection to stack into) loaded here, its name added to ``direct``."""
        params = dict(self.named_parameters())
        for ckpt_name, tensor in weights:
            name = self.rename(ckpt_name)
            if name is None:
                continue
            m = _ATTN_TENSOR.match(name)
            layer = -1 if m is None else int(m.group(1))
            if layer in self.shared and name in params:
                load_param(name, params[name], tensor, source=ckpt_name)
                direct.add(name)
                continue
            yield name, tensor
            if layer in self.k_eq_v and m is not None and m.group(2) == "k_proj":
                yield name.replace(".k_proj.", ".v_proj.", 1), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors (``layer_scalar`` too); returns the parameter names loaded."""
        direct: set[str] = set()
        loaded = load_stacked_weights(self, self._tensors(weights, direct), self.stacked_params)
        return loaded | direct
