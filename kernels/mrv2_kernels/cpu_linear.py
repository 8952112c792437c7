"""``F.linear`` on the CPU, fp32 few-row products through oneDNN.

For the few-row products of decoding, oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``,
the op torch's own CPU compiler emits for linear layers) beats the MKL GEMM that ``F.linear``
calls: it spreads even a one-row product over the threads, and its small-batch kernels waste
less. With the weights column-major (:func:`mrv2.layers.linear.cpu_weight_layout`), all of
SmolLM2-135M's products (2 threads, MKL on row-major weights -> oneDNN): 44.5 -> 26.3 ms at 1
row, 82 -> 40 ms at 2 rows, 73 -> 63 ms at 8 rows, 94 -> 77 ms at 16. From about 64 rows (a
prefill) MKL is as fast or faster (512 rows: 1.11 s against 1.52 s) and keeps them. Results
agree with ``F.linear`` to fp32 accumulation order. Other dtypes, and builds without oneDNN,
take ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["ONEDNN_MAX_ROWS", "linear_cpu", "onednn_linear_available"]

#: Most rows :func:`linear_cpu` sends to oneDNN (at 32 the two are even; MKL wins above).
ONEDNN_MAX_ROWS = 32


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build runs oneDNN's fp32 linear on the CPU (probed once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(y.shape == (2, 3) and torch.equal(y, torch.full((2, 3), 4.0)))


def linear_cpu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for CPU tensors (``x`` ``[..., K]``, ``weight``
    ``[N, K]`` in any strides): oneDNN for fp32 with at most :data:`ONEDNN_MAX_ROWS` rows
    when available (and not switched off with ``torch.backends.mkldnn.enabled``), else
    ``F.linear``."""
    f32 = torch.float32
    if (x.dtype == f32 and weight.dtype == f32 and x.dim() >= 2 and x.device.type == "cpu"
            and x.numel() <= ONEDNN_MAX_ROWS * x.shape[-1]
            and (bias is None or bias.dtype == f32) and onednn_linear_available()
            and torch._C._get_mkldnn_enabled()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
