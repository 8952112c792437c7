"""The engine in a process of its own (``mrv2 serve``'s default): its loop, and what
goes over the pipes.

In one process the event loop and the engine thread share one GIL: on the H200 with 256
streams at once they used about one core between them and the server's own time per output
token was 13-19 ms where the engine's step takes 3-4 ms (BENCHMARKS.md, twenty-third
session). Here the engine steps in a child process (vLLM's engine core) and the server's
process keeps HTTP, tokenization and the streams.

Messages, parent to child (``commands``): ``("add", req_id, ids, params, prompt, mm_items)``
(answered by an ``("ack", req_id, error or None)``), ``("abort", req_id)`` and
``("stop",)``. Child to parent (``outputs``):
``("ready", info)`` once the engine is built, ``("outputs", deltas, stats)`` after every step
with output (``stats``: the engine's counters at most every :data:`STATS_INTERVAL_S`, else
None), ``("stats", stats)`` when it goes idle, ``("failed", message, req_ids)`` when a
step raised (those requests failed, the engine goes on), ``("fatal", message)`` when it cannot
go on.

Outputs go as deltas (:class:`DeltaEncoder`): a cumulative ``RequestOutput`` holds the
prompt's ids and every token so far, so pickling whole outputs each step would cost O(tokens
so far) a stream. The parent rebuilds the cumulative outputs (:class:`OutputAccumulator`). A
request with ``output_kind`` DELTA (the server's) is a delta already: it crosses as it is and
the parent keeps nothing of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mrv2.config import EngineConfig
from mrv2.engine.gc_pauses import GCPauses, freeze_startup_heap
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.entrypoints.stack_sampler import PROFILE_ENV_VAR, StackSampler
from mrv2.logs import configure_logging

logger = logging.getLogger(__name__)

#: Seconds between the engine counters sent with outputs (``/metrics`` reads the latest).
STATS_INTERVAL_S = 0.1

#: One choice's change since the last message: (index, new token ids, text start, text from
#: there, finish reason, stop reason, new logprobs or None, cumulative logprob). The text
#: starts before the end of what was sent when a stop string cut it back.
ChoiceDelta = tuple[int, list[int], int, str, "str | None", "int | str | None",
                    "list[Any] | None", "float | None"]
#: One request's change: (request id, finished, its choices' deltas, its prompt's tokens
#: found in the prefix cache, whether the request's outputs are deltas, its prompt logprobs
#: (in its first message only; None otherwise or when not asked for)).
OutputDelta = tuple[str, bool, list[ChoiceDelta], int, bool, "list[Any] | None"]


class DeltaEncoder:
    """(child) Turns cumulative ``RequestOutput`` s into deltas against what was sent."""

    def __init__(self) -> None:
        #: (request id, choice index) -> (tokens, text length, logprobs) already sent
        self._sent: dict[tuple[str, int], tuple[int, int, int]] = {}
        #: cumulative requests whose prompt logprobs went with an earlier message
        self._prompt_sent: set[str] = set()

    def encode(self, output: RequestOutput) -> OutputDelta:
        choices: list[ChoiceDelta] = []
        if output.delta:  # (a delta request's output: nothing to keep)
            choices = [(c.index, c.token_ids, 0, c.text, c.finish_reason, c.stop_reason,
                        c.logprobs, c.cumulative_logprob) for c in output.outputs]
            return (output.request_id, output.finished, choices, output.num_cached_tokens,
                    True, output.prompt_logprobs)
        prompt = None
        if output.prompt_logprobs is not None and output.request_id not in self._prompt_sent:
            prompt = output.prompt_logprobs
            self._prompt_sent.add(output.request_id)
        for c in output.outputs:
            key = (output.request_id, c.index)
            tokens, text, num_lp = self._sent.get(key, (0, 0, 0))
            start = min(text, len(c.text))
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[num_lp:]
                num_lp = len(c.logprobs)
            choices.append((c.index, c.token_ids[tokens:], start, c.text[start:],
                            c.finish_reason, c.stop_reason, logprobs, c.cumulative_logprob))
            self._sent[key] = (len(c.token_ids), len(c.text), num_lp)
        if output.finished:
            for c in output.outputs:
                self._sent.pop((output.request_id, c.index), None)
            self._prompt_sent.discard(output.request_id)
        return (output.request_id, output.finished, choices, output.num_cached_tokens, False,
                prompt)

    def forget(self, request_id: str) -> None:
        """An aborted request: drop what was sent of it."""
        for key in [k for k in self._sent if k[0] == request_id]:
            del self._sent[key]
        self._prompt_sent.discard(request_id)


class OutputAccumulator:
    """(parent) Rebuilds each request's cumulative ``RequestOutput`` from deltas, in place:
    the one object of a request is updated and handed on again (outputs are cumulative, so a
    reader that sees a later state has lost nothing). A delta request's output is rebuilt as
    it came, a new object each time, and nothing of it is kept."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def apply(self, delta: OutputDelta) -> RequestOutput:
        req_id, finished, choices, cached, is_delta, prompt = delta
        if is_delta:  # a delta request's output, as the engine made it
            outs = [CompletionOutput(index, text, ids, reason, stop, cumulative, logprobs)
                    for index, ids, _, text, reason, stop, logprobs, cumulative in choices]
            return RequestOutput(request_id=req_id, prompt=None, prompt_token_ids=[],
                                 outputs=outs, finished=finished,
                                 new_token_ids=[t for c in outs for t in c.token_ids],
                                 new_text="".join(c.text for c in outs),
                                 num_cached_tokens=cached, prompt_logprobs=prompt, delta=True)
        output = self._outputs.get(req_id)
        if output is None:
            output = RequestOutput(request_id=req_id, prompt=None, prompt_token_ids=[],
                                   outputs=[], finished=False)
            self._outputs[req_id] = output
        by_index = {c.index: c for c in output.outputs}
        new_ids: list[int] = []
        for index, ids, start, text, reason, stop, logprobs, cumulative in choices:
            c = by_index.get(index)
            if c is None:
                c = CompletionOutput(index=index, text="", token_ids=[])
                by_index[index] = c
                output.outputs = [by_index[i] for i in sorted(by_index)]
            c.token_ids.extend(ids)
            c.text = c.text + text if start == len(c.text) else c.text[:start] + text
            c.finish_reason, c.stop_reason, c.cumulative_logprob = reason, stop, cumulative
            if logprobs is not None:
                if c.logprobs is None:
                    c.logprobs = []
                c.logprobs.extend(logprobs)
            new_ids.extend(ids)
        output.new_token_ids = new_ids
        output.finished = finished
        output.num_cached_tokens = cached
        if prompt is not None:
            output.prompt_logprobs = prompt
        if finished:
            del self._outputs[req_id]
        return output

    def forget(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)


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


def run_engine_core(config: EngineConfig, commands: Connection, outputs: Connection,
                    log_level: int | None = None) -> None:
    """The child's main: build the engine, say ready, then step while there is work and take
    commands between steps; returns on ``("stop",)`` or when the parent is gone.
    ``log_level``: the parent's :func:`~mrv2.logs.configured_level` (the child logs as the
    ``mrv2`` command's parent does; None: it configures nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the parent stops us
    if log_level is not None:
        configure_logging(log_level)
    from mrv2.engine.engine import LLMEngine

    try:
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
        hf_config=runner.hf_config if runner.model_entry.input_processor else None)))
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


def _loop(engine: Any, commands: Connection, outputs: Connection, pauses: GCPauses) -> None:
    encoder = DeltaEncoder()
    live: set[str] = set()
    idle_sent = False
    stats_at = 0.0
    while True:
        block = not engine.has_unfinished()
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
                _, req_id, ids, params, prompt, mm_items = message
                try:
                    engine.add_request(ids, params, request_id=req_id, prompt=prompt,
                                       stream=True, mm_items=mm_items)
                except Exception as error:  # (ValueError: the request's own fault)
                    outputs.send(("ack", req_id, f"{type(error).__name__}: {error}"
                                  if not isinstance(error, ValueError) else str(error)))
                    continue
                live.add(req_id)
                outputs.send(("ack", req_id, None))
            elif kind == "abort":
                engine.abort(message[1])
                encoder.forget(message[1])
                live.discard(message[1])
        if not engine.has_unfinished():
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
