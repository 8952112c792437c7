"""Linear layers. Each parameter carries a ``weight_loader(param, loaded[, shard_id])``.

Tensor parallelism (:mod:`mrv2.distributed`): a :class:`ColumnLinear` keeps this rank's equal
slice of the output rows, a :class:`RowLinear` its slice of the input columns and sums the
ranks' partial outputs (an all-reduce; its bias is added once, by rank 0). The loaders take the
checkpoint's whole tensor and copy only this rank's part (``narrow`` of a memory-mapped tensor:
the rest is never read from disk). :class:`LinearBase` itself is replicated: every rank holds
all of it. Layers read the group size when built (``tp_size=None``); ``tp_size=1`` builds a
replicated layer of a sharded class. The fused layers (:class:`QKVLinear`,
:class:`MergedColumnLinear`) take HF's separate checkpoint tensors one shard at a time, each
split the same way; :class:`QKVLinear` splits by heads and replicates key/value heads when
there are fewer of them than ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from mrv2.distributed.parallel_state import all_reduce, tp_rank
from mrv2.distributed.parallel_state import tp_size as group_size
from mrv2.layers.norm import LayerNorm, RMSNorm
from mrv2_kernels.cpu_linear import onednn_linear_available
from mrv2_kernels.norm import silu_and_mul as silu_and_mul_op
from mrv2_kernels.norm_gemv import decode_linear, norm_gemv


def resolve_tp(tp_size: int | None) -> tuple[int, int]:
    """``(rank, size)`` a layer built with ``tp_size`` shards over: the group's for None, a
    replicated layer's ``(0, 1)`` for 1."""
    if tp_size is None:
        tp_size = group_size()
    if tp_size == 1:
        return 0, 1
    if tp_size != group_size():
        raise ValueError(f"tp_size must be None (the group's, {group_size()}) or 1 "
                         f"(replicated), got {tp_size}")
    return tp_rank(), tp_size


def _check_whole(loaded: torch.Tensor, dim: int, size: int) -> None:
    """A sharded layer's loaders take the checkpoint's whole tensor, never a rank's part."""
    if loaded.dim() <= dim or loaded.shape[dim] != size:
        raise ValueError(f"expects the whole checkpoint tensor, {size} along dimension {dim}; "
                         f"got shape {tuple(loaded.shape)}")


def split_evenly(total: int, size: int, what: str) -> int:
    """``total // size``; a ValueError naming ``what`` when it does not divide."""
    if total % size:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({size})")
    return total // size


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
    """``y = x @ weight.T + bias`` with ``weight`` ``[output_size, input_size]``, the same on
    every tensor-parallel rank (replicated)."""

    #: This rank and the group size the layer is split over (``(0, 1)``: not split).
    tp_rank: int = 0
    tp_size: int = 1
    #: Whether this rank adds the bias (a row-parallel layer's rank 0 only).
    adds_bias: bool = True
    #: A reordering of this rank's output rows that the layer's owner applies to the weight
    #: (DeepSeek's RoPE rows after loading; interleaved-RoPE q/k rows as they load), in place
    #: on a ``[rows, ...]`` tensor of all of them (a fused layer's: every shard's, each kept in
    #: its shard); whatever else is indexed by those rows (a LoRA adapter's ``B``) takes it
    #: too. None: no reorder.
    row_order: Callable[[torch.Tensor], torch.Tensor] | None = None

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

    def rank_part(self, loaded: torch.Tensor, is_bias: bool) -> torch.Tensor:
        """This rank's part of a whole checkpoint weight (or bias) tensor: all of it here."""
        return loaded

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's part of a whole checkpoint tensor into ``param``."""
        part = self.rank_part(loaded, param is self.bias)
        with torch.no_grad():
            _copy_checked(param.data, part, "parameter")

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's product (a row-parallel layer all-reduces)."""
        return y

    def runs_plain(self) -> bool:
        """Whether this layer's forward is now this class's plain product (a decode step's
        norm may then fuse into it, :func:`norm_linear`): False for a subclass with its own
        ``forward`` (a quantized layer), or a LoRA layer while adapters run."""
        return type(self).forward is LinearBase.forward

    def process_weights_after_loading(self) -> None:
        """Called once the weights are loaded: the CPU layout (:func:`cpu_weight_layout`).
        Subclasses with their own ``forward`` (which may count on the layout) keep theirs."""
        if self.runs_plain():
            with torch.no_grad():
                self.weight.data = cpu_weight_layout(self.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step's few rows go to a weight-streaming kernel; the rest to cuBLAS.
        return self.reduce(decode_linear(x, self.weight, self.bias if self.adds_bias else None))

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnLinear(LinearBase):
    """A linear layer whose output rows are split across the tensor-parallel ranks: rank
    ``r`` computes outputs ``r * N/size : (r + 1) * N/size`` (its bias rows too)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_size: int | None = None
    ) -> None:
        rank, size = resolve_tp(tp_size)
        super().__init__(input_size, split_evenly(output_size, size, "output size"), bias)
        self.tp_rank, self.tp_size = rank, size
        self.full_output_size = output_size

    def rank_part(self, loaded: torch.Tensor, is_bias: bool) -> torch.Tensor:
        """Rows ``rank * N/size`` onward, ``N/size`` of them."""
        if self.tp_size == 1:
            return loaded  # (a wrong shape is reported by the copy)
        _check_whole(loaded, 0, self.full_output_size)
        return loaded.narrow(0, self.tp_rank * self.output_size, self.output_size)


class RowLinear(LinearBase):
    """A linear layer whose input columns are split across the tensor-parallel ranks; each
    rank multiplies its slice of the input and the partial outputs are summed (all-reduce;
    ``reduce_output=False`` leaves that to the caller, who sums several layers' partials
    at once). Rank 0 adds the bias."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_size: int | None = None,
        reduce_output: bool = True,
    ) -> None:
        rank, size = resolve_tp(tp_size)
        super().__init__(split_evenly(input_size, size, "input size"), output_size, bias)
        self.tp_rank, self.tp_size = rank, size
        self.full_input_size = input_size
        self.adds_bias = rank == 0
        self.reduce_output = reduce_output

    def rank_part(self, loaded: torch.Tensor, is_bias: bool) -> torch.Tensor:
        """Weight columns ``rank * K/size`` onward; the whole bias."""
        if self.tp_size == 1 or is_bias:
            return loaded
        _check_whole(loaded, 1, self.full_input_size)
        return loaded.narrow(1, self.tp_rank * self.input_size, self.input_size)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' partial products."""
        return all_reduce(y) if self.reduce_output and self.tp_size > 1 else y


class FusedColumnLinear(ColumnLinear):
    """Column linears of the same input fused into one output, each filled from its own
    checkpoint tensor (``shard_id``): subclasses say where a shard's rows sit in this rank's
    weight (:meth:`shard_rows`) and which rows of the whole tensor are this rank's
    (:meth:`shard_part`)."""

    def shard_part(self, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        """This rank's rows of the whole checkpoint tensor ``loaded`` of shard ``shard_id``."""
        raise NotImplementedError

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object
    ) -> None:
        """Copy this rank's part of checkpoint tensor ``loaded`` into shard ``shard_id``."""
        start, size = self.shard_rows(shard_id)
        with torch.no_grad():
            _copy_checked(param.data.narrow(0, start, size), self.shard_part(loaded, shard_id),
                          f"shard {shard_id!r}")


class MergedColumnLinear(FusedColumnLinear):
    """Several column linears of the same input fused into one, e.g. an MLP's gate and up.

    Shard ``i`` holds output rows ``sum(output_sizes[:i]) : sum(output_sizes[:i+1])``. With
    tensor parallelism each shard is split across the ranks: a rank holds its slice of every
    shard, in shard order (``[gate_r | up_r]``).
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
        tp_size: int | None = None,
    ) -> None:
        _, size = resolve_tp(tp_size)
        #: Each shard's rows on this rank.
        self.output_sizes = [split_evenly(n, size, "output size") for n in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp_size)

    def shard_rows(self, shard_id: object = None) -> tuple[int, int]:
        """``(first output row, rows)`` of shard ``shard_id`` in this rank's weight."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be in [0, {len(self.output_sizes)}), got {shard_id}")
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def shard_part(self, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        """This rank's rows of checkpoint tensor ``loaded`` (all of shard ``shard_id``)."""
        _, size = self.shard_rows(shard_id)
        if self.tp_size == 1:
            return loaded
        _check_whole(loaded, 0, size * self.tp_size)
        return loaded.narrow(0, self.tp_rank * size, size)


class QKVLinear(FusedColumnLinear):
    """The query, key and value projections fused into one ``[q | k | v]`` output.

    With tensor parallelism each rank holds ``num_heads / size`` query heads and
    ``num_kv_heads / size`` key/value heads, or, with fewer key/value heads than ranks, one:
    head ``rank * num_kv_heads // size`` (replicated on ``size / num_kv_heads`` ranks).
    :attr:`num_heads` and :attr:`num_kv_heads` are this rank's.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_size: int | None = None,
    ) -> None:
        rank, size = resolve_tp(tp_size)
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
        self.num_heads = split_evenly(num_heads, size, "num_attention_heads")
        if num_kv_heads >= size:
            self.num_kv_heads = split_evenly(num_kv_heads, size, "num_key_value_heads")
            self.first_kv_head = rank * self.num_kv_heads
        else:
            if size % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({size}) must be a multiple of num_key_value_heads "
                    f"({num_kv_heads}) when it is larger")
            self.num_kv_heads = 1
            self.first_kv_head = rank * num_kv_heads // size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim * size,
                         bias, tp_size)

    def shard_part(self, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        """This rank's heads of a whole ``q``/``k``/``v`` checkpoint tensor."""
        _, size = self.shard_rows(shard_id)
        if self.tp_size == 1:
            return loaded
        heads = self.num_heads if shard_id == "q" else self.total_kv_heads
        _check_whole(loaded, 0, heads * self.head_dim * (self.tp_size if shard_id == "q" else 1))
        first = (self.tp_rank * self.num_heads if shard_id == "q" else self.first_kv_head)
        return loaded.narrow(0, first * self.head_dim, size)

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
    norm: RMSNorm | LayerNorm,
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
    if (isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward
            and linear.runs_plain()
            and type(linear).reduce is LinearBase.reduce):
        return norm_gemv(x, linear.weight, linear.bias, norm_weight=norm.weight, eps=norm.eps,
                         residual=residual, gated=silu_and_mul)
    if residual is None:
        h, new_residual = cast(torch.Tensor, norm(x)), x
    else:
        h, new_residual = cast(tuple[torch.Tensor, torch.Tensor], norm(x, residual))
    y = linear(h)
    return (silu_and_mul_op(y) if silu_and_mul else y), new_residual
