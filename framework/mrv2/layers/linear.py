"""Linear layers. Each parameter carries a ``weight_loader(param, loaded[, shard_id])``.

Column layers split their output dimension across tensor-parallel ranks, row layers their input
dimension. Only ``tp_size=1`` exists today: the argument marks the seam where sharding goes.
The fused layers (:class:`QKVLinear`, :class:`MergedColumnLinear`) take HF's separate
checkpoint tensors one shard at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from mrv2.layers.norm import RMSNorm
from mrv2_kernels.cpu_linear import onednn_linear_available
from mrv2_kernels.norm import silu_and_mul as silu_and_mul_op
from mrv2_kernels.norm_gemv import decode_linear, norm_gemv


def _check_tp(tp_size: int) -> None:
    if tp_size != 1:
        raise NotImplementedError(f"tensor parallelism is not implemented yet (tp_size={tp_size})")


def cpu_weight_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as the CPU's few-row products read it fastest: an fp32 weight
    column-major (a ``[K, N]`` contiguous buffer, viewed transposed), else unchanged.

    The products stream a ``[K, N]`` matrix row by row (``y += x[k] * W[k, :]``, long vectors)
    markedly faster than they take the ``N`` short dot products of ``[N, K]``: SmolLM2-135M's
    gate/up projection (3072 x 576) at one row, 0.50 -> 0.33 ms through MKL; its LM head
    (49152 x 576), 7.9 -> 4.4 ms. oneDNN (:func:`~mrv2_kernels.cpu_linear.linear_cpu`) gains
    on every shape; MKL alone loses on narrow outputs (``N < K``, a down projection), which
    then stay row-major. Same values, same shape; only the strides change.
    """
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or not weight.is_contiguous()
            or (weight.shape[0] < weight.shape[1] and not onednn_linear_available())):
        return weight
    return weight.t().contiguous().t()


def _copy_checked(target: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"{what} expects shape {tuple(target.shape)}, checkpoint tensor has "
            f"{tuple(loaded.shape)}"
        )
    target.copy_(loaded)


class LinearBase(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` ``[output_size, input_size]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def shard_rows(self, shard_id: object = None) -> tuple[int, int]:
        """``(first output row, rows)`` a checkpoint tensor of ``shard_id`` fills: all of them
        (fused layers override it)."""
        return 0, self.output_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy a whole checkpoint tensor into ``param``."""
        with torch.no_grad():
            _copy_checked(param.data, loaded, "parameter")

    def process_weights_after_loading(self) -> None:
        """Called once the weights are loaded: the CPU layout (:func:`cpu_weight_layout`).
        Subclasses with their own ``forward`` (which may count on the layout) keep theirs."""
        if type(self).forward is LinearBase.forward:
            with torch.no_grad():
                self.weight.data = cpu_weight_layout(self.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step's few rows go to a weight-streaming kernel; the rest to cuBLAS.
        return decode_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnLinear(LinearBase):
    """A linear layer whose output dimension would be split across tensor-parallel ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1
    ) -> None:
        _check_tp(tp_size)
        super().__init__(input_size, output_size // tp_size, bias)
        self.tp_size = tp_size


class RowLinear(LinearBase):
    """A linear layer whose input dimension would be split across tensor-parallel ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1
    ) -> None:
        _check_tp(tp_size)
        super().__init__(input_size // tp_size, output_size, bias)
        self.tp_size = tp_size


class MergedColumnLinear(ColumnLinear):
    """Several column linears of the same input fused into one, e.g. an MLP's gate and up.

    Shard ``i`` holds output rows ``sum(output_sizes[:i]) : sum(output_sizes[:i+1])``.
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool = False, tp_size: int = 1
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, tp_size)

    def shard_rows(self, shard_id: object = None) -> tuple[int, int]:
        """``(first output row, rows)`` of shard ``shard_id``."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id}")
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int
    ) -> None:
        """Copy checkpoint tensor ``loaded`` into shard ``shard_id`` of ``param``."""
        start, size = self.shard_rows(shard_id)
        with torch.no_grad():
            _copy_checked(param.data.narrow(0, start, size), loaded, f"shard {shard_id}")


class QKVLinear(ColumnLinear):
    """The query, key and value projections fused into one ``[q | k | v]`` output."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp_size)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str
    ) -> None:
        """Copy HF's ``q_proj``/``k_proj``/``v_proj`` tensor (``shard_id`` "q", "k" or "v")."""
        start, size = self.shard_rows(shard_id)
        with torch.no_grad():
            _copy_checked(param.data.narrow(0, start, size), loaded, f"shard {shard_id!r}")

    def shard_rows(self, shard_id: object = None) -> tuple[int, int]:
        """``(first output row, rows)`` of shard ``shard_id`` ("q", "k" or "v")."""
        offsets = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        if not isinstance(shard_id, str) or shard_id not in offsets:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return offsets[shard_id]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, q + 2 kv]`` -> ``q [T, q_size]``, ``k``, ``v`` ``[T, kv_size]`` (views)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


def norm_linear(
    norm: RMSNorm,
    linear: LinearBase,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    silu_and_mul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of a pre-norm block: ``linear(norm(x + residual))`` and the new residual.

    With ``silu_and_mul``, ``linear`` is a gate/up pair laid out ``[gate | up]`` (a
    :class:`MergedColumnLinear` of two equal shards) and ``silu(gate) * up`` is returned. The
    new residual is ``x + residual``, or ``x`` when ``residual`` is None (the first layer).
    For a decode step's few rows on the GPU this is one launch
    (:func:`mrv2_kernels.norm_gemv.norm_gemv`), otherwise the norm, the linear layer and the
    activation in turn, with the same roundings. Layers that override ``forward`` (a
    quantized linear, another norm) always take the unfused path. Treat ``residual`` as
    consumed.
    """
    if type(norm).forward is RMSNorm.forward and type(linear).forward is LinearBase.forward:
        return norm_gemv(x, linear.weight, linear.bias, norm_weight=norm.weight, eps=norm.eps,
                         residual=residual, gated=silu_and_mul)
    if residual is None:
        h, new_residual = cast(torch.Tensor, norm(x)), x
    else:
        h, new_residual = cast(tuple[torch.Tensor, torch.Tensor], norm(x, residual))
    y = linear(h)
    return (silu_and_mul_op(y) if silu_and_mul else y), new_residual
