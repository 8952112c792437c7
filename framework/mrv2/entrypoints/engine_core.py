"""The engine in a process of its own (``mrv2 serve``'s default): its loop, and what
goes over the pipes.

In one process the event loop and the engine thread share one GIL: on the H200 with 256
streams at once they used about one core between them and the server's own time per output
token was 13-19 ms where the engine's step takes 3-4 ms (BENCHMARKS.md, twenty-third
session). Here the engine steps in a child process (vLLM's engine core) and the server's
process keeps HTTP, tokenization and the streams.

Messages, parent to child (``commands``): ``("add", req_id, ids, params, prompt, mm_items,
lora, pooling, cache_salt, priority)`` (answered by an ``("ack", req_id, error or None)``),
``("call", call_id, op, arg)`` (answered by an ``("ack", call_id, reply)``), ``("abort",
req_id)`` and ``("stop",)``. Child to parent (``outputs``):
``("ready", info)`` once the engine is built, ``("outputs", deltas, stats)`` after every step
with output (``stats``: the engine's counters at most every :data:`STATS_INTERVAL_S`, else
None), ``("stats", stats)`` when it goes idle, ``("failed", message, req_ids)`` when a
step raised (those requests failed, the engine goes on), ``("fatal", message)`` when it cannot
go on.

Outputs go as deltas (:class:`~mrv2.engine.output_deltas.DeltaEncoder`; the parent rebuilds
them with :class:`~mrv2.engine.output_deltas.OutputAccumulator`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from mrv2.config import EngineConfig
from mrv2.engine.gc_pauses import GCPauses, freeze_startup_heap
from mrv2.engine.output_deltas import DeltaEncoder
from mrv2.entrypoints.engine_calls import call_reply
from mrv2.entrypoints.stack_sampler import PROFILE_ENV_VAR, StackSampler
from mrv2.logs import configure_logging
from mrv2.plugins import get_plugin_manager

logger = logging.getLogger(__name__)

__all__ = ["EngineInfo", "run_engine_core", "run_engine_core_on_fds"]

#: Seconds between the engine counters sent with outputs (``/metrics`` reads the latest).
STATS_INTERVAL_S = 0.1

@dataclass
class EngineInfo:
    """What the server's process needs of the engine it does not hold (``("ready", info)``)."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict[str, Any]
    device: str
    architecture: str
    #: The family's multimodal prompt processor (its import path; None: text only) and the
    #: HF config it is built with: the server's process preprocesses media itself, so the
    #: engine's loop never stalls on an image and the items cross the pipe once.
    input_processor: str | None
    hf_config: Any
    #: The length of the model's embeddings (embedding requests' ``dimensions`` at most).
    hidden_size: int = 0
    #: The ids that end an answer (beam search ends its beams on them in the server).
    eos_token_ids: frozenset[int] = frozenset()
    #: A sequence classifier's label count and names (None, {}: not a classifier).
    num_labels: int | None = None
    id2label: dict[int, str] = field(default_factory=dict)
    #: A pooling request's task when it names none (``LLMEngine.default_pooling_task``).
    default_pooling_task: str = "embed"
    #: Whether embeddings may be cut short (``LLMEngine.matryoshka``).
    matryoshka: bool | tuple[int, ...] = False
    #: The pooling tasks the model cannot answer (``LLMEngine.refused_pooling_tasks``).
    refused_pooling_tasks: dict[str, str] = field(default_factory=dict)


def run_engine_core(config: EngineConfig, commands: Connection, outputs: Connection,
                    log_level: int | None = None, plugins: bytes = b"") -> None:
    """The child's main: build the engine, say ready, then step while there is work and take
    commands between steps; returns on ``("stop",)`` or when the parent is gone.
    ``log_level``: the parent's :func:`~mrv2.logs.configured_level` (the child logs as the
    ``mrv2`` command's parent does; None: it configures nothing). ``plugins``: the parent's
    plugins registered in code, pickled (``(name, ("module", module name) or ("object",
    plugin))`` pairs), registered here before the engine is built."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent stops us
    if log_level is not None:
        configure_logging(log_level)
    from mrv2.engine.engine import LLMEngine

    try:
        _register_plugins(plugins)
        engine = LLMEngine(config)
    except BaseException as error:  # noqa: BLE001 (the parent reports it)
        outputs.send(("fatal", f"the engine could not start: {type(error).__name__}: {error}"))
        return
    runner = engine.runner
    freeze_startup_heap()  # this process lives as long as its engine
    pauses = GCPauses()
    outputs = _LockedConnection(outputs)  # type: ignore[assignment]
    listen = getattr(runner, "add_failure_listener", None)
    if listen is not None:  # a tensor-parallel worker died (told from a watcher thread)
        listen(lambda error: _send_quietly(outputs, ("fatal", f"the engine failed: {error}")))
    outputs.send(("ready", EngineInfo(
        model_dir=str(config.model.model or runner.model_dir),
        max_model_len=engine.max_model_len, vocab_size=runner.vocab_size,
        sampling_defaults=dict(engine.sampling_defaults), device=str(runner.device),
        architecture=runner.model_entry.architecture,
        input_processor=runner.model_entry.input_processor or None,
        hf_config=runner.hf_config if runner.model_entry.input_processor else None,
        hidden_size=engine.hidden_size, eos_token_ids=engine.eos_token_ids,
        num_labels=engine.num_labels, id2label=engine.id2label,
        default_pooling_task=engine.default_pooling_task, matryoshka=engine.matryoshka,
        refused_pooling_tasks=engine.refused_pooling_tasks)))
    profile = os.environ.get(PROFILE_ENV_VAR, "").strip()
    sampler = StackSampler() if profile else None  # (the server's report, FILE.engine)
    if sampler is not None:
        sampler.start()
    try:
        _loop(engine, commands, outputs, pauses)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    finally:
        if sampler is not None:
            sampler.stop()
            sampler.write(f"{profile}.engine")
        engine.shutdown()


def run_engine_core_on_fds(fds: list[int], config: EngineConfig, log_level: int | None = None,
                           plugins: bytes = b"") -> None:
    """:func:`run_engine_core` in a process forked by the zygote
    (:meth:`~mrv2.executor.zygote.Zygote.fork_call`): ``fds`` are the commands pipe's reading
    end and the outputs pipe's writing end."""
    commands_fd, outputs_fd = fds
    run_engine_core(config, Connection(commands_fd, writable=False),
                    Connection(outputs_fd, readable=False), log_level, plugins)


class _LockedConnection:
    """The child's end of the outputs pipe, sent to from the loop and from a tensor-parallel
    watcher thread."""

    def __init__(self, connection: Connection) -> None:
        import threading

        self._connection, self._lock = connection, threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            self._connection.send(message)


def _send_quietly(outputs: Any, message: Any) -> None:
    with contextlib.suppress(OSError):  # the parent is gone
        outputs.send(message)


def _stats(engine: Any, pauses: GCPauses) -> dict[str, Any]:
    """The engine's counters, with its device's memory (the server's process makes no CUDA
    calls: ``/metrics`` reports these) and this process's garbage-collector pauses."""
    stats: dict[str, Any] = engine.stats()
    stats["gc_pause_seconds"] = pauses.total_seconds
    device = engine.runner.device
    if device.type == "cuda":
        import torch

        stats["gpu_memory_allocated"] = torch.cuda.memory_allocated(device)
        stats["gpu_memory_reserved"] = torch.cuda.memory_reserved(device)
    return stats


def _register_plugins(pickled: bytes) -> None:
    """Register the parent's in-code plugins in this process's plugin manager."""
    if not pickled:
        return
    try:
        plugins = pickle.loads(pickled)
    except Exception as error:  # noqa: BLE001 (unpickling raises many kinds)
        raise RuntimeError(
            f"the plugins registered in code in the server's process did not reach the "
            f"engine's process ({type(error).__name__}: {error}): define their classes at a "
            "module's top level, outside `if __name__ == \"__main__\":` (the spawned process "
            "imports the main module without running that block)") from error
    manager = get_plugin_manager()
    for name, (kind, plugin) in plugins:
        manager.register(importlib.import_module(plugin) if kind == "module" else plugin,
                         name=name)


def _loop(engine: Any, commands: Connection, outputs: Connection, pauses: GCPauses) -> None:
    encoder = DeltaEncoder()
    live: set[str] = set()
    idle_sent = False
    stats_at = 0.0
    while True:
        block = not engine.wants_step()
        if block and not idle_sent:
            outputs.send(("stats", _stats(engine, pauses)))
            idle_sent = True
        while commands.poll(None if block else 0):
            block = False
            message = commands.recv()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "add":
                _, req_id, ids, params, prompt, mm_items, lora, pooling, salt, rank = message
                try:
                    engine.add_request(ids, params, request_id=req_id, prompt=prompt,
                                       stream=True, mm_items=mm_items, lora_request=lora,
                                       pooling_params=pooling, cache_salt=salt,
                                       priority=rank)
                except Exception as error:  # (ValueError: the request's own fault)
                    outputs.send(("ack", req_id, f"{type(error).__name__}: {error}"
                                  if not isinstance(error, ValueError) else str(error)))
                    continue
                live.add(req_id)
                outputs.send(("ack", req_id, None))
            elif kind == "call":  # a development route's operation, between steps
                _, call_id, op, arg = message
                outputs.send(("ack", call_id, call_reply(engine, op, arg)))
                idle_sent = False  # (what it changed shows in the next stats: sleeping...)
            elif kind == "abort":
                engine.abort(message[1])
                encoder.forget(message[1])
                live.discard(message[1])
        if not engine.wants_step():
            continue
        idle_sent = False
        try:
            step_outputs = engine.step()
        except Exception as error:
            logger.exception("engine step failed")
            if getattr(error, "fatal", False):
                outputs.send(("fatal", f"the engine failed: {error}"))
                return
            failed = sorted(live)
            for req_id in failed:
                try:
                    engine.abort(req_id)
                except Exception:  # the engine is already broken; the parent still tells
                    logger.exception("abort after a failed step")
                encoder.forget(req_id)
            live.clear()
            outputs.send(("failed", str(error), failed))
            continue
        if step_outputs:
            deltas = [encoder.encode(o) for o in step_outputs]
            for o in step_outputs:
                if o.finished:
                    live.discard(o.request_id)
            now = time.monotonic()
            stats = None
            if now - stats_at >= STATS_INTERVAL_S:
                stats, stats_at = _stats(engine, pauses), now
            outputs.send(("outputs", deltas, stats))
