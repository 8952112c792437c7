"""A tensor-parallel worker: ranks ``1..N-1``, each in its own process.

On one host :class:`~mrv2.executor.tensor_parallel.DistributedRunner` starts
``python -m mrv2.executor.worker FD`` per rank (a fresh interpreter: nothing of the user's
``__main__`` is re-imported, so scripts need no ``if __name__ == "__main__"`` guard) and writes
the rank's :class:`WorkerSpec` to its stdin. The worker joins the group, builds the same
:class:`~mrv2.runner.runner.Runner` as rank 0 and runs the steps rank 0 publishes until told to
stop. If it fails it writes the error and its traceback to pipe ``FD`` and exits 1, so rank 0
can name the cause; it exits by itself when rank 0 goes away (``PR_SET_PDEATHSIG`` on Linux, and
a parent check while it waits for a step).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mrv2.config import EngineConfig
from mrv2.distributed.channel import BroadcastChannel, ChannelClosed, ShmRing
from mrv2.distributed.parallel_state import (
    broadcast_from_first,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_group,
)
from mrv2.runner.runner import Runner, resolve_device

#: Seconds a store operation (joining the group) may wait before it fails.
STORE_TIMEOUT_S = 600.0


@dataclass
class WorkerSpec:
    """What a spawned worker needs: its rank, the group, the engine config and the ring."""

    rank: int
    size: int
    config: EngineConfig
    model_dir: str
    store_port: int  # rank 0's TCPStore on 127.0.0.1
    ring_name: str
    ring_bytes: int


def ready_key(rank: int) -> str:
    """The store key a spawned worker sets once it is up, before joining the group."""
    return f"mrv2/worker-ready/{rank}"


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device of local rank ``local_rank``: GPU ``local_rank`` (selected), or the CPU."""
    device = resolve_device(config.device.device)
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size needs a GPU per rank on this host: rank {local_rank} has "
                f"none ({torch.cuda.device_count()} visible)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return device


def serve_steps(runner: Runner, receive: Callable[[], Any]) -> None:
    """A worker's loop: run what rank 0 publishes until it says stop."""
    while True:
        kind, payload = receive()
        if kind == "execute":
            runner.execute(payload)
        elif kind == "execute_late":  # its masks follow, filled by rank 0 during the forward
            payload.fill_token_bitmasks = functools.partial(_receive_masks, receive,
                                                            payload.token_bitmasks)
            runner.execute(payload)
        elif kind == "remove":
            runner.remove_requests(payload)
        elif kind == "adapters":  # LoRA adapters as rank 0 read them, ahead of their step
            assert runner.lora is not None
            runner.lora.give(*payload)
        elif kind == "rpc":  # (Runner.collective_rpc: every rank answers, errors too)
            try:
                method, args, kwargs = pickle.loads(payload)
                reply = reply_of(runner.call_method(method, args, kwargs))
            except Exception as error:
                reply = (False, f"{type(error).__name__}: {error}")
            gather_replies(reply)
        elif kind == "load_weights":
            _load_weights(runner, receive)
        elif kind == "sleep":
            runner.sleep(payload)
        elif kind == "wake_up":
            runner.wake_up(payload)
        elif kind == "stop":
            return


def reply_of(value: Any) -> tuple[bool, Any]:
    """A rank's :meth:`~mrv2.runner.runner.Runner.collective_rpc` reply: ``(True, value)``,
    or ``(False, why)`` when the value cannot travel (not picklable)."""
    try:
        pickle.dumps(value)
    except Exception as error:
        return False, f"its result cannot be pickled ({type(error).__name__}: {error})"
    return True, value


def gather_replies(reply: tuple[bool, Any]) -> list[tuple[bool, Any]]:
    """Every rank's reply on rank 0, in rank order (the host group's gather); [] elsewhere."""
    group = tp_group()
    replies: list[Any] | None = [None] * group.size if group.rank == 0 else None
    dist.gather_object(reply, replies, dst=0, group=group.cpu_group)
    return list(replies or [])


def _receive_weights(runner: Runner, receive: Callable[[], Any]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0's new weights (:meth:`DistributedRunner.load_weights`): each tensor's name,
    shape and dtype from the channel, its bytes from rank 0's broadcast; until "weights_end"."""
    while True:
        kind, payload = receive()
        if kind == "weights_end":
            return
        if kind != "weight":
            raise RuntimeError(f"expected a weight from rank 0, got {kind!r}")
        name, shape, dtype = payload
        yield name, broadcast_from_first(torch.empty(shape, dtype=dtype, device=runner.device))


def _load_weights(runner: Runner, receive: Callable[[], Any]) -> None:
    """Load rank 0's new weights here. A tensor this rank's loader refuses, rank 0's refused
    too (the same model, the same names): rank 0 raises it; this rank logs it, then receives
    the rest until rank 0's end, so the channel and the collectives stay in step."""
    weights = _receive_weights(runner, receive)
    try:
        runner.load_weights(weights)
    except Exception as error:
        print(f"mrv2 rank {tp_group().rank}: loading new weights failed: {error}",
              file=sys.stderr, flush=True)
    for _ in weights:  # (after a failure: what rank 0 still sent)
        pass


def _receive_masks(receive: Callable[[], Any], masks: dict[str, np.ndarray]) -> None:
    """Rank 0's filled masks of an "execute_late" step, into the arrays its plan holds."""
    kind, filled = receive()
    if kind != "masks":
        raise RuntimeError(f"expected the step's masks from rank 0, got {kind!r}")
    for req_id, mask in filled.items():
        masks[req_id][:] = mask


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_spawned(spec: WorkerSpec) -> None:
    """Join the group as ``spec.rank``, build the runner and serve steps."""
    parent = os.getppid()
    _die_with_parent()
    device = rank_device(spec.config, spec.rank)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False,
                          timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    store.set(ready_key(spec.rank), "1")
    init_tensor_parallel(spec.rank, spec.size, device, store=store)
    runner = Runner(spec.config, spec.model_dir)
    ring = ShmRing.attach(spec.ring_name, spec.size - 1, spec.ring_bytes, spec.rank - 1,
                          spin_s=0.1 if device.type == "cuda" else 0.001)

    def alive() -> None:
        if os.getppid() != parent:
            raise ChannelClosed("rank 0 (the engine process) exited")

    try:
        serve_steps(runner, lambda: ring.receive(alive))
    except ChannelClosed:
        pass
    finally:
        ring.close()
        runner.shutdown()  # its graphs first: NCCL's finalize waits for them
        destroy_tensor_parallel()


def run_torchrun_worker(config: EngineConfig, model_dir: str) -> None:
    """A ``torchrun`` rank other than 0: serve rank 0's steps, then exit the process."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank_device(config, int(os.environ.get("LOCAL_RANK", rank)))
    init_tensor_parallel(rank, size, device, init_method="env://")
    runner = Runner(config, model_dir)
    channel = BroadcastChannel(tp_group().cpu_group, rank)
    serve_steps(runner, channel.receive)
    channel.close()
    runner.shutdown()
    destroy_tensor_parallel()
    sys.exit(0)


def main(argv: list[str]) -> int:
    """``python -m mrv2.executor.worker ERROR_FD`` with a pickled :class:`WorkerSpec` on stdin."""
    errors = os.fdopen(int(argv[1]), "w")
    try:
        spec: WorkerSpec = pickle.load(sys.stdin.buffer)
        run_spawned(spec)
    except BaseException as error:  # tell rank 0 why, then die
        errors.write(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        errors.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
