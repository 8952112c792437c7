"""Llama 4's text model (``Llama4ForCausalLM``; the text path of
``Llama4ForConditionalGeneration``: Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E): a
pre-norm decoder with, per layer, as HF's ``modeling_llama4``:

- iRoPE: layer ``i`` rotates q and k where ``no_rope_layers[i]`` is 1 and uses no position
  encoding (NoPE) where it is 0 (HF's naming: the list marks the RoPE layers). An empty or
  missing list is HF's default, a NoPE layer every ``no_rope_layer_interval`` layers (the
  4th, 8th...; ``nope_layer_interval`` is read where a config has only that name).
- RoPE: HF rotates the complex pairs ``(x0, x1), (x2, x3), ...`` of each head (GPT-J's
  layout), the core's attention the halves ``(x_i, x_{i + d/2})``. As the q and k projections
  of a RoPE layer load, each head's output rows are put in the halves order (even rows, then
  odd: :func:`~mrv2.layers.rope_rows_to_halves`); q and k permuted alike keep their scores,
  v and o are untouched, and a LoRA adapter's ``B`` rows take the same order
  (``qkv_proj.row_order``). Llama 3's frequency scaling (``rope_type: llama3``, Scout) is
  the core's.
- ``use_qk_norm`` (Scout; Maverick: off): an RMS norm without weight (HF's ``L2Norm``,
  ``rms_norm_eps``) over each head of q and k of the RoPE layers, *after* the rotation. A
  rotation keeps a head's norm, so it equals the norm before it: the core's fused q/k norm
  with unit weights.
- Attention temperature tuning (``attn_temperature_tuning``) on the NoPE layers: the query
  of a token at position ``p`` is scaled by ``1 + attn_scale * log1p(floor((p + 1) /
  floor_scale))``, computed per token from the positions the forward gets (graph-safe).
- Chunked local attention (``attention_chunk_size``, 8192 in the published configs) on the
  layers HF's ``layer_types`` calls ``chunked_attention`` (the RoPE layers): a query at
  position ``p`` sees only the keys of its own chunk, ``(p // C) * C .. p``: the core's
  ``Attention(attention_chunk=C)``, whose layers get block tables of their own where that
  saves memory (a request's blocks of its earlier chunks freed: at 131,072 tokens Scout
  holds 3.4x fewer KV blocks a request; :mod:`mrv2.runner.kv_tables`). Any
  ``max_model_len`` runs; the RoPE table is built for the engine's ``max_model_len``
  positions (the model state, :class:`~mrv2_llama4.state.Llama4ModelState`, sizes it
  before the first step; else
  ``max_position_embeddings``, 10M in Scout).
- MoE on the layers ``moe_layers`` lists (HF's default: every ``interleave_moe_layer_step``-th
  layer; Scout: all, Maverick: every other one), a dense SwiGLU MLP of
  ``intermediate_size_mlp`` on the others. The router (``feed_forward.router``, a linear
  layer in the model dtype) picks the top ``num_experts_per_tok`` (1 in the published
  models) of its logits and scores each pick by ``sigmoid(logit)``, not a softmax; HF
  multiplies each token's *input* by its score before the expert (``expert(score * x)``,
  which SiLU makes non-linear in the score), so :class:`Llama4MoE` scales the tokens first
  and runs the fused experts with unit weights (with ``top_k`` > 1, a row per pick). A
  shared expert (``shared_expert``, SwiGLU of ``intermediate_size``) sees every token.

Checkpoints: HF keeps the routed experts stacked and transposed, ``experts.gate_up_proj``
``[E, H, 2I]`` (gate columns, then up) and ``experts.down_proj`` ``[E, I, H]``; they load
transposed into :class:`~mrv2.layers.FusedMoE`'s ``[E, 2I, H]`` / ``[E, H, I]`` (per-expert
tensors, ``experts.{e}.gate_proj.weight``..., of quantized exports load by name). The
multimodal checkpoints' text tensors (``language_model.model.*``,
``language_model.lm_head.weight``; transformers' in-memory ``model.language_model.*``) load
as the text model's; the vision tower's and the projector's (``vision_model.*``,
``multi_modal_projector.*``) as the image encoder's
(:class:`~mrv2_llama4.vision.Llama4VisionEncoder`), whose features replace the prompt's
``<|patch|>`` embeddings (:mod:`mrv2_llama4.inputs`); attention stays causal over them, as
in HF.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.distributed.parallel_state import all_reduce
from mrv2.layers import (
    Attention,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    MoEBlock,
    RotaryEmbedding,
    SelfAttention,
    head_dim_of,
    qk_rows_to_halves,
    rope_heads_to_halves,
    rope_parameters_of,
)
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_llama4.vision import VISION_CHECKPOINT_PREFIXES, Llama4VisionEncoder

__all__ = ["Llama4Attention", "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
           "Llama4MoE", "Llama4Router", "attention_temperature", "chunked_layers",
           "moe_layers", "rope_layers"]

#: Each head's q/k rows from RoPE pairs to halves (a module name: the reorder test swaps it).
_halves = rope_heads_to_halves
#: A q or k projection's checkpoint tensor (after renaming): layer, ``q`` / ``k``, what it is.
_QK = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qk])_proj\.(\w+)$")
#: HF's stacked routed experts (after renaming).
_STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
#: The vision tower and projector of a multimodal checkpoint (the image encoder's).
VISION_PREFIXES: tuple[str, ...] = VISION_CHECKPOINT_PREFIXES


def rope_layers(config: Any) -> list[bool]:
    """Whether each layer rotates q and k (``no_rope_layers[i] == 1``; HF's default where the
    list is empty: every ``no_rope_layer_interval``-th layer is NoPE)."""
    n = int(config.num_hidden_layers)
    marks = list(getattr(config, "no_rope_layers", None) or [])
    if not marks:
        interval = int(getattr(config, "no_rope_layer_interval", None)
                       or getattr(config, "nope_layer_interval", None) or 4)
        marks = [int((i + 1) % interval != 0) for i in range(n)]
    if len(marks) < n:
        raise ValueError(f"no_rope_layers lists {len(marks)} layers; the model has "
                         f"num_hidden_layers={n}")
    return [bool(m) for m in marks[:n]]


def chunked_layers(config: Any) -> list[bool]:
    """Whether each layer attends within chunks of ``attention_chunk_size`` (HF's
    ``layer_types`` ``chunked_attention``; by default the RoPE layers); all False where
    ``attention_chunk_size`` is unset."""
    if not getattr(config, "attention_chunk_size", None):
        return [False] * int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types:
        return [t == "chunked_attention" for t in types[:int(config.num_hidden_layers)]]
    return rope_layers(config)


def moe_layers(config: Any) -> set[int]:
    """The layers that route to experts: ``moe_layers``, else every
    ``interleave_moe_layer_step``-th layer (HF's default)."""
    listed = getattr(config, "moe_layers", None)
    if listed is not None:
        return {int(i) for i in listed}
    step = int(getattr(config, "interleave_moe_layer_step", 1) or 1)
    return set(range(step - 1, int(config.num_hidden_layers), step))


def attention_temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float
                          ) -> torch.Tensor:
    """The NoPE layers' query scale at ``positions`` ``[T]`` (fp32 ``[T]``):
    ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``, as HF computes it."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Llama4Attention(SelfAttention):
    """:class:`~mrv2.layers.SelfAttention` with Llama 4's per-layer options (module
    docstring): RoPE (``rope``) or NoPE (None), the weightless q/k norm of the RoPE layers,
    the query temperature of the NoPE layers, chunked attention where
    :func:`chunked_layers` says so."""

    attn: Attention

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding | None) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, rope, qkv_bias=bias, o_bias=bias)
        if chunked_layers(config)[layer_idx]:  # the same attention, within chunks
            attn = self.attn
            self.attn = Attention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                                  layer_idx, sliding_window=attn.sliding_window,
                                  logit_softcap=attn.logit_softcap,
                                  attention_chunk=int(config.attention_chunk_size))
        #: The RMS norm's epsilon of q and k (RoPE layers with ``use_qk_norm``), else None.
        self.l2_norm_eps: float | None = None
        if rope is not None and getattr(config, "use_qk_norm", False):
            self.l2_norm_eps = float(config.rms_norm_eps)
        #: ``(floor_scale, attn_scale)`` of the query temperature (NoPE layers), else None.
        self.temperature: tuple[float, float] | None = None
        if rope is None and getattr(config, "attn_temperature_tuning", False):
            self.temperature = (float(config.floor_scale), float(config.attn_scale))
        self._unit: torch.Tensor | None = None
        if rope is not None:
            qkv = self.qkv_proj
            qkv.row_order = functools.partial(qk_rows_to_halves, qkv)

    def unit_weight(self, like: torch.Tensor) -> torch.Tensor:
        """Ones ``[head_dim]`` of ``like``'s dtype and device: the weight that makes the core's
        fused q/k RMS norm HF's weightless one (made on first use, as the RoPE table is)."""
        unit = self._unit
        if unit is None or unit.device != like.device or unit.dtype != like.dtype:
            unit = self._unit = torch.ones(self.head_dim, dtype=like.dtype, device=like.device)
        return unit

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """After the QKV projection: the NoPE layers' query temperature, or the RoPE layers'
        rotation with the q/k norm fused (module docstring), attention, output projection."""
        q, k, v = self.qkv_proj.split(qkv)
        if self.temperature is not None:
            scale = attention_temperature(positions, *self.temperature)
            q = (q * scale[:, None]).to(q.dtype)
        norms = None
        if self.l2_norm_eps is not None:
            unit = self.unit_weight(q)
            norms = (unit, unit, self.l2_norm_eps)
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb, qk_norm=norms)
        return cast(torch.Tensor, self.o_proj(out))

    def extra_repr(self) -> str:
        return ("rope" if self.rotary_emb is not None else "nope") + (
            ", qk_norm" if self.l2_norm_eps is not None else "") + (
            f", temperature={self.temperature}" if self.temperature is not None else "")


class Llama4Router(nn.Module):
    """HF's ``Llama4Router``: ``logits = x @ weight.T`` in the model dtype, the top ``top_k``
    logits picked, each scored ``sigmoid(logit)`` (fp32, then the model dtype, as HF rounds
    it). ``forward(x)`` returns ``(scores [T, k] in x's dtype, ids [T, k] int32)``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.sigmoid(top.float()).to(logits.dtype), ids.to(torch.int32)

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k={self.top_k}, sigmoid"


class Llama4MoE(MoEBlock):
    """Llama 4's MoE block: the routed experts run on each token scaled by its pick's
    sigmoid score (HF's ``routed_in = x * score``), plus the shared expert on ``x``; one
    all-reduce under tensor parallelism."""

    def __init__(self, config: Any) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"Llama 4 experts support hidden_act 'silu' only, got "
                             f"{config.hidden_act!r}")
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        experts = int(config.num_local_experts)
        router = Llama4Router(hidden, experts, int(config.num_experts_per_tok))
        super().__init__(router, FusedMoE(experts, hidden, inter),
                         GatedMLP(hidden, inter, config.hidden_act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, ids = cast(Llama4Router, self.gate)(x)
        k = ids.shape[-1]
        if k == 1:  # (the published models: one row a token)
            routed = self.experts(x * scores, torch.ones_like(scores, dtype=torch.float32), ids)
        else:  # a row a (token, pick), each scaled by its score, then summed per token
            rows = (x[:, None, :] * scores[..., None]).reshape(-1, x.shape[-1])
            ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
            routed = self.experts(rows, ones, ids.reshape(-1, 1)).view(*ids.shape, -1).sum(1)
        shared = self.shared_experts
        assert shared is not None
        out = routed + shared(x)
        return all_reduce(out) if self.tp_size > 1 else out


class Llama4ForCausalLM(CausalLM):
    """Llama 4's text model in the mrv2 model contract (module docstring)."""

    def __init__(self, config: Any) -> None:
        head_dim = head_dim_of(config)
        ropes = rope_layers(config)
        routed = moe_layers(config)
        base, scaling = rope_parameters_of(config)
        rope_args: dict[str, Any] = {"head_dim": head_dim, "base": base, "scaling": scaling}
        rope = RotaryEmbedding(max_position=int(config.max_position_embeddings), **rope_args)

        def layer(i: int) -> DecoderLayer:
            attention = Llama4Attention(config, i, rope if ropes[i] else None)
            mlp: nn.Module = (Llama4MoE(config) if i in routed else GatedMLP(
                config.hidden_size, config.intermediate_size_mlp, config.hidden_act))
            return DecoderLayer(config, attention, mlp)

        super().__init__(config, DecoderModel(config, layer))
        #: How the RoPE layers' rotation is built, but for its positions (size_rope_table).
        self._rope_args = rope_args
        self._head_dim = head_dim
        self._rope_layers = ropes
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        #: The whole q and k projections' output rows.
        self._qk_rows = {"q": heads * head_dim, "k": kv_heads * head_dim}
        #: ``(hidden, intermediate)`` of the routed experts: the stacked tensors' checks.
        self._expert_dims = (int(config.hidden_size), int(config.intermediate_size))

    def size_rope_table(self, max_position: int) -> None:
        """The RoPE layers' table for positions ``0 .. max_position - 1`` (the engine's
        ``max_model_len``) instead of ``max_position_embeddings`` (10M in Scout: ~5 GB of
        fp32 cos/sin at head_dim 128). Before the first forward: the table is built on first
        use."""
        if max_position < 1:
            raise ValueError(f"max_position must be >= 1, got {max_position}")
        rope = RotaryEmbedding(max_position=max_position, **self._rope_args)
        for module in self.modules():
            if isinstance(module, Llama4Attention) and module.rotary_emb is not None:
                module.rotary_emb = rope

    def rename(self, name: str) -> str | None:
        """HF's ``feed_forward`` as ``mlp``, its ``router`` as ``gate`` and its
        ``shared_expert`` as ``shared_experts`` (the core's MoE block's names)."""
        name = name.replace(".feed_forward.router.", ".mlp.gate.")
        name = name.replace(".feed_forward.shared_expert.", ".mlp.shared_experts.")
        return super().rename(name.replace(".feed_forward.", ".mlp."))

    def _qk_tensor(self, name: str, layer: int, kind: str, what: str, t: torch.Tensor
                   ) -> torch.Tensor:
        """A RoPE layer's q/k checkpoint tensor with its heads' rows in the halves order: the
        weight, the bias and per-row scales permuted; a per-tensor scale, and block scales
        whose blocks hold whole heads, kept."""
        if not self._rope_layers[layer]:
            return t  # (a NoPE layer: no rotation, no reorder)
        rows, d = self._qk_rows[kind], self._head_dim
        if what in ("weight", "bias", "weight_scale", "weight_scale_inv") and (
                t.dim() >= 1 and t.shape[0] == rows):
            return _halves(t, d)
        if what.endswith("scale") and t.numel() == 1 or (
                what == "weight_scale_inv" and t.dim() == 2 and -(-rows // t.shape[0]) % d == 0):
            return t  # (no row leaves its block)
        raise ValueError(f"checkpoint tensor {name!r} {tuple(t.shape)}: Llama 4 reorders the "
                         f"RoPE layers' q/k projection rows for its interleaved RoPE, which "
                         f"this tensor's layout does not allow (a quantized format?)")

    def _expert_stack(self, name: str, which: str, t: torch.Tensor) -> torch.Tensor:
        """HF's stacked ``gate_up_proj`` ``[E, H, 2I]`` / ``down_proj`` ``[E, I, H]`` as
        :class:`~mrv2.layers.FusedMoE`'s ``[E, 2I, H]`` / ``[E, H, I]`` (a view)."""
        hidden, inter = self._expert_dims
        want = (hidden, 2 * inter) if which == "gate_up_proj" else (inter, hidden)
        if t.dim() != 3 or tuple(t.shape[1:]) != want:
            raise ValueError(f"checkpoint tensor {name!r}: expects HF's stacked experts "
                             f"[num_local_experts, {want[0]}, {want[1]}], got "
                             f"{tuple(t.shape)}")
        return t.transpose(1, 2)

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            target = self.rename(name)
            if target is not None:
                qk = _QK.match(target)
                stacked = _STACKED.search(target)
                if qk is not None:
                    t = self._qk_tensor(name, int(qk.group(1)), qk.group(2), qk.group(3), t)
                elif stacked is not None:
                    t = self._expert_stack(name, stacked.group(1), t)
            yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, the RoPE layers' q/k rows reordered and the stacked experts
        transposed as they stream (module docstring)."""
        return super().load_weights(self._convert(weights))


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """Llama 4's multimodal checkpoints (Scout, Maverick): the text model, built from the
    ``text_config`` (the LM head tied by the top-level ``tie_word_embeddings``), and the image
    encoder (``vision``, replicated under tensor parallelism; module doc). ``self.hf_config``
    is the composite config."""

    media_encoders: ClassVar[tuple[str, ...]] = ("vision",)

    def __init__(self, config: Any) -> None:
        super().__init__(vl_text_config(config, "Llama4ForConditionalGeneration"))
        self.hf_config = config
        self.vision = Llama4VisionEncoder(config)

    def embed_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's tiles ``[tiles, 3, S, S]`` -> their features ``[tiles *
        tokens_per_tile, hidden_size]`` (tile by tile, in order) in the model dtype."""
        return self.vision(pixel_values).to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """``language_model.model.*`` / ``model.language_model.*`` as ``model.*``,
        ``language_model.lm_head.*`` as ``lm_head.*``; the vision tower's and the projector's
        None (:meth:`load_weights` hands them to the encoder)."""
        if name.startswith(VISION_PREFIXES):
            return None
        return super().rename(vl_text_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The text model's tensors through its loader (module doc), the vision tower's and
        the projector's through the encoder's."""
        return load_text_and_encoder(super().load_weights, self.vision, VISION_PREFIXES,
                                     weights, "vision")
