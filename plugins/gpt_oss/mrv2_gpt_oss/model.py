"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b): a decoder of alternating local
(sliding-window, 128 keys) and global attention layers, each with biases on its projections and
a learned attention sink per head, YaRN RoPE, and in every layer a mixture of experts:

- a router with a bias, whose top-k logits are softmaxed (the core's
  :class:`~mrv2.layers.moe.SoftmaxTopKRouter` renormalizing its top-k probabilities: the same
  weights);
- experts with biases on both projections and the clamped ``swigluoai`` activation
  (``min(g, L) * sigmoid(1.702 min(g, L)) * (clamp(u, -L, L) + 1)``, ``L = swiglu_limit``),
  which the core's fused MoE kernels run (:class:`~mrv2.layers.moe.FusedMoE`'s ``bias`` and
  ``activation``).

Checkpoints: the published ones keep the experts in MXFP4 (``quantization_config.quant_method:
"mxfp4"``: ``experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H / 32, 16]`` and
``..._scales`` ``[E, 2I, H / 32]`` e8m0, likewise ``down_proj_*``), everything else in bf16;
transformers 5 saves float experts stacked and transposed (``experts.gate_up_proj``
``[E, H, 2I]``, ``experts.down_proj`` ``[E, I, H]``). Either way the gate and up columns
interleave (gate ``0::2``, up ``1::2``). :meth:`GptOssForCausalLM.load_weights` turns both into
the core's layout as they stream: float stacks transposed and de-interleaved whole; MXFP4
tensors expert by expert under the core's per-expert names (``experts.{e}.gate_proj.blocks``),
so :class:`~mrv2.layers.int_quant_moe.IntFusedMoE` cuts them for tensor parallelism as it cuts
any quantized expert, and the fused MoE kernels multiply the e2m1 codes as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    MoEBlock,
    SelfAttention,
    SoftmaxTopKRouter,
    get_rope,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: The published configs' clamp (HF's module hard-codes it; the checkpoints' config says it).
DEFAULT_SWIGLU_LIMIT = 7.0


def _gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate / up entries along ``dim`` (gate ``0::2``, up ``1::2``) as
    ``[gate | up]``."""
    index: list[slice] = [slice(None)] * t.dim()
    parts = []
    for start in (0, 1):
        index[dim] = slice(start, None, 2)
        parts.append(t[tuple(index)])
    return torch.cat(parts, dim=dim)


class GptOssForCausalLM(CausalLM):
    """gpt-oss causal LM in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        rope = get_rope(config, head_dim_of(config))
        bias = bool(getattr(config, "attention_bias", True))
        limit = float(getattr(config, "swiglu_limit", None) or DEFAULT_SWIGLU_LIMIT)
        experts, top_k = int(config.num_local_experts), int(config.num_experts_per_tok)

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=bias, sinks=True)
            router = SoftmaxTopKRouter(config.hidden_size, experts, top_k, renormalize=True,
                                       bias=True)
            moe = FusedMoE(experts, config.hidden_size, config.intermediate_size, bias=True,
                           activation="swigluoai", swiglu_limit=limit)
            return DecoderLayer(config, attention, MoEBlock(router, moe))

        super().__init__(config, DecoderModel(config, layer))

    def rename(self, name: str) -> str | None:
        """HF's ``mlp.router`` is the MoE block's ``gate``."""
        return super().rename(name.replace(".mlp.router.", ".mlp.gate."))

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            stem, _, kind = name.rpartition(".experts.")
            if not stem:
                yield name, t
            elif kind == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H], gate rows then up rows
                yield name, _gate_up(t.transpose(1, 2), 1)
            elif kind == "down_proj":  # [E, I, H] -> [E, H, I]
                yield name, t.transpose(1, 2)
            elif kind == "gate_up_proj_bias":
                yield f"{stem}.experts.w13_bias", _gate_up(t, 1)
            elif kind == "down_proj_bias":
                yield f"{stem}.experts.w2_bias", t
            elif kind.endswith(("_blocks", "_scales")):  # MXFP4, one expert at a time
                proj, _, role = kind.rpartition("_")
                for e in range(t.shape[0]):
                    if proj == "gate_up_proj":
                        rows = t[e]
                        yield f"{stem}.experts.{e}.gate_proj.{role}", rows[0::2]
                        yield f"{stem}.experts.{e}.up_proj.{role}", rows[1::2]
                    else:
                        yield f"{stem}.experts.{e}.down_proj.{role}", t[e]
            else:
                yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF / OpenAI checkpoint tensors, the experts' turned into the core's layout as they
        load (module docstring)."""
        return super().load_weights(self._convert(weights))
