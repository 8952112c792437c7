"""Tensor parallelism's processes: rank 0 runs the engine, every other rank a worker loop.

:class:`DistributedRunner` is the :class:`~mrv2.runner.runner.Runner` of rank 0. On one host
it starts ranks ``1..N-1`` itself (:mod:`mrv2.executor.worker` processes; GPU ``r`` for rank
``r``), each building the same runner from the same config; under ``torchrun``
(``RANK``/``WORLD_SIZE`` in the environment, any number of hosts) the launcher starts them,
and a rank other than 0 turns into a worker where it builds its engine and exits the process
when rank 0 stops.

Each step rank 0 publishes the :class:`~mrv2.contract.requests.SchedulerOutput` (one host: a
shared-memory ring; across hosts: a gloo broadcast; :mod:`mrv2.distributed.channel`) and then
runs the step itself; every rank builds the same inputs, runs its shard of the model (the
layers all-reduce and all-gather on the device group), samples the same tokens from the same
gathered logits and seeds, and updates its own state table. Only rank 0 copies tokens to the
host. Nothing on that path waits for the GPU. A step's new LoRA adapters go out first, as rank
0 read them (the workers never read adapter files).

Failures: a watchdog thread of rank 0 waits on each worker process. A worker that raises
writes its traceback to a pipe first; one that dies (killed, out of memory) is named with its exit
code. Rank 0 then raises :class:`WorkerDiedError` from its next (or current) step, naming the
rank and the cause; if a collective keeps it blocked (NCCL waits forever for a dead peer),
the watchdog aborts the process group and, as a last resort after ``MRV2_TP_ABORT_S``
seconds (default 30), ends the process with exit code 1 rather than hang.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from mrv2.config import EngineConfig
from mrv2.contract.lora import LoRARequest
from mrv2.contract.requests import SchedulerOutput
from mrv2.distributed.channel import BroadcastChannel, ShmRing
from mrv2.distributed.parallel_state import (
    broadcast_from_first,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_group,
)
from mrv2.executor.worker import (
    STORE_TIMEOUT_S,
    WorkerSpec,
    gather_replies,
    rank_device,
    ready_key,
    reply_of,
)
from mrv2.executor.zygote import ForkedWorker, worker_zygote, zygote_enabled
from mrv2.model_loader.build import check_shardable, load_hf_config
from mrv2.plugins import PluginManager, get_plugin_manager
from mrv2.runner.async_output import AsyncStepOutput
from mrv2.runner.runner import Runner
from mrv2.runner.sleep import check_tags

logger = logging.getLogger(__name__)

_RING_BYTES = 16 << 20


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker failed; the engine cannot continue."""

    fatal = True


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` (or equivalent) launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes] | ForkedWorker
    errors: Any  # the read end of the worker's error pipe


def _start_worker(write_fd: int) -> subprocess.Popen[bytes] | ForkedWorker:
    """A worker process whose error pipe is ``write_fd``: a fresh interpreter, or a fork of
    the zygote with ``MRV2_WORKER_ZYGOTE=1`` (:mod:`mrv2.executor.zygote`)."""
    if zygote_enabled():
        return worker_zygote().fork(write_fd)
    return subprocess.Popen([sys.executable, "-m", "mrv2.executor.worker", str(write_fd)],
                            stdin=subprocess.PIPE, pass_fds=(write_fd,))


def _start_and_watch(ref: weakref.ref[DistributedRunner], write_fd: int,
                     started: queue.Queue[Any], registered: queue.Queue[_Worker | None]
                     ) -> None:
    """A watchdog thread: start the worker (:func:`_start_worker`; its process, or the error,
    goes to ``started``), wait for it to exit, then tell its runner (if it still exists: the
    thread holds no reference, so a dropped engine is freed).

    The worker is started from this thread, which lives as long as the worker: Linux sends
    the parent-death signal (the worker's ``PR_SET_PDEATHSIG``) when the *thread* that
    started a process ends, so a worker started by the thread building the engine would be
    killed as soon as that thread ended (an engine built in a short-lived thread)."""
    try:
        proc = _start_worker(write_fd)
    except BaseException as error:
        started.put(error)
        return
    started.put(proc)
    worker = registered.get()  # (the runner lists it first, so its exit is never missed)
    code = proc.wait()
    runner = ref()
    if runner is not None and worker is not None:
        runner._worker_exited(worker, code)


def _shutdown_if_alive(ref: weakref.ref[DistributedRunner]) -> None:
    runner = ref()
    if runner is not None:
        runner.shutdown()


class DistributedRunner(Runner):
    """Rank 0's runner: starts (or joins) the other ranks, then runs steps as :class:`Runner`
    does, publishing each to the workers first. See the module docstring."""

    def __init__(self, config: EngineConfig, model_dir: str,
                 plugins: PluginManager | None = None) -> None:
        size = config.parallel.tensor_parallel_size
        if tp_group().size > 1 and not launched_by_torchrun():  # (before any state: a
            # failed start's shutdown() must not end the running engine's group; a second
            # group would wait for ranks that never join)
            raise RuntimeError(
                f"a tensor-parallel engine ({tp_group().size} ranks) is already running in "
                "this process: shut it down first (one tensor-parallel engine per process)")
        self._workers: list[_Worker] = []
        self._failure: WorkerDiedError | None = None
        self._stopped = threading.Event()
        self._on_failure: list[Callable[[WorkerDiedError], None]] = []
        self._in_step = False
        #: Inside :meth:`collective_rpc`: every rank runs the method, so what it calls here
        #: (``load_weights``, ``sleep``...) runs on this rank alone.
        self._in_rpc = False
        self._busy = 0  # > 0 while this thread is inside a step or start-up (collectives)
        #: The LoRA adapters the workers were sent (:meth:`_send_adapters`), oldest first.
        self._adapters_sent: OrderedDict[int, None] = OrderedDict()
        self._channel: ShmRing | BroadcastChannel
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(f"tensor_parallel_size ({size}) must equal torchrun's world "
                                 f"size ({os.environ['WORLD_SIZE']})")
            device = rank_device(config, int(os.environ.get("LOCAL_RANK", 0)))
            init_tensor_parallel(0, size, device, init_method="env://")
            self._channel = BroadcastChannel(tp_group().cpu_group, 0)
        else:
            # the model's sharding rules first: a bad split fails here, before any worker
            check_shardable(model_dir, load_hf_config(model_dir, config.model.hf_overrides),
                            (plugins or get_plugin_manager()).registries, size,
                            config.parallel.enable_expert_parallel)
            device = rank_device(config, 0)
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
            self._channel = ShmRing(size - 1, _RING_BYTES)
            try:
                self._spawn(config, model_dir, size, store.port)
                # join only once every worker is up: a worker that dies before can be named
                # (the group's rendezvous would wait for it until its timeout)
                keys = [ready_key(rank) for rank in range(1, size)]
                while not store.check(keys):
                    self._check()
                    time.sleep(0.02)
                self._until_failure(lambda: init_tensor_parallel(0, size, device, store=store))
            except BaseException:
                self.shutdown()
                raise
        try:
            self._until_failure(lambda: Runner.__init__(self, config, model_dir, plugins))
        except BaseException:
            self.shutdown()
            raise
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, config: EngineConfig, model_dir: str, size: int, store_port: int) -> None:
        """Start a worker (:func:`_start_worker`) for ranks 1..size-1 and a watchdog each."""
        assert isinstance(self._channel, ShmRing)
        for rank in range(1, size):
            read_fd, write_fd = os.pipe()
            spec = WorkerSpec(rank, size, config, model_dir, store_port, self._channel.name,
                              _RING_BYTES)
            started: queue.Queue[Any] = queue.Queue()
            registered: queue.Queue[_Worker | None] = queue.Queue()
            threading.Thread(
                target=_start_and_watch, daemon=True, name=f"mrv2-tp-watch{rank}",
                args=(weakref.ref(self), write_fd, started, registered),
            ).start()
            proc = started.get()
            os.close(write_fd)
            if isinstance(proc, BaseException):
                os.close(read_fd)
                raise proc
            worker = _Worker(rank, proc, os.fdopen(read_fd, "r"))
            self._workers.append(worker)
            registered.put(worker)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()

    def _worker_exited(self, worker: _Worker, code: int) -> None:
        """``worker`` exited with ``code``; before :meth:`shutdown` that is a failure."""
        if self._stopped.is_set() or self._failure is not None:
            return
        cause = worker.errors.read().strip() or f"exit code {code}"
        if code < 0:
            cause = f"killed by signal {-code}" + (f": {cause}" if "exit code" not in cause
                                                     else "")
        self._failure = WorkerDiedError(
            f"tensor-parallel worker rank {worker.rank} died: {cause}")
        logger.error("%s", self._failure)
        for listener in list(self._on_failure):
            try:
                listener(self._failure)
            except Exception:
                logger.exception("a worker-failure listener failed")
        threading.Thread(target=self._abort_if_stuck, daemon=True).start()

    def _abort_if_stuck(self) -> None:
        """If this process is inside a step or start-up when a worker dies (a collective that
        may wait forever for the dead rank), abort the process group so the collective
        returns; if it is still inside after ``MRV2_TP_ABORT_S`` seconds, exit the process.
        An idle engine is left alone: its next step raises the failure."""
        grace = float(os.environ.get("MRV2_TP_ABORT_S", "30"))
        deadline = time.monotonic() + grace
        if self._stopped.wait(min(2.0, grace)) or not self._busy:
            return
        if tp_group().backend == "nccl":
            try:
                from torch.distributed import distributed_c10d

                distributed_c10d._abort_process_group()
            except Exception:
                logger.exception("aborting the NCCL process group failed")
        while self._busy and not self._stopped.is_set() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._busy and not self._stopped.is_set():
            print(f"mrv2: {self._failure}; the engine is stuck waiting for it, exiting",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _until_failure(self, work: Callable[[], Any]) -> Any:
        """Run ``work``; if it raises after a worker died (a collective losing its peer),
        raise the worker's failure instead (waiting up to 2 s for the watchdog to see it)."""
        self._check()
        self._busy += 1
        try:
            return work()
        except Exception as error:
            if not isinstance(error, RuntimeError) or isinstance(error, WorkerDiedError):
                raise  # this rank's own error (a bad config fails every rank alike)
            deadline = time.monotonic() + 2.0
            while self._failure is None and self._workers and time.monotonic() < deadline:
                time.sleep(0.02)
            if self._failure is not None:
                raise self._failure from error
            raise
        finally:
            self._busy -= 1

    @property
    def worker_pids(self) -> list[int]:
        """The process ids of the spawned workers (rank 1 first); empty under torchrun."""
        return [worker.proc.pid for worker in self._workers]

    def add_failure_listener(self, listener: Callable[[WorkerDiedError], None]) -> None:
        """Call ``listener(error)`` (from the watchdog thread) when a worker dies."""
        self._on_failure.append(listener)

    # -- the step ----------------------------------------------------------------------------

    def _send_adapters(self, scheduled: SchedulerOutput) -> None:
        """Send the workers the LoRA adapters of the step's new requests they were not sent
        yet, as rank 0 read and checked them: a worker reading the files itself, later,
        could find them gone (the engine would fail) or rewritten (other weights than rank
        0's). The workers keep what rank 0 read recently (as many adapters as it keeps)."""
        lora = self.lora
        if lora is None:
            return
        step_ids = {r.lora_request.lora_int_id for r in scheduled.new_requests
                    if r.lora_request is not None}
        new: dict[int, tuple[LoRARequest, Any]] = {}
        for request in scheduled.new_requests:
            adapter = request.lora_request
            if adapter is None or adapter.lora_int_id in new:
                continue
            if adapter.lora_int_id in self._adapters_sent:
                self._adapters_sent.move_to_end(adapter.lora_int_id)
                continue
            new[adapter.lora_int_id] = (adapter, lora.as_read(adapter))  # (may raise: unsent)
        if not new:
            return
        self._adapters_sent.update(dict.fromkeys(new))
        keep = max(lora.config.max_cpu_loras or 0, lora.config.max_loras, len(step_ids))
        old = [i for i in self._adapters_sent if i not in step_ids]
        forget = old[:max(0, len(self._adapters_sent) - keep)]
        for adapter_id in forget:
            del self._adapters_sent[adapter_id]
        self._channel.publish(("adapters", (list(new.values()), forget)), self._check)

    def execute(self, scheduled: SchedulerOutput) -> AsyncStepOutput:
        """Publish the step to the workers, then run it here."""
        self._check()
        self._send_adapters(scheduled)
        late = scheduled.fill_token_bitmasks
        if late is None:
            self._channel.publish(("execute", scheduled), self._check)
        else:  # masks filled mid-step: "execute_late" goes out now, the masks once filled
            self._channel.publish(("execute_late", replace(scheduled, fill_token_bitmasks=None)),
                                  self._check)

            def fill() -> None:
                late()
                self._channel.publish(("masks", scheduled.token_bitmasks), self._check)

            scheduled = replace(scheduled, fill_token_bitmasks=fill)  # (the same mask arrays)
        self._in_step = True  # the step's own removals reach the workers with the step
        try:
            result: AsyncStepOutput = self._until_failure(lambda: Runner.execute(self, scheduled))
        finally:
            self._in_step = False
        return result

    def remove_requests(self, req_ids: list[str]) -> None:
        """Free rows on every rank."""
        if req_ids and not self._in_step and not self._stopped.is_set():
            self._check()
            self._channel.publish(("remove", list(req_ids)), self._check)
        Runner.remove_requests(self, req_ids)

    def _on_every_rank(self, message: tuple[str, Any], here: Callable[[], Any]) -> Any:
        """Publish ``message`` to the workers (each runs its part), then run ``here``, this
        rank's part (a worker's failure raised as such: :meth:`_until_failure`)."""
        self._check()
        self._channel.publish(message, self._check)
        return self._until_failure(here)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` on every rank (:meth:`Runner.collective_rpc`): it goes out on the
        step channel, each rank runs it, and the results come back to rank 0 by a gather on
        the host group. A rank that raises has its error raised here (rank 0's own as it
        is, a worker's as a RuntimeError naming its rank), after every rank has answered."""
        if self._in_rpc:
            raise RuntimeError("collective_rpc: not from inside another collective_rpc")
        if callable(method) and getattr(method, "__module__", None) == "__main__":
            raise ValueError("method: a function of __main__ cannot reach the other ranks' "
                             "processes; define it in an importable module")
        try:  # (pickled apart: a worker that cannot unpickle it answers so, and goes on)
            payload = pickle.dumps((method, args, kwargs))
        except Exception as error:
            raise ValueError(f"method, args and kwargs must be picklable to reach the other "
                             f"ranks: {error}") from None
        def run() -> list[Any]:
            own: Exception | None = None
            self._in_rpc = True
            try:
                mine = reply_of(self.call_method(method, args, kwargs))
            except Exception as error:
                own, mine = error, (False, f"{type(error).__name__}: {error}")
            finally:
                self._in_rpc = False
            replies = gather_replies(mine)
            if own is not None:
                raise own
            for rank, (ok, value) in enumerate(replies):
                if not ok:
                    raise RuntimeError(f"collective_rpc {method!r}: rank {rank} failed: {value}")
            return [value for _, value in replies]

        results: list[Any] = self._on_every_rank(("rpc", payload), run)
        return results

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load new weights on every rank (:meth:`Runner.load_weights`): each tensor's name,
        shape and dtype go out on the step channel, its bytes by a broadcast over the device
        group, and every rank's loader takes its part of the whole tensor, as at start-up."""
        if self._in_rpc:
            return Runner.load_weights(self, weights)
        self._check()
        self._channel.publish(("load_weights", None), self._check)

        def sent() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                whole = tensor.detach().to(self.device).contiguous()
                self._channel.publish(("weight", (name, tuple(whole.shape), whole.dtype)),
                                      self._check)
                yield name, broadcast_from_first(whole)

        try:
            loaded: set[str] = self._until_failure(lambda: Runner.load_weights(self, sent()))
        finally:  # (after a refused name too: every rank stops at the same tensor)
            self._channel.publish(("weights_end", None), self._check)
        return loaded

    def sleep(self, level: int = 1) -> None:
        """Put every rank to sleep (:meth:`Runner.sleep`), the arguments checked first."""
        if self._in_rpc:
            return Runner.sleep(self, level)
        self._sleeper.check(level)
        self._on_every_rank(("sleep", level), lambda: Runner.sleep(self, level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake every rank (:meth:`Runner.wake_up`: the graphs are captured on every rank
        together). A rank whose device has no room fails, and the engine with it."""
        if self._in_rpc:
            return Runner.wake_up(self, tags)
        woken = list(check_tags(tags))
        self._on_every_rank(("wake_up", woken), lambda: Runner.wake_up(self, woken))

    def __del__(self) -> None:  # an engine dropped without shutdown(): stop its workers
        with contextlib.suppress(Exception):
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers and leave the group together with them (each rank drops its
        graphs, then NCCL finalizes on every rank at once), then wait for them to exit."""
        if not hasattr(self, "_stopped") or self._stopped.is_set():
            return
        if self._failure is None and hasattr(self, "_channel"):
            with contextlib.suppress(Exception):
                self._channel.publish(("stop", None), self._check)
        self._stopped.set()
        if self._failure is None:  # (with a dead peer, waiting for the GPU could hang)
            with contextlib.suppress(Exception):
                Runner.shutdown(self)
        destroy_tensor_parallel(timeout_s=20.0 if self._failure is None else 2.0)
        # closed before the wait: after a worker's failure no "stop" went out, and the ranks
        # still alive, waiting for a step, leave on the closed ring (a message already
        # published is still read first) rather than be killed after the timeout
        if hasattr(self, "_channel"):
            self._channel.close()
        for worker in self._workers:
            try:
                worker.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait(5.0)
            if (worker.proc.returncode or 0) > 0:  # a rank that failed leaving says why
                with contextlib.suppress(OSError, ValueError):
                    logger.warning("tensor-parallel worker rank %d left with exit code %d: %s",
                                   worker.rank, worker.proc.returncode,
                                   worker.errors.read().strip() or "(no error text)")
            worker.errors.close()
