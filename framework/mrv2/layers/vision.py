"""The pre-norm vision-transformer encoder layer that CLIP, SigLIP and their relatives share
(LLaVA's towers, Gemma 3's SigLIP, Idefics3's), in HF's module names: ``self_attn``
(``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``, all biased), ``layer_norm1``, ``mlp``
(``fc1`` / ``fc2``), ``layer_norm2``; and ``encoder.layers`` around them. The towers' own
parts (patch and position embeddings, pre / post norms, pooling) stay in their families.

Attention is bidirectional over each image's patches (``scaled_dot_product_attention``, no
mask, scale ``head_dim ** -0.5``), computed in the layer's dtype by torch: a tower runs once
per image, outside the decode step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VISION_ACTIVATIONS", "VisionAttention", "VisionEncoder", "VisionEncoderLayer",
           "VisionMLP", "vision_activation"]

#: The activations, by HF's ``ACT2FN`` names, that vision towers use.
VISION_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


def vision_activation(field: str, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation HF names ``name`` (config field ``field``); ValueError naming the field
    and the allowed names for another."""
    if name not in VISION_ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; supported: "
                         f"{sorted(VISION_ACTIVATIONS)}")
    return VISION_ACTIVATIONS[name]


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"vision_config.hidden_size {dim} is not divisible by "
                             f"num_attention_heads {heads}")
        self.num_heads = heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, dim = x.shape
        q, k, v = (proj(x).view(n, seq, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # (scale head_dim ** -0.5)
        projected: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(n, seq, dim))
        return projected


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))``, both biased."""

    def __init__(self, dim: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor]
                 ) -> None:
        super().__init__()
        self.act = act
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class VisionEncoderLayer(nn.Module):
    """One pre-norm encoder layer: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``."""

    def __init__(self, dim: int, heads: int, hidden: int,
                 act: Callable[[torch.Tensor], torch.Tensor], eps: float) -> None:
        super().__init__()
        self.self_attn = VisionAttention(dim, heads)
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.mlp = VisionMLP(dim, hidden, act)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class VisionEncoder(nn.Module):
    """HF's ``encoder``: the ``layers`` (its forward is the tower's, which may stop early)."""

    def __init__(self, layers: Iterable[VisionEncoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
