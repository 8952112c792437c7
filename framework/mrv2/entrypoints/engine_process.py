"""The server's side of an engine in a child process (``mrv2 serve``'s default).

:class:`RemoteEngine` stands where the server holds an :class:`~mrv2.engine.engine.LLMEngine`
(tokenizer, limits, sampling defaults, first checks of a request, the family's multimodal
preprocessing, here so the engine's loop never stalls on an image and the items cross the
pipe once); :class:`EngineProcess` stands where it holds an
:class:`~mrv2.entrypoints.engine_thread.EngineThread` (submit, abort, outputs into each
request's asyncio queue, the same merged hand-over). The child runs
:func:`~mrv2.entrypoints.engine_core.run_engine_core`; the pipes' messages are described
there. A request is added when the child acknowledges it: :meth:`EngineProcess.admit`
raises ``ValueError`` with the engine's own message for a request the engine refuses, so the
server answers 400 as it does with the engine on a thread of its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import pickle
import threading
import time
import types
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from mrv2.config import EngineConfig
from mrv2.contract.input_processor import InputProcessor
from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams
from mrv2.contract.pooling import PoolingParams
from mrv2.contract.requests import MultiModalItem
from mrv2.engine.output_deltas import OutputAccumulator, OutputDelta
from mrv2.engine.outputs import RequestOutput
from mrv2.engine.request_inputs import (
    _load_tokenizer,
    check_prompt,
    check_runner,
    make_input_processor,
    process_multimodal,
    tokenizer_kwargs,
)
from mrv2.engine.tokenizer import Tokenizer
from mrv2.entrypoints.engine_calls import reply_result
from mrv2.entrypoints.engine_core import EngineInfo, run_engine_core, run_engine_core_on_fds
from mrv2.entrypoints.engine_thread import LoopHandOver, QueueFullError, check_room
from mrv2.entrypoints.engine_thread import _Sink as ThreadSink
from mrv2.entrypoints.metrics import ServerMetrics
from mrv2.executor.zygote import preload, worker_zygote, zygote_enabled
from mrv2.logs import configured_level
from mrv2.plugins import plugins_registered_in_code

if TYPE_CHECKING:
    from mrv2.entrypoints.tracing import RequestTrace

logger = logging.getLogger(__name__)


@dataclass
class _Sink(ThreadSink):
    """The engine thread's sink, and what the deltas need: an abort mark (set on the loop)."""

    aborted: bool = False


def _plugins_registered_in_code() -> bytes:
    """This process's plugins registered in code, pickled for the engine's process (spawned,
    it loads plugins from their entry points only); a module plugin goes by its name. A
    ``ValueError`` naming them where one does not pickle."""
    registered = plugins_registered_in_code()
    if not registered:
        return b""
    try:
        return pickle.dumps([
            (name, ("module", plugin.__name__) if isinstance(plugin, types.ModuleType)
             else ("object", plugin)) for name, plugin in registered])
    except Exception as error:  # noqa: BLE001 (pickle raises many kinds)
        names = ", ".join(repr(name) for name, _ in registered)
        raise ValueError(
            f"the plugins registered in code ({names}) cannot reach the engine's process, "
            f"which loads plugins from their entry points only: pickling them failed "
            f"({type(error).__name__}: {error}). Define the plugin's class at a module's top "
            "level, install it as a package with an entry point in group 'mrv2', or run the "
            "engine on a thread of this process (mrv2 serve --no-engine-process)") from error


preload("mrv2.entrypoints.engine_core")  # (a forked engine process finds the engine imported)


class ChildProcess(Protocol):
    """The engine's child process as :class:`EngineProcess` handles it: a
    ``multiprocessing.Process`` (spawned) or a
    :class:`~mrv2.executor.zygote.ForkedWorker` (forked by the zygote)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


def _start_child(config: EngineConfig, plugins: bytes
                 ) -> tuple[ChildProcess, Connection, Connection]:
    """The engine's child process, the commands pipe's sending end and the outputs pipe's
    receiving end: forked by the zygote with ``MRV2_WORKER_ZYGOTE=1`` (a process imported
    once, :mod:`mrv2.executor.zygote`), else spawned (CUDA cannot be forked)."""
    ctx = multiprocessing.get_context("spawn")
    child_commands, commands = ctx.Pipe(duplex=False)
    outputs, child_outputs = ctx.Pipe(duplex=False)
    try:
        process: ChildProcess
        if zygote_enabled():
            process = worker_zygote().fork_call(
                run_engine_core_on_fds, (config, configured_level(), plugins),
                [child_commands.fileno(), child_outputs.fileno()])
        else:
            spawned = ctx.Process(target=run_engine_core, name="mrv2-engine-core",
                                  args=(config, child_commands, child_outputs,
                                        configured_level(), plugins), daemon=True)
            spawned.start()
            process = spawned
    except BaseException:
        commands.close()
        outputs.close()
        raise
    finally:
        child_commands.close()
        child_outputs.close()
    return process, commands, outputs


class EngineProcess:
    """Starts the engine's child process and carries requests and outputs to and from it.

    The constructor returns once the engine is built (its model loaded, its graphs captured)
    or raises ``RuntimeError`` with the child's reason. :meth:`start` / :meth:`stop` follow
    the app's lifespan, as the engine thread's."""

    def __init__(self, config: EngineConfig, max_pending: int = 1024,
                 startup_timeout: float | None = None) -> None:
        in_code = _plugins_registered_in_code()  # (refused before anything starts)
        self._process, self._commands, self._outputs = _start_child(config, in_code)
        self.max_pending = max_pending
        self.metrics: ServerMetrics | None = None
        self.fatal: BaseException | None = None
        self.on_fatal: list[Any] = []
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sinks: dict[str, _Sink] = {}
        #: Futures awaiting the engine's ack: a request's refusal (str) or None; a call's
        #: reply (:func:`~mrv2.entrypoints.engine_calls.call_reply`).
        self._acks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._pending = 0
        self._stopped = False
        #: Why new requests get 503 for now (the engine sleeps: ``POST /sleep``), or None.
        self.unavailable: str | None = None
        #: Deltas on their way to their event loops (each kept: a delta is not cumulative).
        self._hand_over: LoopHandOver[tuple[_Sink, OutputDelta]] = LoopHandOver(self._apply)
        self._accumulator = OutputAccumulator()  # (used on the event loop only)
        self._stats: dict[str, Any] = {}
        self.info = self._wait_ready(startup_timeout)
        self._reader = threading.Thread(target=self._read, name="mrv2-engine-reader",
                                        daemon=True)

    def _wait_ready(self, timeout: float | None) -> EngineInfo:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._outputs.poll(1.0):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited ({self._process.exitcode}) "
                                   "before it was ready; its log is above")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the engine process was not ready after {timeout} s")
        try:
            message = self._outputs.recv()
        except (EOFError, OSError):
            self._process.join(10)
            raise RuntimeError(f"the engine process exited ({self._process.exitcode}) before "
                               "it was ready; its log is above") from None
        if message[0] != "ready":
            self._process.join(10)
            raise RuntimeError(message[1] if message[0] == "fatal" else
                               f"the engine process sent {message[0]!r} before 'ready'")
        info: EngineInfo = message[1]
        return info

    # -- the worker interface (as EngineThread's) ---------------------------------------------

    def bind(self, metrics: ServerMetrics) -> None:
        """Report into ``metrics`` (the app's)."""
        self.metrics = metrics
        metrics.stats = self._stats
        metrics.num_pending = lambda: self._pending

    def start(self) -> None:
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopped = True
        with contextlib.suppress(OSError):
            self._send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %s s: killing it", timeout)
            self._process.kill()
            self._process.join(5)
        self._fail_all(RuntimeError("the server is shutting down"))

    @property
    def num_pending(self) -> int:
        return self._pending

    async def admit(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None, sink: asyncio.Queue[RequestOutput | BaseException],
                    loop: asyncio.AbstractEventLoop,
                    mm_items: list[MultiModalItem] | None = None,
                    lora: LoRARequest | None = None,
                    pooling: PoolingParams | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    trace: RequestTrace | None = None) -> None:
        """Add a request (through adapter ``lora``, if any; its prefix-cache blocks salted
        with ``cache_salt``, if any; scheduled by ``priority``; ``trace``: its span made when
        it finishes, if any) once the engine accepts it;
        ``ValueError`` (the engine's message) if it refuses, :class:`QueueFullError` past
        ``max_pending`` sequences."""
        entry = _Sink(loop, sink, time.monotonic(), num_prompt=len(prompt_token_ids),
                      num_seqs=params.n, trace=trace)
        ack: asyncio.Future[str | None] = loop.create_future()
        with self._lock:
            check_room(self.fatal, self._stopped, self._pending, params.n, self.max_pending,
                       self.unavailable)
            self._pending += params.n
            self._sinks[req_id] = entry
            self._acks[req_id] = (loop, ack)
        message = ("add", req_id, prompt_token_ids, params, prompt, mm_items, lora, pooling,
                   cache_salt, priority)
        try:
            if mm_items:  # media tensors: a long write, off the event loop
                await asyncio.to_thread(self._send, message)
            else:
                self._send(message)
        except OSError as error:
            self._drop(req_id)
            raise QueueFullError(f"the engine process is gone: {error}") from None
        try:
            refused = await ack
        except QueueFullError:
            self._drop(req_id)
            raise
        except asyncio.CancelledError:  # the client left while the engine took it
            self.abort(req_id)
            raise
        if refused is not None:
            self._drop(req_id)
            raise ValueError(refused)

    async def call(self, op: str, arg: Any = None) -> Any:
        """Run engine operation ``op`` in the engine's process between steps
        (:mod:`mrv2.entrypoints.engine_calls`) and return its result; raises its ValueError
        or :class:`~mrv2.entrypoints.engine_calls.EngineBusy`, and :class:`QueueFullError`
        once the engine failed or the server stops."""
        loop = asyncio.get_running_loop()
        call_id = f"call-{uuid.uuid4().hex}"
        done: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if self._stopped:  # (its ack would never come: _fail_all has run, or will)
                raise QueueFullError("the server is shutting down" if self.fatal is None
                                     else f"the engine failed: {self.fatal}")
            self._acks[call_id] = (loop, done)
        try:
            self._send(("call", call_id, op, arg))
        except OSError as error:
            with self._lock:
                self._acks.pop(call_id, None)
            raise RuntimeError(f"the engine process is gone: {error}") from None
        return reply_result(await done)

    def abort(self, req_id: str) -> None:
        """Cancel a request (on the event loop); unknown or finished ids are ignored."""
        entry = self._drop(req_id)
        if entry is None:
            return
        entry.aborted = True
        self._accumulator.forget(req_id)
        if self.metrics is not None:
            self.metrics.observe_aborted(entry.num_seqs)
        with contextlib.suppress(OSError):
            self._send(("abort", req_id))

    def mark_fatal(self, error: BaseException) -> None:
        """The engine cannot go on: refuse new requests, fail those in flight, tell the
        :attr:`on_fatal` listeners (as EngineThread's)."""
        with self._lock:
            if self.fatal is not None:
                return
            self.fatal = error
            self._stopped = True
        self._fail_all(RuntimeError(f"the engine failed: {error}"))
        for listener in list(self.on_fatal):
            try:
                listener(error)
            except Exception:
                logger.exception("an on_fatal listener failed")

    # -- helpers ------------------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._commands.send(message)

    def _drop(self, req_id: str) -> _Sink | None:
        with self._lock:
            entry = self._sinks.pop(req_id, None)
            self._acks.pop(req_id, None)
            if entry is not None:
                self._pending -= entry.num_seqs
        return entry

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            acks, self._acks = self._acks, {}
            for entry in sinks.values():
                self._pending -= entry.num_seqs
        for loop, ack in acks.values():  # their admit raises QueueFullError (503)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_refuse, ack, QueueFullError(str(error)))
        for req_id, entry in sinks.items():
            if req_id in acks:
                continue  # its admit raises instead
            if self.metrics is not None:
                self.metrics.requests_failed.inc()
            _put(entry, error)

    # -- the reader thread --------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._outputs.recv()
            except (EOFError, OSError):
                with self._lock:
                    stopped = self._stopped
                if not stopped:
                    self._process.join(5)  # (its exit code, not None, in the message)
                    self.mark_fatal(RuntimeError(
                        f"the engine process exited ({self._process.exitcode})"))
                return
            kind = message[0]
            if kind == "outputs":
                self._deliver(message[1], time.monotonic())
                if message[2] is not None:
                    self._set_stats(message[2])
            elif kind == "stats":
                self._set_stats(message[1])
            elif kind == "ack":
                with self._lock:
                    waiting = self._acks.pop(message[1], None)
                if waiting is not None:
                    with contextlib.suppress(RuntimeError):
                        waiting[0].call_soon_threadsafe(_settle, waiting[1], message[2])
            elif kind == "failed":
                error = RuntimeError(f"the engine failed: {message[1]}")
                for req_id in message[2]:
                    entry = self._drop(req_id)
                    if entry is not None:
                        if self.metrics is not None:
                            self.metrics.requests_failed.inc()
                        _put(entry, error)
            elif kind == "fatal":
                self.mark_fatal(RuntimeError(message[1]))

    def _set_stats(self, stats: dict[str, Any]) -> None:
        self._stats = stats
        if self.metrics is not None:
            self.metrics.stats = stats

    def _deliver(self, deltas: list[OutputDelta], now: float) -> None:
        """Account each delta (TTFT, TPOT, finished counts) and hand it to its loop."""
        metrics = self.metrics
        traced: list[tuple[_Sink, list[tuple[str, int, float | None, float]], Any]] = []
        with self._lock:
            for delta in deltas:
                req_id, finished, choices = delta[:3]
                entry = self._sinks.get(req_id)
                if entry is None:
                    continue
                generated = sum(entry.count(index, len(ids), reason, now=now)
                                for index, ids, _, _, reason, *_ in choices)
                if (generated or (finished and entry.first is None)) and metrics is not None:
                    metrics.observe_tokens(entry.num_prompt if entry.first is None else 0,
                                           generated)  # (a pooling request has no tokens)
                if generated and entry.first is None:
                    entry.first = now
                    if metrics is not None:
                        metrics.observe_first_token(now - entry.arrival)
                if finished:
                    del self._sinks[req_id]
                    self._pending -= entry.num_seqs
                    lengths = entry.finished_lengths(now)
                    if metrics is not None:
                        metrics.observe_finished(lengths)
                    if entry.trace is not None:
                        traced.append((entry, lengths, delta[7]))
                self._hand_over.add(entry.loop, (entry, delta))
        for entry, lengths, queued in traced:  # (outside the lock, before the answers end)
            assert entry.trace is not None
            entry.trace.finish(entry.arrival, entry.first, now, entry.num_prompt, lengths,
                               queued)
        self._hand_over.post()

    def _apply(self, batch: list[tuple[_Sink, OutputDelta]]) -> None:
        # (on the loop) the deltas into outputs, each touched request's once: a cumulative
        # output's latest state, or a delta request's outputs folded into one
        touched: dict[str, tuple[_Sink, RequestOutput]] = {}
        for entry, delta in batch:
            if entry.aborted:
                self._accumulator.forget(delta[0])
                continue
            output = self._accumulator.apply(delta)
            earlier = touched.get(delta[0])
            if earlier is not None and output.delta:
                earlier[1].add(output)
            else:
                touched[delta[0]] = (entry, output)
        for entry, output in touched.values():
            entry.queue.put_nowait(output)


def _settle(future: asyncio.Future[Any], reply: Any) -> None:
    if not future.done():
        future.set_result(reply)


def _refuse(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _put(entry: _Sink, item: BaseException) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: the client is gone
        entry.loop.call_soon_threadsafe(entry.queue.put_nowait, item)


class RemoteEngine:
    """What the server needs of an engine that runs in a child process: its config,
    tokenizer, limits and sampling defaults, the first checks of a request, the family's
    multimodal preprocessing (here, in a worker thread of the server), and the worker that
    carries requests (:attr:`process`)."""

    def __init__(self, config: EngineConfig, max_pending: int = 1024,
                 startup_timeout: float | None = None) -> None:
        self.config = config
        self.process = EngineProcess(config, max_pending, startup_timeout)
        info = self.process.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.hidden_size = info.hidden_size
        self.num_labels, self.id2label = info.num_labels, info.id2label
        self.default_pooling_task = info.default_pooling_task
        self.matryoshka = info.matryoshka
        self.refused_pooling_tasks = info.refused_pooling_tasks
        if info.num_labels is not None:  # (the engine serves a classifier as pooling)
            config.model.runner = "pooling"
        self.eos_token_ids = info.eos_token_ids
        self.sampling_defaults = info.sampling_defaults
        self.tokenizer: Tokenizer | None = None if config.model.skip_tokenizer_init else (
            _load_tokenizer(config.model.tokenizer or info.model_dir, config.model.chat_template,
                            required=config.model.tokenizer is not None,
                            kwargs=tokenizer_kwargs(config.model)))
        self.input_processor: InputProcessor | None = make_input_processor(
            info.input_processor, info.model_dir, info.hf_config, self.tokenizer, config)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 lora: LoRARequest | None = None, pooling: bool = False) -> None:
        """The checks that need no engine state (the runner's kind, the prompt's length and
        ids, the params' token ids); the engine makes the rest (``lora``'s adapter too) when
        it adds the request."""
        check_runner(self.config, pooling)
        check_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size, pooling,
                     self.config.model.max_logprobs)

    def process_multimodal(self, prompt_token_ids: list[int], mm_data: Any
                           ) -> tuple[list[int], list[MultiModalItem]]:
        """As the engine's ``process_multimodal``, here in the server's process (the family's
        processor is built here from what the child reported)."""
        return process_multimodal(self.input_processor, self.process.info.architecture,
                                  prompt_token_ids, mm_data)

    def shutdown(self) -> None:
        """Stop the child (idempotent)."""
        self.process.stop()
