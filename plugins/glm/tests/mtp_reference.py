"""A plain-torch reference of one GLM-4.x MTP layer, independent of mrv2's layers.

Written from DeepSeek-V3's description of multi-token prediction (technical report, section
2.2) as GLM-4.5 uses it: for MTP depth ``k`` and position ``i``, the previous depth's
representation ``h_i`` (depth 0: the main model's final hidden state) and the embedding of the
token at ``i + k`` are each RMS-normalized, concatenated ``[embedding ; hidden]`` and projected
back to the model width; one transformer block then runs over the sequence, causally, and the
shared output head (after the layer's own final norm) predicts the token at ``i + k + 1``.

The transformer block is HF transformers' ``Glm4MoeDecoderLayer`` (an independent oracle: its
attention with GQA, partial rotary, q/k norms and biases, its noaux_tc router, per-expert loop
and shared experts), run over the whole sequence with an explicit causal mask and no cache.
Weights come in checkpoint names (``model.layers.{N}.*``, one tensor per expert).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.glm4_moe.modeling_glm4_moe import (
    Glm4MoeDecoderLayer,
    Glm4MoeRotaryEmbedding,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, in fp32."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MTPReference:
    """MTP layer ``N = num_hidden_layers`` of a checkpoint, over whole sequences."""

    def __init__(self, config: Any, weights: dict[str, torch.Tensor],
                 embedding: torch.Tensor, head: torch.Tensor) -> None:
        self.config = config
        self.eps = float(config.rms_norm_eps)
        prefix = f"model.layers.{config.num_hidden_layers}."
        mine = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        self.enorm = mine.pop("enorm.weight")
        self.hnorm = mine.pop("hnorm.weight")
        self.eh_proj = mine.pop("eh_proj.weight")
        self.final_norm = mine.pop("shared_head.norm.weight")
        mine.pop("embed_tokens.weight", None)
        mine.pop("shared_head.head.weight", None)
        self.embedding, self.head = embedding, head

        block_config = type(config).from_dict(config.to_dict())
        block_config._attn_implementation = "eager"
        self.block = Glm4MoeDecoderLayer(block_config, config.num_hidden_layers).eval()
        self.rotary = Glm4MoeRotaryEmbedding(block_config)
        self._load_block(mine)

    def _load_block(self, tensors: dict[str, torch.Tensor]) -> None:
        """Per-expert checkpoint tensors -> HF's stacked ``gate_up_proj`` / ``down_proj``."""
        experts = self.config.n_routed_experts
        base = "mlp.experts."
        gate_up = torch.stack([
            torch.cat([tensors.pop(f"{base}{e}.gate_proj.weight"),
                       tensors.pop(f"{base}{e}.up_proj.weight")])
            for e in range(experts)
        ])
        down = torch.stack([tensors.pop(f"{base}{e}.down_proj.weight") for e in range(experts)])
        tensors = {**tensors, f"{base}gate_up_proj": gate_up, f"{base}down_proj": down}
        missing, unexpected = self.block.load_state_dict(tensors, strict=False)
        assert not missing and not unexpected, (missing, unexpected)

    @torch.no_grad()
    def hidden(self, next_tokens: torch.Tensor, previous: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """One sequence: ``next_tokens`` ``[S]`` (the token after each position),
        ``previous`` ``[S, H]`` hidden states, ``positions`` ``[S]`` -> MTP outputs
        ``[S, H]`` (block output plus residual, before the final norm)."""
        e = rms_norm(self.embedding[next_tokens.long()], self.enorm, self.eps)
        h = rms_norm(previous, self.hnorm, self.eps)
        x = torch.cat([e, h], dim=-1) @ self.eh_proj.T
        seq = x.shape[0]
        mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
        pos = positions.long()[None]
        cos_sin = self.rotary(x[None], pos)
        out = self.block(x[None], attention_mask=mask, position_ids=pos,
                         position_embeddings=cos_sin)
        return out[0]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP outputs ``[S, H]`` -> ``[S, vocab]`` through the final norm and the shared head."""
        return rms_norm(hidden, self.final_norm, self.eps) @ self.head.T
