"""Plain-torch specification of :func:`~mrv2_kernels.fused_moe.fused_moe` (its contract is in
that module's docstring) and the shape checks both paths share."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .fp8_gemm import dequantize_weight_block_fp8
from .fused_moe_fp8 import DEFAULT_BLOCK, check_fp8_args, quant_dequant_groups
from .fused_moe_int import IntExperts, check_int_args, dequantize_int_experts

__all__ = ["ACTIVATIONS", "PLAIN", "SWIGLUOAI_ALPHA", "Epilogue", "fused_moe_ref", "glu"]

#: The gated activations of the contract: ``silu(gate) * up``, gpt-oss's clamped
#: ``"swigluoai"``, Gemma 4's GeGLU and Step's clamped SiLU ``"silu_clamp"`` (:func:`glu`).
ACTIVATIONS = ("silu", "swigluoai", "gelu_tanh", "silu_clamp")
#: ``swigluoai``'s sigmoid slope (gpt-oss).
SWIGLUOAI_ALPHA = 1.702


class Epilogue(NamedTuple):
    """The experts' activation and optional biases (``w13_bias`` ``[E, 2I]``: gate then up,
    ``w2_bias`` ``[E, H]``), as :func:`check_epilogue` returns them."""

    activation: str = "silu"
    swiglu_limit: float = 7.0
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None


#: SiLU, no biases.
PLAIN = Epilogue()


def check_epilogue(w13: torch.Tensor, w2: torch.Tensor, epi: Epilogue) -> Epilogue:
    """``epi`` with contiguous biases; a ValueError naming a bad activation or bias."""
    if epi.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got "
                         f"{epi.activation!r}")
    if epi.activation in ("swigluoai", "silu_clamp") and not epi.swiglu_limit > 0:
        raise ValueError(f"swiglu_limit must be positive, got {epi.swiglu_limit}")
    e, two_i = w13.shape[0], w13.shape[1]
    hidden = w2.shape[1]
    for name, b, want in (("w13_bias", epi.w13_bias, (e, two_i)),
                          ("w2_bias", epi.w2_bias, (e, hidden))):
        if b is not None and (tuple(b.shape) != want or b.device != w13.device):
            raise ValueError(f"{name} must be {want} on {w13.device}, got {tuple(b.shape)} "
                             f"on {b.device}")
    return epi._replace(
        w13_bias=None if epi.w13_bias is None else epi.w13_bias.contiguous(),
        w2_bias=None if epi.w2_bias is None else epi.w2_bias.contiguous())


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu",
        swiglu_limit: float = 7.0) -> torch.Tensor:
    """The gated activation of fp32 ``gate`` / ``up``: ``silu(gate) * up``; (``swigluoai``)
    ``g * sigmoid(1.702 g) * (u + 1)`` of ``g = min(gate, limit)`` and ``u = clamp(up, -limit,
    limit)``; (``silu_clamp``, Step-3.5 / 3.7) ``min(silu(gate), limit) * clamp(up, -limit,
    limit)``; or (``gelu_tanh``, GeGLU: Gemma 4) ``gelu(gate, approximate="tanh") * up``."""
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "silu_clamp":
        return F.silu(gate).clamp(max=swiglu_limit) * up.clamp(-swiglu_limit, swiglu_limit)
    if activation == "swigluoai":
        g = gate.clamp(max=swiglu_limit)
        u = up.clamp(-swiglu_limit, swiglu_limit)
        return g * torch.sigmoid(SWIGLUOAI_ALPHA * g) * (u + 1)
    return F.silu(gate) * up


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    """The shapes of the contract; a ValueError starts with the argument at fault."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H={hidden}], got {tuple(w13.shape)}")
    num_experts, two_i, _ = w13.shape
    if w2.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"w2 must be [E={num_experts}, H={hidden}, I={two_i // 2}] (from w13 "
            f"{tuple(w13.shape)}), got {tuple(w2.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [T={num_tokens}, K], got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must be shaped like topk_ids {tuple(topk_ids.shape)}, got "
            f"{tuple(topk_weights.shape)}"
        )



def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | list[int] = DEFAULT_BLOCK,
    valid_tokens: torch.Tensor | None = None,
    int_experts: IntExperts | None = None,
    epilogue: Epilogue = PLAIN,
) -> torch.Tensor:
    """Plain-torch specification: a Python loop over (token, slot) pairs grouped by expert.
    ``epilogue``: the activation and the biases (added to the fp32 products, before the
    roundings and the routing weight).
    Integer weights (``int_experts``): the unquantized contract on the dequantized weights.
    FP8 weights (both scales given): the weights dequantized, ``x`` and the activation
    quantized per row and group of ``bk`` (:mod:`~mrv2_kernels.fused_moe_fp8`'s contract).
    ``valid_tokens`` (``[1]``): rows from ``valid_tokens[0]`` on are padding, left at zero
    here (unspecified in the contract)."""
    if int_experts is not None:
        q = int_experts
        check_int_args(w13, w2, q, x.shape[1])
        w13 = dequantize_int_experts(w13, q.w13_scale, q.w13_zeros, q.bits, q.group_size,
                                     fp4=q.fp4)
        w2 = dequantize_int_experts(w2, q.w2_scale, q.w2_zeros, q.bits, q.group_size,
                                    fp4=q.fp4)
    _check(x, w13, w2, topk_weights, topk_ids)
    epi = check_epilogue(w13, w2, epilogue)
    fp8 = check_fp8_args(w13, w2, w13_scale, w2_scale, block)
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    if valid_tokens is not None:  # read on the host: the reference never runs in a graph
        flat_ids = flat_ids[: max(0, int(valid_tokens.reshape(-1)[0])) * top_k]
    x_in = x if fp8 is None else quant_dequant_groups(x, fp8[1])
    for e in flat_ids.unique().tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tokens = pairs // top_k
        if fp8 is None or w13_scale is None or w2_scale is None:
            w13_e, w2_e = w13[e].float(), w2[e].float()
        else:
            w13_e = dequantize_weight_block_fp8(w13[e], w13_scale[e], fp8, torch.float32)
            w2_e = dequantize_weight_block_fp8(w2[e], w2_scale[e], fp8, torch.float32)
        gate_up = x_in[tokens].float() @ w13_e.T
        if epi.w13_bias is not None:
            gate_up = gate_up + epi.w13_bias[e].float()
        gate_up = gate_up.to(x.dtype).float()
        act = glu(gate_up[:, :inter], gate_up[:, inter:], epi.activation,
                  epi.swiglu_limit).to(x.dtype)
        act_in = act if fp8 is None else quant_dequant_groups(act, fp8[1])
        y = act_in.float() @ w2_e.T
        if epi.w2_bias is not None:
            y = y + epi.w2_bias[e].float()
        weight = topk_weights.reshape(-1)[pairs].float()
        out.index_add_(0, tokens, y * weight[:, None])
    return out.to(x.dtype)
