"""The engine loop on its own thread, fed by a thread-safe queue, feeding asyncio queues.

HTTP handlers (on the asyncio loop) call :meth:`EngineThread.submit` / :meth:`abort`; the
engine thread owns the :class:`LLMEngine` and is the only thread that touches it (but for
read-only ``validate``). Outputs go to each request's ``asyncio.Queue`` in batches, one
``loop.call_soon_threadsafe`` for all of them. While the loop still works on the last batch
(its streams' chunks not yet written), the next steps' outputs wait here and merge into one
output a request (:meth:`RequestOutput.add`: the server's deltas are appended), as vLLM's
output collector merges. So a loop that cannot write a chunk a token for every stream writes a few
tokens a chunk instead of taking more of the GIL it shares with this thread. (On the H200,
256 streams at once, the merge measured level with a step's outputs always going over:
10.5-11.6k tok/s either way, inside the runs' spread; it stays because it bounds the loop's
work when the loop falls behind.) The queues are unbounded, so a slow client never stalls
decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams
from mrv2.contract.pooling import PoolingParams
from mrv2.contract.requests import MultiModalItem
from mrv2.engine.engine import LLMEngine
from mrv2.engine.outputs import RequestOutput
from mrv2.entrypoints.engine_calls import call_reply, reply_result
from mrv2.entrypoints.metrics import ServerMetrics

if TYPE_CHECKING:
    from mrv2.entrypoints.tracing import RequestTrace

logger = logging.getLogger(__name__)

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """Too many sequences in flight."""


def check_room(fatal: BaseException | None, stopped: bool, pending: int, n: int,
               max_pending: int, unavailable: str | None = None) -> None:
    """Raise :class:`QueueFullError` when a request of ``n`` sequences cannot be taken: the
    engine failed, the server is stopping, the engine cannot serve for now (``unavailable``
    says why: it sleeps), or ``max_pending`` would be passed (either worker calls it under
    its lock before it counts the request)."""
    if fatal is not None:
        raise QueueFullError(f"the engine failed: {fatal}")
    if stopped:
        raise QueueFullError("the server is shutting down")
    if unavailable is not None:
        raise QueueFullError(unavailable)
    if pending + n > max_pending:
        raise QueueFullError(
            f"{pending} sequences in flight and this request adds {n}: more than this server "
            f"queues (--max-pending {max_pending}); retry later")


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    arrival: float
    first: float | None = None
    num_prompt: int = 0
    num_seqs: int = 1  # the request's n: what it counts against max_pending
    #: Per choice: its tokens so far and its finish reason (the finished lengths of /metrics).
    tokens: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    #: Per choice: when its finish reason came (its own decode ends there, not the request's).
    ends: dict[int, float] = field(default_factory=dict)
    #: What makes its span when it finishes (``--otlp-traces-endpoint``), or None.
    trace: RequestTrace | None = None

    def count(self, index: int, tokens: int, reason: str | None, total: bool = False,
              now: float = 0.0) -> int:
        """Choice ``index``'s ``tokens`` more (``total``: ``tokens`` in all, a cumulative
        output's) and its finish reason, if any (come at ``now``); returns how many are new."""
        before = self.tokens.get(index, 0)
        self.tokens[index] = tokens if total else before + tokens
        if reason:
            self.reasons[index] = reason
            self.ends.setdefault(index, now)
        return self.tokens[index] - before

    def finished_lengths(self, now: float) -> list[tuple[str, int, float | None, float]]:
        """(finish reason, tokens, seconds from the request's first token to the choice's
        end: None without a first token, seconds from the request's arrival to the choice's
        end) of each choice, the request ending at ``now``."""
        first = self.first
        return [(self.reasons.get(i, "unknown"), n,
                 None if first is None else self.ends.get(i, now) - first,
                 self.ends.get(i, now) - self.arrival)
                for i, n in sorted(self.tokens.items())]


class LoopHandOver(Generic[T]):
    """Hands items from a worker thread to the event loops that wait for them, one callback a
    loop for all it has: while a loop works on its last batch (the tasks that batch woke have
    not yet run), its next items wait here; ``deliver(batch)`` runs on the loop. Items added
    under one key merge while they wait, by ``fold(earlier, later)`` (default: the later
    stands for both); items added without a key all stay, in order. Used by the engine thread
    and by the engine process's reader."""

    def __init__(self, deliver: Callable[[list[T]], None],
                 fold: Callable[[T, T], T] | None = None) -> None:
        self._deliver = deliver
        self._fold = fold
        self._lock = threading.Lock()
        self._backlog: dict[asyncio.AbstractEventLoop, dict[Hashable, T]] = {}
        self._busy: set[asyncio.AbstractEventLoop] = set()

    def add(self, loop: asyncio.AbstractEventLoop, item: T, key: Hashable | None = None) -> None:
        """Queue ``item`` for ``loop`` (:meth:`post` sends it)."""
        with self._lock:
            backlog = self._backlog.setdefault(loop, {})
            earlier = None if key is None or self._fold is None else backlog.get(key)
            backlog[object() if key is None else key] = (
                item if earlier is None or self._fold is None else self._fold(earlier, item))

    def post(self) -> None:
        """Hand each idle loop its backlog."""
        with self._lock:
            ready = [(loop, list(items.values())) for loop, items in self._backlog.items()
                     if items and loop not in self._busy]
            for loop, _ in ready:
                self._busy.add(loop)
                del self._backlog[loop]
        for loop, batch in ready:
            with contextlib.suppress(RuntimeError):  # a closed loop: its clients are gone
                loop.call_soon_threadsafe(self._hand_over, loop, batch)

    def _hand_over(self, loop: asyncio.AbstractEventLoop, batch: list[T]) -> None:
        # (on the loop) the loop counts as busy until the tasks this wakes have run (they were
        # scheduled first) and written their chunks
        self._deliver(batch)
        loop.call_soon(self._loop_idle, loop)

    def _loop_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._busy.discard(loop)
            items = self._backlog.pop(loop, None)
            if items:
                self._busy.add(loop)
        if items:  # items came while it was busy: hand them over now
            self._hand_over(loop, list(items.values()))


class EngineThread:
    """Runs ``engine.step()`` in a daemon thread while there is work."""

    def __init__(self, engine: LLMEngine, max_pending: int = 1024,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.metrics = metrics or ServerMetrics(str(engine.config.model.model or "mrv2"),
                                                engine.runner.device)
        self.metrics.stats = engine.stats()
        self.metrics.num_pending = lambda: self._pending
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._pending = 0  # sequences (n per request) submitted, not yet finished or aborted
        self._lock = threading.Lock()
        #: Outputs on their way to their event loops (the latest a request while they wait).
        self._hand_over: LoopHandOver[tuple[_Sink, RequestOutput]] = LoopHandOver(
            _fill_queues, _fold_outputs)
        self._thread = threading.Thread(target=self._run, name="mrv2-engine", daemon=True)
        self._stopped = False
        #: The error that ended the engine for good (a tensor-parallel worker died), or None.
        self.fatal: BaseException | None = None
        #: Why new requests get 503 for now (the engine sleeps: ``POST /sleep``), or None.
        self.unavailable: str | None = None
        #: Called (from whichever thread saw it) once :attr:`fatal` is set.
        self.on_fatal: list[Any] = []

    # -- called from the asyncio side --------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_pending(self) -> int:
        return self._pending

    def submit(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None, sink: asyncio.Queue[RequestOutput | BaseException],
               loop: asyncio.AbstractEventLoop,
               mm_items: list[MultiModalItem] | None = None,
               lora: LoRARequest | None = None,
               pooling: PoolingParams | None = None,
               cache_salt: str | None = None, priority: int = 0,
               trace: RequestTrace | None = None) -> None:
        """Queue a (validated) request (through adapter ``lora``, if any; its prefix-cache
        blocks salted with ``cache_salt``, if any; scheduled by ``priority``; ``trace``: its
        span made when it finishes, if any); its outputs go to ``sink``. Raises
        :class:`QueueFullError` when its ``n`` sequences would take the server past
        ``max_pending`` sequences in flight."""
        with self._lock:
            check_room(self.fatal, self._stopped, self._pending, params.n, self.max_pending,
                       self.unavailable)
            self._pending += params.n
            # (queued under the lock: a shutdown, which marks itself under it first, finds it)
            self._commands.put(("add", (req_id, prompt_token_ids, params, prompt, sink, loop,
                                        time.monotonic(), mm_items, lora, pooling,
                                        cache_salt, priority, trace)))

    async def admit(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None, sink: asyncio.Queue[RequestOutput | BaseException],
                    loop: asyncio.AbstractEventLoop,
                    mm_items: list[MultiModalItem] | None = None,
                    lora: LoRARequest | None = None,
                    pooling: PoolingParams | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    trace: RequestTrace | None = None) -> None:
        """:meth:`submit` (the server awaits either worker's ``admit``; this one has nothing
        to wait for: the engine checked the request on the loop already)."""
        self.submit(req_id, prompt_token_ids, params, prompt, sink, loop, mm_items, lora,
                    pooling, cache_salt, priority, trace)

    def abort(self, req_id: str) -> None:
        """Cancel a request (run on the engine thread); unknown or finished ids are ignored."""
        self._commands.put(("abort", req_id))

    async def call(self, op: str, arg: Any = None) -> Any:
        """Run engine operation ``op`` between steps (:mod:`mrv2.entrypoints.engine_calls`)
        and return its result; raises its ValueError or
        :class:`~mrv2.entrypoints.engine_calls.EngineBusy`, and :class:`QueueFullError` once
        the engine failed or the server stops (nobody would run it)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[str | None, Any]] = loop.create_future()
        with self._lock:  # (as submit's: a shutdown answers every call queued before it)
            if self._stopped:
                raise QueueFullError("the server is shutting down" if self.fatal is None
                                     else f"the engine failed: {self.fatal}")
            self._commands.put(("call", (op, arg, loop, done)))
        return reply_result(await done)

    def mark_fatal(self, error: BaseException) -> None:
        """The engine cannot go on (any thread): refuse new requests, fail those in flight
        on the engine thread, tell the :attr:`on_fatal` listeners."""
        with self._lock:
            if self.fatal is not None:
                return
            self.fatal = error
            self._stopped = True
        self._commands.put(("fatal", error))
        for listener in list(self.on_fatal):
            try:
                listener(error)
            except Exception:
                logger.exception("an on_fatal listener failed")

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # outside a step (an abort, the stats...): as fatal,
            # not a thread gone quietly with its clients waiting and /health still 200
            logger.exception("the engine thread failed")
            self.mark_fatal(error)
            self._shutdown(error)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            block = not engine.wants_step()
            try:
                while True:
                    command, arg = self._commands.get(block=block)
                    block = False
                    if command == "stop":
                        self._shutdown()
                        return
                    if command == "fatal":
                        self._shutdown(arg)
                        return
                    self._handle(command, arg)
            except queue.Empty:
                pass
            if not engine.wants_step():
                self.metrics.stats = engine.stats()
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # keep serving: fail the requests in flight
                logger.exception("engine step failed")
                if getattr(error, "fatal", False):
                    self.mark_fatal(error)
                    continue
                self._fail_all(error)
                continue
            now = time.monotonic()
            for output in outputs:
                self._deliver(output, now)
            self._hand_over.post()
            self.metrics.stats = engine.stats()

    def _handle(self, command: str, arg: Any) -> None:
        if command == "call":
            op, value, loop, done = arg
            reply = call_reply(self.engine, op, value)
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(reply))
            return
        if command == "add":
            (req_id, ids, params, prompt, sink_queue, loop, arrival, mm_items, lora, pool,
             salt, priority, trace) = arg
            sink = _Sink(loop, sink_queue, arrival, num_prompt=len(ids), num_seqs=params.n,
                         trace=trace)
            try:
                self.engine.add_request(ids, params, request_id=req_id, prompt=prompt,
                                        stream=True, mm_items=mm_items, lora_request=lora,
                                        pooling_params=pool, cache_salt=salt,
                                        priority=priority)
            except Exception as error:
                self._finish_pending(sink)
                _put(sink, error)
                return
            self._sinks[req_id] = sink
        elif command == "abort":
            aborted = self._sinks.pop(arg, None)
            if aborted is not None:
                self.metrics.observe_aborted(aborted.num_seqs)
                self._finish_pending(aborted)
                self.engine.abort(arg)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        """Account ``output`` and queue it for its loop (``_hand_over.post`` sends it)."""
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        generated = sum(sink.count(c.index, len(c.token_ids), c.finish_reason,
                                   total=not output.delta, now=now) for c in output.outputs)
        if generated > 0 or (output.finished and sink.first is None):  # (pooling: no tokens)
            self.metrics.observe_tokens(sink.num_prompt if sink.first is None else 0,
                                        generated)
        if sink.first is None and output.new_token_ids:
            sink.first = now
            self.metrics.observe_first_token(now - sink.arrival)
        if output.finished:
            del self._sinks[output.request_id]
            self._finish_pending(sink)
            lengths = sink.finished_lengths(now)
            self.metrics.observe_finished(lengths)
            if sink.trace is not None:
                sink.trace.finish(sink.arrival, sink.first, now, sink.num_prompt, lengths,
                                  output.time_in_queue)
        self._hand_over.add(sink.loop, (sink, output), key=output.request_id)

    def _fail_all(self, error: BaseException) -> None:
        for req_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(req_id)
            except Exception:  # the engine is already broken; still tell the client
                logger.exception("abort after a failed step")
            self._finish_pending(sink)
            self.metrics.requests_failed.inc()
            _put(sink, RuntimeError(f"the engine failed: {error}"))
        self._sinks.clear()

    def _shutdown(self, cause: BaseException | None = None) -> None:
        with self._lock:
            self._stopped = True
        error = RuntimeError("the server is shutting down" if cause is None
                             else f"the engine failed: {cause}")
        self._fail_all(error)
        while True:  # requests and calls still queued: tell their clients
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                sink = _Sink(arg[5], arg[4], arg[6], num_seqs=arg[2].n)
                self._finish_pending(sink)
                _put(sink, error)
            elif command == "call":
                _refuse(arg[2], arg[3], QueueFullError(str(error)))

    def _finish_pending(self, sink: _Sink) -> None:
        with self._lock:
            self._pending -= sink.num_seqs


def _fold_outputs(earlier: tuple[_Sink, RequestOutput], later: tuple[_Sink, RequestOutput]
                  ) -> tuple[_Sink, RequestOutput]:
    """Two outputs of one request waiting for its loop, as one (each is the engine's own new
    object: folding into the earlier changes nothing anybody else holds)."""
    earlier[1].add(later[1])
    return earlier


def _fill_queues(batch: list[tuple[_Sink, RequestOutput]]) -> None:
    """(on the loop) each output into its request's queue."""
    for sink, output in batch:
        sink.queue.put_nowait(output)


def _refuse(loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any],
            error: BaseException) -> None:
    """Fail a call's future (from the engine thread) with ``error``."""
    def fail() -> None:
        if not done.done():
            done.set_exception(error)

    with contextlib.suppress(RuntimeError):  # a closed loop: the caller is gone
        loop.call_soon_threadsafe(fail)


def _put(sink: _Sink, item: RequestOutput | BaseException) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: the client is gone
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
