"""Gemma 3n's text decoder (``Gemma3nForCausalLM``, HF ``Gemma3nTextConfig``) and, for text
prompts, its multimodal checkpoints (``Gemma3nForConditionalGeneration``: E2B, E4B).

Gemma 4's attention (:mod:`mrv2_gemma.gemma4`: plain ``x * weight`` norms, per-head q/k norms,
a weightless v norm, scale 1.0, a RoPE per layer type, KV sharing through
:class:`~mrv2_gemma.gemma4.Gemma4SharedAttention`, per-layer embeddings, soft-capped logits)
inside another layer, each piece checked against transformers 5.17's ``modeling_gemma3n.py``:

- **AltUp.** The stream is ``altup_num_inputs`` parallel copies ``[n, T, hidden]``: the
  embeddings, then ``altup_projections[i]`` of them rescaled to the embeddings' RMS. Each
  layer *predicts* every copy from all of them (a per-token ``n x n`` mix from a router over
  the active copy ``altup_active_idx``), runs on the active prediction, and *corrects* every
  copy by the layer's innovation (a per-token, per-copy scale from the router over the
  output). At the end ``altup_unembed_projections`` bring copies 1.. back (rescaled to copy
  0's RMS) and the copies are averaged: :class:`Gemma3nAltUp`.
- **Laurel**: a low-rank residual (``linear_left``, ``linear_right``, ``post_laurel_norm``)
  on the normed input, summed with the attention's residual and scaled by ``1 / sqrt(2)``.
- **Per-layer inputs** are gated in from the corrected active copy (times
  ``correct_output_scale`` with ``altup_correct_scale``) and added to copies 1.. only.
- **Activation sparsity** (``activation_sparsity_pattern[i]`` > 0, the first ten layers of
  the published checkpoints): the MLP's gate keeps only what exceeds its mean plus
  ``icdf(p)`` standard deviations (over the whole intermediate width: under tensor
  parallelism the moments are summed across ranks), shifted down by that cutoff.
- ``intermediate_size`` per layer (a list); KV sharing: the last ``num_kv_shared_layers``
  layers read the cache of the last earlier layer of their type (the sliding window of the
  reader).

``Gemma3nForConditionalGeneration`` serves text: the decoder under ``model.language_model.*``,
the top-level ``tie_word_embeddings`` tying the head. Its token ids past the text vocabulary
(``vision_config.vocab_offset`` .., ``audio_config.vocab_offset`` ..: the media control tokens)
are embedded by ``embed_vision`` / ``embed_audio``'s token path as HF's (a table, a norm, a
projection, a weightless norm), and read the per-layer table at id 0. The MobileNetV5 vision
and USM audio towers' tensors are skipped; a prompt with ``multi_modal_data`` is refused as it
arrives (:class:`Gemma3nTextOnlyInputs`).

Refused with a ValueError naming the field: layer types other than sliding/full, a
``num_kv_shared_layers`` that leaves a shared layer no source, an ``altup_active_idx`` out of
range, sparsity outside ``[0, 1)``, per-layer lists of the wrong length, RoPE types unknown
to :mod:`mrv2.layers.rotary`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.input_processor import InputProcessor
from mrv2.contract.requests import MultiModalItem
from mrv2.distributed.parallel_state import all_reduce, tp_size
from mrv2.layers import ColumnLinear, GatedMLP, LinearBase, RMSNorm, RotaryEmbedding, RowLinear
from mrv2.layers.rotary import SUPPORTED_ROPE_TYPES
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_gemma.gemma4 import (
    GATE_ACTS,
    Gemma4Attention,
    Gemma4ForCausalLM,
    Gemma4SharedAttention,
    Gemma4TextModel,
    first_shared_layer,
    gemma4_rope,
    kv_source,
    unit_rms_norm,
)

__all__ = ["Gemma3nForCausalLM", "Gemma3nForConditionalGeneration", "Gemma3nTextOnlyInputs",
           "check_gemma3n"]

_KINDS = ("sliding_attention", "full_attention")
#: The multimodal checkpoint's tower tensors (skipped) and its embedders' soft-token norm.
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "vision_tower.", "audio_tower.")
_EMBEDDERS = ("embed_vision", "embed_audio")


def _per_layer(config: Any, name: str) -> list[Any]:
    value = getattr(config, name)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * int(
        config.num_hidden_layers)
    if len(values) != int(config.num_hidden_layers):
        raise ValueError(f"config.json {name} lists {len(values)} values for "
                         f"{config.num_hidden_layers} layers")
    return values


def check_gemma3n(config: Any) -> None:
    """ValueError naming the field for what this decoder cannot match (module docstring)."""
    layers, types = int(config.num_hidden_layers), list(config.layer_types)
    if len(types) != layers or not set(types) <= set(_KINDS):
        raise ValueError(f"config.json layer_types must list {layers} of {_KINDS}, got {types}")
    if not 0 <= layers - first_shared_layer(config) < layers:
        raise ValueError(f"config.json num_kv_shared_layers = {config.num_kv_shared_layers} "
                         f"must be in [0, {layers})")
    for i in range(first_shared_layer(config), layers):
        kv_source(config, i)  # (a ValueError naming the field where there is none)
    if not 0 <= int(config.altup_active_idx) < int(config.altup_num_inputs):
        raise ValueError(f"config.json altup_active_idx = {config.altup_active_idx} must be "
                         f"in [0, altup_num_inputs = {config.altup_num_inputs})")
    _per_layer(config, "intermediate_size")
    bad = [p for p in _per_layer(config, "activation_sparsity_pattern")
           if not 0.0 <= float(p) < 1.0]
    if bad:
        raise ValueError(f"config.json activation_sparsity_pattern values must be in [0, 1), "
                         f"got {bad}")
    act = str(config.hidden_activation)
    if act not in GATE_ACTS:
        raise ValueError(f"config.json hidden_activation must be one of {sorted(GATE_ACTS)}, "
                         f"got {act!r}")
    for kind in set(types):
        params = (getattr(config, "rope_parameters", None) or {}).get(kind)
        if not isinstance(params, Mapping) or "rope_theta" not in params:
            raise ValueError(f"config.json rope_parameters has no {kind!r} entry with a "
                             "rope_theta")
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"config.json rope_parameters[{kind!r}].rope_type = {rope_type!r} "
                             f"is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (HF multiplies by scalar buffers of the model dtype)."""
    return float(torch.tensor(value, dtype=dtype, device="cpu"))


def _rms(x: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """Root mean square over the last dimension (the mean square floored at ``floor`` first)."""
    square = x.pow(2).mean(-1, keepdim=True)
    return square.clamp(min=floor).sqrt() if floor is not None else square ** 0.5


class Gemma3nAltUp(nn.Module):
    """AltUp's predict and correct steps over the copies ``[n, T, hidden]`` (HF's names:
    ``modality_router`` after ``router_norm`` times ``1 / hidden``, then tanh; the
    ``prediction_coefs`` ``n x n`` mix a token; ``correction_coefs`` plus one a copy;
    ``correct_output_scale``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, n = int(config.hidden_size), int(config.altup_num_inputs)
        self.n, self.active = n, int(config.altup_active_idx)
        self.input_scale = 1.0 / hidden
        self._scales: dict[torch.dtype, float] = {}
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        # (plain products: n is 4; a router of n outputs is too narrow for the GEMV kernels)
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(hidden, n, bias=False)
        self.router_norm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._scales.get(x.dtype)
        if scale is None:
            scale = self._scales[x.dtype] = _rounded(self.input_scale, x.dtype)
        routed = self.modality_router(self.router_norm(x) * scale)
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, copies: torch.Tensor) -> torch.Tensor:
        """``[n, T, hidden]`` -> the predictions, same shape."""
        modalities = self._modalities(copies[self.active])
        coefs = self.prediction_coefs(modalities).view(-1, self.n, self.n).transpose(1, 2)
        mixed = torch.matmul(copies.permute(1, 2, 0), coefs).permute(2, 0, 1)
        return (mixed + copies).contiguous()

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """The predictions moved by the layer's innovation ``activated - predictions[active]``
        ``[T, hidden]``, a per-token scale per copy."""
        coefs = self.correction_coefs(self._modalities(activated)) + 1.0
        innovation = activated - predictions[self.active]
        return innovation.unsqueeze(0) * coefs.t().unsqueeze(-1) + predictions


class Gemma3nLaurel(nn.Module):
    """Laurel: ``x + post_laurel_norm(linear_right(linear_left(x)))``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, rank = int(config.hidden_size), int(config.laurel_rank)
        self.linear_left = ColumnLinear(hidden, rank)
        self.linear_right = RowLinear(rank, hidden)
        self.post_laurel_norm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class Gemma3nMLP(GatedMLP):
    """The GeGLU MLP; with ``sparsity`` > 0, HF's Gaussian top-k on the gate: ``relu(gate -
    (mean + std * icdf(sparsity)))``, the moments over the whole intermediate width."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, sparsity: float
                 ) -> None:
        super().__init__(hidden_size, intermediate_size, act)
        self.width = intermediate_size
        self.std_multiplier: float | None = None
        if sparsity > 0.0:
            normal = torch.distributions.normal.Normal(0.0, 1.0)
            self.std_multiplier = float(normal.icdf(torch.tensor(sparsity, device="cpu")))
        self._multipliers: dict[torch.dtype, float] = {}

    def _cutoff(self, gate: torch.Tensor, multiplier: float) -> torch.Tensor:
        if tp_size() == 1:
            std, mean = torch.std_mean(gate, dim=-1, keepdim=True, correction=0)
            return mean + std * multiplier
        g = gate.float()  # (each rank holds a slice: sum the moments over the ranks)
        sums = all_reduce(torch.cat([g.sum(-1, keepdim=True), g.pow(2).sum(-1, keepdim=True)],
                                    dim=-1))
        mean = sums[:, :1] / self.width
        std = (sums[:, 1:] / self.width - mean * mean).clamp(min=0.0).sqrt()
        return (mean + std * multiplier).to(gate.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.std_multiplier is not None:
            multiplier = self._multipliers.get(gate_up.dtype)
            if multiplier is None:
                multiplier = self._multipliers[gate_up.dtype] = _rounded(
                    self.std_multiplier, gate_up.dtype)
            gate, up = gate_up.chunk(2, dim=-1)
            gate = F.relu(gate - self._cutoff(gate, multiplier))
            gate_up = torch.cat([gate, up], dim=-1)
        return cast(torch.Tensor, self.down_proj(self.act_fn(gate_up)))


class Gemma3nDecoderLayer(nn.Module):
    """One Gemma 3n layer (HF's names): ``altup`` around attention (Gemma 4's, or its
    kv-shared form) with ``laurel`` beside it, the sparse GeGLU ``mlp`` between its norms, the
    per-layer input gated into copies 1... ``forward(positions, copies, per_layer_input)`` ->
    the next copies ``[n, T, hidden]``."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        source = kv_source(config, layer_idx)
        self.self_attn: Gemma4Attention | Gemma4SharedAttention = (
            Gemma4Attention(config, layer_idx, rope) if source is None
            else Gemma4SharedAttention(config, layer_idx, source, rope))
        act = str(config.hidden_activation)
        self.mlp = Gemma3nMLP(hidden, int(_per_layer(config, "intermediate_size")[layer_idx]),
                              act, float(_per_layer(config, "activation_sparsity_pattern")
                                         [layer_idx]))
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps=eps)
        self.altup = Gemma3nAltUp(config)
        self.laurel = Gemma3nLaurel(config)
        self.correct_scale = bool(config.altup_correct_scale)
        ple = int(config.hidden_size_per_layer_input)
        self.act = GATE_ACTS[act]
        self.per_layer_input_gate = LinearBase(hidden, ple)
        self.per_layer_projection = LinearBase(ple, hidden)
        self.post_per_layer_input_norm = RMSNorm(hidden, eps=eps)

    def forward(self, positions: torch.Tensor, copies: torch.Tensor,
                per_layer_input: torch.Tensor) -> torch.Tensor:
        altup, attn = self.altup, self.self_attn
        predictions = altup.predict(copies)
        active = predictions[altup.active]
        normed = cast(torch.Tensor, self.input_layernorm(active))
        laurel = self.laurel(normed)
        out = self.post_attention_layernorm(attn.attend(positions, attn.in_proj(normed)))
        out = (active + out + laurel) / math.sqrt(2)
        out = out + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(out)))
        corrected = altup.correct(predictions, out)
        first = corrected[altup.active]
        if self.correct_scale:
            first = first * altup.correct_output_scale.to(first.dtype)
        gated = self.act(self.per_layer_input_gate(first)) * per_layer_input
        corrected[1:] += self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return corrected


class Gemma3nTextModel(Gemma4TextModel):
    """Gemma 4's text model (scaled embeddings, per-layer embeddings, ``norm``) with AltUp's
    ``altup_projections`` / ``altup_unembed_projections`` around the layers (HF's
    ``model.*`` names)."""

    def __init__(self, config: Any, rope: dict[str, RotaryEmbedding]) -> None:
        types = list(config.layer_types)
        super().__init__(config, lambda i: Gemma3nDecoderLayer(config, i, rope[types[i]]))
        hidden, n = int(config.hidden_size), int(config.altup_num_inputs)
        self.altup_projections = nn.ModuleList(LinearBase(hidden, hidden) for _ in range(n - 1))
        self.altup_unembed_projections = nn.ModuleList(
            LinearBase(hidden, hidden) for _ in range(n - 1))
        self.ple_vocab = int(config.vocab_size_per_layer_input)

    @staticmethod
    def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``x`` scaled to RMS ``target`` (its own RMS floored at ``sqrt(1e-5)``)."""
        return x * target / _rms(x, floor=1e-5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (the per-layer table reads them: ids past it read row 0, as HF's
        multimodal model) and positions ``[T]`` -> final hidden states ``[T, hidden]``."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        ple_ids = input_ids.masked_fill((input_ids < 0) | (input_ids >= self.ple_vocab), 0)
        ple = self.per_layer_inputs(ple_ids, x)
        target = _rms(x)
        copies = torch.stack([x] + [self._rescaled(proj(x), target)
                                    for proj in self.altup_projections])
        for i, layer in enumerate(self.layers):
            copies = layer(positions, copies, ple[:, i])
        target = _rms(copies[0])
        outs = [copies[0]] + [self._rescaled(proj(copies[i + 1]), target)
                              for i, proj in enumerate(self.altup_unembed_projections)]
        return cast(torch.Tensor, self.norm(torch.stack(outs).mean(dim=0)))


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    """Gemma 3n's text decoder in the mrv2 model contract (module docstring); Gemma 4's
    loader (kv-shared layers' query projections loaded apart) and soft-capped logits."""

    def __init__(self, config: Any) -> None:
        check_gemma3n(config)
        ropes = {kind: gemma4_rope(config, kind, int(config.head_dim))
                 for kind in set(config.layer_types)}
        super().__init__(config, Gemma3nTextModel(config, ropes))

    def keep_aux_hidden_states(self, layer_ids: Any, max_num_tokens: int) -> torch.Tensor:
        """Refused: AltUp's stream is several copies (no one residual stream to draft from)."""
        raise ValueError(f"{type(self).__name__} keeps no aux hidden states (its AltUp stream "
                         "is several copies): Eagle3 speculation is not supported")


class Gemma3nTokenEmbedder(nn.Module):
    """HF's ``Gemma3nMultimodalEmbedder`` for token ids: ``embedding`` (rows from
    ``vocab_offset``), ``hard_embedding_norm``, ``embedding_projection``, a weightless norm.
    (Its soft-token norm serves the towers' outputs: not loaded.)"""

    def __init__(self, media_config: Any, hidden_size: int) -> None:
        super().__init__()
        width, self.eps = int(media_config.hidden_size), float(media_config.rms_norm_eps)
        self.vocab_offset, self.vocab_size = (int(media_config.vocab_offset),
                                              int(media_config.vocab_size))
        self.embedding = nn.Embedding(self.vocab_size, width)
        self.hard_embedding_norm = RMSNorm(width, eps=self.eps)
        self.embedding_projection = LinearBase(width, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.embedding((input_ids - self.vocab_offset).clamp(0, self.vocab_size - 1))
        return unit_rms_norm(self.embedding_projection(self.hard_embedding_norm(rows)), self.eps)


class Gemma3nForConditionalGeneration(Gemma3nForCausalLM):
    """Gemma 3n's multimodal checkpoint for text prompts (module docstring). ``config`` is the
    composite ``Gemma3nConfig`` (``self.hf_config``); ``self.config`` its ``text_config``."""

    def __init__(self, config: Any) -> None:
        super().__init__(vl_text_config(config, type(self).__name__))
        self.hf_config = config
        hidden = int(self.config.hidden_size)
        self.embed_vision = Gemma3nTokenEmbedder(config.vision_config, hidden)
        self.embed_audio = Gemma3nTokenEmbedder(config.audio_config, hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text ids through the scaled table; media control ids through their embedder."""
        x = super().embed_input_ids(input_ids)
        vision, audio = self.embed_vision, self.embed_audio
        in_vision = (input_ids >= vision.vocab_offset) & (input_ids < audio.vocab_offset)
        x = torch.where(in_vision.unsqueeze(-1), vision(input_ids).to(x.dtype), x)
        in_audio = input_ids >= audio.vocab_offset
        return torch.where(in_audio.unsqueeze(-1), audio(input_ids).to(x.dtype), x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return super().forward(input_ids, positions, inputs_embeds)

    def rename(self, name: str) -> str | None:
        """``model.language_model.*`` as ``model.*``; the embedders' token path as
        ``embed_vision.*`` / ``embed_audio.*``; the towers' tensors (and the embedders'
        soft-token norms) None."""
        if name.startswith(_TOWERS) or ".soft_embedding_norm." in name:
            return None
        for embedder in _EMBEDDERS:
            for prefix in (f"model.{embedder}.", f"{embedder}."):
                if name.startswith(prefix):
                    return embedder + "." + name[len(prefix):]
        return super().rename(vl_text_name(name))


class Gemma3nTextOnlyInputs(InputProcessor):
    """The input processor of ``Gemma3nForConditionalGeneration``: text prompts only. Any
    ``multi_modal_data`` is refused as the request arrives, naming the field: mrv2 runs
    neither Gemma 3n's MobileNetV5 vision tower nor its USM audio tower."""

    text_only = True

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Always a ValueError naming ``multi_modal_data`` and its keys."""
        keys = ", ".join(sorted(map(str, mm_data))) or "empty"
        raise ValueError(f"multi_modal_data ({keys}): Gemma3nForConditionalGeneration serves "
                         "text prompts only in mrv2 (its MobileNetV5 vision and USM audio "
                         "towers are not implemented)")
