"""New weights from a trainer in other processes, over a process group of their own (SGLang's
``init_weights_update_group`` / ``update_weights_from_distributed``; what OpenRLHF and its
peers build on vLLM's ``collective_rpc``): the trainer's rank 0 broadcasts each tensor, and
every engine rank receives it whole and loads its part, as at start-up.

The group is stateless as these trainers make it: a ``TCPStore`` whose server is the
trainer's rank 0 at ``master_address:master_port``, keys under ``"{group_name}/"``, and a
gloo or NCCL process group on it, made apart from torch.distributed's default group (which
a tensor-parallel engine already uses for its own ranks). Engine rank ``r`` of the
tensor-parallel group joins as ``rank_offset + r``. :func:`trainer_group` is the trainer's
side, for a trainer written against mrv2 (and the tests).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mrv2.distributed.parallel_state import tp_rank

__all__ = ["BACKENDS", "GroupSpec", "WeightGroup", "check_metas", "join", "leave",
           "receive", "trainer_group"]

#: The process group kinds a weight group may use.
BACKENDS = ("nccl", "gloo")
_GROUPS: dict[str, WeightGroup] = {}  # this process's groups, by name


@dataclass(frozen=True)
class GroupSpec:
    """Where the trainer's rank 0 waits and who joins (checked: :meth:`check`)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    timeout_s: float = 600.0

    def check(self, num_ranks: int) -> GroupSpec:
        """ValueError naming the field and the allowed values; returns itself."""
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(f"master_address must be a host name or address, got "
                             f"{self.master_address!r}")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a port number 1..65535, got "
                             f"{self.master_port!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ValueError(f"group_name must be a non-empty string, got {self.group_name!r}")
        if not isinstance(self.rank_offset, int) or self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer's), got "
                             f"{self.rank_offset!r}")
        if not isinstance(self.world_size, int) or \
                self.world_size < self.rank_offset + num_ranks:
            raise ValueError(f"world_size must be at least rank_offset + the engine's "
                             f"{num_ranks} ranks = {self.rank_offset + num_ranks}, got "
                             f"{self.world_size!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        return self


class WeightGroup:
    """One member of a weight group: rank ``rank`` of ``spec.world_size``; rank 0 (the
    trainer's) serves the store."""

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self.spec = spec
        self.rank = rank
        self.store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size,
                                   is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        prefixed = dist.PrefixStore(f"{spec.group_name}/", self.store)
        self.group: Any
        if spec.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, timeout)

    @property
    def device(self) -> torch.device:
        """Where the group's tensors live: this process's GPU for NCCL, else the CPU."""
        if self.spec.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every member (contiguous, on :attr:`device`), in place."""
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def close(self) -> None:
        """Leave the group (the store's connection closes with it)."""
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.group = None


def trainer_group(master_address: str, master_port: int, world_size: int,
                  group_name: str = "weight_update_group", backend: str = "nccl",
                  timeout_s: float = 600.0) -> WeightGroup:
    """The trainer's side (rank 0, the store's server): returns once every engine rank has
    joined (:meth:`~mrv2.engine.engine.LLMEngine.init_weights_update_group`, called at the
    same time). Then ``broadcast`` each tensor, in the order of the names the engine is given
    (:meth:`~mrv2.engine.engine.LLMEngine.update_weights_from_distributed`)."""
    spec = GroupSpec(master_address, master_port, 1, world_size, group_name, backend,
                     timeout_s).check(world_size - 1)
    return WeightGroup(spec, 0)


def check_metas(names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Sequence[int]]
                ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of each tensor the trainer will send: ValueError naming the
    field when the lists differ in length, a dtype is not a torch dtype's name
    (``"bfloat16"``) or a shape has a negative size."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes must be as long as each other, got "
                         f"{len(names)}, {len(dtypes)} and {len(shapes)}")
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if isinstance(dtype, str):
            found = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(found, torch.dtype):
                raise ValueError(f"dtypes: {dtype!r} (of {name!r}) is not a torch dtype "
                                 "(bfloat16, float16, float32, ...)")
            dtype = found
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtypes: {dtype!r} (of {name!r}) is not a torch dtype")
        if not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"shapes: {list(shape)!r} (of {name!r}) must be sizes >= 0")
        metas.append((str(name), dtype, tuple(int(s) for s in shape)))
    return metas


# -- run on every engine rank (``Runner.collective_rpc``) ---------------------------------------

def join(runner: Any, spec: GroupSpec) -> None:
    """Join ``spec``'s group as engine rank ``spec.rank_offset + tp_rank()`` (replacing a
    group of that name this process had)."""
    leave(runner, spec.group_name)
    _GROUPS[spec.group_name] = WeightGroup(spec, spec.rank_offset + tp_rank())


def receive(runner: Any, metas: list[tuple[str, torch.dtype, tuple[int, ...]]],
            group_name: str) -> set[str]:
    """Receive each tensor of ``metas`` from the trainer and load it
    (:meth:`~mrv2.runner.runner.Runner.load_weights`); returns the parameter names loaded."""
    group = _GROUPS.get(group_name)
    if group is None:
        raise ValueError(f"group_name: no weight group {group_name!r} was joined here "
                         f"(init_weights_update_group first; joined: {sorted(_GROUPS)})")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype, shape in metas:
            tensor = group.broadcast(torch.empty(shape, dtype=dtype, device=group.device))
            yield name, tensor

    received = tensors()
    try:
        loaded: set[str] = runner.load_weights(received)
    finally:
        for _ in received:  # (after a refused name: what the trainer still sends)
            pass
    return loaded


def leave(runner: Any, group_name: str) -> bool:
    """Leave the group of that name, if this process joined one; whether it had."""
    group = _GROUPS.pop(group_name, None)
    if group is not None:
        group.close()
    return group is not None
