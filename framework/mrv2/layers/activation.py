"""Activations of gated MLPs."""

from __future__ import annotations

import torch
from torch import nn

from mrv2_kernels.norm import silu_and_mul


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input laid out ``[..., 2 * d]`` as ``[gate | up]``.

    One fused kernel (:func:`mrv2_kernels.norm.silu_and_mul`) on the Triton path.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
