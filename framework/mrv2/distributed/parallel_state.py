"""This process's place in the tensor-parallel group, and the collectives the layers call.

One process per rank (:mod:`mrv2.distributed.executor` starts them). Before a model is built,
:func:`init_tensor_parallel` records the rank and world size and creates two groups on
torch.distributed: the device group (NCCL on CUDA, gloo on the CPU) for the layers'
all-reduce and all-gather, inside the CUDA graphs, and a gloo group for host-side agreement
(the KV block count) and the step broadcast across hosts. Layers read :func:`tp_rank` and
:func:`tp_size` when they are built; with no group (the default) the size is 1 and every
collective returns its input, so single-device code pays nothing.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class TensorParallelGroup:
    """Rank and size, and the process groups when ``size > 1``."""

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    backend: str = "gloo"


_GROUP = TensorParallelGroup()
#: Routed experts are split whole across the ranks (expert parallelism) in the layers built
#: now (:func:`expert_parallel_build`), rather than each expert's columns.
_EXPERT_PARALLEL = False


def expert_parallel() -> bool:
    """Whether the routed-expert layers built now split their experts across the ranks."""
    return _EXPERT_PARALLEL


@contextmanager
def expert_parallel_build(enabled: bool) -> Iterator[None]:
    """Build layers with expert parallelism ``enabled`` (the engine's
    ``enable_expert_parallel``): routed experts whole on one rank each."""
    global _EXPERT_PARALLEL
    saved, _EXPERT_PARALLEL = _EXPERT_PARALLEL, enabled
    try:
        yield
    finally:
        _EXPERT_PARALLEL = saved


def tp_group() -> TensorParallelGroup:
    """The current group (rank 0 of 1 unless :func:`init_tensor_parallel` ran)."""
    return _GROUP


def tp_rank() -> int:
    """This process's tensor-parallel rank."""
    return _GROUP.rank


def tp_size() -> int:
    """The tensor-parallel world size (1 without a group)."""
    return _GROUP.size


def init_tensor_parallel(rank: int, size: int, device: torch.device, *,
                         init_method: str | None = None, store: Any = None,
                         timeout_s: float = 600.0) -> TensorParallelGroup:
    """Join the ``size``-rank group as ``rank`` (through ``init_method`` — a ``tcp://``
    address or ``env://`` — or a ready ``store``) and make it current. NCCL on CUDA (this
    process's GPU must already be selected), gloo on the CPU."""
    global _GROUP
    if size == 1:
        _GROUP = TensorParallelGroup()
        return _GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"store": store} if store is not None else {
            "init_method": init_method or "env://"}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, **kwargs)
    ranks = list(range(size))
    device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
    cpu_group = device_group if backend == "gloo" else dist.new_group(
        ranks, backend="gloo", timeout=timeout)
    _GROUP = TensorParallelGroup(rank, size, device_group, cpu_group, backend)
    if device.type == "cuda":  # create the communicator now, outside any graph capture
        all_reduce(torch.ones(1, device=device))
    return _GROUP


@contextmanager
def as_rank(rank: int, size: int) -> Iterator[None]:
    """Build layers as ``rank`` of ``size`` in this process, with no process group (tests and
    tools that check a rank's shapes and slices; a collective inside raises)."""
    global _GROUP
    saved = _GROUP
    _GROUP = TensorParallelGroup(rank, size)
    try:
        yield
    finally:
        _GROUP = saved


def destroy_tensor_parallel(timeout_s: float = 20.0) -> None:
    """Leave the group (idempotent); the layers built afterwards are single-rank again.

    Every rank calls it at about the same time, after dropping its CUDA graphs: NCCL's
    finalize waits for the other ranks and for the graphs that captured its collectives. If
    it has not returned after ``timeout_s`` (a peer that died, or never got there), the
    communicators are aborted instead, so leaving never hangs."""
    global _GROUP
    backend, _GROUP = _GROUP.backend, TensorParallelGroup()
    if not dist.is_initialized():
        return
    if backend != "nccl":
        dist.destroy_process_group()
        return
    leaving = threading.Thread(target=dist.destroy_process_group, daemon=True,
                               name="mrv2-tp-destroy")
    leaving.start()
    leaving.join(timeout_s)
    if leaving.is_alive():
        logger.warning("leaving the NCCL group took over %.0f s; aborting it", timeout_s)
        from torch.distributed import distributed_c10d

        distributed_c10d._abort_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; returns ``x``."""
    if _GROUP.size > 1:
        dist.all_reduce(x, group=_GROUP.device_group)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order."""
    size = _GROUP.size
    if size == 1:
        return x
    x = x.contiguous()
    if _GROUP.backend == "nccl":
        stacked = torch.empty((size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(stacked, x, group=_GROUP.device_group)
        parts = list(stacked.unbind(0))
    else:
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=_GROUP.device_group)
    return torch.cat(parts, dim=-1)


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place, as bytes (any dtype; ``x`` contiguous, on this
    rank's device); returns ``x``. Rank 0 of the group is the process group's rank 0."""
    if _GROUP.size > 1 and x.numel():
        dist.broadcast(x.reshape(-1).view(torch.uint8), src=0, group=_GROUP.device_group)
    return x


def agree_min(value: int) -> int:
    """The smallest ``value`` over the ranks (host-side, gloo): e.g. the KV blocks every rank
    can hold."""
    if _GROUP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_GROUP.cpu_group)
    return int(t.item())


def shard_range(total: int, what: str) -> tuple[int, int]:
    """``(start, length)`` of this rank's equal part of ``total`` (``what`` names the dimension
    in the error when ``total`` does not split evenly)."""
    size, rank = _GROUP.size, _GROUP.rank
    if total % size:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({size})")
    length = total // size
    return rank * length, length
