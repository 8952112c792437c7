"""Gemma 4's audio encoder: the audio tower (a USM conformer) and the audio embedder of HF's
``Gemma4ForConditionalGeneration``, in plain torch (numerically HF's, transformers 5.17), one
clip at a time. Replicated under tensor parallelism: every rank runs it whole.

Checkpoint names
----------------
The tower's tensors come under ``model.audio_tower.`` (transformers 5.17's names) or
``audio_tower.`` (the layout without ``model.``), the embedder's under ``model.embed_audio.``
or ``embed_audio.``; the module's parameter and buffer names are the checkpoint's without
``model.``: ``subsample_conv_projection.{layer0,layer1}.{conv,norm}.weight``,
``subsample_conv_projection.input_proj_linear.weight``; per layer ``layers.{i}.``
``feed_forward{1,2}.{ffw_layer_1,ffw_layer_2}``, ``self_attn.{q_proj,k_proj,v_proj,post}``
and ``lconv1d.{linear_start,linear_end}`` (clippable linears: ``linear.weight`` and, with
``use_clipped_linears``, the scalar buffers ``input_min``, ``input_max``, ``output_min``,
``output_max``; bounds not in the checkpoint stay at +-inf),
``feed_forward{1,2}.{pre,post}_layer_norm.weight``, ``self_attn.relative_k_proj.weight``,
``self_attn.per_dim_scale``, ``lconv1d.depthwise_conv1d.weight``,
``lconv1d.{pre_layer_norm,conv_norm}.weight``, ``norm_{pre_attn,post_attn,out}.weight``;
``output_proj.{weight,bias}``; the embedder's ``embedding_projection.weight``.

Computation
-----------
A clip comes as the feature extractor's log-mel frames ``[frames, mel]``, only the valid ones
(those whose analysis window holds real samples: a prefix; HF zeroes and masks the rest, and
nothing valid reads them, so a clip alone gives HF's batched rows). The subsampler runs two
``3 x 3`` stride-2 convolutions (no bias; zero padding 1) over ``(time, mel)``, each followed
by a LayerNorm over channels (no bias) and a ReLU, flattens ``(mel, channel)`` and projects to
``hidden_size``: ``ceil(ceil(frames / 2) / 2)`` tokens. Each conformer layer is
``ff1 -> attention -> light conv -> ff2 -> norm_out``, where a feed-forward is ``x +
residual_weight * post_norm(clamp(W2 act(W1 pre_norm(clamp(x)))))`` and the attention block
``x + norm_post_attn(clamp(attn(norm_pre_attn(clamp(x)))))`` (``clamp``: to
+-``gradient_clipping``; the feed-forward's and these norms' eps is 1e-6, HF's default, the
light conv's ``rms_norm_eps``). Attention (fp32) is chunked local self-attention: queries in
blocks of ``attention_chunk_size``, each attending over its block widened by
``attention_context_left - 1`` keys before and ``attention_context_right`` after; a query sees
keys at distance ``0 .. context_left - 2`` before it and ``1 .. context_right - 1`` after it.
Logits are ``q k + q r`` with ``q`` scaled by ``head_dim ** -0.5 / ln 2 * softplus
(per_dim_scale)``, ``k`` by ``ln(1 + e) / ln 2`` and ``r`` the relative-position keys
(``relative_k_proj`` of sinusoidal embeddings of distances ``context // 2 .. 0``, aligned by
Transformer-XL's shift), soft-capped by ``attention_logit_cap``, masked with
``attention_invalid_logits_value``. The light conv is ``x + linear_end(act(conv_norm(clamp(
dwconv(glu(linear_start(pre_layer_norm(x))))))))`` with a causal depthwise convolution.
``output_proj`` (with bias) maps to ``output_proj_dims``; the embedder RMS-normalises (no
scale) and projects to the text hidden size: the clip's rows of HF's ``get_audio_features(
...).pooler_output`` at the valid positions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.weights import load_encoder_weights, under_prefixes
from mrv2_gemma.gemma4_vision import _ACTIVATIONS, _ClippableLinear, _Embedder, _RMSNorm

__all__ = ["AUDIO_CHECKPOINT_PREFIXES", "Gemma4AudioEncoder", "audio_tokens"]

_MODULES: tuple[str, ...] = ("audio_tower.", "embed_audio.")
#: Checkpoint prefixes of the tower and the embedder: transformers 5.17's names, then the
#: layout without ``model.``.
AUDIO_CHECKPOINT_PREFIXES: tuple[str, ...] = tuple("model." + m for m in _MODULES) + _MODULES

_HF_EPS = 1e-6  # (HF's Gemma4RMSNorm default, which its feed-forward and layer norms keep)


def _halved(n: int) -> int:
    """The length after a ``3``-wide stride-2 convolution with padding 1: ``ceil(n / 2)``."""
    return (n + 2 - 3) // 2 + 1 if n > 0 else 0


def audio_tokens(frames: int) -> int:
    """The soft tokens of a clip of ``frames`` valid mel frames (two stride-2 convolutions),
    as HF's processor counts them."""
    return _halved(_halved(frames))


class _SubsampleLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, (3, 3), stride=(2, 2), padding=1,
                              bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x.to(self.conv.weight.dtype))
        return F.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


class _Subsampler(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        first, second = (int(c) for c in cfg.subsampling_conv_channels)
        eps = float(cfg.rms_norm_eps)
        self.layer0 = _SubsampleLayer(1, first, eps)
        self.layer1 = _SubsampleLayer(first, second, eps)
        self.input_proj_linear = nn.Linear((first // 4) * second, int(cfg.hidden_size),
                                           bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.layer0(features[None, None]))  # [1, C, T', F']
        out: torch.Tensor = self.input_proj_linear(x.permute(0, 2, 3, 1).flatten(2))
        return out


def _clamp(x: torch.Tensor, limit: float) -> torch.Tensor:
    bound = min(limit, torch.finfo(x.dtype).max)
    return torch.clamp(x, -bound, bound)


class _FeedForward(nn.Module):
    def __init__(self, cfg: Any, clipped: bool) -> None:
        super().__init__()
        dim = int(cfg.hidden_size)
        self.ffw_layer_1 = _ClippableLinear(dim, dim * 4, clipped)
        self.ffw_layer_2 = _ClippableLinear(dim * 4, dim, clipped)
        self.pre_layer_norm = _RMSNorm(dim, _HF_EPS)
        self.post_layer_norm = _RMSNorm(dim, _HF_EPS)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.clip, self.scale = float(cfg.gradient_clipping), float(cfg.residual_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(self.pre_layer_norm(
            _clamp(x, self.clip)))))
        return self.post_layer_norm(_clamp(h, self.clip)) * self.scale + x


class _Attention(nn.Module):
    """Chunked local attention with relative-position logits (module doc)."""

    def __init__(self, cfg: Any, clipped: bool) -> None:
        super().__init__()
        dim = int(cfg.hidden_size)
        self.num_heads = int(cfg.num_attention_heads)
        self.head_dim = dim // self.num_heads
        width = self.num_heads * self.head_dim
        self.q_scale = self.head_dim ** -0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.chunk = int(cfg.attention_chunk_size)
        self.past = int(cfg.attention_context_left) - 1
        self.future = int(cfg.attention_context_right)
        self.context = self.chunk + self.past + self.future
        self.cap = float(cfg.attention_logit_cap)
        self.invalid = float(cfg.attention_invalid_logits_value)
        self.q_proj = _ClippableLinear(dim, width, clipped)
        self.k_proj = _ClippableLinear(dim, width, clipped)
        self.v_proj = _ClippableLinear(dim, width, clipped)
        self.post = _ClippableLinear(dim, dim, clipped)
        self.relative_k_proj = nn.Linear(dim, width, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))

    def mask(self, length: int, device: torch.device) -> torch.Tensor:
        """``[blocks, chunk, context]``: which context keys each query of a clip of
        ``length`` tokens sees (HF's blocked sliding-window mask over the valid keys)."""
        blocks = -(-length // self.chunk)
        start = torch.arange(blocks, device=device)[:, None, None] * self.chunk
        query = start + torch.arange(self.chunk, device=device)[None, :, None]
        key = start - self.past + torch.arange(self.context, device=device)[None, None, :]
        dist = query - key
        window = ((dist >= 0) & (dist < self.past)) | ((dist < 0) & (-dist < self.future))
        return window & (key >= 0) & (key < length) & (query < length)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T, H, d]`` -> the query blocks ``[1, blocks, chunk, H, d]``."""
        blocks = -(-x.shape[1] // self.chunk)
        x = F.pad(x, (0, 0, 0, 0, 0, blocks * self.chunk - x.shape[1]))
        return x.reshape(1, blocks, self.chunk, self.num_heads, self.head_dim)

    def _contexts(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T, H, d]`` -> each block's keys ``[1, blocks, context, H, d]``."""
        x = F.pad(x, (0, 0, 0, 0, self.past, self.future + self.chunk - 1))
        return torch.movedim(x.unfold(1, self.context, self.chunk), -1, 2)

    def _rel_shift(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, H, blocks, chunk, P]`` logits by relative position -> by context key."""
        _, heads, blocks, chunk, width = x.shape
        x = F.pad(x, (0, self.context + 1 - width))
        x = x.reshape(1, heads, blocks, chunk * (self.context + 1))[..., : chunk * self.context]
        return x.reshape(1, heads, blocks, chunk, self.context)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        length = x.shape[1]
        shape = (1, length, self.num_heads, self.head_dim)
        q = self.q_proj(x).float().view(shape) * self.q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).float().view(shape) * self.k_scale
        v = self.v_proj(x).float().view(shape)
        queries = self._blocks(q).permute(0, 3, 1, 2, 4)  # [1, H, blocks, chunk, d]
        keys, values = (self._contexts(t).permute(0, 3, 1, 2, 4) for t in (k, v))
        rel = self.relative_k_proj(positions).view(-1, self.num_heads, self.head_dim).float()
        by_key = queries @ keys.transpose(-1, -2)
        by_pos = (queries.reshape(1, self.num_heads, -1, self.head_dim) @ rel.permute(1, 2, 0))
        logits = by_key + self._rel_shift(by_pos.view(*queries.shape[:4], -1))
        logits = torch.tanh(logits / self.cap) * self.cap
        weights = F.softmax(logits.masked_fill(~mask, self.invalid), dim=-1,
                            dtype=torch.float32)
        out = (weights @ values).permute(0, 2, 3, 1, 4).reshape(1, -1, self.num_heads
                                                                * self.head_dim)
        projected: torch.Tensor = self.post(out[:, :length].to(x.dtype))
        return projected


class _LightConv(nn.Module):
    def __init__(self, cfg: Any, clipped: bool) -> None:
        super().__init__()
        dim, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        self.linear_start = _ClippableLinear(dim, dim * 2, clipped)
        self.linear_end = _ClippableLinear(dim, dim, clipped)
        kernel = int(cfg.conv_kernel_size)
        self.depthwise_conv1d = nn.Conv1d(dim, dim, kernel, groups=dim, bias=False)
        self.pre_layer_norm = _RMSNorm(dim, eps)
        self.conv_norm = _RMSNorm(dim, eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.clip, self.left = float(cfg.gradient_clipping), kernel - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        h = self.depthwise_conv1d(F.pad(h.transpose(1, 2), (self.left, 0))).transpose(1, 2)
        out: torch.Tensor = self.linear_end(self.act(self.conv_norm(_clamp(h, self.clip)))) + x
        return out


class _ConformerLayer(nn.Module):
    def __init__(self, cfg: Any, clipped: bool) -> None:
        super().__init__()
        dim = int(cfg.hidden_size)
        self.feed_forward1 = _FeedForward(cfg, clipped)
        self.feed_forward2 = _FeedForward(cfg, clipped)
        self.self_attn = _Attention(cfg, clipped)
        self.lconv1d = _LightConv(cfg, clipped)
        self.norm_pre_attn = _RMSNorm(dim, _HF_EPS)
        self.norm_post_attn = _RMSNorm(dim, _HF_EPS)
        self.norm_out = _RMSNorm(dim, _HF_EPS)
        self.clip = float(cfg.gradient_clipping)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(_clamp(x, self.clip)), positions, mask)
        x = self.norm_post_attn(_clamp(h, self.clip)) + x
        x = self.feed_forward2(self.lconv1d(x))
        out: torch.Tensor = self.norm_out(_clamp(x, self.clip))
        return out


class _AudioTower(nn.Module):
    """HF's ``Gemma4AudioModel`` for one clip of valid frames."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        clipped = bool(cfg.use_clipped_linears)
        self.subsample_conv_projection = _Subsampler(cfg)
        self.layers = nn.ModuleList(
            _ConformerLayer(cfg, clipped) for _ in range(int(cfg.num_hidden_layers)))
        self.output_proj = nn.Linear(int(cfg.hidden_size), int(cfg.output_proj_dims), bias=True)
        self.hidden_size = int(cfg.hidden_size)

    def positions(self, context: int, dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
        """``[context // 2 + 1, hidden]``: sinusoidal embeddings (sin, then cos) of the
        relative distances ``context // 2 .. 0`` (fp32, then ``dtype``)."""
        count = self.hidden_size // 2
        step = math.log(10000.0) / max(count - 1, 1)
        inv = torch.exp(torch.arange(count, device=device) * -step)
        scaled = torch.arange(context // 2, -1, -1, device=device)[:, None] * inv[None, :]
        return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1).to(dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.subsample_conv_projection(features)  # [1, tokens, hidden]
        if not len(self.layers):
            out: torch.Tensor = self.output_proj(x)
            return out
        attn = cast(_ConformerLayer, self.layers[0]).self_attn
        positions = self.positions(attn.context, x.dtype, x.device)
        mask = attn.mask(x.shape[1], x.device)
        for layer in self.layers:
            x = layer(x, positions, mask)
        out = self.output_proj(x)
        return out


class Gemma4AudioEncoder(nn.Module):
    """One clip's valid log-mel frames -> its Gemma 4 soft tokens: the audio tower and the
    audio embedder (module docstring). ``config`` is the composite ``Gemma4Config`` (its
    ``audio_config`` and ``text_config.hidden_size``). ValueError naming the config field for
    a setting HF's code does not run."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        ac = config.audio_config
        if ac is None:
            raise ValueError("audio_config is None: the checkpoint has no audio tower")
        if ac.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported audio_config.hidden_act {ac.hidden_act!r}; allowed: "
                             f"{sorted(_ACTIVATIONS)}")
        channels = list(ac.subsampling_conv_channels)
        if len(channels) != 2 or int(channels[0]) < 4 or int(channels[1]) < 1:
            raise ValueError(f"audio_config.subsampling_conv_channels {channels}: two "
                             "channel counts, the first >= 4")
        dim, heads = int(ac.hidden_size), int(ac.num_attention_heads)
        if dim % 2 or heads < 1 or dim % heads:
            raise ValueError(f"audio_config.hidden_size {dim}: even and a multiple of "
                             f"num_attention_heads {heads}")
        if int(ac.attention_chunk_size) < 1 or int(ac.attention_context_left) < 1 or int(
                ac.attention_context_right) < 0:
            raise ValueError("audio_config.attention_chunk_size / attention_context_left must "
                             "be >= 1, attention_context_right >= 0")
        self.audio_tower = _AudioTower(ac)
        self.embed_audio = _Embedder(int(ac.output_proj_dims), int(config.text_config.hidden_size),
                                     float(ac.rms_norm_eps))
        #: Mel bins per frame the projection takes (two halvings to ``channels[0] // 4``).
        quarter = int(channels[0]) // 4
        self.mel_bins = tuple(range(4 * quarter - 3, 4 * quarter + 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """One clip's valid frames ``[frames, mel]`` (any float dtype) ->
        ``[audio_tokens(frames), text_hidden_size]`` in the parameters' dtype. ValueError for
        a shape the subsampler does not take."""
        if features.dim() != 2 or features.shape[0] < 1 or features.shape[1] not in self.mel_bins:
            raise ValueError(f"input_features {tuple(features.shape)}: expected [frames >= 1, "
                             f"mel] with mel in {list(self.mel_bins)}")
        out: torch.Tensor = self.embed_audio(self.audio_tower(features)[0])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the tower's and the embedder's checkpoint tensors (names under
        :data:`AUDIO_CHECKPOINT_PREFIXES`; others ignored) and return the names of the
        parameters and buffers loaded. ValueError naming the tensor for a name under those
        prefixes that matches none of them, or a shape mismatch."""
        return load_encoder_weights(self, weights, under_prefixes(AUDIO_CHECKPOINT_PREFIXES),
                                    "Gemma 4 audio encoder", buffers=True,
                                    hint="use_clipped_linears")
