"""RMSNorm and LayerNorm, each optionally fused with the residual add that precedes it, and
RMSNorm's tensor-parallel form over a projection split across ranks (:class:`ShardedRMSNorm`)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from mrv2.distributed.parallel_state import all_reduce
from mrv2_kernels.layer_norm import layer_norm
from mrv2_kernels.norm import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32.

    ``forward(x)`` returns the normed ``x``; ``forward(x, residual)`` first adds ``residual`` to
    ``x`` and returns ``(normed, new_residual)``, where ``new_residual`` is the sum. As in HF
    transformers, the normed value is cast back to the input dtype before the weight multiply.
    One fused kernel (:func:`mrv2_kernels.norm.rms_norm`) on the Triton path, which writes
    ``new_residual`` into ``residual``'s storage: use the returned residual, not the argument.

    ``affine=False``: no learned scale (HF's weightless ``L2Norm``: NanoChat, Llama 4's q/k
    norm); ``weight`` is then a buffer of ones that no checkpoint fills, so every fused path
    runs as for a learned one.
    """

    weight: torch.Tensor

    def __init__(self, hidden_size: int, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(hidden_size))
        else:
            self.register_buffer("weight", torch.ones(hidden_size), persistent=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension, computed in fp32 and rounded once to the input dtype
    (torch's ``layer_norm`` in bf16 / fp16, HF's ``nn.LayerNorm`` and Cohere's norm alike).

    ``bias=False``: no shift (Cohere); ``affine=False``: neither scale nor shift (OLMo). The
    parameters are ``weight`` and ``bias``, a checkpoint's names. ``forward(x, residual)``
    first adds ``residual`` and returns ``(normed, new_residual)`` as :class:`RMSNorm` does,
    from one fused kernel (:func:`mrv2_kernels.layer_norm.layer_norm`) on the Triton path,
    which writes ``new_residual`` into ``residual``'s storage: use the returned residual.

    ``weight_offset``: a constant the scale is the checkpoint's ``weight`` plus (Nemotron's
    ``LayerNorm1P``: ``1 + weight``), added once as the weight loads, in the parameter's dtype
    (as HF adds it to its own parameter); the kernel sees the sum.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True,
                 affine: bool = True, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = float(weight_offset)
        self.weight = nn.Parameter(torch.ones(hidden_size)) if affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if affine and bias else None
        self.hidden_size = hidden_size
        if weight_offset and not affine:
            raise ValueError("weight_offset needs a weight (affine=True)")
        if self.weight is not None and self.weight_offset:
            self.weight.weight_loader = self._load_offset  # type: ignore[attr-defined]

    def _load_offset(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"parameter expects shape {tuple(param.shape)}, checkpoint "
                             f"tensor has {tuple(loaded.shape)}")
        with torch.no_grad():
            param.data.copy_(loaded)
            param.data.add_(self.weight_offset)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return layer_norm(x, self.weight, self.bias, self.eps, residual)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, weight={self.weight is not None}, "
                f"bias={self.bias is not None}"
                + (f", weight_offset={self.weight_offset}" if self.weight_offset else ""))


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a projection that tensor parallelism splits across the ranks: the query or
    key projection normalized over all its heads at once (OLMo 2, MiniMax-M2), not per head.

    Each rank holds ``size`` of the ``full_size`` features (from ``first`` on; the weight is
    this slice of the checkpoint's). The mean square is the sum of every rank's squares
    (all-reduced, fp32) over ``full_size``; ``replicas``: how many ranks hold each feature
    (key heads replicated over more ranks than there are heads), whose sums count once.
    Without tensor parallelism it is :class:`RMSNorm` (the fused kernel). As HF's RMSNorm: the
    normed value cast to the input dtype before the weight multiply.
    """

    def __init__(self, full_size: int, eps: float = 1e-6, first: int = 0,
                 size: int | None = None, replicas: int = 1) -> None:
        super().__init__()
        self.full_size, self.eps, self.first, self.replicas = full_size, eps, first, replicas
        self.size = full_size if size is None else size
        self.weight = nn.Parameter(torch.ones(self.size))
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.full_size,):
            raise ValueError(f"expects the whole norm weight [{self.full_size}], got "
                             f"{tuple(loaded.shape)}")
        with torch.no_grad():
            param.data.copy_(loaded.narrow(0, self.first, self.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == self.full_size:
            return cast(torch.Tensor, rms_norm(x, self.weight, self.eps))
        xf = x.float()
        squares = all_reduce(xf.pow(2).sum(-1, keepdim=True))
        mean = squares / (self.full_size * self.replicas)
        return self.weight * (xf * torch.rsqrt(mean + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.size} of {self.full_size}, eps={self.eps}"
                + (f", replicas={self.replicas}" if self.replicas > 1 else ""))
