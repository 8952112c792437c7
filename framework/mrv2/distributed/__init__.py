"""Tensor parallelism on torch.distributed: the rank's group and collectives
(:mod:`~mrv2.distributed.parallel_state`), the step channel
(:mod:`~mrv2.distributed.channel`); the processes are :mod:`mrv2.executor`'s."""

from mrv2.distributed.parallel_state import (
    agree_min,
    all_gather_last,
    all_reduce,
    shard_range,
    tp_rank,
    tp_size,
)

__all__ = ["agree_min", "all_gather_last", "all_reduce", "shard_range", "tp_rank", "tp_size"]
