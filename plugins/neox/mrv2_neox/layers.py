"""StableLM's per-head q/k LayerNorms and the attention that runs them. The blocks of GPT-NeoX,
StableLM and GPT-J are the core's (:class:`~mrv2.layers.ParallelDecoderLayer` or
:class:`~mrv2.layers.DecoderLayer`) on its :class:`~mrv2.layers.LayerNorm` (weight and bias;
one kernel with the residual add before it).

The core's fused decode kernels for RMSNorms (the norm + GEMV kernel, the per-head RMS q/k
norm inside the RoPE kernel) do not apply: each LayerNorm runs before the projection after it.
The rotation, partial in all three (the first ``rotary_dim`` dims of each head, halves
layout; GPT-J's q/k rows reordered to it as they load), is the core's RoPE kernel, run before
attention (the attention kernel rotates whole heads only).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers import RotaryEmbedding, SelfAttention


class HeadLayerNorm(nn.Module):
    """StableLM's q or k norm (HF's ``StableLmLayerNormPerHead``): a LayerNorm without a bias
    over each head's ``head_dim`` entries, each head with its own weight. This rank keeps
    ``heads`` of the checkpoint's ``total_heads`` from head ``first``: ``weight`` ``[heads,
    head_dim]``, row ``h`` from the checkpoint's ``norms.{first + h}.weight``
    (:meth:`load_head`). ``forward(x)``: ``x`` ``[T, heads * head_dim]`` -> normed, same shape
    (fp32 math, rounded once, as torch's LayerNorm kernel)."""

    def __init__(self, total_heads: int, head_dim: int, first: int, heads: int,
                 eps: float) -> None:
        super().__init__()
        self.total_heads, self.first, self.eps = total_heads, first, eps
        self.weight = nn.Parameter(torch.ones(heads, head_dim))

    def load_head(self, head: int, loaded: torch.Tensor) -> bool:
        """Checkpoint head ``head``'s weight ``[head_dim]`` into its row where this rank keeps
        that head; whether it does. A head out of ``0 .. total_heads - 1`` or a weight of
        another size is a ``ValueError``."""
        heads, head_dim = self.weight.shape
        if not 0 <= head < self.total_heads or tuple(loaded.shape) != (head_dim,):
            raise ValueError(f"expects heads 0..{self.total_heads - 1} of [{head_dim}] each, "
                             f"got head {head} of {tuple(loaded.shape)}")
        if not self.first <= head < self.first + heads:
            return False
        with torch.no_grad():
            self.weight.data[head - self.first].copy_(loaded)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads, head_dim = self.weight.shape
        per_head = x.reshape(-1, heads, head_dim).float()
        normed = F.layer_norm(per_head, (head_dim,), None, None, self.eps) * self.weight.float()
        return normed.to(x.dtype).reshape(x.shape)

    def extra_repr(self) -> str:
        heads, head_dim = self.weight.shape
        return (f"heads={heads} of {self.total_heads} from {self.first}, "
                f"head_dim={head_dim}, eps={self.eps}")


class QKNormAttention(SelfAttention):
    """:class:`~mrv2.layers.SelfAttention` with StableLM's per-head q/k LayerNorms
    (``q_layernorm`` / ``k_layernorm``: :class:`HeadLayerNorm`, this rank's heads) run on the
    projections' output before the rotation."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding | None, *,
                 qkv_bias: bool, eps: float) -> None:
        super().__init__(config, layer_idx, rope, qkv_bias=qkv_bias)
        qkv, d = self.qkv_proj, self.head_dim
        self.q_layernorm = HeadLayerNorm(qkv.num_heads * qkv.tp_size, d,
                                         qkv.tp_rank * qkv.num_heads, qkv.num_heads, eps)
        self.k_layernorm = HeadLayerNorm(qkv.total_kv_heads, d, qkv.first_kv_head,
                                         qkv.num_kv_heads, eps)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The q/k norms (unfused: the core fuses RMS norms only), the rotation, attention,
        the output projection."""
        q, k, v = self.qkv_proj.split(qkv)
        q, k = self.q_layernorm(q), self.k_layernorm(k)
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb)
        return cast(torch.Tensor, self.o_proj(out))
