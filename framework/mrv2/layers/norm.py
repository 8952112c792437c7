"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from mrv2_kernels.norm import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32.

    ``forward(x)`` returns the normed ``x``; ``forward(x, residual)`` first adds ``residual`` to
    ``x`` and returns ``(normed, new_residual)``, where ``new_residual`` is the sum. As in HF
    transformers, the normed value is cast back to the input dtype before the weight multiply.
    One fused kernel (:func:`mrv2_kernels.norm.rms_norm`) on the Triton path, which writes
    ``new_residual`` into ``residual``'s storage: use the returned residual, not the argument.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
