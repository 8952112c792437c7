"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32.

    ``forward(x)`` returns the normed ``x``; ``forward(x, residual)`` first adds ``residual`` to
    ``x`` and returns ``(normed, new_residual)``, where ``new_residual`` is the sum. As in HF
    transformers, the normed value is cast back to the input dtype before the weight multiply.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps)).to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        dtype = x.dtype
        if residual is None:
            return self._norm(x.float(), dtype)
        summed = x.float() + residual.float()
        return self._norm(summed, dtype), summed.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
