"""Activations of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mrv2_kernels.norm import silu_and_mul


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input laid out ``[..., 2 * d]`` as ``[gate | up]``.

    One fused kernel (:func:`mrv2_kernels.norm.silu_and_mul`) on the Triton path.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """``gelu(gate, approximate="tanh") * up`` for ``[..., 2 * d]`` laid out ``[gate | up]``
    (HF's ``gelu_pytorch_tanh``: Gemma's GeGLU), in torch and in the input dtype, as HF
    computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


#: Gated activations by HF ``hidden_act`` name.
ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiluAndMul,
                                           "gelu_pytorch_tanh": GeluTanhAndMul}
